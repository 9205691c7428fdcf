"""One incident, one alert: NaN on 30 consecutive steps reaches each tracker once, with its origin.

The fault-injection model of tests/test_trackers.py under ``policy="skip"``: ``act`` takes the log of
a negative input on steps 10..39 (the first traced to ``act``'s ``aten.log``, the later ones named
where the NaN is seen, ``inp.weight``: one incident). Each tracker is read back from its own files: W&B's offline run file, MLflow's file store,
TensorBoard's event file, and the ``torchdebug`` logger's records.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import torchdebug as td
from tests.fixtures import health_models as hm
from tests.fixtures.models import origin_line
from tests.fixtures.trackers import wandb_run
from tests.test_trackers import FaultyNet, _Records, _tracker_env
from torchdebug import TorchDebugWarning
from torchdebug.sinks._episodes import GAP, EpisodeEnd, Episodes, episode_title
from torchdebug.sinks._records import Finding, Scalars
from torchdebug.store import open_run

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

FIRST, LAST, STEPS = 10, 39, 45  # NaN on steps 10..39: 30 steps, one incident
ORIGIN = f"nan born in forward of act (LogAct): aten.log at {origin_line('log')}"


@pytest.fixture(scope="module")
def flood(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("episodes")
    handler = _Records()
    logger = logging.getLogger("torchdebug")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
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
                    policy="skip",
                    run=root / "runs",
                    report_to=["tensorboard", "wandb", "mlflow", "logging"],
                ) as mon,
            ):
                for step, (x, y) in enumerate(hm.batches(STEPS)):
                    model.act.shift = -10.0 if FIRST <= step <= LAST else 1.0
                    opt.zero_grad()
                    F.mse_loss(model(x), y).backward()
                    opt.step()
                    mon.step()
            yield {
                "run": open_run(mon.run_dir),
                "root": root,
                "wandb": wandb_run(root),
                "mlflow": mlflow.MlflowClient(),
                "logs": handler.records,
            }
    finally:
        wandb.teardown()
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


def test_the_run_holds_every_anomaly(flood: dict[str, Any]) -> None:
    # the store keeps all 30 records: the episodes are what the trackers are sent, nothing is lost
    steps = sorted({a["step"] for a in flood["run"].anomalies()})
    assert steps == list(range(FIRST, LAST + 1))


def test_wandb_gets_one_alert_with_a_stable_title(flood: dict[str, Any]) -> None:
    wb = flood["wandb"]
    (alert,) = wb.alerts
    title, text, level = alert
    assert (title, level) == ("torchdebug: nan in act (LogAct)", "ERROR")
    assert text.startswith(f"torchdebug: {ORIGIN} (step {FIRST})\n")
    table = wb.tables["torchdebug/findings"]
    assert table["columns"][-2:] == ["count", "last_step"]
    # one row per episode: the NaN steps, the skip policy's 30 info events, its end-of-run count
    assert [(r[0], r[1], r[2], r[-2], r[-1]) for r in table["data"]] == [
        (FIRST, "anomaly", "nan", 30, LAST),
        (FIRST, "event", "skipped_step", 30, LAST),
        (STEPS - 5, "event", "skipped_steps", 1, STEPS - 5),
    ]


def test_mlflow_gets_one_artifact_per_episode(flood: dict[str, Any]) -> None:
    client = flood["mlflow"]
    (mrun,) = client.search_runs(["0"])
    rid = mrun.info.run_id
    names = sorted(a.path for a in client.list_artifacts(rid, "torchdebug"))
    assert names == [f"torchdebug/anomaly-step{FIRST}.json", "torchdebug/findings.json"]
    dl = flood["root"] / "dl"
    doc = json.loads(
        Path(client.download_artifacts(rid, f"torchdebug/anomaly-step{FIRST}.json", str(dl))).read_text()
    )
    assert doc["summary"] == f"{ORIGIN} (step {FIRST})" and doc["hint"]
    findings = json.loads(
        Path(client.download_artifacts(rid, "torchdebug/findings.json", str(dl))).read_text()
    )
    assert [(f["record"], f["step"], f["count"], f["last_step"]) for f in findings["findings"]] == [
        ("anomaly", FIRST, 30, LAST),
        ("event", FIRST, 30, LAST),
        ("event", STEPS - 5, 1, STEPS - 5),
    ]


def test_tensorboard_keeps_the_origin_and_sums_the_episode(flood: dict[str, Any]) -> None:
    ea = EventAccumulator(str(flood["run"].path / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()

    def text(tag: str) -> dict[int, str]:
        return {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors(f"{tag}/text_summary")}

    (origin,) = text("torchdebug/anomalies").items()
    assert origin[0] == FIRST and origin[1].startswith(f"**{ORIGIN} (step {FIRST})**")
    assert text("torchdebug/first_anomaly") == {FIRST: origin[1]}
    summaries = [
        (e.step, e.tensor_proto.string_val[0].decode())
        for e in ea.Tensors("torchdebug/episodes/text_summary")
    ]
    assert summaries == [
        (LAST, f"{ORIGIN}: 30 records, steps {FIRST}-{LAST}"),
        (LAST, f"skipped_step: skipped by policy: {ORIGIN} (step {FIRST}): 30 records, steps {FIRST}-{LAST}"),
    ]


def test_logging_gets_one_record_per_episode(flood: dict[str, Any]) -> None:
    found = [
        (r.levelname, r.torchdebug["step"], r.torchdebug["episode"])
        for r in flood["logs"]
        if r.torchdebug["record"] == "anomaly"
    ]
    assert found == [("ERROR", FIRST, 1)]


def test_no_output_through_the_last_resort_handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # report_to=["logging"] and no handler configured anywhere: logging would print every WARNING+
    # record on stderr through logging.lastResort; the torchdebug logger's NullHandler stops that
    reached: list[logging.LogRecord] = []

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reached.append(record)

    logger = logging.getLogger("torchdebug")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logging, "lastResort", Spy(logging.WARNING))
    torch.manual_seed(0)
    model = FaultyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        pytest.warns(TorchDebugWarning),
        td.watch(model, opt, policy="skip", run=tmp_path, report_to=["logging"]) as mon,
    ):
        for step, (x, y) in enumerate(hm.batches(14)):
            model.act.shift = -10.0 if step >= FIRST else 1.0
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            mon.step()
    assert len(open_run(mon.run_dir).anomalies()) == 4  # steps 10..13
    assert reached == []
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


# ------------------------------------------------------------------------------- the grouper alone


def _nan(step: int, module: str = "act") -> Finding:
    doc = {
        "kind": "nan",
        "phase": "forward",
        "module": module,
        "op": "aten.log",
        "summary": f"nan in {module}",
    }
    return Finding("anomaly", step, doc)


def _event(step: int, kind: str = "input_bound") -> Finding:
    return Finding("event", step, {"kind": kind, "severity": "warning", "message": "m"})


def test_episodes_group_by_origin_or_rule_and_close_after_a_gap() -> None:
    eps = Episodes()
    out = eps.see([_nan(5), _event(5), _nan(6), _nan(6, "fc1"), _event(40), _nan(7)])
    firsts = [(r.step, r.name, r.episode) for r in out if isinstance(r, Finding) and not r.repeat]
    repeats = [(r.step, r.episode) for r in out if isinstance(r, Finding) and r.repeat]
    # the NaN in fc1 at step 6 is the same incident as act's (non-finite values, consecutive)
    assert firsts == [(5, "nan", 1), (5, "input_bound", 2)]
    assert repeats == [(6, 1), (6, 1), (40, 2), (7, 1)]
    # a scalar GAP + 1 steps past step 7 closes the NaN episode; input_bound (last at 40) stays open
    out = eps.see([Scalars(7 + GAP + 1, {})])
    ends = [(e.number, e.count, e.first.step, e.last_step) for e in out if isinstance(e, EpisodeEnd)]
    assert ends == [(1, 4, 5, 7)]
    # a NaN after the gap is a new episode
    (again,) = eps.see([_nan(7 + GAP + 2)])
    assert isinstance(again, Finding) and (again.episode, again.repeat) == (3, False)
    assert [(e.number, e.count) for e in eps.close() if isinstance(e, EpisodeEnd)] == [(2, 2), (3, 1)]
    assert eps.close() == []


def test_titles_are_stable_and_fit_wandb() -> None:
    assert episode_title(_nan(5)) == episode_title(_nan(900)) == "torchdebug: nan in act"
    assert episode_title(_event(3, "gradient_explosion")) == "torchdebug: gradient_explosion"
    long = episode_title(_nan(1, "encoder.layers.11.self_attention.out_projection.linear_final"))
    assert len(long) == 63 and long.endswith("...")
