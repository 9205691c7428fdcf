"""Several ranks, one view: the rank of birth in every rank's error, the dashboard's per-rank table
and rank selector, FSDP2's global gradient norm. 2 CPU processes over gloo, each test under a timeout."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.test_distributed import BAD_STEP, SQRT_LINE, Net, _batch, run_pairs, wrapped_net
from torchdebug.store import open_run

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
TIMEOUT = pytest.mark.timeout(120)  # a hang fails the test; the first test pays for the 2-process fixture
SITE = f"nan born in forward of feat (Feat): aten.sqrt at tests/test_distributed.py:{SQRT_LINE}"


def _scenario(rank: int, out: Path, name: str, sc: dict) -> dict:
    result: dict = {"rank": rank}
    net, model = wrapped_net(bool(sc.get("fsdp")))
    norms: dict[str, list] = {"total": [], "host": [], "shard": [], "per": [], "host_per": []}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"run_dir": str(out / "runs" / name), **sc.get("config", {})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with td.watch(model, opt, config=td.DebugConfig(**cfg)) as mon:
                result["run_dir"] = str(mon.run_dir)
                for step in range(sc.get("steps", 10)):
                    net.delay_s = sc.get(f"delay_rank{rank}", 0.0)
                    if rank == 1 and step == sc.get("hang_step"):
                        net.hang_s = sc["hang_s"]
                    x, y = _batch(rank, step, sc.get("poison"))
                    loss = nn.functional.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    mon.step()
                    grads = [p.grad for p in model.parameters()]
                    if sc.get("fsdp") and all(g is not None for g in grads):  # a skipped step dropped them
                        total = torch.nn.utils.get_total_norm(grads)  # DTensor-aware (a collective)
                        norms["total"].append(
                            float(total.full_tensor() if hasattr(total, "full_tensor") else total)
                        )
                        norms["host"].append(mon.grad_norm_host)  # what GradientHealth's rules read
                        norms["shard"].append(
                            float(torch.cat([g.to_local().reshape(-1) for g in grads]).norm())
                        )
                        # each parameter's whole gradient (a collective) against what the rules read
                        norms["per"].append([float(g.full_tensor().norm()) for g in grads])
                        norms["host_per"].append(list(mon.grad_norms_host))
        except td.NonFiniteError as e:
            result["error"] = str(e)
            result["summary"] = e.anomaly.summary()
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)]
    result["step"] = mon.global_step
    result["norms"] = norms
    return result


SCENARIOS = {
    "raise": {"poison": "forward"},  # rank 1's batch of step 7 holds a -1: sqrt makes a NaN there only
    # one run with everything the dashboard's rank view shows: rank 1 is 3x slower (30 ms vs 10 ms of
    # sleep in each forward: a straggler), sleeps 2.5 s in the forward of step 2 (hang records on both
    # ranks, the watchdog fires after 1 s), and its NaN of step 7 is skipped on both ranks
    "view": {
        "steps": 15,
        "poison": "forward",
        "delay_rank0": 0.01,
        "delay_rank1": 0.03,
        "hang_step": 2,
        "hang_s": 2.5,
        "config": {"policy": "skip", "hang_timeout": 1.0},
    },
    "fsdp": {"steps": 4, "fsdp": True},  # FSDP2 (fully_shard) on CPU/gloo, nothing poisoned
    # rank 1's batch of step 7 holds x = 0: d sqrt(x w) / dw = x / (2 sqrt(x w)) = 0 / 0 = NaN in feat.w's
    # local gradient; the reduce-scatter puts feat.w (one element) in rank 0's shard, rank 1's is empty
    "fsdp_nan": {"steps": 9, "fsdp": True, "poison": "backward", "config": {"policy": "skip"}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every scenario in one pair of processes (one process-group start for the whole file)."""
    out = tmp_path_factory.mktemp("ranks")
    t0 = time.perf_counter()
    pairs = run_pairs(_scenario, SCENARIOS, out)
    print(f"2-rank fixture: {time.perf_counter() - t0:.1f} s")
    return pairs


@TIMEOUT
def test_every_rank_raises_an_error_naming_the_rank_of_birth(runs):
    summary = f"{SITE} (step {BAD_STEP}, born on rank 1 of 2)"
    for r in runs["raise"]:
        assert r["step"] == BAD_STEP and r["warnings"] == []
        assert r["summary"] == summary
        # the same head on both ranks (rank 1 sent what it found; rank 1's error goes on with the
        # tensors its replay saw); rank 0 replayed rank 1's micro-step too: NaN there as well, so the
        # cause is the model's (its data), not rank 1's device
        lines = r["error"].splitlines()
        assert lines[:8] == [
            f"torchdebug: {summary}",
            "  phase     forward",
            "  module    feat (Feat)",
            "  op        aten.sqrt",
            f"  line      tests/test_distributed.py:{SQRT_LINE}",
            f"  step      {BAD_STEP}",
            "  rank      1 of 2",
            "  noticed   nan in the loss; born on rank 1 of 2",
        ]
        (cause,) = [x for x in lines if x.startswith("  cause     ")]
        assert cause.startswith("  cause     model: ")
        # x[3, 0] = -1 times w after 7 updates
        assert "  hint      sqrt of negative input (min -0.993)" in lines
    run = Path(runs["raise"][0]["run_dir"])
    for k in (0, 1):  # each rank's store keeps the rank of birth and the world size
        with open_run(run, rank=k) as rec:
            (a,) = rec.anomalies()
        assert (a["rank"], a["world_size"], a["summary"]) == (1, 2, summary)


