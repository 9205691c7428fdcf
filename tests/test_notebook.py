"""How records read in a notebook and a debugger: a short repr, an HTML view, and pandas frames of a run."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug.events import Anomaly, RuleEvent
from torchdebug.store import create_run, open_run

ANOMALY = Anomaly(
    phase="forward",
    module="blocks.0.attn",
    op="aten._softmax",
    location="train.py:41",
    kind="nan",
    step=20,
    module_type="Attention",
    hint="softmax over a row whose entries are all -inf (a fully masked row)",
)


def test_anomaly_repr_is_its_one_line_summary() -> None:
    assert repr(ANOMALY) == (
        "<Anomaly nan born in forward of blocks.0.attn (Attention): aten._softmax at train.py:41 (step 20)>"
    )


def test_anomaly_html_names_the_origin() -> None:
    assert ANOMALY._repr_html_() == (
        '<div class="torchdebug-anomaly"><div style="color:#c0392b;font-weight:bold">'
        "nan born in forward of blocks.0.attn (Attention): aten._softmax at train.py:41 (step 20)</div><table>"
        '<tr><th style="text-align:left;padding-right:1em">phase</th><td style="text-align:left"><code>forward</code></td></tr>'
        '<tr><th style="text-align:left;padding-right:1em">module</th><td style="text-align:left"><code>blocks.0.attn (Attention)</code></td></tr>'
        '<tr><th style="text-align:left;padding-right:1em">op</th><td style="text-align:left"><code>aten._softmax</code></td></tr>'
        '<tr><th style="text-align:left;padding-right:1em">line</th><td style="text-align:left"><code>train.py:41</code></td></tr>'
        '<tr><th style="text-align:left;padding-right:1em">step</th><td style="text-align:left"><code>20</code></td></tr>'
        '<tr><th style="text-align:left;padding-right:1em">hint</th><td style="text-align:left"><code>'
        "softmax over a row whose entries are all -inf (a fully masked row)</code></td></tr></table></div>"
    )


def test_html_escapes_what_came_from_the_model() -> None:
    a = Anomaly(phase="forward", module="<script>", op=None, location=None, kind="nan")
    assert "<script>" not in a._repr_html_() and "&lt;script&gt;" in a._repr_html_()


def test_rule_event_repr_and_html() -> None:
    e = RuleEvent("gradient_explosion", 5, "total gradient norm 17 grew 23.6x", "warning", modules=("fc1",))
    assert (
        repr(e) == "<RuleEvent warning: step 5: gradient_explosion [fc1]: total gradient norm 17 grew 23.6x>"
    )
    assert e._repr_html_() == (
        '<div class="torchdebug-event"><div style="color:#b9770e;font-weight:bold">warning: gradient_explosion</div><table>'
        '<tr><th style="text-align:left;padding-right:1em">step</th><td style="text-align:left"><code>5</code></td></tr>'
        '<tr><th style="text-align:left;padding-right:1em">modules</th><td style="text-align:left"><code>fc1</code></td></tr>'
        '<tr><th style="text-align:left;padding-right:1em">message</th><td style="text-align:left"><code>'
        "total gradient norm 17 grew 23.6x</code></td></tr></table></div>"
    )
    long = RuleEvent("slowdown", 1, "x" * 200)
    assert len(repr(long)) == len("<RuleEvent >") + 120 and repr(long).endswith("...>")


def _train(
    mon: td.Monitor, model: nn.Module, opt: torch.optim.Optimizer, steps: int, bad: int | None
) -> None:
    for step in range(steps):
        x = torch.ones(4, 3)
        if step == bad:
            x[0, 0] = math.nan
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step()


def test_monitor_repr_follows_the_session(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = td.watch(model, opt, policy="skip", run=tmp_path, announce=False)
    assert repr(mon) == "<Monitor not started: step 0, 0 anomalies, 0 warnings>"
    with pytest.warns(td.TorchDebugWarning), mon:
        _train(mon, model, opt, 3, bad=1)
        assert repr(mon) == f"<Monitor active: step 3, 1 anomaly, 0 warnings, run {mon.run_dir}>"
    assert repr(mon) == f"<Monitor closed: step 3, 1 anomaly, 0 warnings, run {mon.run_dir}>"
    html = mon._repr_html_()
    assert "torchdebug watch of Linear" in html and "<code>closed</code>" in html
    assert "<code>1, first: nan born in input of Linear (step 1)</code>" in html
    assert f"<code>{mon.run_dir}</code>" in html
    # the verdict leads, worded and ranked as `torchdebug show` words the stored run
    said = mon.verdict()
    assert said["level"] == "error" and said["text"].startswith("finished, but non-finite values at step 1: ")
    assert html.index(f"<code>{said['text']}</code>") < html.index("<code>closed</code>")
    assert "color:#c0392b" in html


def test_a_healthy_session_is_green_in_a_notebook() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, run=False, announce=False) as mon:
        _train(mon, model, opt, 3, None)
        assert mon.verdict()["text"] == "running: step 2, no anomalies so far"
    assert mon.verdict()["findings"] == [] and mon.verdict()["level"] == "ok"
    assert mon.verdict()["text"] == "finished: 3 steps, no anomalies"
    html = mon._repr_html_()
    assert "<code>finished: 3 steps, no anomalies</code>" in html and "color:#1e8449" in html


@pytest.fixture
def run_path(tmp_path: Path) -> Path:
    """A run of 3 steps: loss 1.0, 0.5, 0.25; lr only at step 0 and 2; one anomaly; two events."""
    w = create_run(root=tmp_path, name="nb")
    w.log_scalars(0, {"loss": 1.0, "lr": 0.1})
    w.log_scalars(1, {"loss": 0.5})
    w.log_scalars(2, {"loss": 0.25, "lr": 0.05})
    w.log_anomaly(1, ANOMALY)
    w.log_rule_event(RuleEvent("gradient_explosion", 1, "grew 20x", "warning", modules=("fc1", "fc2")))
    w.log_event(None, "note", "info", "a message outside any step")
    w.close("failed")
    return Path(w.path)


def test_run_repr_and_html(run_path: Path) -> None:
    with open_run(run_path) as run:
        assert repr(run) == f"<Run nb: failed, 3 steps, 1 anomaly, {run_path}>"
        html = run._repr_html_()
    assert '<div style="color:#c0392b;font-weight:bold">torchdebug run nb</div>' in html
    assert (
        "<code>1, first: nan born in forward of blocks.0.attn (Attention): aten._softmax at train.py:41 (step 20)</code>"
        in html
    )
    assert "<code>gradient_explosion 1, note 1</code>" in html


def _row(key: str, value: object) -> str:
    return (
        f'<tr><th style="text-align:left;padding-right:1em">{key}</th>'
        f'<td style="text-align:left"><code>{value}</code></td></tr>'
    )


@pytest.mark.parametrize(
    ("kind", "colour", "text"),
    [
        ("healthy", "#1e8449", "finished: 140 steps, no anomalies"),
        (
            "failed",
            "#c0392b",
            "failed at step 3: nan born in forward of blocks.1.act (LogAct): aten.log at tests/fixtures/models.py:49",
        ),
    ],
    ids=["healthy-green", "nan-red"],
)
def test_a_stored_run_leads_with_its_verdict(
    watched_runs: dict[str, Path], kind: str, colour: str, text: str
) -> None:
    # real watched runs: 140 clean steps; a NaN born at step 3 in blocks.1.act's log (policy="raise")
    with open_run(watched_runs[kind]) as run:
        html = run._repr_html_()
        assert str(run.verdict()) == text and run.verdict()["level"] == (
            "ok" if kind == "healthy" else "error"
        )
    assert html.startswith(
        f'<div class="torchdebug-run"><div style="color:{colour};font-weight:bold">torchdebug run {kind}</div>'
        f"<table>{_row('verdict', text)}{_row('status', 'failed' if kind == 'failed' else 'finished')}"
    )


def test_a_diverged_run_leads_with_its_divergence(watched_runs: dict[str, Path], tmp_path: Path) -> None:
    from torchdebug.views.verdict import verdict

    # the real diverged run: amber, and the same sentence as `torchdebug show`
    with open_run(watched_runs["diverged"]) as run:
        said, html = verdict(run), run._repr_html_()
    assert said["text"].startswith("finished, but diverged at step 10")
    assert html.startswith(
        '<div class="torchdebug-run"><div style="color:#b9770e;font-weight:bold">torchdebug run diverged</div>'
        f"<table>{_row('verdict', said['text'].replace('->', '-&gt;'))}"
    )
    # a written one, for the exact words: loss 0.5 -> 12 from step 8, never back
    w = create_run(root=tmp_path, name="div")
    for step in range(12):
        w.log_scalars(step, {"loss": 0.5 if step < 8 else 12.0})
    w.log_rule_event(
        RuleEvent(
            "divergence",
            10,
            "loss diverged",
            "warning",
            evidence={"metric": "loss", "before": 0.5, "after": 12.0, "since_step": 8},
        )
    )
    w.close("finished")
    with open_run(w.path) as run:
        html = run._repr_html_()
    assert html.startswith(
        '<div class="torchdebug-run"><div style="color:#b9770e;font-weight:bold">torchdebug run div</div>'
        f"<table>{_row('verdict', 'finished, but diverged at step 8: loss 0.5 -&gt; 12 and did not recover')}"
    )


def test_the_verdict_reads_as_its_sentence_in_a_notebook() -> None:
    from torchdebug.views.verdict import judge

    nan = {
        "summary": "nan born in forward of fc2 (Linear): aten.addmm at train.py:42 (step 6)",
        "kind": "nan",
        "phase": "forward",
        "module": "fc2",
        "op": "aten.addmm",
        "location": "train.py:42",
        "step": 6,
    }
    slow = {"kind": "slowdown", "step": 2, "severity": "warning", "message": "step 3x slower"}
    v = judge("failed", steps=7, last_step=6, anomalies=[nan], events=[slow, dict(slow, step=4)])
    # still the plain dict every view reads, and its sentence
    assert isinstance(v, dict) and v["level"] == "error"
    assert str(v) == (
        "failed at step 6: nan born in forward of fc2 (Linear): aten.addmm at train.py:42; also 2 slowdown"
    )
    assert v._repr_html_() == (
        '<div class="torchdebug-verdict"><div style="color:#c0392b;font-weight:bold">'
        "failed at step 6: nan born in forward of fc2 (Linear): aten.addmm at train.py:42; also 2 slowdown</div>"
        "<table>"
        + _row(
            "nan",
            "non-finite values at step 6: nan born in forward of fc2 (Linear): aten.addmm at train.py:42",
        )
        + _row("slowdown x2", "slowdown at step 2: step 3x slower")
        + _row("slowdown x2", "slowdown at step 4: step 3x slower")
        + "</table></div>"
    )
    healthy = judge("finished", steps=3, last_step=2, anomalies=[], events=[])
    assert healthy._repr_html_() == (
        '<div class="torchdebug-verdict"><div style="color:#1e8449;font-weight:bold">'
        "finished: 3 steps, no anomalies</div><table></table></div>"
    )


def test_metrics_frame_is_one_row_per_step(run_path: Path) -> None:
    with open_run(run_path) as run:
        frame = run.metrics_frame()
        only_loss = run.metrics_frame(["loss"])
    assert frame.index.name == "step" and list(frame.index) == [0, 1, 2]
    assert list(frame.columns) == ["loss", "lr"]
    assert list(frame["loss"]) == [1.0, 0.5, 0.25]
    assert frame["lr"][0] == 0.1 and math.isnan(frame["lr"][1]) and frame["lr"][2] == 0.05
    assert list(only_loss.columns) == ["loss"]


def test_events_and_anomalies_frames(run_path: Path) -> None:
    with open_run(run_path) as run:
        events = run.events_frame()
        anomalies = run.anomalies_frame()
    assert list(events.columns) == ["step", "severity", "kind", "message", "modules", "wall_time"]
    assert events[["severity", "kind", "modules"]].values.tolist() == [
        ["warning", "gradient_explosion", "fc1, fc2"],
        ["info", "note", ""],
    ]
    assert events["step"].tolist()[0] == 1 and events["step"].isna().tolist() == [False, True]
    assert anomalies[["step", "phase", "module", "op"]].values.tolist() == [
        [1, "forward", "blocks.0.attn", "aten._softmax"]
    ]
    assert list(anomalies.columns) == [
        "step", "kind", "phase", "module", "parameter", "op", "location", "rank", "symptom",
        "detected_by", "summary",
    ]  # fmt: skip


def test_anomalies_frame_names_the_module_of_a_parameter(watched_runs: dict[str, Path]) -> None:
    pytest.importorskip("pandas")
    # policy="skip": step 10 traced to blocks.1.act; steps 11..39 seen in the weights (no replay)
    with open_run(watched_runs["warned"]) as run:
        frame = run.anomalies_frame()
    assert len(frame) == 30
    assert frame.loc[0, ["module", "op", "location"]].tolist() == [
        "blocks.1.act",
        "aten.log",
        "tests/fixtures/models.py:49",
    ]
    later = frame.iloc[1:]
    assert set(later["parameter"]) == {"blocks.0.fc.weight"}
    assert set(later["module"]) == {"blocks.0.fc"}  # the parameter's owner, not ""
    assert set(later["detected_by"]) == {"sentinel (no replay)"}


def test_a_step_record_shows_in_a_notebook() -> None:
    from torchdebug.events import StepRecord

    record = StepRecord(step=7, loss=0.25, grad_norm=1.5, lr=(0.001,), values={"x": 1.0})
    assert repr(record) == "<StepRecord step 7  loss=0.25  |g|=1.5  lr=0.001>"  # not every field
    ok = record._repr_html_()
    # led by the step's verdict, green: nothing to act on
    assert ok.startswith(
        '<div class="torchdebug-step"><div style="color:#1e8449;font-weight:bold">step 7: ok</div>'
    )
    assert (
        "<th" in ok and "<code>0.25</code>" in ok and "<code>1.5</code>" in ok and "<code>0.001</code>" in ok
    )
    bad = StepRecord(
        step=20,
        skipped=True,
        skip_reason="nan",
        anomaly=Anomaly(
            phase="forward",
            module="fc",
            op="aten.log",
            location="t.py:3",
            kind="nan",
            step=20,
            hint="log of negative input",
        ),
        events=[
            RuleEvent(step=20, kind="loss_spike", severity="warning", message="loss 9 is 12 sigmas above")
        ],
    )._repr_html_()
    assert bad.startswith(  # red: the anomaly leads, and what became of the update
        '<div class="torchdebug-step"><div style="color:#c0392b;font-weight:bold">'
        "nan born in forward of fc: aten.log at t.py:3 (step 20), update skipped</div>"
    )
    assert "<code>nan born in forward of fc: aten.log at t.py:3 (step 20)</code>" in bad
    assert "<code>log of negative input</code>" in bad
    assert "<code>loss_spike: loss 9 is 12 sigmas above</code>" in bad and "<code>nan</code>" in bad
    warned = StepRecord(
        step=5,
        events=[
            RuleEvent("slowdown", 5, "step 3x slower", "warning"),
            RuleEvent("oom_risk", 5, "93% of device memory", "error"),
            RuleEvent("lr_change", 5, "lr 0.1 -> 0.01", "info"),
        ],
    )._repr_html_()
    assert warned.startswith(  # the error first, the other warning counted, the info not
        '<div class="torchdebug-step"><div style="color:#c0392b;font-weight:bold">'
        "step 5: oom_risk: 93% of device memory; and 1 more</div>"
    )
    skipped = StepRecord(step=6, skipped=True, skip_reason="loss spike")._repr_html_()
    assert skipped.startswith(
        '<div class="torchdebug-step"><div style="color:#b9770e;font-weight:bold">'
        "step 6: update skipped (loss spike)</div>"
    )


def test_frames_without_pandas_name_the_fix(run_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    with open_run(run_path) as run, pytest.raises(ImportError) as info:
        run.metrics_frame()
    assert str(info.value) == (
        "Run.metrics_frame() needs pandas: pip install pandas (or pip install 'torchdebug[pandas]')"
    )
