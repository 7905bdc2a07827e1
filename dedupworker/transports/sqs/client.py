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
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
)

from dedupworker.config import WorkerConfig
from dedupworker.errors import TransportError
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
