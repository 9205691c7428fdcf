"""Loss-spike forensics: why the loss spiked (``SpikeReport``), attributed from numbers only.

The session (``session/rollback.py``) gathers the evidence when the robust loss-spike rule fires (the
replayed step's per-row losses, the learning rates and gradient norms of the steps before, the
optimizer's state) and :func:`attribute` turns it into one verdict. Each verdict carries the numbers
it rests on; when none of the checks holds the cause is ``"unknown"`` with the evidence that was looked
at. The checks, in order:

- ``batch``: a few rows of the replayed batch are far above the batch's other rows (more than
  ``mads`` robust sigmas of the batch's own row losses), and without them the step's loss would not be
  a spike. Rows are named by index, with their loss and how many times the running median it is.
- ``learning_rate``: a learning rate jumped at least ``LR_JUMP`` times from one step to the next within
  the ``LOOKBACK`` steps before the spike, in param groups holding at least half the trainable
  elements (a scheduler jump, a warm-up restart).
- ``optimizer_state``: an adaptive optimizer's last update, per element, was at least ``COLLAPSE``
  times what a steady gradient gives: ``|m_hat| / (sqrt(v_hat) + eps)`` is at most about 1 while the
  gradient's scale is stationary (the mean of recent gradients cannot exceed their RMS), so a value of
  2 or more means the second-moment estimate lags the gradient: it had collapsed (the gradient was
  near zero for long) when the gradient came back. The total gradient norm did not jump.
- ``layer``: one module's updates or gradients jumped before the loss did: its param group's learning
  rate jumped (groups holding less than half the elements), or its update/weight ratio on the last
  detail check before the spike, or its gradient norm at a step before the spike, rose ``LAYER_JUMP``
  times above its own median while most layers' did not.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._robust import MAD_TO_SIGMA

CAUSES = ("batch", "learning_rate", "optimizer_state", "layer", "unknown")
LOOKBACK = 8  # steps before the spike whose learning rates and gradients are looked at
LR_JUMP = 2.0  # a step-to-step learning-rate factor that counts as a jump (warm-up: (t+1)/t < 2)
COLLAPSE = 2.0  # RMS of m_hat / (sqrt(v_hat) + eps): <= ~1 for a stationary gradient
LAYER_JUMP = 10.0  # a layer's gradient norm this many times its own median
ROW_FRACTION = 0.25  # "a few rows": at most this share of the batch (at least one row)
TOP = 5


@dataclass(frozen=True)
class SpikeRow:
    """One row of the replayed batch: its index, its loss, how many times the running median it is
    and how many robust sigmas above the batch's other rows."""

    index: int
    loss: float
    times_median: float
    batch_sigmas: float

    def __str__(self) -> str:
        return f"row {self.index}: loss {_f(self.loss)} ({_f(self.times_median)}x the running median)"


