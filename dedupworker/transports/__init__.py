"""Transports, each loaded by name only when chosen (see dedupworker.transport.TRANSPORTS)."""
