"""What a sink receives, and the one naming scheme every sink and ``torchdebug export`` share.

A run's records reach a sink in two ways: live, from the run writer's thread (``decode_batch`` of
the queue's tuples), and after the fact, from a run folder (``run_records``). Both give the same
records under the same names, so a tracker shows the same thing whichever way it was fed.

Names (all under ``torchdebug/``):

- a stored metric under its own name: ``torchdebug/loss``, ``torchdebug/grad_norm``,
  ``torchdebug/lr/0`` (parameter group 0), ``torchdebug/observe/<name>`` ...; per-parameter ones
  under ``torchdebug/params/``: ``torchdebug/params/grad_norm/<parameter>``,
  ``torchdebug/params/update_ratio/<parameter>``, ``torchdebug/params/weight_norm/<parameter>``;
- ``torchdebug/memory/<key>`` (bytes), ``torchdebug/time/<phase>`` (seconds; the whole step is
  ``total``), ``torchdebug/throughput/<x>_per_s``;
- ``torchdebug/nonfinite/<tensor>/nan`` and ``.../inf`` (counts) and ``torchdebug/histograms/<tensor>``
  from tensor statistics on the detailed schedule;
- texts: ``torchdebug/anomalies``, ``torchdebug/events/<kind>`` (the first record of each episode),
  ``torchdebug/first_anomaly`` (the run's first anomaly, alone), ``torchdebug/episodes`` (an
  episode of several records: how many, which steps), ``torchdebug/verdict``; run-level
  fields ``torchdebug/status``, ``torchdebug/verdict``, ``torchdebug/run_folder`` and
  ``torchdebug/first_anomaly/headline`` (``.../phase``, ``.../module``, ``.../op``, ``.../line``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..events import module_label
from ..views.report._format import anomaly_rows

PREFIX = "torchdebug/"
ANOMALIES = PREFIX + "anomalies"
VERDICT = PREFIX + "verdict"
FIRST_ANOMALY_TEXT = PREFIX + "first_anomaly"
EPISODES = PREFIX + "episodes"
STATUS = PREFIX + "status"
RUN_FOLDER = PREFIX + "run_folder"
FIRST_ANOMALY = PREFIX + "first_anomaly/"  # + headline, phase, module, op, line
FINDINGS = PREFIX + "findings"
STEP = PREFIX + "step"


# Stored per-parameter families (``grad_norm/<param>`` ...) go under ``torchdebug/params/``: the total
# ``grad_norm`` is a leaf, and MLflow's file store keeps each metric in a file named after it, so no
# name may also be a folder of others.
_PER_PARAMETER = ("grad_norm/", "update_ratio/", "weight_norm/")


def metric_tag(name: str) -> str:
    """A stored metric's name in every tracker: ``loss`` -> ``torchdebug/loss``,
    ``grad_norm/fc1.weight`` -> ``torchdebug/params/grad_norm/fc1.weight``."""
    if name.startswith(_PER_PARAMETER):
        return f"{PREFIX}params/{name}"
    return PREFIX + name


def memory_tag(key: str) -> str:
    return f"{PREFIX}memory/{key}"


def timing_tag(key: str) -> str:
    """``forward`` -> ``torchdebug/time/forward``; the whole step (stored as ``step``) is ``total``;
    rates (``samples_per_s``) go under ``torchdebug/throughput/``."""
    if key == "step":
        key = "total"  # as Run.timings() reads it back
    if key.endswith("_per_s"):
        return f"{PREFIX}throughput/{key}"
    return f"{PREFIX}time/{key}"


def event_tag(kind: str) -> str:
    return f"{PREFIX}events/{kind}"


def histogram_tag(tensor: str) -> str:
    return f"{PREFIX}histograms/{tensor}"


def nonfinite_tags(tensor: str) -> tuple[str, str]:
    return f"{PREFIX}nonfinite/{tensor}/nan", f"{PREFIX}nonfinite/{tensor}/inf"


@dataclass(frozen=True)
class RunInfo:
    """The run a sink reports: its name, id and folder (None without one)."""

    name: str
    run_id: str | None = None
    path: Path | None = None
    config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scalars:
    """Values of one step under their tracker names (``torchdebug/loss`` ...); ``metrics``: the step
    has stored metrics (not only memory, timings or tensor statistics), as ``Run.steps()`` counts."""

    step: int
    values: dict[str, float]
    wall_time: float | None = None
    metrics: bool = False


@dataclass(frozen=True)
class Histogram:
    """Summary statistics of one tensor at one step (min, max, mean, std, numel, NaN/Inf counts)."""

    step: int
    name: str
    stats: Mapping[str, Any]
    wall_time: float | None = None


@dataclass(frozen=True)
class Finding:
    """An anomaly or a rule event, as stored: ``doc`` is the anomaly document or the event
    (``kind``, ``severity``, ``message``, ``data``)."""

    kind: str  # "anomaly" | "event"
    step: int | None
    doc: Mapping[str, Any]
    wall_time: float | None = None
    # set by the episode grouper (``_episodes.py``): the incident's number (0: not grouped), and
    # whether an earlier record of the same episode was already sent
    episode: int = 0
    repeat: bool = False

    @property
    def severity(self) -> str:
        return "error" if self.kind == "anomaly" else str(self.doc.get("severity") or "warning")

    @property
    def name(self) -> str:
        """The anomaly's kind (``nan``) or the event's (``gradient_explosion``)."""
        return str(self.doc.get("kind") or self.kind)

    @property
    def headline(self) -> str:
        """One line: the anomaly's summary, or ``gradient_explosion [fc1]: grad norm 64 is ...``."""
        if self.kind == "anomaly":
            return str(self.doc.get("summary") or f"{self.name} (step {self.step})")
        mods = _modules(self.doc)
        where = f" [{', '.join(mods)}]" if mods else ""
        return f"{self.name}{where}: {self.doc.get('message', '')}"

    def first_anomaly_fields(self) -> dict[str, str]:
        """``torchdebug/first_anomaly/headline``, ``.../phase``, ``.../module``, ``.../op``, ``.../line``
        (those the anomaly says) as text."""
        fields = {FIRST_ANOMALY + "headline": self.headline}
        fields.update({FIRST_ANOMALY + k: str(v) for k, v in self.where().items() if v is not None})
        return fields

    def where(self) -> dict[str, Any]:
        """``phase``, ``module``, ``op``, ``line`` of an anomaly (None for what it does not say)."""
        d = self.doc
        module = d.get("module")
        label = (
            module_label(str(module), str(d.get("module_type") or "") or None) if module is not None else None
        )
        return {"phase": d.get("phase"), "module": label, "op": d.get("op"), "line": d.get("location")}

    def text(self) -> str:
        """The full block: for an anomaly the same rows as the terminal and the report."""
        if self.kind != "anomaly":
            at = f"step {self.step}: " if self.step is not None else ""
            return f"torchdebug {self.severity}: {at}{self.headline}"
        d = self.doc
        rows = [
            *anomaly_rows(d),
            ("step", d.get("step")),
            ("noticed", d.get("symptom")),
            ("hint", d.get("hint")),
        ]
        lines = [f"torchdebug: {self.headline}"]
        lines += [f"  {k:<10}{v}" for k, v in rows if v not in (None, "")]
        frames = d.get("frames") or []
        if isinstance(frames, list) and frames:
            lines.append("  last module calls before it:")
            for f in frames:
                if isinstance(f, Mapping):
                    bad = "  <- non-finite" if f.get("output_nonfinite") else ""
                    where = module_label(str(f.get("module") or ""), f.get("module_type") or None)
                    lines.append(f"    {f.get('phase', ''):<8} {where}{bad}")
        return "\n".join(lines)

    def markdown(self) -> str:
        """Markdown for a text panel (TensorBoard): the headline in bold and the block as code, or
        ``**warning** `gradient_explosion` [fc1]: grad norm 64 is 32x its running median``."""
        if self.kind != "anomaly":
            mods = _modules(self.doc)
            where = f" [{', '.join(mods)}]" if mods else ""
            return f"**{self.severity}** `{self.name}`{where}: {self.doc.get('message', '')}"
        body = "\n".join("    " + line for line in self.text().splitlines())
        return f"**{self.headline}**\n\n{body}"

    def row(self) -> list[Any]:
        """The row of a findings table (columns ``FINDING_COLUMNS``)."""
        if self.kind == "anomaly":
            w = self.where()
        else:
            mods = _modules(self.doc)
            w = {"phase": None, "module": ", ".join(mods) if mods else None, "op": None, "line": None}
        return [
            self.step,
            self.kind,
            self.name,
            self.severity,
            self.headline,
            w["phase"],
            w["module"],
            w["op"],
            w["line"],
        ]