@TIMEOUT
def test_show_and_reports_name_the_rank_of_birth_once(runs, capsys):
    from torchdebug.cli import main
    from torchdebug.views.report import render_report

    run = runs["raise"][0]["run_dir"]
    summary = f"{SITE} (step {BAD_STEP}, born on rank 1 of 2)"
    assert main(["show", run]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"  {summary}  (recorded by rank 0, 1)" in out  # no "rank 1:" prefix: the summary names it
    assert main(["report", run]) == 0
    text = capsys.readouterr().out.splitlines()
    card = text.index(f"  * {summary}")
    assert "      rank      1 of 2" in text[card : card + 8]
    html = render_report(run, "html")
    assert "<dt>rank</dt><dd>1 of 2</dd>" in html


def test_one_process_anomaly_says_nothing_about_ranks():
    a = td.Anomaly(phase="forward", module="fc", op="aten.log", location="m.py:3", kind="nan", step=4)
    assert a.summary() == "nan born in forward of fc: aten.log at m.py:3 (step 4)"
    assert "rank" not in str(a) and "world_size" not in a.to_dict()
    moved = td.Anomaly(phase="forward", module="fc", op=None, location=None, kind="inf", rank=1, world_size=2)
    assert moved.summary() == "inf born in forward of fc (born on rank 1 of 2)"
    assert moved.to_dict()["world_size"] == 2


# -- the dashboard: one view of all ranks (a real server, a real headless Chromium) -------------------


def _cells(page, table: str) -> list[list[str]]:
    """The body rows of a table on the page, as the browser shows their text."""
    return page.evaluate(
        f"[...document.querySelectorAll('#{table} tr')].slice(1).map(r => [...r.cells].map(c => c.innerText))"
    )


def _expected_rows(run_dir: Path) -> list[list[str]]:
    """The per-rank table worked out from what each rank recorded: medians of the step's total time
    and data wait in ms, the largest RSS sample in MiB, the last grad_norm to 4 significant digits."""
    rows = []
    for k in (0, 1):
        with open_run(run_dir, rank=k) as rec:
            timings, memory = rec.timings(), rec.memory()
            total = statistics.median(t["total"] for t in timings)
            data = statistics.median(t["data"] for t in timings)
            rss = max(m["rss"] for m in memory)
            norms = [v for v in rec.series("grad_norm").values if math.isfinite(v)]
            hangs = len(rec.events("hang"))
            rows.append(
                [
                    str(k),
                    "finished",
                    "15",
                    f"{total * 1000:.1f} ms",
                    f"{data * 1000:.1f} ms",
                    f"{rss / 1048576:.1f} MiB",
                    "-",  # no CUDA on these ranks
                    f"{rec.series('grad_norm').values[-1]:.4g}",
                    "1",  # the skipped step's anomaly, recorded by both ranks
                    str(hangs),
                ]
            )
            assert len(timings) == 15 and norms and hangs == 1
    return rows


@TIMEOUT
@pytest.mark.browser
def test_dashboard_shows_every_rank_and_switches_charts_by_rank(runs, browser):
    from torchdebug.views.server import serve

    run_dir = Path(runs["view"][0]["run_dir"])
    rid = run_dir.name
    summary = f"{SITE} (step {BAD_STEP}, born on rank 1 of 2)"
    expected = _expected_rows(run_dir)
    with open_run(run_dir, rank=0) as rec:
        (straggler,) = rec.events("straggler")
        (hang0,) = rec.events("hang")
        loss0 = rec.series("loss")
    assert all(math.isfinite(v) for v in loss0.values)  # rank 0's batches were all finite
    with open_run(run_dir, rank=1) as rec:
        (hang1,) = rec.events("hang")
        loss1 = rec.series("loss")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        with serve(run_dir.parent, port=0) as h:
            page.goto(f"{h.url}/runs/{rid}")
            page.wait_for_function("document.getElementById('chart-loss').data !== undefined", timeout=15_000)
            assert _cells(page, "rank-table") == expected
            assert _cells(page, "rank-anomalies") == [["1", str(BAD_STEP), summary, "0, 1"]]
            ev = straggler["data"]["evidence"]
            assert _cells(page, "rank-stragglers") == [
                ["1", str(straggler["step"]), f"{ev['ratio']:.4g}", straggler["message"]]
            ]
            assert _cells(page, "rank-hangs") == [
                [
                    str(h["data"]["rank"]),
                    str(h["step"]),
                    h["data"]["phase"],
                    "1",
                    h["data"]["where"],
                    h["message"].split("\n")[0],  # the rank's own line; the verdict is shown once above
                ]
                for h in (hang0, hang1)
            ]
            verdict = hang0["message"].split("\n")[1]
            assert verdict.startswith("hang verdict: rank 1 never entered all_reduce #")
            assert page.inner_text("#rank-hang-verdict") == verdict
            assert hang1["data"]["phase"] == "forward" and hang1["step"] == 2
            # the selector: rank 0's charts first, then rank 1's
            assert page.inner_text("#rank-select a[aria-current=page]") == "rank 0"
            # the charts carry 6 significant digits (views/report/_figures.py keeps pages light)
            assert page.evaluate("document.getElementById('chart-loss').data[0].y") == [
                float(f"{v:.6g}") for v in loss0.values
            ]
            page.click("#rank-select >> text=rank 1")
            page.wait_for_url(f"{h.url}/runs/{rid}?rank=1")
            page.wait_for_function("document.getElementById('chart-loss').data !== undefined", timeout=15_000)
            assert page.inner_text("#rank-select a[aria-current=page]") == "rank 1"
            # rank 1's own losses, its NaN of step 7 a gap (null) in the chart
            y = page.evaluate("document.getElementById('chart-loss').data[0].y")
            assert y == [None if math.isnan(v) else float(f"{v:.6g}") for v in loss1.values]
            assert y[BAD_STEP] is None
            assert _cells(page, "rank-table") == expected  # the table shows every rank on every page
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard_ranks.png"), full_page=True)
    finally:
        page.close()
    assert errors == []


@TIMEOUT
@pytest.mark.browser
def test_dashboard_of_one_rank_has_no_rank_table_or_selector(browser, tmp_path):
    from tests.fixtures.runs import write_small_run
    from torchdebug.views.server import serve

    run = write_small_run(tmp_path / "runs")
    page = browser.new_page()
    try:
        with serve(run.parent, port=0) as h:
            page.goto(f"{h.url}/runs/{run.name}")
            page.wait_for_function("document.getElementById('chart-loss').data !== undefined", timeout=15_000)
            assert page.locator("#rank-table, #rank-select, #ranks").count() == 0
            assert "Ranks" not in page.inner_text("main")
    finally:
        page.close()


# -- FSDP2: the global gradient norm, not the rank's shard ---------------------------------------------


@TIMEOUT
def test_fsdp2_grad_norm_is_the_norm_of_the_whole_gradient_on_every_rank(runs):
    r0, r1 = runs["fsdp"]
    assert r0["step"] == r1["step"] == 4 and r0["warnings"] == r1["warnings"] == []
    stored = []
    for k in (0, 1):
        with open_run(r0["run_dir"], rank=k) as rec:
            stored.append(rec.series("grad_norm").values)
    ref = r0["norms"]["total"]  # torch's own DTensor-aware total norm of the FSDP2 gradients
    assert r1["norms"]["total"] == ref
    for r, values in zip((r0, r1), stored, strict=True):
        assert values == pytest.approx(ref, rel=1e-5)
        assert r["norms"]["host"] == pytest.approx(ref, rel=1e-5)  # what the health rules see
        # the rank's shard alone is smaller: the test would fail on the old local norm
        assert all(s < t * 0.999 for s, t in zip(r["norms"]["shard"], ref, strict=True))
        # per parameter too (the vanishing rule's per-layer norms, grad_norm/<param> on detail steps)
        for host, whole in zip(r["norms"]["host_per"], r["norms"]["per"], strict=True):
            assert len(host) == 5 and host == pytest.approx(whole, rel=1e-5)  # feat.w, fc1, fc2

    # by hand, step 0: the same Net (seed 0) without FSDP on both ranks' batches; FSDP2 averages the
    # ranks' gradients (reduce-scatter with mean), which is the gradient of the mean of the two losses
    torch.manual_seed(0)
    net = Net()
    losses = [nn.functional.mse_loss(net(x), y) for x, y in (_batch(k, 0, None) for k in (0, 1))]
    ((losses[0] + losses[1]) / 2).backward()
    by_hand = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in net.parameters()]).double())
    assert stored[0][0] == pytest.approx(float(by_hand), rel=1e-5)


@TIMEOUT
def test_fsdp2_grad_norm_is_nan_on_every_rank_when_one_rank_holds_the_nan_shard(runs):
    r0, r1 = runs["fsdp_nan"]
    stored = []
    for k in (0, 1):
        with open_run(r0["run_dir"], rank=k) as rec:
            s = rec.series("grad_norm")
            stored.append(dict(zip(s.steps, s.values, strict=True)))
            (a,) = rec.anomalies()
            assert (a["step"], a["rank"]) == (
                BAD_STEP,
                0,
            )  # the NaN shard: born, for FSDP2's sentinel, on rank 0
    for r in (r0, r1):
        assert r["step"] == 9 and len(r["norms"]["total"]) == 8  # step 7 skipped: its gradients dropped
    assert math.isnan(stored[0][BAD_STEP]) and math.isnan(stored[1][BAD_STEP])
    clean = [k for k in range(9) if k != BAD_STEP]
    for k in (0, 1):
        assert [stored[k][i] for i in clean] == pytest.approx(r0["norms"]["total"], rel=1e-5)
