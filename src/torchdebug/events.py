"""Plain-data records that instruments produce: anomalies, rule events, step records (no live tensors)."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the store and the views read events without importing torch
    from .stats import TensorStats


class Phase(str, enum.Enum):
    """Where in a training step something happened."""

    INPUT = "input"
    PARAMETER = "parameter"
    FORWARD = "forward"
    BACKWARD = "backward"
    GRADIENT_EDIT = "gradient_edit"  # between backward() and the update: clipping, normalisation, unscaling
    OPTIMIZER = "optimizer"

    def __str__(self) -> str:
        return self.value


def _plain(value: Any) -> Any:
    """Turn dataclasses, enums, tuples and TensorStats into JSON-ready values."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    return value


# Severity colours of the notebook views (_repr_html_), the same red/amber/grey as the reports'.
SEVERITY_COLOURS = {"error": "#c0392b", "warning": "#b9770e", "info": "#5d6d7e", "ok": "#1e8449"}


def html_table(title: str, colour: str, rows: Sequence[tuple[str, Any]], css_class: str) -> str:
    """A small two-column table with a coloured title line: what a notebook shows for a record."""
    import html

    cells = "".join(
        f'<tr><th style="text-align:left;padding-right:1em">{html.escape(k)}</th>'
        f'<td style="text-align:left"><code>{html.escape(str(v))}</code></td></tr>'
        for k, v in rows
    )
    return (
        f'<div class="{css_class}"><div style="color:{colour};font-weight:bold">{html.escape(title)}</div>'
        f"<table>{cells}</table></div>"
    )


def module_label(name: str, type_name: str | None = None) -> str:
    """Render a qualified module name; the root ``""`` is shown as its class name."""
    if name:
        return f"{name} ({type_name})" if type_name else name
    return type_name or "<root>"


