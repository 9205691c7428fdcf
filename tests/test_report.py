"""Tests of reports: JSON summary numbers, text/JSON goldens, self-contained HTML, figures, PNG and CLI."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.runs import MiB, write_small_run
from torchdebug.cli import main as cli_main
from torchdebug.store import create_run, open_run
from torchdebug.views.report import build_report, collect_data, collect_views, render_report
from torchdebug.views.report._figures import build_figures
from torchdebug.views.report._format import envelope, event_category, json_safe

GOLDEN = Path(__file__).parent / "golden"
VOLATILE = ("run_id", "created", "ended", "torch", "python", "torchdebug", "host", "pid")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_run(tmp_path_factory.mktemp("runs"))


@pytest.fixture
def run(small_run: Path) -> Any:
    with open_run(small_run) as r:
        yield r


def _check_golden(request: pytest.FixtureRequest, name: str, text: str) -> None:
    path = GOLDEN / name
    if request.config.getoption("--overwrite-golden"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    expected = path.read_text(encoding="utf-8")
    assert text == expected, f"{name} differs from the golden; rerun with --overwrite-golden if intended"


def _normalized_text(run: Any, text: str) -> str:
    # created and ended may fall in the same second or not: normalize the whole line
    text = re.sub(r"(?m)^created  .*$", "created  <created>   ended <ended>", text)
    for key in VOLATILE:
        value = run.meta.get(key)
        if value not in (None, ""):
            text = text.replace(str(value), f"<{key}>")
    return text


def _normalized_report(report: dict[str, Any]) -> dict[str, Any]:
    rep = json_safe(report)
    rep["run"] = {k: (f"<{k}>" if k in VOLATILE and v is not None else v) for k, v in rep["run"].items()}
    for key in ("anomalies", "events", "segments"):
        for doc in rep[key]:
            doc.pop("wall_time", None)
    return rep


def test_build_report_numbers_worked_by_hand(run: Any) -> None:
    rep = build_report(run)
    assert rep["summary"] == {
        "total_debug_operations": 8,
        "anomalies_detected": 1,
        "memory_leaks_detected": 1,  # memory_leak
        "performance_issues_detected": 1,  # input_bound
        "debug_mode": "full_debug",
        "debug_level": "advanced",
    }
    perf = rep["performance_analysis"]
    # step time = sum of phases = t; seven steps of 0.08 s and one of 0.16 s: mean 0.72 / 8 = 0.09
    assert perf["average_execution_time"] == pytest.approx(0.09, rel=1e-12)
    assert perf["max_execution_time"] == pytest.approx(0.16, rel=1e-12)
    assert perf["min_execution_time"] == pytest.approx(0.08, rel=1e-12)
    assert perf["timed_steps"] == 8
    mem = rep["memory_analysis"]
    # RSS = 100..107 MiB: mean 103.5 MiB; CUDA allocated = 10, 12, ... 24 MiB: mean 17 MiB
    assert mem == {
        "average_memory_usage": 103 * MiB + MiB // 2,
        "max_memory_usage": 107 * MiB,
        "average_gpu_memory": 17 * MiB,
        "max_gpu_memory": 24 * MiB,
        "samples": 8,
    }
    assert all(type(mem[k]) is int for k in mem)
    grad = rep["gradient_analysis"]
    # finite norms 4 + 3 + 2 + 1.5 + 1 + 64 + 0.5 = 76 over 7 steps; step 6 is Inf
    assert grad["average_gradient_norm"] == 76 / 7
    assert grad["max_gradient_norm"] == 64.0
    assert grad["nonfinite_gradient_steps"] == 1
    assert grad["gradient_anomalies"] == 2  # gradient_explosion, nonfinite_gradients (not loss_spike)
    ops = rep["operation_breakdown"]
    # 8 steps total 0.72 s: data and forward 1/4 each, backward 3/8, optimizer and other 1/16 each
    assert ops["time_by_phase"] == pytest.approx(
        {"data": 0.18, "forward": 0.18, "backward": 0.27, "optimizer": 0.045, "other": 0.045}, rel=1e-12
    )
    assert ops["events_by_kind"] == {
        "gradient_explosion": 1,
        "input_bound": 1,
        "loss_spike": 1,
        "memory_leak": 1,
        "nonfinite_gradients": 1,
    }
    assert ops["anomalies_by_phase"] == {"forward": 1}
    a = rep["anomalies"][0]
    assert (a["phase"], a["module"], a["op"], a["location"], a["step"]) == (
        "forward",
        "fc2",
        "aten.addmm",
        "train.py:42",
        6,
    )
    loss = rep["metrics"]["loss"]
    assert loss == {"points": 8, "last_step": 7, "last": 0.75, "min": 0.75, "max": 8.0, "nonfinite": 1}
    assert rep["config"] == {"mode": "full_debug", "level": "advanced", "every": 4}


@pytest.mark.parametrize(
    ("kind", "category"),
    [
        ("gradient_explosion", "gradient"),
        ("vanishing_gradient", "gradient"),
        ("loss_spike", "loss"),
        ("memory_leak", "memory"),
        ("input_bound", "performance"),
        ("level_change", "other"),
    ],
)
def test_event_category(kind: str, category: str) -> None:
    assert event_category(kind) == category


def test_text_report_golden(request: pytest.FixtureRequest, run: Any) -> None:
    text = render_report(run, "text")
    assert isinstance(text, str)
    assert "nan born in forward of fc2 (Linear): aten.addmm at train.py:42 (step 6)" in text
    _check_golden(request, "small_run.txt", _normalized_text(run, text))


def test_a_run_that_raised_on_its_nan_counts_only_the_recorded_norms(watched_runs: dict[str, Path]) -> None:
    # policy="raise" stopped step 3 before its numbers were written: steps 0..2 hold finite norms
    with open_run(watched_runs["failed"]) as failed:
        text = render_report(failed, "text")
    assert isinstance(text, str)
    line = next(x for x in text.splitlines() if x.startswith("  grad norm "))
    assert line.endswith(", NaN/Inf in 0 recorded norms")
    assert text.index("nan born in forward of blocks.1.act") < text.index(line)


def test_json_report_golden(request: pytest.FixtureRequest, run: Any) -> None:
    text = render_report(run, "json")
    assert isinstance(text, str)
    parsed = json.loads(text)  # strict JSON: NaN/Inf would not parse in browsers
    assert parsed["metrics"]["grad_norm"]["last"] == 0.5
    # allow_nan=False: raises if a NaN/Inf float was left in (json_safe turns them into strings)
    golden = (
        json.dumps(_normalized_report(build_report(run)), indent=2, sort_keys=True, allow_nan=False) + "\n"
    )
    _check_golden(request, "small_run.json", golden)


def test_report_accepts_a_path_and_writes_the_file(small_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.txt"
    text = render_report(small_run, "text", path=out)
    assert out.read_text(encoding="utf-8") == text


def test_unknown_format_lists_the_allowed_ones(run: Any) -> None:
    with pytest.raises(ValueError, match=r"format must be one of \('text', 'json', 'html', 'png'\)"):
        render_report(run, "pdf")


_REMOTE = re.compile(
    r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//|@import\s+url\(\s*[\"']?(?:https?:)?//",
    re.IGNORECASE,
)


def test_html_is_one_self_contained_file(run: Any, tmp_path: Path) -> None:
    html = render_report(run, "html", path=tmp_path / "r.html")
    assert isinstance(html, str)
    assert not _REMOTE.search(html), "the report must load nothing from the network"
    assert "<script src" not in html  # the chart renderer is inlined, not referenced
    assert "window.tdCharts" in html and len(html) < 200_000  # 8 steps: ~30 KB renderer + data
    for chart in (
        "loss",
        "grad_norm",
        "nonfinite",
        "layers",
        "update_ratio",
        "memory",
        "step_time",
        "throughput",
    ):
        assert f'id="chart-{chart}"' in html
    # the anomaly card and a rule event are server-rendered, readable without JavaScript
    assert "nan born in forward of fc2 (Linear): aten.addmm at train.py:42 (step 6)" in html
    assert "fc1 output reached 1.5e38" in html and "grad norm 64 is 32x its running median" in html
    assert "full_debug" in html  # config


def test_the_remote_check_catches_remote_scripts() -> None:
    assert _REMOTE.search('<script src="https://cdn.plot.ly/plotly.min.js"></script>')
    assert _REMOTE.search("<link rel=stylesheet href='//fonts.example/x.css'>")
    assert not _REMOTE.search('<script src="/static/plotly.min.js"></script>')


def _fig(figs: list[dict[str, Any]], fid: str) -> dict[str, Any]:
    return next(f for f in figs if f["id"] == fid)


def _trace(fig: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in fig["data"] if t.get("name") == name)


def test_figures_keep_nan_inf_skips_and_anomalies_visible(run: Any) -> None:
    figs = build_figures(collect_data(run))
    loss = _fig(figs, "loss")
    line = _trace(loss, "loss")
    assert line["y"][6] is None  # a gap in the line ...
    assert _trace(loss, "loss NAN")["x"] == [6]  # ... and its own marker
    assert _trace(loss, "lr/0")["yaxis"] == "y2"
    g = _fig(figs, "grad_norm")
    assert _trace(g, "grad_norm inf")["x"] == [6]
    assert _trace(g, "skipped step")["x"] == [6]
    assert _trace(g, "anomaly")["x"] == [6]
    assert _trace(g, "gradient events")["x"] == [5, 6]
    nf = _fig(figs, "nonfinite")
    assert _trace(nf, "params with non-finite grad")["y"] == [0, 0, 0, 0, 0, 0, 2, 0]
    assert _trace(nf, "NaN values (tensor stats)")["x"] == [0, 4, 6]
    assert _trace(nf, "NaN values (tensor stats)")["y"] == [0, 0, 4]  # 3 in fc1 + 1 in fc2 at step 6
    heat = _fig(figs, "layers")["data"]
    assert heat[0]["y"] == ["fc1.weight", "fc2.weight"]
    # 8 steps -> 8 columns of width 1; cell = log10 of the norm
    assert heat[0]["z"][0][5] == pytest.approx(math.log10(60.0), abs=5e-4)  # 3 decimals
    assert heat[0]["z"][1][7] == pytest.approx(math.log10(0.125), abs=5e-4)
    assert heat[0]["z"][0][6] is None and heat[1]["x"] == [6.0, 6.0]  # Inf and NaN marked, not dropped
    mem = _trace(_fig(figs, "memory"), "rss")
    assert mem["y"][0] == 100.0 and mem["y"][7] == 107.0  # MiB
    st = _fig(figs, "step_time")
    assert [t["name"] for t in st["data"]] == [
        "data",
        "forward",
        "backward",
        "optimizer",
        "other",
        "step total",
    ]
    assert _trace(st, "step total")["y"][5] == pytest.approx(160.0)  # ms
    assert _trace(_fig(figs, "throughput"), "samples/s")["y"][5] == pytest.approx(200.0)  # 32 / 0.16
    json.dumps(figs, allow_nan=False)  # JSON-ready


def test_views_are_strict_json(run: Any) -> None:
    views = collect_views(run)
    json.dumps(json_safe(views), allow_nan=False)
    assert views["status"] == "finished"


def test_envelope_keeps_spikes_and_nonfinite() -> None:
    # 1000 flat points with a spike at 517 and a NaN at 800, squeezed into 20 points
    values = [1.0] * 1000
    values[517] = 1e6
    values[800] = math.nan
    steps, vals = envelope(list(range(1000)), values, 20)
    assert len(steps) <= 21  # 10 buckets x (min, max) + the NaN
    assert 517 in steps and vals[steps.index(517)] == 1e6
    assert 800 in steps and math.isnan(vals[steps.index(800)])
    assert steps == sorted(steps)


def test_long_run_charts_are_downsampled_without_losing_the_spike(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="long")
    for s in range(20_000):
        w.log_scalars(
            s, {"loss": 1.0 + (99.0 if s == 12_345 else 0.0), "grad_norm": math.nan if s == 777 else 1.0}
        )
    w.close()
    with open_run(w.path) as r:
        figs = build_figures(collect_data(r, max_points=500))
    loss = _trace(_fig(figs, "loss"), "loss")
    assert len(loss["x"]) <= 500
    assert max(y for y in loss["y"] if y is not None) == 100.0 and 12_345 in loss["x"]
    assert _trace(_fig(figs, "grad_norm"), "grad_norm NAN")["x"] == [777]


def test_png_loss_axis_leaves_a_lone_spike_out() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from torchdebug.views.report._png import _robust_ylim, spikes

    # a loss falling from 2.0 by 0.01 a step, one spike of 500 at step 50: the spike's residual to its
    # neighbours' median (~1.5) is ~498.5, far over 20 x the median residual (0.05) and half the
    # 10-90 % spread (0.4); the axis spans the rest: 1.01 .. 2.0, padded by 5 % of 0.99
    ys = [2.0 - 0.01 * s for s in range(100)]
    ys[50] = 500.0
    assert spikes(ys) == {50}
    ax = Figure().add_subplot()
    ax.plot(range(100), ys)
    assert _robust_ylim(ax, ys) == 1
    lo, hi = ax.get_ylim()
    assert lo == pytest.approx(1.01 - 0.0495) and hi == pytest.approx(2.0 + 0.0495)
    # a level that lasts (a divergence, 30 steps at 500) is data, not a spike: the axis is matplotlib's
    lasting = [2.0] * 70 + [500.0] * 30
    assert spikes(lasting) == set() and _robust_ylim(Figure().add_subplot(), lasting) == 0


def test_png_leads_with_the_verdict_and_draws_as_the_html_charts(
    watched_runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    said: list[tuple[str, str]] = []
    axes: list[Any] = []
    text, add_subplot = Figure.text, Figure.add_subplot

    def recorded_text(fig: Any, x: float, y: float, s: str, *args: Any, **kw: Any) -> Any:
        said.append((s, kw.get("color", "")))
        return text(fig, x, y, s, *args, **kw)

    def kept(fig: Any, *args: Any, **kw: Any) -> Any:
        axes.append(add_subplot(fig, *args, **kw))
        return axes[-1]

    monkeypatch.setattr(Figure, "text", recorded_text)
    monkeypatch.setattr(Figure, "add_subplot", kept)
    # the failed run: a NaN born at step 3 (policy="raise"); one memory sample, at step 0
    with open_run(watched_runs["failed"]) as failed:
        png = render_report(failed, "png")
    assert isinstance(png, bytes) and png[:8] == b"\x89PNG\r\n\x1a\n"
    # the suptitle first, then the verdict under it, red (103 characters: one line of up to 140)
    assert said == [
        ("PyTorch Debug Analysis: failed", ""),
        (
            "failed at step 3: nan born in forward of blocks.1.act (LogAct): aten.log at tests/fixtures/models.py:49",
            "#c0392b",
        ),
    ]
    mem_ax, marks_ax = axes[3:]
    # a series of one point is a dot, not an invisible line
    assert [(len(line.get_xdata()), line.get_marker()) for line in mem_ax.get_lines()] == [
        (1, "None"),
        (1, "o"),
    ]
    # whole steps, none negative, on every axis (a lone point's axis is padded left of 0)
    for ax in axes:
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(x.isdigit() for x in labels), labels
    # the markers sit on named lanes, not at a height that reads as a count
    assert [t.get_text() for t in marks_ax.get_yticklabels()] == ["anomaly", "error", "warning", "info"]


def test_png_is_the_analysis_figure(run: Any, tmp_path: Path) -> None:
    png = render_report(run, "png", path=tmp_path / "debug_analysis.png")
    assert isinstance(png, bytes) and png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # IHDR
    assert (width, height) == (2250, 1500)  # 15 x 10 inches at 150 dpi
    assert (tmp_path / "debug_analysis.png").read_bytes() == png


def test_cli_report_formats_and_errors(
    small_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["report", str(small_run), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["anomalies_detected"] == 1
    out = tmp_path / "r.html"
    assert cli_main(["report", str(small_run), "-o", str(out)]) == 0  # format from the suffix
    assert out.read_text(encoding="utf-8").startswith("<!doctype html>")
    assert capsys.readouterr().err == f"wrote html report to {out}\n"
    assert cli_main(["report", str(small_run), "--format", "png"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs an output file" in err
    pdf = tmp_path / "x.pdf"
    assert cli_main(["report", str(small_run), "-o", str(pdf)]) == 2  # refused, not text named .pdf
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no report format writes .pdf files" in err and not pdf.exists()
    assert cli_main(["report", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["report", str(small_run), "--format", "pdf"]) == 2


def test_run_report_method_matches_render_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    import torchdebug as td

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, run=tmp_path, config=td.DebugConfig(mode="anomaly_detection")) as mon:
        for _ in range(3):
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    run = td.open_run(mon.run_dir)
    text = td.report(run)
    assert isinstance(text, str) and text == td.render_report(run, format="text")
    out = tmp_path / "r.json"
    assert td.report(run, "json", path=out) == out.read_text()
