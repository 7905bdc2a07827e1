"""Logging setup: human-readable by default, one JSON object per line with --log-format json."""

from __future__ import annotations

import json
import logging
import sys
import time

from dedupworker.observe.outage import tame_pool_log

_FIELDS = ("handler", "transport", "message_id", "entity", "outcome", "attempt", "duration_seconds")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _FIELDS:
            if hasattr(record, name):
                entry[name] = getattr(record, name)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger("dedupworker")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    tame_pool_log(root)
