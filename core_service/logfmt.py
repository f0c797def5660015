"""Log lines that a client cannot forge: control characters in a record's message are escaped.

Values that come from clients (hosts, reasons, details) end up in log messages; one with a
newline would start a line of its own that reads like the Core's. The formatter escapes the
message (`\\n` -> `\\\\n`, other control characters as `\\\\xNN`), never the traceback it appends.
"""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def escape(text: str) -> str:
    """`text` with every control character written as a visible escape."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class EscapingFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = escape(record.message)
        return super().formatMessage(record)


def configure(level: str) -> None:
    """The Core's logging: one line per record on stderr, messages escaped."""
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