@dataclass(frozen=True)
class SpikeReport:
    """Why the loss spiked at ``step``: ``cause`` and the numbers it rests on.

    ``cause`` is one of ``"batch"``, ``"learning_rate"``, ``"optimizer_state"``, ``"layer"``,
    ``"unknown"``. ``rows`` (batch), ``params`` (optimizer_state), ``modules`` and ``began`` (layer, or
    the step the learning rate jumped) name what carried it; ``evidence`` holds every number looked at.
    ``str(report)`` is a short text; ``to_dict()`` is JSON-ready (``SpikeReport.from_dict`` reads it).

    Example:
        >>> r = SpikeReport(step=45, loss=9.0, median=1.0, sigmas=40.0, cause="learning_rate",
        ...                 message="lr of group 0 rose 30x at step 44", began=44)
        >>> r.to_dict()["cause"]
        'learning_rate'
    """

    step: int
    loss: float
    median: float
    sigmas: float
    cause: str
    message: str
    rows: tuple[SpikeRow, ...] = ()
    params: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    began: int | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        head = (
            f"loss spike at step {self.step}: loss {_f(self.loss)}, {_f(self.sigmas)} robust sigmas above "
            f"its running median {_f(self.median)}"
        )
        lines = [head, f"  cause: {self.cause}: {self.message}"]
        lines += [f"    {r}" for r in self.rows[:TOP]]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: ``step 45: cause batch: rows 3, 17 carry it (...)``."""
        return f"loss spike at step {self.step} (loss {_f(self.loss)}, median {_f(self.median)}): {self.cause}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rows"] = [dataclasses.asdict(r) for r in self.rows]
        d["params"], d["modules"] = list(self.params), list(self.modules)
        d["evidence"] = _plain(dict(self.evidence))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpikeReport:
        rows = tuple(SpikeRow(**r) for r in d.get("rows", ()))
        return cls(
            step=int(d["step"]),
            loss=float(d["loss"]),
            median=float(d["median"]),
            sigmas=float(d["sigmas"]),
            cause=str(d["cause"]),
            message=str(d["message"]),
            rows=rows,
            params=tuple(d.get("params", ())),
            modules=tuple(d.get("modules", ())),
            began=d.get("began"),
            evidence=dict(d.get("evidence", {})),
        )


@dataclass
class Evidence:
    """What the session gathered for one spike (host numbers only; see ``attribute``).

    ``rows``: per-row losses of the replayed step (None: no replay, ``rows_note`` says why) and
    ``reduction`` how they make the step's loss (``"mean"``, ``"sum"``, or None when neither).
    ``lrs``: (step, learning rate per group) of the recent steps, oldest first; ``group_sizes`` the
    trainable elements per group and ``group_modules`` the modules each group updates.
    ``grads``: (step, total gradient norm, per-layer gradient norms) of the recent steps, oldest
    first. ``adaptive``: per parameter of an adaptive optimizer, ``(name, rms of m_hat / (sqrt(v_hat)
    + eps), update/weight ratio of its last update)``. ``updates``: module -> update/weight ratio of
    the last update, where the optimizer's state tells it. ``ratios``: (step, per-layer update/weight
    ratio) of the recent detail steps (the gradient-health schedule), oldest first.
    """

    step: int
    loss: float
    median: float
    sigma: float
    mads: float
    rows: list[float] | None = None
    row_index: list[int] = field(default_factory=list)  # the first batch row of each part
    rows_note: str = ""
    reduction: str | None = None
    lrs: list[tuple[int, tuple[float, ...]]] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    group_modules: list[list[str]] = field(default_factory=list)
    grads: list[tuple[int, float, dict[str, float]]] = field(default_factory=list)
    adaptive: list[tuple[str, float, float]] = field(default_factory=list)
    updates: dict[str, float] = field(default_factory=dict)
    ratios: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)


def attribute(ev: Evidence) -> SpikeReport:
    """The verdict on one spike: the first check that holds (module docstring), else ``"unknown"``.

    Pure: host numbers in, a :class:`SpikeReport` out. Never names a cause the numbers do not show.
    """
    base: dict[str, Any] = {
        "step": ev.step,
        "loss": ev.loss,
        "median": ev.median,
        "sigmas": (ev.loss - ev.median) / ev.sigma if ev.sigma > 0 else math.inf,
    }
    looked: dict[str, Any] = dict(ev.notes)
    after = ev.notes.get("unrecovered")  # {"step", "cause", "median"}: an earlier spike not recovered from
    for check in (_batch, _learning_rate, _optimizer_state, _layer):
        if check is _batch and after:
            looked["batch_why"] = (
                f"the loss had not come back to its median {_f(after['median'])} since the spike at step "
                f"{after['step']} (cause {after['cause']}): the rows' losses measure the model that spike "
                "left, not the data"
            )
            continue
        verdict = check(ev, looked)
        if verdict is not None:
            cause, message, extra = verdict
            evidence = {**looked, **extra.pop("evidence", {})}
            return SpikeReport(**base, cause=cause, message=message, evidence=evidence, **extra)
    if after and after.get("cause") in CAUSES and after["cause"] != "unknown":
        return SpikeReport(
            **base,
            cause=after["cause"],
            message=(
                f"the same incident as the spike at step {after['step']} (cause {after['cause']}): the loss "
                f"had not come back to its median {_f(after['median'])} since"
            ),
            began=after["step"],
            evidence=looked,
        )
    parts = [f"{k}: {v}" for k, v in looked.items() if k.endswith("_why")]
    return SpikeReport(
        **base,
        cause="unknown",
        message="no check holds (" + "; ".join(parts) + ")" if parts else "no evidence was available",
        evidence=looked,
    )


# --------------------------------------------------------------------------- the checks


def _batch(ev: Evidence, looked: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    rows = ev.rows
    if not rows:
        looked["batch_why"] = ev.rows_note or "no per-row losses"
        return None
    n = len(rows)
    med = _median(rows)
    sig = max(MAD_TO_SIGMA * _median([abs(r - med) for r in rows]), 1e-2 * abs(med), 1e-12)
    z = [(r - med) / sig for r in rows]
    out = sorted((i for i in range(n) if z[i] > ev.mads), key=lambda i: -rows[i])
    looked["rows"] = {"count": n, "median": med, "max": max(rows), "max_sigmas": max(z)}
    if not out:
        looked["batch_why"] = f"no row is more than {_f(ev.mads)} sigmas above the batch's other rows"
        return None
    if ev.reduction not in ("mean", "sum"):
        looked["batch_why"] = "the loss is neither the mean nor the sum of the per-row losses"
        return None
    # the fewest of the outlying rows (highest first) without which the loss is not a spike
    carried: set[int] = set()
    without = z_without = math.inf
    for i in out:
        carried.add(i)
        rest = [rows[j] for j in range(n) if j not in carried]
        without = sum(rest) / len(rest) if ev.reduction == "mean" else sum(rest) * n / len(rest)
        z_without = (without - ev.median) / ev.sigma if ev.sigma > 0 else math.inf
        if z_without <= ev.mads:
            break
    out = [i for i in out if i in carried]
    if z_without > ev.mads:
        looked["batch_why"] = f"without rows {_list(out)} the loss {_f(without)} is still a spike"
        return None
    if len(out) > max(1, int(ROW_FRACTION * n)):
        looked["batch_why"] = f"{len(out)} of {n} rows carry it: the whole batch, not a few rows"
        return None
    index = ev.row_index if len(ev.row_index) == n else list(range(n))
    named = tuple(
        SpikeRow(index[i], rows[i], rows[i] / ev.median if ev.median else math.inf, z[i]) for i in out
    )
    desc = ", ".join(f"{r.index} ({_f(r.times_median)}x the running median)" for r in named[:TOP])
    return (
        "batch",
        f"{len(out)} of {n} rows carry it: rows {desc}; without them the loss "
        f"would be {_f(without)} ({_f(z_without)} sigmas)",
        {"rows": named, "evidence": {"loss_without_rows": without, "sigmas_without_rows": z_without}},
    )


def _jumps(ev: Evidence) -> list[tuple[int, int, float, float]]:
    """(group, step, lr before, lr after) of the largest jump per group in the lookback, >= LR_JUMP."""
    lrs = [x for x in ev.lrs if ev.step - LOOKBACK <= x[0] < ev.step]
    prev = [x for x in ev.lrs if x[0] < ev.step - LOOKBACK]
    seq = ([prev[-1]] if prev else []) + lrs
    best: dict[int, tuple[int, int, float, float]] = {}
    for (_, a), (s, b) in itertools.pairwise(seq):
        for g, (x, y) in enumerate(zip(a, b)):
            if not (math.isfinite(x) and math.isfinite(y)) or y <= 0:
                continue
            factor = y / x if x > 0 else math.inf
            if factor >= LR_JUMP and (g not in best or factor > _factor(best[g])):
                best[g] = (g, s, x, y)
    return sorted(best.values())


def _factor(j: tuple[int, int, float, float]) -> float:
    return j[3] / j[2] if j[2] > 0 else math.inf


def _learning_rate(ev: Evidence, looked: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    jumps = _jumps(ev)
    looked["lr_jumps"] = [{"group": g, "step": s, "before": x, "after": y} for g, s, x, y in jumps]
    if not jumps:
        looked["learning_rate_why"] = f"no learning rate rose {_f(LR_JUMP)}x from one step to the next"
        return None
    total = sum(ev.group_sizes) or 1
    covered = sum(ev.group_sizes[g] for g, *_ in jumps if g < len(ev.group_sizes))
    if covered * 2 < total:
        looked["learning_rate_why"] = (
            "the learning rate jumped only in groups holding a minority of the weights"
        )
        return None
    g, s, x, y = max(jumps, key=_factor)
    return (
        "learning_rate",
        f"the learning rate of group {g} went {_f(x)} -> {_f(y)} ({_f(_factor((g, s, x, y)))}x) at step "
        f"{s}, just before the spike" + (f" ({len(jumps)} groups jumped)" if len(jumps) > 1 else ""),
        {"began": s},
    )


def _optimizer_state(ev: Evidence, looked: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    if not ev.adaptive:
        looked["optimizer_state_why"] = "no adaptive optimizer state (exp_avg_sq)"
        return None
    worst = sorted(ev.adaptive, key=lambda a: -a[1])
    looked["adaptive_max"] = {"param": worst[0][0], "normalized_update": worst[0][1]}
    bad = [a for a in worst if a[1] >= COLLAPSE]
    if not bad:
        looked["optimizer_state_why"] = (
            f"every parameter's normalized update |m_hat|/sqrt(v_hat) is below {_f(COLLAPSE)}"
        )
        return None
    norms = [t for s, t, _ in ev.grads if s < ev.step and math.isfinite(t)]
    if len(norms) >= 4:
        med = _median(norms[:-1])
        if med > 0 and norms[-1] > LAYER_JUMP * med:
            looked["optimizer_state_why"] = "the total gradient norm jumped too"
            return None
    names = tuple(a[0] for a in bad[:TOP])
    desc = ", ".join(f"{a[0]} {_f(a[1])} (update/weight {_f(a[2])})" for a in bad[:TOP])
    return (
        "optimizer_state",
        f"the adaptive optimizer's update is large although the gradient is not: |m_hat|/sqrt(v_hat) "
        f"RMS {desc}, where a steady gradient gives at most ~1: the second-moment estimate had "
        "collapsed",
        {"params": names, "evidence": {"collapsed": {a[0]: a[1] for a in bad[:TOP]}}},
    )


def _layer(ev: Evidence, looked: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    jumps = _jumps(ev)
    total = sum(ev.group_sizes) or 1
    minority = [j for j in jumps if j[0] < len(ev.group_sizes) and ev.group_sizes[j[0]] * 2 < total]
    if minority and jumps and len(minority) == len(jumps):
        g, s, x, y = max(minority, key=_factor)
        modules = tuple(dict.fromkeys(ev.group_modules[g] if g < len(ev.group_modules) else []))
        others = [v for k, v in ev.updates.items() if k not in modules]
        ratio = ", ".join(f"{m} {_f(ev.updates[m])}" for m in modules if m in ev.updates)
        text = (
            f"{_names(modules)} (param group {g}): its learning rate went {_f(x)} -> {_f(y)} "
            f"({_f(_factor((g, s, x, y)))}x) at step {s}, so its updates jumped there"
        )
        if ratio:
            text += f"; last update/weight ratio {ratio}"
            if others:
                text += f" (other layers' median {_f(_median(others))})"
        return "layer", text, {"modules": modules, "began": s, "evidence": {"group": g}}
    measured = _ratio_jump(ev, looked)
    if measured is not None:
        return measured
    hist = [(s, layers) for s, _, layers in ev.grads if s <= ev.step]
    if len(hist) < LOOKBACK + 4:
        looked["layer_why"] = f"gradient norms of {len(hist)} steps kept (need {LOOKBACK + 4})"
        return None
    early = [h for h in hist if h[0] < ev.step - LOOKBACK]
    recent = [h for h in hist if ev.step - LOOKBACK <= h[0] < ev.step]
    names = list(hist[-1][1])
    began: dict[str, tuple[int, float, float]] = {}
    for name in names:
        base = _median([h[1].get(name, math.nan) for h in early])
        if not (base > 0 and math.isfinite(base)):
            continue
        for s, layers in recent:
            v = layers.get(name, math.nan)
            if v > LAYER_JUMP * base:
                began[name] = (s, base, v)
                break
    looked["layer_jumps"] = {k: {"step": s, "median": b, "norm": v} for k, (s, b, v) in began.items()}
    if not began:
        looked["layer_why"] = f"no layer's gradient norm rose {_f(LAYER_JUMP)}x before the spike"
        return None
    if len(began) > max(1, len(names) // 3):
        looked["layer_why"] = f"{len(began)} of {len(names)} layers jumped together: not one layer"
        return None
    first = min(began.items(), key=lambda kv: kv[1][0])
    name, (s, b, v) = first
    modules = tuple(sorted(began, key=lambda k: began[k][0]))
    return (
        "layer",
        f"{_names(modules)}: gradient norm {_f(b)} -> {_f(v)} ({_f(v / b)}x its median) from step {s}, "
        f"before the loss spiked at step {ev.step}",
        {"modules": modules, "began": s},
    )


def _ratio_jump(ev: Evidence, looked: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    """A layer whose update/weight ratio, measured on the detail steps, rose LAYER_JUMP times above its
    median of the earlier checks at the last check before the spike, while most layers' did not."""
    checks = [(s, r) for s, r in ev.ratios if s < ev.step]
    if len(checks) < 3:
        return None
    (last, now), earlier = checks[-1], checks[:-1]
    jumped: dict[str, tuple[float, float]] = {}
    for name, v in now.items():
        base = _median([r.get(name, math.nan) for _, r in earlier])
        if base > 0 and math.isfinite(base) and v > LAYER_JUMP * base:
            jumped[name] = (base, v)
    looked["ratio_jumps"] = {k: {"step": last, "median": b, "ratio": v} for k, (b, v) in jumped.items()}
    if not jumped or len(jumped) > max(1, len(now) // 3):
        return None
    prev = earlier[-1][0]
    modules = tuple(sorted(jumped, key=lambda k: -jumped[k][1] / jumped[k][0]))
    desc = ", ".join(f"{m or '<root>'} {_f(jumped[m][0])} -> {_f(jumped[m][1])}" for m in modules[:TOP])
    return (
        "layer",
        f"update/weight ratio {desc} (its median over the earlier checks -> the check at step {last}); "
        f"the jump began after the check at step {prev}, before the loss spiked at step {ev.step}",
        {"modules": modules, "began": last, "evidence": {"previous_check": prev}},
    )


# --------------------------------------------------------------------------- helpers


def _median(xs: Sequence[float]) -> float:
    s = sorted(x for x in xs if math.isfinite(x))
    if not s:
        return math.nan
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def _f(x: float) -> str:
    return f"{x:.4g}"


def _list(xs: Sequence[int]) -> str:
    return ", ".join(str(x) for x in xs[:TOP]) + (", ..." if len(xs) > TOP else "")


def _names(modules: Sequence[str]) -> str:
    return ", ".join(m or "<root>" for m in modules) or "<unnamed>"


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _plain(dataclasses.asdict(x))
    return x


__all__ = ["CAUSES", "Evidence", "SpikeReport", "SpikeRow", "attribute"]