@dataclass(frozen=True)
class ModuleFrame:
    """One module call seen before an anomaly, with the magnitude range of what went in and out."""

    module: str
    module_type: str
    phase: str  # "forward" | "backward"
    input_abs_min: float | None = None
    input_abs_max: float | None = None
    output_abs_min: float | None = None
    output_abs_max: float | None = None
    output_nonfinite: bool = False

    def __str__(self) -> str:
        def rng(lo: float | None, hi: float | None) -> str:
            if lo is None or hi is None:
                return "-"
            return f"[{lo:.3g}, {hi:.3g}]"

        bad = "  <- non-finite" if self.output_nonfinite else ""
        return (
            f"{self.phase:<8} {module_label(self.module, self.module_type):<40} "
            f"|in|∈{rng(self.input_abs_min, self.input_abs_max):<22} "
            f"|out|∈{rng(self.output_abs_min, self.output_abs_max)}{bad}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


CAUSES = ("model", "compiler", "kernel_backend", "hardware", "unknown")


@dataclass(frozen=True)
class Cause:
    """Whose fault an anomaly is, with the evidence the verdict rests on.

    ``verdict`` is one of ``CAUSES``: ``"model"`` (an eager replay reproduces it: the model, its data
    or its loss code), ``"compiler"`` (compiled code makes it, eager code does not), ``"kernel_backend"``
    (one kernel backend makes it, another does not: ``backend`` names it), ``"hardware"`` (a replay on
    another rank came out finite and the fault stays on ``rank``), ``"unknown"`` (nothing tried
    reproduced it; ``tried`` says what was tried). ``evidence`` is one sentence of what was replayed
    where and what differed; ``compiles``, ``replays`` and ``collectives`` (those the cross-rank replay
    added) count the work it took.
    """

    verdict: str
    evidence: str
    tried: tuple[str, ...] = ()
    compiles: int = 0
    replays: int = 0
    module: str | None = None  # compiler: the first module whose compiled output is non-finite
    location: str | None = None  # the source line of that module's op, when known
    backend: str | None = None  # kernel_backend: the backend that made it; compiler: backend/subsystem
    rank: int | None = None  # hardware: the rank whose replay stays non-finite
    host: str | None = None
    device: str | None = None
    collectives: int = 0  # collectives the verdict took across ranks (the micro-step sent, the outcomes)

    def __post_init__(self) -> None:
        if self.verdict not in CAUSES:
            raise ValueError(f"verdict must be one of {CAUSES}, got {self.verdict!r}")

    def __str__(self) -> str:
        return f"{self.verdict}: {self.evidence}"


@dataclass(frozen=True)
class Anomaly:
    """Where the first non-finite value was born.

    ``phase`` is one of ``Phase``; ``module`` the qualified name as in ``model.named_modules()``
    (``""`` for the root or for code outside any module); ``op`` the aten op (forward) or the autograd
    node (backward); ``location`` the user's ``path/file.py:LINE`` that ran the op (for backward, the
    forward line that created the node); ``kind`` ``"nan" | "inf" | "-inf"``; ``step`` the count of
    completed ``mon.step()`` calls (``None`` for ``locate_nonfinite``).

    ``noticed``: when the origin is an Inf made by overflow that a later op turned into NaN (an fp16
    matmul, then a softmax), that later op (phase, module, op, line); else None. ``reproducible``:
    True when replaying the failing step made the same non-finite values, False when two replays came
    out finite (then ``module``, ``op`` and ``location`` are None: no origin is claimed, and
    ``symptom`` says what was non-finite in the step), None when no replay ran. Both keys are left out
    of ``to_dict()`` when None, as in documents written before they existed.
    """

    phase: str
    module: str | None  # None: no origin traced (a fault the replay did not reproduce)
    op: str | None
    location: str | None
    kind: str
    step: int | None = None
    rank: int = 0
    tensor: TensorStats | None = None
    inputs: tuple[TensorStats, ...] = ()
    frames: tuple[ModuleFrame, ...] = ()
    related: Anomaly | None = None
    hint: str = ""
    module_type: str = ""
    micro_step: int | None = None
    symptom: str = ""  # where the sentinel noticed it, e.g. "gradient of fc.weight"
    detected_by: str = "locate"  # "locate" | "sentinel" | "sentinel (no replay)"
    stack: tuple[str, ...] = ()  # user frames, innermost last, capped
    parameter: str | None = None  # for phase "parameter"/"optimizer": the parameter's qualified name
    # Where the origin's Inf (an overflow) became NaN further on, e.g. the softmax after an fp16 matmul.
    noticed: Anomaly | None = None
    # Whether replaying the failing step made the same non-finite values: None when no replay ran.
    reproducible: bool | None = None
    world_size: int = 1  # ranks in the run; > 1: ``rank`` is the rank of birth and the summary names it
    cause: Cause | None = None  # whose fault: the model, the compiler, a kernel backend, the hardware

    @property
    def where(self) -> str:
        if self.module is None:
            # an op without a module: read from an autograd graph the trace did not see being built
            return "an untraced module" if self.op and self.phase == "forward" else "no traced origin"
        return module_label(self.module, self.module_type)

    def site(self) -> str:
        """``forward of attn (Attention): aten._softmax at model.py:12``: phase, module, op and line."""
        s = f"{self.phase} of {self.parameter if self.parameter else self.where}"
        if self.op:
            s += f": {self.op}"
        if self.location:
            s += f" at {self.location}"
        return s

    def _when(self) -> str:
        """`` (step 7)``, on several ranks `` (step 7, born on rank 1 of 2)``; empty when neither is known."""
        parts = [f"step {self.step}"] if self.step is not None else []
        if self.world_size > 1:
            on = "on" if self.reproducible is False else "born on"  # not reproduced: where it was seen
            parts.append(f"{on} rank {self.rank} of {self.world_size}")
        return f" ({', '.join(parts)})" if parts else ""

    def summary(self) -> str:
        """One line: ``nan born in forward of blocks.1.attn (Attention): aten.log at model.py:41 (step 7)``;
        on several ranks it ends ``(step 7, born on rank 1 of 2)`` on every rank. A forward or backward
        NaN seen without a replay names no birthplace: ``nan in the forward, origin not traced: ...``."""
        if self.reproducible is False:
            s = f"{self.kind} not reproducible: {self.symptom or 'non-finite values'}, finite on replay"
            return s + self._when()
        if self.detected_by.endswith("(no replay)") and self.phase in ("forward", "backward") and not self.op:
            # seen, not traced: where it was noticed is not where it was born
            return (
                f"{self.kind} in the {self.phase}, origin not traced: {self.symptom or 'non-finite values'}"
                + (self._when())
            )
        what = f"{self.kind} born in {self.phase}"
        where = self.parameter if self.parameter else self.where
        s = f"{what} of {where}"
        if self.cause is not None and self.cause.verdict == "compiler":
            # compiled code made it, not an op the eager trace saw: the module whose compiled code is wrong
            s = f"{self.kind} from compiled {where}"
        if self.op:
            s += f": {self.op}"
        if self.location:
            s += f" at {self.location}"
        return s + self._when()

    def __str__(self) -> str:
        lines = [f"torchdebug: {self.summary()}"]
        lines.append(f"  phase     {self.phase}")
        lines.append(f"  module    {self.where}")
        if self.parameter:
            lines.append(f"  parameter {self.parameter}")
        if self.op:
            lines.append(f"  op        {self.op}")
        if self.location:
            lines.append(f"  line      {self.location}")
        if self.step is not None:
            micro = f" (micro-step {self.micro_step})" if self.micro_step else ""
            lines.append(f"  step      {self.step}{micro}")
        if self.world_size > 1:
            lines.append(f"  rank      {self.rank} of {self.world_size}")
        elif self.rank:
            lines.append(f"  rank      {self.rank}")
        if self.symptom:
            lines.append(f"  noticed   {self.symptom}")
        if self.noticed is not None:
            lines.append(f"  became    {self.noticed.kind} in {self.noticed.site()}")
        if self.reproducible is False:
            lines.append("  replay    did not reproduce it (replayed twice, same batch, weights and RNG)")
        if self.cause is not None:
            lines.append(f"  cause     {self.cause}")
        if self.hint:
            lines.append(f"  hint      {self.hint}")
        if self.tensor is not None:
            lines.append(f"  output    {self.tensor}")
        for i, t in enumerate(self.inputs):
            lines.append(f"  input[{i}]  {t}")
        if self.related is not None:
            lines.append(f"  related   {self.related.summary()}")
        if self.frames:
            lines.append("  last module calls before it:")
            lines.extend(f"    {f}" for f in self.frames)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Anomaly {self.summary()}>"

    def _repr_html_(self) -> str:
        """The anomaly in a notebook: the summary line in red, then phase, module, op, line, step, hint."""
        rows: list[tuple[str, Any]] = [("phase", self.phase), ("module", self.where)]
        if self.parameter:
            rows.append(("parameter", self.parameter))
        if self.op:
            rows.append(("op", self.op))
        if self.location:
            rows.append(("line", self.location))
        if self.step is not None:
            rows.append(("step", self.step))
        if self.world_size > 1:
            rows.append(("rank", f"{self.rank} of {self.world_size}"))
        if self.symptom:
            rows.append(("noticed", self.symptom))
        if self.cause is not None:
            rows.append(("cause", str(self.cause)))
        if self.hint:
            rows.append(("hint", self.hint))
        return html_table(self.summary(), SEVERITY_COLOURS["error"], rows, "torchdebug-anomaly")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        # newer fields: absent when unset, as in older documents
        for key in ("noticed", "reproducible", "cause"):
            if d[key] is None:
                del d[key]
        if self.world_size == 1:
            del d["world_size"]
        if self.noticed is not None:
            d["noticed"]["site"] = self.noticed.site()
        d["summary"] = self.summary()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


SEVERITIES = ("info", "warning", "error")


@dataclass(frozen=True)
class RuleEvent:
    """A rule that fired: exploding gradients, loss spike, leak, input-bound step ...

    ``kind`` is a short snake_case name; ``modules`` the layers it concerns; ``evidence`` plain numbers.
    """

    kind: str
    step: int | None
    message: str
    severity: str = "warning"
    modules: tuple[str, ...] = ()
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def __str__(self) -> str:
        where = f" [{', '.join(self.modules)}]" if self.modules else ""
        at = f"step {self.step}: " if self.step is not None else ""
        return f"{self.severity}: {at}{self.kind}{where}: {self.message}"

    def __repr__(self) -> str:
        text = str(self)
        return f"<RuleEvent {text if len(text) <= 120 else text[:117] + '...'}>"

    def _repr_html_(self) -> str:
        """The event in a notebook: severity in its colour, step, kind, modules, message."""
        rows: list[tuple[str, Any]] = []
        if self.step is not None:
            rows.append(("step", self.step))
        if self.modules:
            rows.append(("modules", ", ".join(self.modules)))
        rows.append(("message", self.message))
        colour = SEVERITY_COLOURS.get(self.severity, SEVERITY_COLOURS["info"])
        return html_table(f"{self.severity}: {self.kind}", colour, rows, "torchdebug-event")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass
class StepRecord:
    """What ``mon.step()`` returns: the step's numbers after its single host transfer."""

    step: int
    micro_steps: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    skipped: bool = False
    skip_reason: str = ""
    scale: float | None = None
    lr: tuple[float, ...] = ()
    time_s: float | None = None
    values: dict[str, float] = field(default_factory=dict)
    anomaly: Anomaly | None = None
    events: list[RuleEvent] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"step {self.step}"]
        if self.loss is not None:
            parts.append(f"loss={self.loss:.4g}")
        if self.grad_norm is not None:
            parts.append(f"|g|={self.grad_norm:.4g}")
        if self.lr:
            parts.append("lr=" + ",".join(f"{x:.3g}" for x in self.lr))
        if self.skipped:
            parts.append(f"SKIPPED ({self.skip_reason})")
        if self.anomaly is not None:
            parts.append(f"ANOMALY: {self.anomaly.summary()}")
        parts.extend(str(e) for e in self.events)
        return "  ".join(parts)

    def _repr_html_(self) -> str:
        """The step in a notebook: led by the step in one line (red with an anomaly, amber when
        skipped or warned, green otherwise), then its numbers, the skip, the anomaly's origin and
        the rule events."""
        rows: list[tuple[str, Any]] = []
        for name, value in (("loss", self.loss), ("grad norm", self.grad_norm), ("loss scale", self.scale)):
            if value is not None:
                rows.append((name, f"{value:.4g}"))
        if self.lr:
            rows.append(("lr", ", ".join(f"{x:.3g}" for x in self.lr)))
        if self.micro_steps > 1:
            rows.append(("micro-steps", self.micro_steps))
        if self.time_s is not None:
            rows.append(("time", f"{self.time_s * 1e3:.3g} ms"))
        if self.skipped:
            rows.append(("skipped", self.skip_reason or "yes"))
        if self.anomaly is not None:
            rows.append(("anomaly", self.anomaly.summary()))
            if self.anomaly.hint:
                rows.append(("hint", self.anomaly.hint))
        rows += [(f"{e.severity}", f"{e.kind}: {e.message}") for e in self.events]
        level, said = self._said()
        return html_table(said, SEVERITY_COLOURS[level], rows, "torchdebug-step")

    def _said(self) -> tuple[str, str]:
        """The step in one line and its level (what its notebook view leads with, in that colour):
        ``("ok", "step 7: ok")``; an anomaly (``"error"``): its summary, and ``, update skipped``
        when the policy skipped it; a skipped update (``"warning"``); else the most severe rule event
        (``"step 5: gradient_explosion: ..."``, ``; and 2 more`` when there are others)."""
        if self.anomaly is not None:
            return "error", self.anomaly.summary() + (", update skipped" if self.skipped else "")
        if self.skipped:
            return "warning", f"step {self.step}: update skipped" + (
                f" ({self.skip_reason})" if self.skip_reason else ""
            )
        loud = sorted(
            (e for e in self.events if e.severity in ("warning", "error")),
            key=lambda e: e.severity != "error",  # errors first, then in the order they fired
        )
        if loud:
            more = f"; and {len(loud) - 1} more" if len(loud) > 1 else ""
            return loud[0].severity, f"step {self.step}: {loud[0].kind}: {loud[0].message}{more}"
        return "ok", f"step {self.step}: ok"

    def __repr__(self) -> str:
        text = str(self)
        return f"<StepRecord {text if len(text) <= 160 else text[:157] + '...'}>"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


