"""Readers never write into a run folder (a closed database beside a stray or broken WAL), and every
error about a damaged run's files names the file and says what to do (random byte flips)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import random
import shutil
import sys
from pathlib import Path

import pytest

from tests.fixtures.runs import write_small_run
from torchdebug.cli import main
from torchdebug.store import list_runs, open_run

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SQLite's -shm handling is POSIX here")


def _state(folder: Path) -> dict[str, str]:
    """Every file of the folder and the hash of its bytes: any created, removed or changed file shows."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


# A WAL header is 32 bytes; the probe's "only a header" file was 24 bytes of it.
_STRAYS = {
    "random-wal": {"rank0.sqlite-wal": random.Random(1).randbytes(4096)},
    "header-only-wal": {"rank0.sqlite-wal": bytes.fromhex("377f0682002de218") + bytes(16)},
    "empty-wal": {"rank0.sqlite-wal": b""},
    "random-wal-and-shm": {
        "rank0.sqlite-wal": random.Random(2).randbytes(8192),
        "rank0.sqlite-shm": random.Random(3).randbytes(32768),
    },
    "shm-only": {"rank0.sqlite-shm": random.Random(4).randbytes(32768)},
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_run(tmp_path_factory.mktemp("template"), name="good")


@pytest.mark.parametrize("stray", sorted(_STRAYS))
def test_no_command_writes_beside_a_closed_database_with_a_stray_wal(
    tmp_path: Path, template: Path, stray: str
) -> None:
    root = tmp_path / "runs"
    run = root / "good"
    shutil.copytree(template, run)
    for name, data in _STRAYS[stray].items():
        (run / name).write_bytes(data)
    before = _state(run)
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    commands = [
        ("runs", str(root)),
        ("runs", str(root), "--json"),
        ("show", str(run)),
        ("show", str(run), "--json"),
        ("report", str(run), "--format", "text", "-o", str(out_dir / "r.txt")),
        ("report", str(run), "--format", "json", "-o", str(out_dir / "r.json")),
        ("report", str(run), "--format", "html", "-o", str(out_dir / "r.html")),
    ]
    for cmd in commands:
        code, out, err = _cli(*cmd)
        assert code == 0, (cmd, err)
        # the probe: `show` created rank0.sqlite-shm (and SQLite may rewrite the -wal)
        assert _state(run) == before, cmd
    code, out, _ = _cli("show", str(run))
    assert "steps      8 (last step 7)" in out  # the closed database is read whole
    with open_run(run) as r:
        assert r.series("loss").steps == list(range(8))
    assert [i.status for i in list_runs(root)] == ["finished"]
    assert _state(run) == before

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from torchdebug.views.server import create_app

    routes = [
        "/",
        "/api/runs",
        "/api/runs/good",
        "/runs/good",
        "/api/runs/good/metrics",
        "/api/runs/good/metrics?names=loss&max_points=4",
        "/api/runs/good/anomalies",
        "/api/runs/good/events",
        "/api/runs/good/report.json",
        "/api/runs/good/ranks",
        "/api/runs/good/views",
        "/training-logs/debug/summary?run=good",
        "/training-logs/debug/training/summary?run=good",
    ]
    with TestClient(create_app(root, warm=0), base_url="http://127.0.0.1") as client:
        for route in routes:
            r = client.get(route)
            assert r.status_code == 200, (route, r.text[:300])
            assert _state(run) == before, route


# -- random byte flips: errors name the file and the fix -------------------------------------------


@pytest.fixture(scope="module")
def flippable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    from torchdebug.store import create_run

    w = create_run(root=tmp_path_factory.mktemp("flips"), name="r")
    for s in range(300):
        w.log_scalars(s, {"loss": 1.0 / (s + 1), "grad_norm": 0.5})
        w.log_timing(s, {"forward": 0.01, "step": 0.02})
        w.log_memory(s, {"rss": 1000 + s})
        if s % 10 == 0:
            w.log_tensor_stats(s, "fc.weight", {"mean": 0.1, "std": 1.0})
    for s in range(0, 300, 7):
        w.log_event(s, "loss_spike", "warning", "loss rose", {"evidence": {"ratio": 2.0}})
    w.log_anomaly(5, {"phase": "forward", "module": "fc", "kind": "nan"})
    w.close()
    return w.path, (w.path / "rank0.sqlite").read_bytes()


# Seeds whose 20 flips gave, before: "'utf-8' codec can't decode byte 0xe9 ..." (27, 68, 156: the
# schema's text), "internal error TypeError: name must be a str, got NoneType" (92: a metric's name).
@pytest.mark.parametrize("seed", [27, 68, 92, 156, *range(5)])
def test_a_flipped_database_gives_an_error_naming_the_file_and_the_fix(
    flippable: tuple[Path, bytes], seed: int
) -> None:
    run, good = flippable
    rng = random.Random(seed)
    data = bytearray(good)
    for _ in range(20):
        i = rng.randrange(100, len(data))
        data[i] ^= 1 << rng.randrange(8)
    (run / "rank0.sqlite").write_bytes(bytes(data))
    for cmd in (("show",), ("report", "--format", "json"), ("report", "--format", "text")):
        code, _, err = _cli(cmd[0], str(run), *cmd[1:])
        if code == 0:
            continue  # a flip in free space or in a value: nothing to complain about
        assert code == 1 and err.count("\n") == 1, err
        assert "codec can't decode" not in err and "internal error" not in err, err
        assert str(run / "rank0.sqlite") in err, err
        assert "restore it from a backup" in err or "copy" in err, err
