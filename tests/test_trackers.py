"""watch(report_to=...) with the real tracker libraries, offline, read back with their own readers.

One run of a fault-injection model under ``policy="warn"``: a gradient explosion at step 8 (``inp``'s
gradient x1e4) and a NaN born at step 10 in ``act`` (``log`` of a negative input, the line tagged
ORIGIN:log in tests/fixtures/models.py). Every backend must hold the run folder's scalars at the
same steps, the anomaly's headline and phase/module/op/line, the rule event and the final status.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td
from tests.fixtures import health_models as hm
from tests.fixtures.models import LogAct, origin_line
from torchdebug import ConfigError, DebugConfig, TorchDebugWarning
from torchdebug.sinks import Sink, _hub, export_run
from torchdebug.sinks._records import metric_tag
from torchdebug.store import open_run

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.fixtures.trackers import WandbRun, wandb_run

CFG = {"policy": "warn", "explode_warmup": 5, "detail_every": 5, "mode": "gradient_checking"}
EXPLODE_AT, NAN_AT, STEPS = 8, 10, 11


def origin(module: str = "act") -> str:
    """The NaN's origin as the verdict says it: the anomaly's summary without its "(step 10)"."""
    return f"nan born in forward of {module} (LogAct): aten.log at {origin_line('log')}"


def finished_verdict(module: str = "act") -> str:
    """judge() for the faulty run that finished: one step with an anomaly (10), so "non-finite values
    at step 10: <origin>"; the NaN outranks the gradient_explosion warning at step 8, which is counted
    after it; the finding starts with a letter, so "finished, but ..."."""
    return f"finished, but non-finite values at step {NAN_AT}: {origin(module)}; also 1 gradient_explosion"


class FaultyNet(nn.Module):
    """inp -> tanh -> act (log, NaN when its shift is negative) -> out; inp's gradient x1e4 on ``fault``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(hm.D_IN, hm.D_HIDDEN)
        self.act = LogAct()
        self.out = nn.Linear(hm.D_HIDDEN, hm.D_OUT)
        self.fault = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.fault:
            h = hm._Amplify.apply(h, 1e4)
        return self.out(self.act(torch.tanh(h)))


def train_faulty(mon: Any, model: FaultyNet, opt: torch.optim.Optimizer, steps: int = STEPS) -> None:
    for step, (x, y) in enumerate(hm.batches(steps)):
        model.fault = step == EXPLODE_AT
        model.act.shift = -10.0 if step == NAN_AT else 1.0
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        mon.step()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _tracker_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_DIR", str(root))
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_CONSOLE", "off")
    mp.setenv("MLFLOW_TRACKING_URI", (root / "mlruns").as_uri())
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is kept for local use


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The faulty run sent to all four trackers; yields where each one's output is."""
    import mlflow
    import wandb

    root = tmp_path_factory.mktemp("trackers")
    handler = _Records()
    logger = logging.getLogger("torchdebug")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # no stderr copy through the root logger's last-resort handler
    try:
        with pytest.MonkeyPatch.context() as mp:
            _tracker_env(mp, root)
            torch.manual_seed(0)
            model = FaultyNet()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            with (
                pytest.warns(TorchDebugWarning),
                td.watch(
                    model,
                    opt,
                    config=CFG,
                    run=root / "runs",
                    report_to=["tensorboard", "wandb", "mlflow", "logging"],
                ) as mon,
            ):
                train_faulty(mon, model, opt)
            assert mlflow.active_run() is None and wandb.run is None  # both opened and ended by the sinks
            mlflow_runs = mlflow.MlflowClient().search_runs(["0"])
            yield {
                "mon": mon,
                "root": root,
                "run": open_run(mon.run_dir),
                "wandb": wandb_run(root),
                "mlflow": (mlflow.MlflowClient(), mlflow_runs),
                "logs": handler.records,
            }
    finally:
        wandb.teardown()  # W&B keeps its settings (WANDB_DIR) and service process until then
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _stored(run: Any) -> dict[str, dict[int, float]]:
    """Every stored metric by its tracker name: {tag: {step: value}}."""
    out = {}
    for name in run.metric_names():
        s = run.series(name)
        out[metric_tag(name)] = dict(zip(s.steps, s.values))
    return out