# The rule-event kinds the seed-era summaries count, exactly as the engine's rules emit them
# (instruments/health.py: ExplosionRule, VanishingRule, LossSpikeRule, LossPlateauRule). A test drives
# each rule with a real model and checks its kind is one of these, so the two cannot drift apart.
GRADIENT_EXPLOSION = "gradient_explosion"
VANISHING_GRADIENT = "vanishing_gradient"
LOSS_SPIKE = "loss_spike"
LOSS_PLATEAU = "loss_plateau"
LOSS_KINDS = frozenset({LOSS_SPIKE, LOSS_PLATEAU})


def not_under_compile(kind: str, step: int, what: str, instead: str) -> RuleEvent:
    """The info event of a per-module instrument that stands down for a ``torch.compile``d model.

    Its hooks would see nothing inside the compiled region, and adding or removing them changes what
    Dynamo guards on (a recompile each time, or, for a dispatch mode, no compilation at all).
    """
    return RuleEvent(
        kind,
        step,
        f"{what} not measured: the model runs under torch.compile, where per-module hooks see nothing "
        f"and would make Dynamo recompile it; {instead}",
        "info",
    )


def rule_counts(kinds: Iterable[str]) -> tuple[int, int, int]:
    """(gradient explosions, gradient vanishing, loss anomalies) among rule-event kinds.

    Counts the exact kinds the rules emit: ``gradient_explosion``, ``vanishing_gradient``, and
    ``loss_spike`` + ``loss_plateau``; any other kind counts nowhere.

    Example:
        >>> rule_counts(["gradient_explosion", "loss_spike", "memory_leak"])
        (1, 0, 1)
    """
    kinds = list(kinds)
    return (
        sum(k == GRADIENT_EXPLOSION for k in kinds),
        sum(k == VANISHING_GRADIENT for k in kinds),
        sum(k in LOSS_KINDS for k in kinds),
    )


