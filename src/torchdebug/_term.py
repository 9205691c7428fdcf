"""Text read from a run, made safe to print to a terminal: control characters escaped, long names cut."""

from __future__ import annotations

import re
from typing import Any

# C0 and C1 controls (ESC starts terminal escape sequences, CR rewrites a line, BEL rings), DEL, and
# the invisible bidirectional/line-separator marks that can disguise text.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    o = ord(m.group())
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(text: Any, limit: int | None = None) -> str:
    """``str(text)`` with every control character written as an escape (``\\x1b``), cut to ``limit``.

    Args:
        text: anything; names, messages and paths that came from a run folder.
        limit: at most this many characters; a longer text ends in ``...``.

    Example: ``printable("evil\\x1b[2J", 8) == "evil\\\\x..."``. Cost: one regex scan.
    """
    s = str(text)
    if _UNSAFE.search(s) is not None:
        s = _UNSAFE.sub(_escape, s)
    if limit is not None and len(s) > limit:
        s = s[: max(limit - 3, 0)] + "..."
    return s