def test_the_run_has_the_faults_it_was_given(faulty: dict[str, Any]) -> None:
    run = faulty["run"]
    (anomaly,) = run.anomalies()
    assert anomaly["summary"] == (
        f"nan born in forward of act (LogAct): aten.log at {origin_line('log')} (step {NAN_AT})"
    )
    assert [(e["kind"], e["step"]) for e in run.events()] == [("gradient_explosion", EXPLODE_AT)]
    assert run.status == "finished"
    assert math.isnan(run.series("loss").values[NAN_AT])


def test_tensorboard_holds_the_run(faulty: dict[str, Any]) -> None:
    run = faulty["run"]
    ea = EventAccumulator(str(run.path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    stored = _stored(run)
    assert "torchdebug/params/grad_norm/inp.weight" in stored  # a detail step's per-parameter norms
    assert set(ea.Tags()["scalars"]) == set(stored)
    for tag, values in stored.items():
        got = {e.step: e.value for e in ea.Scalars(tag)}
        assert sorted(got) == sorted(values), tag
        # event files hold float32
        assert all(_same(got[s], float(np.float32(v))) for s, v in values.items()), tag

    def text(tag: str) -> dict[int, str]:
        return {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors(f"{tag}/text_summary")}

    (block,) = text("torchdebug/anomalies").items()
    assert block[0] == NAN_AT
    headline = run.anomalies()[0]["summary"]
    for line in (
        f"**{headline}**",
        "phase     forward",
        "module    act (LogAct)",
        "op        aten.log",
        f"line      {origin_line('log')}",
    ):
        assert line in block[1]
    (event,) = text("torchdebug/events/gradient_explosion").items()
    assert event[0] == EXPLODE_AT and event[1].startswith("**warning** `gradient_explosion` [inp]: ")
    verdict = text("torchdebug/verdict")
    assert verdict == {NAN_AT: f"**{finished_verdict()}**  \nrun folder: `{run.path}`"}


def test_wandb_holds_the_run(faulty: dict[str, Any]) -> None:
    run, wb = faulty["run"], faulty["wandb"]
    assert isinstance(wb, WandbRun)
    rows: dict[int, dict[str, Any]] = {}
    for row in wb.history:
        if "torchdebug/step" in row:
            rows.setdefault(row["torchdebug/step"], {}).update(row)
    for tag, values in _stored(run).items():
        for step, value in values.items():
            assert _same(float(rows[step][tag]), value), (tag, step)  # JSON keeps the float64 exactly
    headline = run.anomalies()[0]["summary"]
    (alert,) = wb.alerts
    title, text, level = alert
    assert (title, level) == ("torchdebug: nan in act (LogAct)", "ERROR")  # the incident, not its step
    assert text.startswith(f"torchdebug: {headline}\n")
    assert f"\n  line      {origin_line('log')}\n" in text
    assert wb.summary["torchdebug/status"] == "finished"
    assert wb.summary["torchdebug/verdict"] == finished_verdict()
    assert wb.summary["torchdebug/run_folder"] == str(run.path)
    assert {k: v for k, v in wb.summary.items() if k.startswith("torchdebug/first_anomaly/")} == {
        "torchdebug/first_anomaly/headline": headline,
        "torchdebug/first_anomaly/phase": "forward",
        "torchdebug/first_anomaly/module": "act (LogAct)",
        "torchdebug/first_anomaly/op": "aten.log",
        "torchdebug/first_anomaly/line": origin_line("log"),
    }
    table = wb.tables["torchdebug/findings"]
    assert table["columns"] == [
        "step",
        "record",
        "kind",
        "severity",
        "headline",
        "phase",
        "module",
        "op",
        "line",
        "count",
        "last_step",
    ]
    assert [r[:4] for r in table["data"]] == [
        [EXPLODE_AT, "event", "gradient_explosion", "warning"],
        [NAN_AT, "anomaly", "nan", "error"],
    ]
    assert table["data"][1][4:] == [
        headline,
        "forward",
        "act (LogAct)",
        "aten.log",
        origin_line("log"),
        1,
        NAN_AT,
    ]
    assert wb.exit_code == 0


def test_mlflow_holds_the_run(faulty: dict[str, Any]) -> None:
    run = faulty["run"]
    client, runs = faulty["mlflow"]
    (mrun,) = runs
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == run.name
    rid = mrun.info.run_id
    for tag, values in _stored(run).items():
        got = {m.step: m.value for m in client.get_metric_history(rid, tag)}
        assert sorted(got) == sorted(values), tag
        assert all(_same(got[s], v) for s, v in values.items()), tag
    headline = run.anomalies()[0]["summary"]
    tags = {k: v for k, v in mrun.data.tags.items() if k.startswith("torchdebug/")}
    assert tags == {
        "torchdebug/status": "finished",
        "torchdebug/verdict": finished_verdict(),
        "torchdebug/run_folder": str(run.path),
        "torchdebug/first_anomaly/headline": headline,
        "torchdebug/first_anomaly/phase": "forward",
        "torchdebug/first_anomaly/module": "act (LogAct)",
        "torchdebug/first_anomaly/op": "aten.log",
        "torchdebug/first_anomaly/line": origin_line("log"),
    }
    doc = client.download_artifacts(rid, f"torchdebug/anomaly-step{NAN_AT}.json", str(faulty["root"] / "dl"))
    import json

    stored = {k: v for k, v in run.anomalies()[0].items() if k not in ("id", "wall_time")}
    assert json.loads(Path(doc).read_text()) == stored
    findings = client.download_artifacts(rid, "torchdebug/findings.json", str(faulty["root"] / "dl"))
    kinds = [(f["record"], f["kind"], f["step"]) for f in json.loads(Path(findings).read_text())["findings"]]
    assert kinds == [("event", "gradient_explosion", EXPLODE_AT), ("anomaly", "nan", NAN_AT)]


def test_logging_sink_routes_findings_through_the_torchdebug_logger(faulty: dict[str, Any]) -> None:
    run, logs = faulty["run"], faulty["logs"]
    headline = run.anomalies()[0]["summary"]
    found = [(r.levelname, r.torchdebug["record"], r.torchdebug["step"]) for r in logs]
    assert [f for f in found if f[1] != "scalars"] == [
        ("WARNING", "event", EXPLODE_AT),
        ("ERROR", "anomaly", NAN_AT),
        ("INFO", "end", NAN_AT),
    ]
    assert [f[2] for f in found if f[1] == "scalars"] == list(range(STEPS))  # DEBUG: one per step
    (anomaly,) = [r for r in logs if r.torchdebug["record"] == "anomaly"]
    assert anomaly.name == "torchdebug"
    assert anomaly.getMessage().startswith(f"torchdebug: {headline}\n  phase     forward\n")
    assert {k: anomaly.torchdebug[k] for k in ("kind", "phase", "module", "op", "line")} == {
        "kind": "nan",
        "phase": "forward",
        "module": "act (LogAct)",
        "op": "aten.log",
        "line": origin_line("log"),
    }
    (end,) = [r for r in logs if r.torchdebug["record"] == "end"]
    assert end.torchdebug["status"] == "finished" and end.torchdebug["run_folder"] == str(run.path)


def test_every_tracker_says_the_verdict_of_show(faulty: dict[str, Any]) -> None:
    from torchdebug.views.verdict import verdict

    run = faulty["run"]
    shown = verdict(open_run(run.path))["text"]  # what `torchdebug show`, the reports and the dashboard say
    assert shown == finished_verdict()
    ea = EventAccumulator(str(run.path / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()
    (tb,) = [e.tensor_proto.string_val[0].decode() for e in ea.Tensors("torchdebug/verdict/text_summary")]
    _, mlflow_runs = faulty["mlflow"]
    (end,) = [r for r in faulty["logs"] if r.torchdebug["record"] == "end"]
    said = {
        "tensorboard": tb.split("**")[1],  # "**<verdict>**  \nrun folder: ..."
        "wandb": faulty["wandb"].summary["torchdebug/verdict"],
        "mlflow": mlflow_runs[0].data.tags["torchdebug/verdict"],
        "logging": end.torchdebug["verdict"],
    }
    assert said == dict.fromkeys(said, shown)


def test_the_tally_keeps_the_verdict_exact_in_bounded_memory() -> None:
    from torchdebug.sinks._records import KEEP, Finding, Scalars, Tally
    from torchdebug.views.verdict import judge

    def anomaly(step: int, module: str) -> dict[str, Any]:
        return {
            "kind": "nan",
            "phase": "forward",
            "module": module,
            "summary": f"nan in {module} (step {step})",
        }

    def event(step: int, severity: str) -> dict[str, Any]:
        return {"kind": "loss_spike", "severity": severity, "message": f"spike {step}", "data": None}

    tally = Tally()
    anomalies: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    n = KEEP + 1000
    for step in range(5, 5 + n):  # one anomaly per step 5 .. 3004, two at step 5
        tally.see(Scalars(step, {"torchdebug/loss": 1.0}, None, True))
        docs = [anomaly(step, "fc1")] + ([anomaly(step, "fc2")] if step == 5 else [])
        for doc in docs:
            tally.see(Finding("anomaly", step, doc))
            anomalies.append({**doc, "step": step})
    late = anomaly(3, "fc3")  # logged after the cap, at an earlier step: it becomes the first
    tally.see(Finding("anomaly", 3, late))
    anomalies.append({**late, "step": 3})
    for step, severity in [(7, "warning"), (9, "info"), (11, "error"), (12, "warning")]:
        tally.see(Finding("event", step, event(step, severity)))
        events.append({**event(step, severity), "step": step})
    tally.see(Scalars(5 + n, {"torchdebug/memory/allocated": 1.0}))  # no stored metric: not a step
    for status in ("finished", "failed"):
        want = judge(status, steps=n, last_step=4 + n, anomalies=anomalies, events=events)["text"]
        assert tally.end(status, None).verdict == want
    # n + 1 distinct anomaly steps (5 .. 3004 and 3), the first at step 3 in fc3; then the error
    # event (it outranks the warnings of its kind), the other two loss_spike events counted
    assert want == (
        f"failed at step {4 + n}: {n + 1} steps with non-finite values, first at step 3: nan in fc3; "
        "loss_spike at step 11: spike 11; also 2 loss_spike"
    )
    assert len(tally._anomaly_docs) == KEEP and tally.steps == n and tally.anomalies == n + 2


def test_export_sends_the_same_names_and_values_as_the_live_sinks(
    faulty: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    from torchdebug.cli import main

    run = faulty["run"]
    _tracker_env(monkeypatch, tmp_path)
    assert main(["export", str(run.path), "--to", "mlflow"]) == 0
    client = mlflow.MlflowClient()
    (mrun,) = client.search_runs(["0"])
    live_client, (live,) = faulty["mlflow"]
    assert set(mrun.data.metrics) == set(live.data.metrics)
    assert {k: v for k, v in mrun.data.tags.items() if k.startswith("torchdebug/")} == {
        k: v for k, v in live.data.tags.items() if k.startswith("torchdebug/")
    }
    for tag in ("torchdebug/loss", "torchdebug/params/grad_norm/inp.weight", "torchdebug/grad_norm"):
        exported = [(m.step, m.value) for m in client.get_metric_history(mrun.info.run_id, tag)]
        streamed = [(m.step, m.value) for m in live_client.get_metric_history(live.info.run_id, tag)]
        assert len(exported) == len(streamed)
        assert all(a[0] == b[0] and _same(a[1], b[1]) for a, b in zip(exported, streamed))
    import wandb

    end = export_run(run.path, "wandb", dir=str(tmp_path))
    assert end.status == "finished" and end.anomalies == 1 and end.events == 1
    wandb.teardown()  # the service writes the rest of the run's file
    wb = wandb_run(tmp_path)
    assert wb.summary["torchdebug/verdict"] == faulty["wandb"].summary["torchdebug/verdict"]
    assert len(wb.alerts) == 1


# -- choosing sinks, and sinks that fail -------------------------------------------------------------


def _tiny_run(tmp_path: Path, steps: int = 4, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, run=tmp_path / "runs", **kwargs) as mon:
        hm.train(mon, model, opt, steps)
    return mon


class _Boom(Sink):
    name = "boom"

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls = 0

    def scalars(self, rec: Any) -> None:
        self.calls += 1
        if self.where == "scalars":
            raise RuntimeError("tracker down")

    def finish(self, end: Any) -> None:
        if self.where == "finish":
            raise RuntimeError("tracker down at the end")


@pytest.mark.parametrize("where", ["scalars", "finish"])
def test_a_failing_sink_is_switched_off_with_one_warning(tmp_path: Path, where: str) -> None:
    boom, good = _Boom(where), _Boom("nowhere")
    with pytest.warns(TorchDebugWarning) as caught:
        mon = _tiny_run(tmp_path, steps=6, report_to=[boom, good])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert messages[0].startswith("torchdebug: the 'boom' sink failed: RuntimeError('tracker down")
    assert f"run folder {mon.run_dir} keeps everything" in messages[0]
    assert open_run(mon.run_dir).series("loss").steps == list(range(6))  # training went on, all recorded
    assert good.calls >= 1  # the other sink kept going
    if where == "scalars":
        assert boom.calls == 1  # off after its first failure


def test_a_sink_that_falls_behind_is_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()

    class Stuck(Sink):
        name = "stuck"

        def scalars(self, rec: Any) -> None:
            gate.wait(10)

    monkeypatch.setattr(_hub, "MAX_BEHIND", 3)
    monkeypatch.setattr(_hub, "CLOSE_TIMEOUT", 0.5)
    torch.manual_seed(0)
    model = hm.HealthyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        pytest.warns(TorchDebugWarning, match="'stuck' sink fell more than 3 records behind"),
        td.watch(model, opt, run=tmp_path / "runs", report_to=[Stuck()]) as mon,
    ):
        for _ in range(3):
            hm.train(mon, model, opt, 2)
            mon.writer.flush()  # a batch per round: the stuck sink holds the first one
    gate.set()


def test_unknown_tracker_names_the_allowed_ones() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown name 'wandbb'; expected .*'tensorboard', 'wandb', 'mlflow', 'logging', 'all', 'none'",
    ):
        td.watch(hm.HealthyNet(), report_to=["wandbb"])
    with pytest.raises(TypeError, match="report_to items must be names"):
        td.watch(hm.HealthyNet(), report_to=[object()])


def test_a_missing_tracker_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        ImportError, match=r"report_to='wandb' needs the wandb package: pip install 'torchdebug\[wandb\]'"
    ):
        td.watch(hm.HealthyNet(), report_to="wandb")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert DebugConfig(report_to="all").report_to == ("all",)
    from torchdebug.sinks import resolve_names

    assert resolve_names(("all",)) == ["tensorboard", "logging"]  # "all": the installed ones
    assert DebugConfig(report_to=["none"]).report_to == ()


def test_a_tracker_that_cannot_start_is_left_out_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "ftp://nowhere.invalid/mlruns")  # no store for this scheme
    with pytest.warns(TorchDebugWarning) as caught:
        mon = _tiny_run(tmp_path, steps=2, report_to=["mlflow"])
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(
        "torchdebug: the 'mlflow' sink could not start: RuntimeError(\"MLflow could not"
    )
    assert "set MLFLOW_TRACKING_URI to your tracking server" in message
    assert open_run(mon.run_dir).series("loss").steps == [0, 1]  # training and the run folder went on


def test_report_to_needs_the_run_folder() -> None:
    with pytest.raises(ConfigError, match="need the run store: drop run=False"):
        td.watch(hm.HealthyNet(), run=False, report_to="logging")


def test_open_tracker_runs_are_used_and_left_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    _tracker_env(monkeypatch, tmp_path)
    writer = SummaryWriter(str(tmp_path / "mine"))
    user_wb = wandb.init(name="mine", dir=str(tmp_path))
    try:
        with mlflow.start_run(run_name="mine") as user_ml:
            mon = _tiny_run(tmp_path, steps=3, report_to=["wandb", "mlflow", writer])
            assert mlflow.active_run().info.run_id == user_ml.info.run_id  # still the user's, still open
            assert wandb.run is user_wb
            writer.add_scalar("mine", 1.0, 0)  # the user's writer is still open
        run = mlflow.MlflowClient().get_run(user_ml.info.run_id)
        assert run.data.tags["torchdebug/status"] == "finished"
        assert run.data.tags["torchdebug/run_folder"] == str(mon.run_dir)
    finally:
        user_wb.finish()
        wandb.teardown()  # the service writes the rest of the run's file
        writer.close()
    ea = EventAccumulator(str(tmp_path / "mine"))
    ea.Reload()
    assert {"mine", "torchdebug/loss"} <= set(ea.Tags()["scalars"])
    wb = wandb_run(tmp_path)
    assert wb.summary["torchdebug/status"] == "finished" and wb.alerts == []


def test_a_failed_run_says_so_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    import wandb

    _tracker_env(monkeypatch, tmp_path)
    handler = _Records()
    logger = logging.getLogger("torchdebug")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "propagate", False)
    torch.manual_seed(0)
    model = FaultyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        with (
            pytest.raises(td.NonFiniteError),
            pytest.warns(TorchDebugWarning, match="gradient_explosion"),
            td.watch(
                model,
                opt,
                config={**CFG, "policy": "raise"},
                run=tmp_path / "runs",
                report_to=["wandb", "mlflow", "logging"],
            ) as mon,
        ):
            train_faulty(mon, model, opt)
    finally:
        logger.removeHandler(handler)
        wandb.teardown()  # the service writes the rest of the run's file
    run = open_run(mon.run_dir)
    assert run.status == "failed"
    headline = run.anomalies()[0]["summary"]
    # judge(): failed with one anomaly step -> "failed at step 10: <origin>", then the rest by kind (the
    # gradient_explosion warning at step 8 is outranked)
    verdict = f"failed at step {NAN_AT}: {origin()}; also 1 gradient_explosion"
    assert headline == f"{origin()} (step {NAN_AT})"
    wb = wandb_run(tmp_path)
    assert wb.summary["torchdebug/status"] == "failed" and wb.summary["torchdebug/verdict"] == verdict
    assert [a[0] for a in wb.alerts] == ["torchdebug: nan in act (LogAct)", "torchdebug: the run failed"]
    assert wb.alerts[1][1] == f"{verdict}\nrun folder: {run.path}"
    assert wb.exit_code == 1  # the W&B run torchdebug opened ends as failed
    (mrun,) = mlflow.MlflowClient().search_runs(["0"])
    assert mrun.info.status == "FAILED" and mrun.data.tags["torchdebug/verdict"] == verdict
    (end,) = [r for r in handler.records if r.torchdebug["record"] == "end"]
    from torchdebug.views.verdict import verdict as judged

    assert judged(run)["text"] == verdict  # the sentence of `torchdebug show`
    assert (end.levelname, end.torchdebug["status"], end.torchdebug["verdict"]) == (
        "ERROR",
        "failed",
        verdict,
    )


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_mlflow_server_never_holds_up_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MLflow's client retries a refused connection with backoff for minutes; the sink connects on its
    # own thread with a short timeout, so training starts at once and the sink is dropped with one warning
    pytest.importorskip("mlflow")
    port = _closed_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    box: dict[str, Any] = {}

    def train() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            box["mon"] = _tiny_run(tmp_path, steps=3, report_to=["mlflow"])
        box["said"] = [str(w.message) for w in caught]

    t = threading.Thread(target=train, daemon=True)
    t.start()
    t.join(120)  # a watchdog for a hang (the old path blocked 322 s), not a timing
    assert not t.is_alive(), "training waited for the unreachable MLflow server"
    (message,) = [m for m in box["said"] if "sink" in m]
    assert message.startswith(
        f"torchdebug: the 'mlflow' sink could not start: RuntimeError('MLflow tracking server "
        f"http://127.0.0.1:{port} did not answer a connection within"
    )
    assert "check MLFLOW_TRACKING_URI" in message
    assert open_run(box["mon"].run_dir).series("loss").steps == [0, 1, 2]