def is_anomalous(anomaly: Any, severities: Iterable[str] = ()) -> bool:
    """The one definition of an anomalous step (or seed-era operation), shared by every summary.

    Anomalous: it has a NaN/Inf record (``anomaly`` not None), or a warning- or error-level rule
    event (``severities`` of its events). Info-level events (a skipped step under policy "skip", a
    level change) are not anomalies.

    Example:
        >>> is_anomalous(None, ["info", "warning"]), is_anomalous(None, ["info"])
        (True, False)
    """
    return anomaly is not None or any(s in ("warning", "error") for s in severities)


def training_summary(
    total_steps: int,
    anomaly_steps: int,
    gradient_explosions: int,
    gradient_vanishing: int,
    loss_anomalies: int,
) -> dict[str, Any]:
    """The seed-era training summary: the counts and their rates per step (0 when there were no steps)."""
    d = max(total_steps, 1)
    return {
        "total_steps": total_steps,
        "anomaly_steps": anomaly_steps,
        "gradient_explosions": gradient_explosions,
        "gradient_vanishing": gradient_vanishing,
        "loss_anomalies": loss_anomalies,
        "anomaly_rate": anomaly_steps / d,
        "loss_anomaly_rate": loss_anomalies / d,
        "gradient_explosion_rate": gradient_explosions / d,
        "gradient_vanishing_rate": gradient_vanishing / d,
    }


def plain(value: Any) -> Any:
    """Public alias of the JSON-ready converter used by every record's ``to_dict``."""
    return _plain(value)


__all__: Sequence[str] = [
    "Anomaly",
    "ModuleFrame",
    "Phase",
    "RuleEvent",
    "StepRecord",
    "is_anomalous",
    "module_label",
    "plain",
    "rule_counts",
    "training_summary",
]
