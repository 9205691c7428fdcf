"""Per-parameter vectors in the run store: one packed row per detail step, read back as metrics."""

from __future__ import annotations

import math
import sqlite3
import time
from pathlib import Path

import numpy as np

from torchdebug.store import _vectors, create_run, open_run
from torchdebug.store._aggregate import metric_stats

NAMES = ["grad_norm/a", "grad_norm/b"]
# step: values; 0.1 is not a float32, so step 20's row is stored as float64, the others as float32
DATA = {0: [1.0, math.nan], 10: [0.5, 2.0], 20: [0.1, math.inf]}


def _write(root: Path, **kw: object) -> Path:
    w = create_run(root=root, name="v", **kw)  # type: ignore[arg-type]
    for step, values in DATA.items():
        w.log_vector(step, NAMES, values)
        w.log_scalar("loss", step, float(step))
    w.close()
    return w.path


def _db(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path / "rank0.sqlite")


def test_a_detail_steps_numbers_are_one_packed_row_per_vector(tmp_path: Path) -> None:
    path = _write(tmp_path)
    con = _db(path)
    try:
        rows = con.execute("SELECT step, length(data) FROM vectors ORDER BY step").fetchall()
        rolled = con.execute(
            "SELECT count(*) FROM metric_rollup r JOIN metrics m ON m.id = r.metric_id WHERE m.name LIKE 'grad_norm/%'"
        ).fetchone()[0]
        raw = con.execute(
            "SELECT count(*) FROM scalars s JOIN metrics m ON m.id = s.metric_id WHERE m.name LIKE 'grad_norm/%'"
        ).fetchone()[0]
    finally:
        con.close()
    # 2 values x 4 bytes (float32 exact), then 2 x 8 bytes (0.1 needs float64)
    assert rows == [(0, 8), (10, 8), (20, 16)]
    assert (rolled, raw) == (0, 0)  # no per-value row anywhere
    with open_run(path) as run:
        assert run.metric_names() == ["grad_norm/a", "grad_norm/b", "loss"]
        a, b = run.series("grad_norm/a"), run.series("grad_norm/b")
        assert (a.steps, a.values) == ([0, 10, 20], [1.0, 0.5, 0.1])  # 0.1 exactly, not 0.10000000149
        assert b.steps == [0, 10, 20] and math.isnan(b.values[0]) and b.values[1:] == [2.0, math.inf]
        assert run.at_step(10)["scalars"] == {"loss": 10.0, "grad_norm/a": 0.5, "grad_norm/b": 2.0}
        assert run.last_values() == {
            "grad_norm/a": (20, 0.1),
            "grad_norm/b": (20, math.inf),
            "loss": (20, 20.0),
        }
        assert run.steps() == 3
        stats = metric_stats(run)
    # a: 1.0 + 0.5 + 0.1 = 1.6 over 3 finite points; b: one finite point (2.0), NaN and +Inf are bad
    assert stats["grad_norm/a"] == {
        "points": 3, "count": 3, "bad": 0, "sum": 1.6, "min": 0.1, "max": 1.0, "last_step": 20, "last": 0.1,
    }  # fmt: skip
    assert stats["grad_norm/b"] == {
        "points": 3, "count": 1, "bad": 2, "sum": 2.0, "min": 2.0, "max": 2.0, "last_step": 20, "last": math.inf,
    }  # fmt: skip


def test_a_downsampled_vector_series_keeps_each_buckets_extremes(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="d")
    for step in range(8):
        w.log_vector(step, ["x"], [[3.0, 1.0, 2.0, 9.0, math.nan, 4.0, 5.0, 6.0][step]])
    w.close()
    with open_run(w.path) as run:
        s = run.series("x", max_points=4)  # 2 buckets: steps 0-3 and 4-7
    assert s.downsampled and s.steps == [1, 3, 4, 7]  # lowest 1.0 and highest 9.0; the NaN and 6.0
    assert s.values[:2] == [1.0, 9.0] and math.isnan(s.values[2]) and s.values[3] == 6.0


def test_a_run_written_before_vectors_reads_and_resumes(tmp_path: Path) -> None:
    # a v4 file: per-parameter numbers as scalar rows (what log_scalars writes), no vector tables
    w = create_run(root=tmp_path, name="old")
    for step, values in DATA.items():
        w.log_scalars(step, dict(zip(NAMES, values)))
    w.close()
    con = _db(w.path)
    for table in ("vectors", "vector_members", "vector_names"):
        con.execute(f"DROP TABLE {table}")
    con.execute("PRAGMA user_version = 4")
    con.commit()
    con.close()
    with open_run(w.path) as run:
        assert run.schema_version == 4
        assert run.series("grad_norm/a").values == [1.0, 0.5, 0.1]
        assert run.at_step(10)["scalars"] == {"grad_norm/a": 0.5, "grad_norm/b": 2.0}
        assert metric_stats(run)["grad_norm/a"]["sum"] == 1.6
    # resumed by a writer of today: migrated to v6, the same names now arrive as a vector
    w2 = create_run(path=w.path)
    w2.log_vector(30, NAMES, [0.25, 4.0])
    w2.close()
    with open_run(w.path) as run:
        assert run.schema_version == 6
        assert run.series("grad_norm/a").steps == [0, 10, 20, 30]
        assert run.series("grad_norm/a").values == [1.0, 0.5, 0.1, 0.25]
        st = metric_stats(run)["grad_norm/a"]
        assert (st["points"], st["sum"], st["last_step"], st["last"]) == (4, 1.85, 30, 0.25)