@pytest.mark.parametrize(
    ("to", "fix"),
    [
        ("wandb", "log in with `wandb login` (or set WANDB_API_KEY; WANDB_MODE=offline writes locally)"),
        ("mlflow", "set MLFLOW_TRACKING_URI to your tracking server"),
    ],
)
def test_export_without_the_trackers_setup_is_a_configuration_error(
    tmp_path: Path, to: str, fix: str
) -> None:
    import os
    import subprocess

    pytest.importorskip(to)
    run = _tiny_run(tmp_path / "runs", steps=2).run_dir
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(HOME=str(home), PYTHONPATH=str(Path(__file__).parents[1] / "src"))
    done = subprocess.run(
        [sys.executable, "-m", "torchdebug", "export", str(run), "--to", to],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=home,
        env=env,
    )
    assert done.returncode == 1, done.stderr  # the documented exit code of a setup problem, not 4
    assert done.stderr.count("\n") == 1 and "internal error" not in done.stderr
    assert done.stderr.startswith(f"torchdebug: error: the {to!r} tracker could not start: ")
    assert fix in done.stderr
    if to == "mlflow":  # the second fix is offered only where it applies: mlflow-skinny alone
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            distribution("mlflow")
            skinny = False
        except PackageNotFoundError:
            skinny = True
        offered = "or pip install mlflow (the full package) for MLflow 3's local SQLite store" in done.stderr
        assert offered == skinny, done.stderr
