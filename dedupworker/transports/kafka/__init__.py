"""The kafka transport (confluent-kafka): key-ordered parallelism, gap-aware commits.

options.py      KafkaOptions: its command-line options, importable without confluent_kafka
transport.py    KafkaTransport and its consumer thread (its docstring tells the scheme)
buffer.py       the per-key buffer of polled messages that handler threads take from
partitions.py   buffered messages and each partition's gap-aware commit offset
dead_letter.py  the dead-letter producer and its headers
drain.py        the --drain check: has the group consumed the whole topic?
probe.py        the --drain end probe
client.py       librdkafka settings, making a client, the reachability check, wording its errors
"""

from dedupworker.transports.kafka.options import KafkaOptions

__all__ = ["KafkaOptions"]
