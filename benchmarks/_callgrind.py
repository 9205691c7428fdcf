"""The callgrind plumbing the instruction-count benchmarks share: the client-request shim, the
valgrind command and the reading of its per-thread dumps.

A benchmark's child process loads the shim with ``ctypes`` and switches instrumentation on and off
around the steps it counts (``td_window_start`` / ``td_window_stop``), zeroes the counts
(``td_zero``) and dumps them under a name (``td_dump``: the calling thread only). The parent runs
the child under :func:`run` and reads one :class:`Dump` per file callgrind wrote (one per thread
and dump: ``--separate-threads=yes``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SHIM = r"""
#include <valgrind/callgrind.h>
void td_window_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void td_window_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void td_zero(void) { CALLGRIND_ZERO_STATS; }
void td_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


@dataclass(frozen=True)
class Dump:
    """One file callgrind wrote: the thread it counts (1: the main thread), its instructions, and
    the name given to ``td_dump`` (``None`` for the dump at exit)."""

    thread: int
    instructions: int
    trigger: str | None


def require_valgrind() -> None:
    """Exit with the install command when valgrind or its client-request header is missing."""
    if shutil.which("valgrind") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        sys.exit("valgrind is not installed: apt-get install valgrind")


def shim() -> Path:
    """The client-request shim, built once into the system temp folder (``gcc``)."""
    so = Path(tempfile.gettempdir()) / f"torchdebug-callgrind-shim-{os.getuid()}.so"
    if not so.exists():
        src = so.with_name(f"{so.stem}.{os.getpid()}.c")
        src.write_text(_SHIM)
        tmp = so.with_name(f"{so.name}.{os.getpid()}")
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True)
        os.replace(tmp, so)  # atomic: parallel builders each replace it with the same library
        src.unlink()
    return so


def run(script: str, args: list[str], what: str, keep: Path | None = None) -> list[Dump]:
    """Run ``python script *args`` under callgrind, instrumentation off at start, and read every
    dump it wrote. ``what`` names the run in the error raised when it fails; ``keep``: a file
    prefix to copy callgrind's files to (``PREFIX.cg.out*``, for ``callgrind_annotate``)."""
    with tempfile.TemporaryDirectory(prefix="td-cg-") as tmp:
        out_file = Path(tmp) / "cg.out"
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--separate-threads=yes",
            f"--callgrind-out-file={out_file}",
            sys.executable,
            script,
            *args,
        ]
        # a fixed hash seed: string hashing decides how often dict lookups collide, which moves a
        # process's count by ~0.5 M instructions per step between seeds
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONPATH=str(ROOT / "src"))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if out.returncode != 0:
            raise RuntimeError(f"{what} failed under valgrind:\n{out.stderr[-3000:]}")
        dumps = []
        for f in sorted(Path(tmp).glob("cg.out*")):
            text = f.read_text(errors="replace")
            total = re.search(r"^totals:\s+(\d+)", text, re.M)
            thread = re.search(r"^thread:\s+(\d+)", text, re.M)
            trigger = re.search(r"^desc: Trigger: Client Request: (\S+)", text, re.M)
            dumps.append(
                Dump(
                    int(thread.group(1)) if thread else 1,
                    int(total.group(1)) if total else 0,
                    trigger.group(1) if trigger else None,
                )
            )
            if keep is not None:
                shutil.copy(f, keep.with_name(f"{keep.name}.{f.name}"))
    return dumps
