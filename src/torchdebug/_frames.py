"""Which stack frames are the user's, and how a source location is written (``path/file.py:LINE``)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep
_PACKAGE_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_STACK_DEPTH = 8

_USER_CODE_IN_PACKAGE = (os.path.join(_OWN_DIR, "demo.py"),)  # the demo's model is user code
# installed packages whose lines are never the user's: the training frameworks that call user code
_LIBRARIES = frozenset(
    {
        "torch",
        "torchdebug",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
        "lightning_utilities",
        "transformers",
        "accelerate",
    }
)


def _installed_library(filename: str) -> bool:
    for d in _PACKAGE_DIRS:
        i = filename.find(d)
        if i >= 0:
            return filename[i + len(d) :].split(os.sep, 1)[0] in _LIBRARIES
    return False


@functools.lru_cache(maxsize=4096)
def skip_frame(filename: str) -> bool:
    """True for frames that are not the user's: torch, torchdebug (but the demo), the stdlib,
    ``<string>``, and installed Lightning, transformers and accelerate (other installed libraries,
    a model from timm say, are user code). Cached per file name."""
    if filename in _USER_CODE_IN_PACKAGE:
        return False
    if filename.startswith((_TORCH_DIR, _OWN_DIR, "<")) or _installed_library(filename):
        return True
    # the stdlib (contextlib, functools ...), but not libraries installed under it (system Pythons
    # put site-packages inside the stdlib folder; a model from an installed library is user code)
    return filename.startswith(_STDLIB_DIR) and not any(d in filename for d in _PACKAGE_DIRS)


@functools.lru_cache(maxsize=4096)
def _display_path(filename: str, cwd: str) -> str:
    try:
        rel = os.path.relpath(filename, cwd)
    except ValueError:  # other drive on Windows
        return filename
    return filename if rel.startswith("..") else rel


def format_location(filename: str, lineno: int) -> str:
    """``path/file.py:LINE``, relative to the working directory when the file lies under it."""
    return f"{_display_path(filename, os.getcwd())}:{lineno}"


def raw_user_frames(start: Any, depth: int) -> tuple[tuple[str, int, str], ...]:
    """Up to ``depth`` user frames as raw (filename, line, function), innermost first; formatted later."""
    out: list[tuple[str, int, str]] = []
    f = start
    while f is not None and len(out) < depth:
        code = f.f_code
        if not skip_frame(code.co_filename):
            out.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back
    return tuple(out)


def format_frames(raw: tuple[tuple[str, int, str], ...]) -> tuple[str | None, tuple[str, ...]]:
    """(innermost ``file:line``, frames innermost last) from :func:`raw_user_frames`."""
    if not raw:
        return None, ()
    locs = [format_location(fn, ln) for fn, ln, _ in raw]
    return locs[0], tuple(f"{loc} in {name}" for loc, (_, _, name) in reversed(list(zip(locs, raw))))


def user_location(start: Any, limit: int = 200) -> str | None:
    """The innermost user frame as ``file:line`` (stops at the first one: cheap)."""
    f = start
    while f is not None and limit > 0:
        limit -= 1
        name = f.f_code.co_filename
        if not skip_frame(name):
            return format_location(name, f.f_lineno)
        f = f.f_back
    return None


def user_stack(start: Any = None, depth: int = _STACK_DEPTH) -> tuple[str | None, tuple[str, ...]]:
    """The innermost user frame (not torch, not torchdebug) as ``file:line``, and up to ``depth`` user frames."""
    f = start if start is not None else sys._getframe(1)
    first: str | None = None
    frames: list[str] = []
    while f is not None and len(frames) < depth:
        code = f.f_code
        if not skip_frame(code.co_filename):
            loc = format_location(code.co_filename, f.f_lineno)
            if first is None:
                first = loc
            frames.append(f"{loc} in {code.co_name}")
        f = f.f_back
    frames.reverse()  # innermost last
    return first, tuple(frames)


def _first_user(f: Any, anonymous: bool = False) -> Any:
    """The innermost user frame from ``f`` outwards, or None; ``anonymous``: also code without a file
    (``<stdin>``, ``<string>``), but not the interpreter's or torch's generated code."""
    while f is not None:
        name = f.f_code.co_filename
        if not skip_frame(name):
            return f
        if anonymous and name.startswith("<") and not name.startswith(("<frozen", "<eval_with_key")):
            return f
        f = f.f_back
    return None


def warn_at_user(message: Warning, start: Any = None) -> None:
    """Issue ``message`` attributed to the innermost user frame (not torch's, not torchdebug's).

    ``warnings.warn(stacklevel=N)`` points at whatever frame sits N levels up, which inside hooks
    and wrapped optimizers is torch's or torchdebug's own line; this walks to the user's line (the
    ``opt.step()`` or ``mon.step()`` call) and honours the filters and "once" registry of that
    frame's module, as ``warnings.warn`` would. Falls back to the caller when no user frame exists.
    """
    first = start if start is not None else sys._getframe(1)
    f = _first_user(first)
    if f is None and threading.current_thread() is not threading.main_thread():
        # no user frame on this thread (an autograd device thread, a worker): the training loop's line
        # on the main thread, which waits in backward() or join()
        main = sys._current_frames().get(threading.main_thread().ident or -1)
        f = _first_user(main)
    if f is None:  # code without a file (python -c, stdin, exec of a string, a notebook cell)
        f = _first_user(first, anonymous=True)
    if f is None:
        f = first
    g = f.f_globals
    warnings.warn_explicit(
        message,
        type(message),
        f.f_code.co_filename,
        f.f_lineno,
        module=g.get("__name__"),
        registry=g.setdefault("__warningregistry__", {}),
        # the source line is looked up through the module's loader; code without a file (stdin) has
        # none that can give it (its loader raises ImportError), so none is asked
        module_globals=None if f.f_code.co_filename.startswith("<") else g,
    )
