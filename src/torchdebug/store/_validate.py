"""What a reader accepts from a run's files: meta.json and the JSON documents stored in the database.

Hand-written checks rather than pydantic: the store, the CLI and the reports must work without the
``[dashboard]`` extra that brings pydantic, and these few flat shapes need no more. Everything that
fails raises ``RunStoreError`` naming the file (or table row), the field and what was found, so one
malformed run is listed as unreadable and never takes the others down.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

from .._errors import RunStoreError

#: Deeper JSON than this is refused: no torchdebug document nests past ~5 levels, and recursive
#: consumers (reports, JSON encoders) must never meet 200k levels.
MAX_DEPTH = 64
_INT64 = 2**63
#: The most bytes a reader takes from meta.json (a few KiB in practice) and summary.json (~200 B).
META_CAP = 16 * 2**20
SUMMARY_CAP = 2**20
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


@contextlib.contextmanager
def regular(path: str | os.PathLike[str]) -> Iterator[int]:
    """An open descriptor of ``path`` (links followed) when it is a regular file, else RunStoreError.

    Opened without blocking, so a FIFO is refused at once instead of waiting for a writer (and a
    device such as /dev/zero is never read). Closed on leaving."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise RunStoreError(f"cannot read {os.fspath(path)}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
            raise RunStoreError(f"{os.fspath(path)} is not a regular file ({kind}); refused")
        yield fd
    finally:
        os.close(fd)


def read_file(path: str | os.PathLike[str], cap: int) -> bytes:
    """The bytes of a run's small file: a regular file only (see :func:`regular`), at most ``cap``
    bytes (more: RunStoreError, nothing past the cap read)."""
    with regular(path) as fd:
        chunks, left = [], cap + 1
        while left > 0:
            chunk = os.read(fd, min(left, 2**20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    data = b"".join(chunks)
    if len(data) > cap:
        raise RunStoreError(
            f"{os.fspath(path)} holds more than {cap} bytes, more than such a file ever holds; refused"
        )
    return data


_STR = (str,)
_INT = (int,)
_NUM = (int, float, str)  # NaN/Inf are stored as the strings "nan", "inf", "-inf"

META_FIELDS: dict[str, tuple[type, ...]] = {
    "run_id": _STR,
    "name": _STR,
    "created": _STR,
    "opened": _STR,
    "ended": _STR,
    "status": _STR,
    "torch": _STR,
    "python": _STR,
    "torchdebug": _STR,
    "host": _STR,
    "pid": _INT,
    "rank": _INT,
    "world_size": _INT,
    "schema_version": _INT,
    "config": (dict,),
    "dropped": _INT,
    "lost": _INT,
    "lost_from_step": _INT,
    "write_error": _STR,
}
ANOMALY_FIELDS: dict[str, tuple[type, ...]] = {
    "frames": (list,),
    "tensor": (dict,),
    "stack": (list,),
    "related": (dict,),
    "micro_step": _INT,
    "rank": _INT,
    "world_size": _INT,
    "cause": (dict,),
}
CAUSE_FIELDS: dict[str, tuple[type, ...]] = {
    "verdict": (str,),
    "evidence": (str,),
    "tried": (list,),
    "compiles": _INT,
    "replays": _INT,
    "rank": _INT,
}
FRAME_FIELDS: dict[str, tuple[type, ...]] = {
    "input_abs_min": _NUM,
    "input_abs_max": _NUM,
    "output_abs_min": _NUM,
    "output_abs_max": _NUM,
}
TENSOR_STATS_FIELDS: dict[str, tuple[type, ...]] = {
    "numel": _INT,
    "bytes": _INT,
    "nan_count": _INT,
    "posinf_count": _INT,
    "neginf_count": _INT,
    "min": _NUM,
    "max": _NUM,
    "mean": _NUM,
    "std": _NUM,
}
EVENT_DATA_FIELDS: dict[str, tuple[type, ...]] = {"modules": (list,), "evidence": (dict,)}

_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "a JSON object", list: "a JSON list"}


def _kind(value: Any) -> str:
    return {dict: "a JSON object", list: "a JSON list", bool: "a boolean", type(None): "null"}.get(
        type(value), f"{type(value).__name__} {value!r:.40}"
    )


def load(text: Any, where: str) -> Any:
    """Parse JSON text, refusing what is not text, not JSON, or nested deeper than ``MAX_DEPTH``."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RunStoreError(f"{where} is not UTF-8 text ({e})") from None
    if not isinstance(text, str):
        raise RunStoreError(f"{where} is not JSON text (found {_kind(text)})")
    try:
        value = json.loads(text)
    except RecursionError:
        raise RunStoreError(f"{where} is JSON nested too deeply to read (over {MAX_DEPTH} levels)") from None
    except ValueError as e:
        raise RunStoreError(f"{where} is corrupt (not valid JSON: {e})") from None
    _check_depth(value, where)
    return value


def _check_depth(value: Any, where: str) -> None:
    stack = [(value, 1)]
    while stack:  # iterative: the depth being checked is what must not recurse
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RunStoreError(f"{where} is JSON nested too deeply to read (over {MAX_DEPTH} levels)")
        # only containers are pushed: a leaf cannot be too deep (a meta.json is mostly leaves)
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))


def check_fields(doc: dict[str, Any], fields: dict[str, tuple[type, ...]], where: str) -> None:
    """Each known key holds null or one of its types (a bool is not an int; ints fit in 64 bits)."""
    for key, types in fields.items():
        v = doc.get(key)
        if v is None:
            continue
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if ok and isinstance(v, int) and not isinstance(v, bool) and not -_INT64 <= v < _INT64:
            ok = False
        if not ok:
            want = " or ".join(_NAMES.get(t, t.__name__) for t in types)
            raise RunStoreError(f"{where}: {key!r} must be {want} or null, found {_kind(v)}")


def document(text: Any, where: str, fields: dict[str, tuple[type, ...]] | None = None) -> dict[str, Any]:
    """A stored JSON object, checked: a JSON list, text or number where an object belongs is refused."""
    doc = load(text, where)
    if not isinstance(doc, dict):
        raise RunStoreError(f"{where} must hold a JSON object, found {_kind(doc)}")
    if fields:
        check_fields(doc, fields, where)
    return doc


def meta(text: Any, where: str) -> dict[str, Any]:
    """meta.json's content, checked against ``META_FIELDS`` (unknown keys are kept as they are)."""
    doc = document(text, where, META_FIELDS)
    for key, low in (("rank", 0), ("world_size", 1), ("pid", 0)):
        if isinstance(doc.get(key), int) and doc[key] < low:
            raise RunStoreError(f"{where}: {key!r} must be >= {low}, found {doc[key]}")
    return doc


def anomaly(text: Any, where: str) -> dict[str, Any]:
    """An anomaly document; its frames must be objects too."""
    doc = document(text, where, ANOMALY_FIELDS)
    for i, frame in enumerate(doc.get("frames") or ()):
        if not isinstance(frame, dict):
            raise RunStoreError(f"{where}: frames[{i}] must be a JSON object, found {_kind(frame)}")
        check_fields(frame, FRAME_FIELDS, f"{where} frames[{i}]")
    if doc.get("cause") is not None:
        check_fields(doc["cause"], CAUSE_FIELDS, f"{where} cause")
    return doc
