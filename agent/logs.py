"""Structured one-line logs: ``<time> <level> agent <event> key=value ...``.

Every line carries one event name and its fields, so operators can grep for an event and
machines can split on spaces (values with spaces or quotes are JSON-quoted).
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOGGER_NAME = "elaswave.agent"


def _format_value(value: object) -> str:
    text = value if isinstance(value, str) else str(value)
    if text == "" or any(ch in text for ch in ' "=\n\t'):
        return json.dumps(text)
    return text


def format_event(event: str, **fields: object) -> str:
    """``event key=value ...`` with values quoted only when needed."""
    parts = [event] + [f"{key}={_format_value(value)}" for key, value in fields.items()]
    return " ".join(parts)


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def log_event(level: int, event: str, **fields: object) -> None:
    get_logger().log(level, format_event(event, **fields))


def setup_logging(level: str = "INFO") -> None:
    """Send agent logs to stderr as one line per event, UTC timestamps."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = logging.Formatter(
        "%(asctime)s.%(msecs)03dZ %(levelname)s agent %(message)s", "%Y-%m-%dT%H:%M:%S"
    )
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    logger = get_logger()
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
