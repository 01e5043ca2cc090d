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


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def printable(text: object, *, newlines: bool = False) -> str:
    """``text`` as a string a terminal shows as it is: every character Python does not call printable
    (C0 and C1 controls, DEL, the Unicode format characters that reorder or hide text such as U+202E,
    line and paragraph separators, unassigned code points) written as an escape (``\\x1b``, ``\\u202e``);
    a space stays. ``newlines``: keep newlines and tabs (a block of lines); else they are escaped too (one
    field, one line)."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():
        return s
    keep = "\n\t" if newlines else ""
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in s)


class PrintableFormatter(logging.Formatter):
    """A log formatter whose lines are :func:`printable` (a message quoting a file's content cannot
    drive the terminal); tracebacks keep their lines."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), newlines=True)


__all__ = ["PrintableFormatter", "printable"]
