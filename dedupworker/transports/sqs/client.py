"""The boto3 client, what the queue's attributes say (visibility, redrive policy), and boto3
errors turned into TransportErrors that name the queue, the endpoint and the fix."""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
)

from dedupworker.config import WorkerConfig
from dedupworker.errors import ConfigurationError, TransportError
from dedupworker.transports.sqs.options import SqsOptions, check_visibility

NOT_FOUND = {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"}
PERMISSIONS = (
    "sqs:ReceiveMessage, sqs:DeleteMessage, sqs:ChangeMessageVisibility, sqs:SendMessage, "
    "sqs:GetQueueAttributes (and sqs:SendMessage, sqs:GetQueueAttributes, sqs:GetQueueUrl on "
    "the dead-letter queue)"
)


def _client(config: WorkerConfig) -> Any:
    try:
        return boto3.session.Session().client(
            "sqs", config=Config(max_pool_connections=config.concurrency + 2)
        )
    except NoRegionError as exc:
        raise TransportError(
            "no AWS region for SQS: set AWS_DEFAULT_REGION (or `region` in the AWS config "
            "file of AWS_PROFILE)"
        ) from exc


def attributes_of(client: Any, url: str, what: str) -> dict[str, str]:
    """All attributes of the queue at `url` (`what` names it in an error: "queue", ...)."""
    try:
        response = client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])
    except (BotoCoreError, ClientError) as exc:
        raise _explain(exc, url, what, client.meta.endpoint_url) from exc
    attributes: dict[str, str] = response.get("Attributes", {})
    return attributes


def dead_letter_url(client: Any, url: str, options: SqsOptions, attributes: dict[str, str]) -> str:
    """Where the queue at `url` (with these attributes) sends dead letters: --dead-letter, else
    its redrive policy's target; neither is a configuration error (nothing is ever dropped)."""
    if options.dead_letter:
        attributes_of(client, options.dead_letter, "dead-letter queue")
        return options.dead_letter
    target = json.loads(attributes.get("RedrivePolicy") or "{}").get("deadLetterTargetArn")
    if not target:
        raise ConfigurationError(
            f"the SQS queue {url} has no redrive policy and no --dead-letter queue was "
            "given: dedupworker never drops a message, so it needs a dead-letter queue; "
            "pass --dead-letter URL (DEDUPWORKER_DEAD_LETTER) or add a redrive policy"
        )
    *_, account, queue_name = target.split(":")
    try:
        response = client.get_queue_url(QueueName=queue_name, QueueOwnerAWSAccountId=account)
    except (BotoCoreError, ClientError) as exc:
        raise _explain(exc, target, "redrive dead-letter queue", url) from exc
    found: str = response["QueueUrl"]
    return found


def _visibility(options: SqsOptions, attributes: dict[str, str]) -> int:
    if options.visibility_timeout is not None:
        return math.ceil(options.visibility_timeout)  # checked by SqsOptions
    seconds = int(attributes.get("VisibilityTimeout", 30))
    return check_visibility(seconds, "the queue's VisibilityTimeout")


def _explain(exc: Exception, url: str, what: str, endpoint: str) -> TransportError:
    """A TransportError that names the queue, the endpoint and the fix."""
    if isinstance(exc, EndpointConnectionError | ConnectTimeoutError):
        return TransportError(
            f"cannot reach the SQS endpoint {endpoint} for the {what} {url}: start it or point "
            f"AWS_ENDPOINT_URL_SQS at it{_host_note(url, endpoint)}"
        )
    if isinstance(exc, NoCredentialsError):
        return TransportError(
            f"no AWS credentials for the SQS {what} {url}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or give the pod or instance a role"
        )
    code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
    if code in NOT_FOUND:
        return TransportError(
            f"the SQS {what} {url} does not exist at {endpoint}: create it or fix the URL "
            f"(--queue and --dead-letter take queue URLs){_host_note(url, endpoint)}"
        )
    if "AccessDenied" in code or "Authoriz" in code:
        return TransportError(
            f"access denied to the SQS {what} {url}: the worker needs {PERMISSIONS} ({exc})"
        )
    return TransportError(f"the SQS {what} {url} at {endpoint} failed: {exc}")


def _host_note(url: str, endpoint: str) -> str:
    host, endpoint_host = urlsplit(url).netloc, urlsplit(endpoint).netloc
    if not host or host == endpoint_host:
        return ""
    return f" (the URL names {host} but boto3 sends to {endpoint_host}: set AWS_ENDPOINT_URL_SQS)"


def _redrive_note(attributes: dict[str, str]) -> str:
    policy = json.loads(attributes.get("RedrivePolicy") or "{}")
    count = policy.get("maxReceiveCount")
    return f", redrive after {count} receives" if count is not None else ""