def test_compaction_keeps_a_vector_row_per_256_steps(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="c", keep_recent=0)
    for step in range(0, 4200, 10):  # a detail step every 10 steps, past one 4096-step chunk
        w.log_vector(step, ["g"], [float(step)])
        w.log_scalar("loss", step, 1.0)
    w.flush()
    w.log_scalar("loss", 4200, 1.0)  # the next commit compacts [0, 4096)
    w.close()
    with open_run(w.path) as run:
        s = run.series("g")
        steps = run.steps()
    # the last detail step of each 256-step bucket: 250, 510, 760, ..., 4090 (16 of them)
    kept = [max(x for x in range(0, 4096, 10) if x // 256 == b) for b in range(16)]
    assert [x for x in s.steps if x < 4096] == kept and kept[:3] == [250, 510, 760]
    assert [x for x in s.steps if x >= 4096] == list(range(4100, 4200, 10))
    assert s.values == [float(x) for x in s.steps] and s.downsampled
    assert steps == 421  # every step with a record: 420 detail steps (0-4190) and 4200, compacted or not


def test_the_writer_commits_every_commit_steps_steps(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="k", flush_interval=3600, batch_size=10_000, commit_steps=4)
    try:
        time.sleep(0.3)  # steps wake the writer at most every 0.25 s after its last wake-up
        for step in range(5):  # step 4's record wakes the writer thread: steps 0-3 are committed
            w.log_scalar("loss", step, float(step))
        got: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
            with open_run(w.path) as run:
                got = run.series("loss").steps
        assert got[:4] == [0, 1, 2, 3]
    finally:
        w.close()


def test_a_compressible_vector_is_stored_compressed_and_read_back_exactly(tmp_path: Path) -> None:
    # norms of one model share their sign-and-exponent bytes: 1 + i/64 (float32-exact, all in [1, 2))
    # compress; full-range float32 bit patterns do not and stay raw (4 bytes a value)
    names = [f"grad_norm/p{i}" for i in range(64)]
    norms = [1.0 + i / 64 for i in range(64)]
    wide = [0.1 * (1 + i / 64) for i in range(64)]  # not float32-exact: float64, compressed
    bits = np.random.default_rng(0).integers(0, 0x7F000000, 64, dtype=np.uint32)  # finite, any exponent
    noise = bits.view(np.float32).astype(float).tolist()
    w = create_run(root=tmp_path, name="z")
    w.log_vector(0, names, norms)
    w.log_vector(10, names, wide)
    w.log_vector(20, names, noise)
    w.log_vector(30, names, [math.nan, math.inf, -math.inf, -0.0, *norms[4:]])
    w.close()
    con = _db(w.path)
    try:
        rows = con.execute(
            "SELECT step, length(data), substr(data, 1, 1) FROM vectors ORDER BY step"
        ).fetchall()
    finally:
        con.close()
    small = {step: (n, head) for step, n, head in rows}
    assert small[20] == (4 * 64, bytes(noise_head(noise)))  # raw float32, unchanged
    for step in (0, 10, 30):
        assert small[step][0] < 4 * 64 and small[step][1] == bytes([_vectors.CODEC_SHUFFLED_ZLIB])
    with open_run(w.path) as run:
        assert run.series("grad_norm/p5").values[:3] == [norms[5], wide[5], noise[5]]
        assert run.at_step(0)["scalars"] == dict(zip(names, norms))
        assert run.at_step(10)["scalars"] == dict(zip(names, wide))  # float64 exactly
        assert run.at_step(20)["scalars"] == dict(zip(names, noise))
        last = run.at_step(30)["scalars"]
        stats = metric_stats(run)
    assert math.isnan(last["grad_norm/p0"]) and last["grad_norm/p1"] == math.inf
    assert last["grad_norm/p2"] == -math.inf and math.copysign(1.0, last["grad_norm/p3"]) == -1.0
    assert [last[n] for n in names[4:]] == norms[4:]
    # p9: 1 + 9/64 (steps 0 and 30), 0.1 * (1 + 9/64), noise[9]; p0: NaN at step 30 is bad
    p9 = [norms[9], wide[9], noise[9], norms[9]]
    assert stats["grad_norm/p9"]["sum"] == sum(p9) and stats["grad_norm/p9"]["max"] == max(p9)
    assert (stats["grad_norm/p0"]["points"], stats["grad_norm/p0"]["bad"]) == (4, 1)


def noise_head(values: list[float]) -> list[int]:
    """The first byte of ``values`` packed raw as little-endian float32."""
    return [np.asarray(values[:1], dtype="<f4").tobytes()[0]]


def test_pack_round_trips_every_form_exactly() -> None:
    cases = {
        "short": [0.5, 0.25],
        "float32": [2.0 + i / 8 for i in range(100)],
        "float64": [1 / 3 + i for i in range(100)],
        "special": [
            math.nan,
            math.inf,
            -math.inf,
            -0.0,
            0.0,
            2.0**-149,
            2.0**127,
            1.0,
            1.0,
            1.0,
        ],  # float32-exact
    }
    for case, values in cases.items():
        data = _vectors.pack(values)
        back = _vectors.unpack(data, len(values))
        assert np.array_equal(back, np.asarray(values), equal_nan=True), case
        assert [math.copysign(1.0, x) for x in back] == [math.copysign(1.0, x) for x in values], case
    assert len(_vectors.pack(cases["short"])) == 8  # under 8 values: always raw
    # 100 values in [2, 3): 400 bytes raw, far less compressed; the special values compress too
    assert len(_vectors.pack(cases["float32"])) < 200 and len(_vectors.pack(cases["special"])) < 40
