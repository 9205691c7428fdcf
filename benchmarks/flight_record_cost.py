"""Cost of one rank's flight record (``torchdebug.session.hangs.capture``) with a full Flight Recorder ring.

Usage: python benchmarks/flight_record_cost.py [--collectives 2500]

A one-rank gloo group runs --collectives all-reduces of 4 floats (the ring keeps the last 2000),
then the record is captured twice in fresh groups' processes: as at exit (no calling lines) and as
when the watchdog fires (with them: torch symbolizes every entry's stack). Prints the wall time of
each (host clock, one sample each: the first dump pays the symbolization, a repeat would not).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time


def _child(reason: str, n: int) -> None:
    import torch
    import torch.distributed as dist

    from torchdebug.session import hangs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    t = torch.ones(4)
    for _ in range(n):
        dist.all_reduce(t)
    t0 = time.perf_counter()
    rec = hangs.capture(0, reason, "data", 1, threading.get_ident())
    dt = time.perf_counter() - t0
    print(f"{reason:<5} record: {len(rec['entries'])} entries in {dt * 1e3:.1f} ms")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--collectives", type=int, default=2500)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.collectives)
        return
    for reason in ("exit", "hang"):  # a fresh process each: the symbolization is cached after a dump
        cmd = [sys.executable, __file__, "--child", reason, "--collectives", str(a.collectives)]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
