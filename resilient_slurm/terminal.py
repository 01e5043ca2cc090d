"""Strings read from disk made harmless in human output (the one guard of that class).

A manifest's provenance (the command line, the git commit), a history's evidence, a daemon status'
error, a run or node name: any of them may hold control characters, written by a hostile program or a
damaged file. Printed raw, an escape sequence moves the cursor, rewrites the title, hides lines or
fakes a successful verify. Every command's human output goes through :func:`printable` (tables,
lines, error messages) and the CLI's log handler through :class:`PrintableFormatter`; JSON output is
left exact (``json.dumps`` escapes control characters itself).
"""

from __future__ import annotations

import logging
import re

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode controls that reorder or hide text
# (bidirectional overrides and isolates, zero-width marks, the byte-order mark).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: object, *, newlines: bool = False) -> str:
    """``text`` as a string a terminal shows as it is: every control character written as an escape
    (``\\x1b``, ``\\u202e``). ``newlines``: keep newlines and tabs (a block of lines); else they are
    escaped too (one field, one line)."""
    s = text if isinstance(text, str) else str(text)
    return (_UNSAFE if newlines else _UNSAFE_LINE).sub(_escape, s)


class PrintableFormatter(logging.Formatter):
    """A log formatter whose lines are :func:`printable` (a message quoting a file's content cannot
    drive the terminal); tracebacks keep their lines."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), newlines=True)


__all__ = ["PrintableFormatter", "printable"]