FINDING_COLUMNS = ("step", "record", "kind", "severity", "headline", "phase", "module", "op", "line")


def _modules(doc: Mapping[str, Any]) -> list[str]:
    data = doc.get("data")
    mods = data.get("modules") if isinstance(data, Mapping) else None
    return [str(m) for m in mods] if isinstance(mods, list) else []


@dataclass(frozen=True)
class RunEnd:
    """How the run ended: ``status`` (finished | failed), the one-line ``verdict``, the run folder."""

    status: str
    verdict: str
    path: Path | None
    anomalies: int = 0
    events: int = 0
    first_anomaly: Finding | None = None
    last_step: int | None = None


#: anomaly documents (and, apart, divergence events) a tally keeps; past it only counts (bounded memory)
KEEP = 2000


class Tally:
    """What went by, for the verdict: :func:`torchdebug.views.verdict.judge` over the same documents
    ``show`` reads back, so every tracker gets the sentence of ``show``, the reports and the dashboard.

    Kept, in bounded memory: the first ``KEEP`` anomaly documents (and the earliest-step one when it
    comes later), the exact number of distinct steps with an anomaly; the first ``KEEP`` divergence
    events; of the other warning and error events, the first of each kind and severity (the verdict
    ranks kinds, not times) and their count by kind (at most ``KEEP`` kinds); the number
    of distinct steps with stored metrics, the last step, and the records the writer lost.
    Steps arrive in order, so distinct steps are counted by comparing with the last one seen; anomaly
    steps also against the set of the kept documents' steps and the earliest step seen (exact unless
    an anomaly past the first ``KEEP`` comes at a step between earlier ones).
    """

    def __init__(self) -> None:
        self.anomalies = 0
        self.events = 0
        self.first: Finding | None = None
        self.last_step: int | None = None
        self.steps = 0  # distinct steps with stored metrics
        self.lost = 0
        self._metric_step: int | None = None
        self._anomaly_docs: list[dict[str, Any]] = []
        self._earliest: dict[str, Any] | None = None  # a later anomaly at an earlier step than the kept ones
        self._anomaly_steps: set[int] = set()  # of the kept documents
        self._kept_min: float = math.inf  # their earliest step
        self._max_anomaly_step: int | None = None
        self._anomaly_step_count = 0
        self._divergence_events: list[dict[str, Any]] = []
        # the first warning/error event of each (kind, severity): a kind's error outranks its warnings
        self._first_of_kind: dict[tuple[str, str], dict[str, Any]] = {}
        self._loud_by_kind: dict[str, int] = {}

    def see(self, rec: Any) -> None:
        """Count one record (a histogram, or scalars without stored metrics, counts for nothing:
        ``Run.summary()``'s steps and last step come from metrics, anomalies and events)."""
        step = getattr(rec, "step", None)
        if (isinstance(rec, Scalars) and not rec.metrics) or isinstance(rec, Histogram):
            return
        if isinstance(step, int) and (self.last_step is None or step > self.last_step):
            self.last_step = step
        if isinstance(rec, Scalars):
            if self._metric_step is None or rec.step > self._metric_step:
                self._metric_step = rec.step
                self.steps += 1
        elif isinstance(rec, Finding):
            doc = {**rec.doc, "step": step}  # as Run.anomalies() / Run.events() return it
            if rec.kind == "anomaly":
                self._see_anomaly(rec, doc, step if isinstance(step, int) else None)
            else:
                self._see_event(doc)

    def _see_anomaly(self, rec: Finding, doc: dict[str, Any], step: int | None) -> None:
        self.anomalies += 1
        if self.first is None:
            self.first = rec
        earliest = min(self._kept_min, _step_or_inf(self._earliest))
        if step is not None and step not in self._anomaly_steps:
            # a new step: any step while the kept documents' set holds them all; past the cap one
            # after every step seen (in order) or before every step seen (never seen)
            top = self._max_anomaly_step
            if len(self._anomaly_docs) < KEEP or top is None or step > top or step < earliest:
                self._anomaly_step_count += 1
            self._max_anomaly_step = step if top is None else max(top, step)
        if len(self._anomaly_docs) < KEEP:
            self._anomaly_docs.append(doc)
            if step is not None:
                self._anomaly_steps.add(step)
                self._kept_min = min(self._kept_min, step)
        elif step is not None and step < earliest:
            self._earliest = doc

    def _see_event(self, doc: dict[str, Any]) -> None:
        from ..views.verdict import DIVERGENCE, DIVERGENCE_END

        self.events += 1
        if doc.get("kind") in (DIVERGENCE, DIVERGENCE_END):
            if len(self._divergence_events) < KEEP:
                self._divergence_events.append(doc)
        elif doc.get("severity") in ("warning", "error"):
            kind = str(doc.get("kind"))
            if kind in self._loud_by_kind or len(self._loud_by_kind) < KEEP:
                self._loud_by_kind[kind] = self._loud_by_kind.get(kind, 0) + 1
                self._first_of_kind.setdefault((kind, str(doc.get("severity"))), doc)

    def judge(self, status: str) -> dict[str, Any]:
        """``judge(status, ...)`` over what was kept (the same result as over the whole run)."""
        from ..views.verdict import judge

        anomalies = self._anomaly_docs + ([self._earliest] if self._earliest is not None else [])
        return judge(
            status,
            steps=self.steps,
            last_step=self.last_step,
            anomalies=anomalies,
            events=self._divergence_events + list(self._first_of_kind.values()),
            lost=self.lost,
            anomaly_steps=self._anomaly_step_count,
            event_counts=self._loud_by_kind,
        )

    def end(self, status: str, path: Path | None) -> RunEnd:
        return RunEnd(
            status,
            self.judge(status)["text"],
            path,
            self.anomalies,
            self.events,
            self.first,
            self.last_step,
        )


