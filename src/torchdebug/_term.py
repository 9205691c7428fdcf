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


# Severity -> SGR colour code: red for what stopped or broke a run, yellow for what needs a look,
# green for a clean finish, dim for information.
_SGR = {"error": "31", "warning": "33", "ok": "32", "info": "2"}
# Run statuses and event severities as they are stored, mapped to the four above.
_SEVERITY_OF = {
    "failed": "error",
    "crashed": "error",
    "unreadable": "error",
    "error": "error",
    "anomaly": "error",
    "warning": "warning",
    "running": "warning",
    "finished": "ok",
    "ok": "ok",
    "info": "info",
}


def use_colour(stream: Any, environ: Any = None) -> bool:
    """Whether to colour text written to ``stream``: a terminal, ``NO_COLOR`` unset, ``TERM`` not dumb.

    ``NO_COLOR`` (any non-empty value, https://no-color.org) always wins; ``FORCE_COLOR`` (non-empty)
    colours a pipe too. Cost: one ``isatty`` call.
    """
    import os

    env = os.environ if environ is None else environ
    if env.get("NO_COLOR"):
        return False
    if env.get("FORCE_COLOR"):
        return True
    if env.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


def style(text: str, severity: str, enabled: bool) -> str:
    """``text`` in its severity's colour when ``enabled`` (see :func:`use_colour`), else unchanged.

    ``severity``: ``error``/``warning``/``ok``/``info``, or a run status (``failed``, ``finished``
    ...) or an event severity; anything else is left plain.

    Example: ``style("failed", "failed", True) == "\\x1b[31mfailed\\x1b[0m"``.
    """
    code = _SGR.get(_SEVERITY_OF.get(severity, severity))
    if not enabled or code is None or not text:
        return text
    return f"\x1b[{code}m{text}\x1b[0m"
