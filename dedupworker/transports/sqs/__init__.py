"""The sqs transport (boto3): long polls, batched receive and delete, visibility kept alive.

options.py     SqsOptions: its command-line options, importable without boto3
transport.py   SqsTransport (imports boto3; see its docstring for the requeue scheme)
inbox.py       received, unsettled messages and the threads waiting for them, under one lock
state.py       the state a message carries across re-sends (STATE attribute) and its receipt
attributes.py  headers, and the attributes of copies and dead letters fitted to SQS's limits
client.py      the boto3 client, the queue's attributes, boto3 errors explained with their fix
"""

from dedupworker.transports.sqs.options import SqsOptions

__all__ = ["SqsOptions"]