def _step_or_inf(doc: Mapping[str, Any] | None) -> float:
    step = doc.get("step") if doc is not None else None
    return step if isinstance(step, int) else math.inf


Record = Scalars | Histogram | Finding


def _finite_or(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) else math.nan


def _nonfinite_counts(stats: Mapping[str, Any]) -> tuple[float, float]:
    nan = int(stats.get("nan_count") or 0)
    inf = int(stats.get("posinf_count") or 0) + int(stats.get("neginf_count") or 0)
    return float(nan), float(inf)


def _json_doc(text: Any) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        doc = json.loads(text)
    except (TypeError, ValueError):
        return {"unreadable": str(text)[:200]}
    return doc if isinstance(doc, dict) else {"value": doc}


def decode_low(low: Sequence[tuple[Any, ...]]) -> list[Record]:
    """The run writer's queued low-priority tuples (``RunWriter.add_listener``) as records: the
    scalars of each step together (metrics, memory, timings, non-finite counts), then histograms."""
    by_step: dict[int, dict[str, float]] = {}
    walls: dict[int, float] = {}
    hists: list[Record] = []
    metric_steps: set[int] = set()
    for rec in low:
        tag = rec[0]
        if tag == "s":
            _, name, step, value, wall = rec
            by_step.setdefault(step, {})[metric_tag(name)] = value
            metric_steps.add(step)
            walls.setdefault(step, wall)
        elif tag == "m" or tag == "T":
            _, step, items, wall = rec
            d = by_step.setdefault(step, {})
            name_of = memory_tag if tag == "m" else timing_tag
            for k, v in items:
                d[name_of(k)] = float(v)
            walls.setdefault(step, wall)
        elif tag == "t":
            _, step, name, stats, wall = rec
            nan_tag, inf_tag = nonfinite_tags(name)
            d = by_step.setdefault(step, {})
            d[nan_tag], d[inf_tag] = _nonfinite_counts(stats)
            walls.setdefault(step, wall)
            hists.append(Histogram(step, name, stats, wall))
    out: list[Record] = [Scalars(s, by_step[s], walls.get(s), s in metric_steps) for s in sorted(by_step)]
    return out + hists


def decode_high(high: Sequence[tuple[Any, ...]]) -> list[Finding]:
    """The queued anomalies and events as findings (segments are not findings)."""
    out: list[Finding] = []
    for rec in high:
        if rec[0] == "a":
            out.append(Finding("anomaly", rec[1], _json_doc(rec[6]), rec[2]))
        elif rec[0] == "e":
            _, step, wall, kind, severity, message, data = rec
            ev = {"kind": kind, "severity": severity, "message": message, "data": _json_doc(data) or None}
            out.append(Finding("event", step, ev, wall))
    return out


def run_records(run: Any) -> Iterator[Record]:
    """A stored run (``torchdebug.store.Run``) as the same records, by step: every metric, memory and
    timing sample and tensor statistic, then every anomaly and rule event in the order logged."""
    by_step: dict[int, dict[str, float]] = {}
    walls: dict[int, float] = {}
    for name in run.metric_names():
        s = run.series(name)
        tag = metric_tag(name)
        for step, value, wall in zip(s.steps, s.values, s.wall_times):
            by_step.setdefault(step, {})[tag] = _finite_or(value)
            walls.setdefault(step, wall)
    metric_steps = set(by_step)
    for sample in run.memory():
        d = by_step.setdefault(sample["step"], {})
        for k, v in sample.items():
            if k not in ("step", "wall_time"):
                d[memory_tag(k)] = float(v)
        walls.setdefault(sample["step"], sample["wall_time"])
    for sample in run.timings():
        d = by_step.setdefault(sample["step"], {})
        for k, v in sample.items():
            if k not in ("step", "wall_time"):
                d[timing_tag(k)] = float(v)
        walls.setdefault(sample["step"], sample["wall_time"])
    hists: list[Histogram] = []
    for row in run.tensor_stats():
        step, name, stats = row["step"], row["name"], row["stats"]
        nan_tag, inf_tag = nonfinite_tags(name)
        d = by_step.setdefault(step, {})
        d[nan_tag], d[inf_tag] = _nonfinite_counts(stats)
        walls.setdefault(step, row["wall_time"])
        hists.append(Histogram(step, name, stats, row["wall_time"]))
    for step in sorted(by_step):
        yield Scalars(step, by_step[step], walls.get(step), step in metric_steps)
    yield from hists
    findings: list[Finding] = [
        Finding(
            "anomaly",
            a.get("step"),
            {k: v for k, v in a.items() if k not in ("id", "wall_time")},
            a.get("wall_time"),
        )
        for a in run.anomalies()
    ]
    for e in run.events():
        ev = {k: e.get(k) for k in ("kind", "severity", "message", "data")}
        findings.append(Finding("event", e.get("step"), ev, e.get("wall_time")))
    findings.sort(key=lambda f: f.wall_time or 0.0)
    yield from findings
