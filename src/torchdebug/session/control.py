"""What a watch session offers besides the step protocol: live control (the dashboard's level switch,
``reconfigure``, the seed-era runtime switches, ``clear``), the OOM retry, how it reads in a notebook,
and building its instruments. A base class of :class:`~torchdebug.session.monitor.Monitor`; the
attributes it uses are the session's (declared below for the type checker)."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from torch import nn

from .._config import DebugConfig, DebugLevel
from .._instruments import REGISTRY, spec
from .._step import Instrument, StepPhase, StepState
from ..events import Anomaly, RuleEvent, StepRecord, rule_counts, training_summary
from ..nonfinite.sentinel import Sentinel
from .deferred import DeferredReads
from .driver import PlainLoopDriver
from .protocol import Session
from .wrappers import _compiled_orig


class Controls:
    """Live control, the notebook view and the instruments' construction of a session (see above)."""

    # the session's attributes these methods use (set in Monitor.__init__)
    config: DebugConfig
    model: Any
    optimizer: Any
    params: list[Any]
    param_names: list[str]
    names: dict[Any, str]
    roots: dict[str, Any] | None
    uses_cuda: bool
    _called: Any
    _param_ids: set[int]
    writer: Any
    run_dir: Path | None
    global_step: int
    instruments: list[Instrument]
    anomalies: list[Anomaly]
    events: deque[RuleEvent]
    records: deque[StepRecord]
    counters: dict[str, int]
    level_overrides: list[str]
    state: StepState
    sentinel: Sentinel
    _enabled: frozenset[str]
    _async: DeferredReads | None
    _plain: PlainLoopDriver
    _entered: bool
    _closed: bool
    _segment_start: int
    _pending_level: DebugLevel | None
    _pending_changes: dict[str, Any]

    @property
    def reads_late(self) -> bool:
        """The step's numbers are read one step later (``sync="async"``, or "auto" where it fits)."""
        return self._async is not None

    def emit(self, event: RuleEvent) -> None:
        raise NotImplementedError

    def _call(self, inst: Any, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def _disable(self, inst: Any, exc: BaseException) -> None:
        raise NotImplementedError

    # -- the user's calls -------------------------------------------------------------------------
    def run_step(self, step_fn: Callable[[Any], Any], batch: Any) -> Any:
        """Run ``step_fn(batch)`` (forward + loss + backward; returns the loss) with the OOM policy.

        With ``on_oom="retry_half"`` an out-of-memory error re-runs the step on halves of the batch
        with gradients scaled so they equal the full-batch gradients (gradient accumulation), and
        records an ``oom_retry`` event. Call ``optimizer.step()`` and ``mon.step()`` after it.
        """
        if not callable(step_fn):
            raise TypeError(
                f"run_step(step_fn, batch): step_fn must be callable, got {type(step_fn).__name__}"
            )
        from ..memory.recovery import run_step_with_oom_retry

        def new_micro_step(_piece: Any) -> None:
            self.state.phase = StepPhase.START  # the failed attempt never reached its backward

        def record(retry: Any) -> None:
            evidence = retry.to_dict() if hasattr(retry, "to_dict") else {}
            self.emit(RuleEvent("oom_retry", self.global_step, str(retry), "warning", evidence=evidence))

        return run_step_with_oom_retry(
            step_fn,
            batch,
            on_oom=self.config.on_oom,
            optimizer=self.optimizer,
            params=self.params,
            before_attempt=new_micro_step,
            on_retry=record,
        )

    # -- live control (dashboard) ----------------------------------------------------------------
    def set_level(self, level: str | DebugLevel) -> DebugLevel:
        """Switch the debug level of the live session; instruments follow at the end of the next step.

        Safe to call from another thread (the dashboard's): the switch itself happens on the training
        thread inside ``mon.step()``. Raises ``ValueError`` for an unknown level, listing the allowed.
        """
        lv = DebugLevel(level) if not isinstance(level, DebugLevel) else level
        self._pending_level = lv
        self.level_overrides.append(lv.value)
        if self.writer is not None:
            self.writer.log_event(
                self.global_step,
                "level_change",
                "info",
                f"debug level set to {lv.value}",
                {"level": lv.value},
            )
        return lv

    def reconfigure(self, **changes: Any) -> DebugConfig:
        """Change options of the live session; instruments follow at the end of the next step.

        Validated now (``ConfigError`` naming the option), applied on the training thread inside
        ``mon.step()`` like ``set_level``, and recorded as a ``config_change`` event. Returns the
        config the session will run with. Runtime switches of the seed-era names:
        ``enable_debugging`` / ``disable_debugging`` / ``get_debugging_status``.
        """
        new = self.config.replace(**{**self._pending_changes, **changes})
        self._pending_changes.update(changes)
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.log_event(
                    self.global_step,
                    "config_change",
                    "info",
                    "options changed: " + ", ".join(f"{k}={v!r}" for k, v in sorted(changes.items())),
                    {"changes": {k: getattr(v, "value", v) for k, v in changes.items()}},
                )
        return new

    def enable_debugging(self, options: Any = None) -> dict[str, Any]:
        """Seed 000's runtime switch; see ``torchdebug.compat.enable_debugging``."""
        from .runtime import enable_debugging

        return enable_debugging(self, options)

    def disable_debugging(self, options: Any = None) -> dict[str, Any]:
        """Seed 000's runtime switch; see ``torchdebug.compat.disable_debugging``."""
        from .runtime import disable_debugging

        return disable_debugging(self, options)

    def get_debugging_status(self) -> dict[str, Any]:
        """Seed 000's status; see ``torchdebug.compat.get_debugging_status``."""
        from .runtime import get_debugging_status

        return get_debugging_status(self)

    def clear(self) -> None:
        """Start a new history segment (the dashboard's "clear"); nothing stored is deleted."""
        self.events.clear()
        self.records.clear()
        self.counters = dict.fromkeys(self.counters, 0)
        for inst in self.instruments:
            c = getattr(inst, "counters", None)
            if isinstance(c, dict):
                for k in c:
                    c[k] = 0
        if self.writer is not None and hasattr(self.writer, "start_segment"):
            self.writer.start_segment(f"cleared at step {self.global_step}", step=self.global_step)
        self._segment_start = self.global_step

    def training_summary(self) -> dict[str, Any]:
        """The seed-era training summary (counts and rates since the last ``clear()``).

        ``anomaly_steps`` counts the steps ``events.is_anomalous`` calls anomalous (a NaN/Inf, or a
        warning-level event), as every seed-era summary does; the rule counts are ``rule_counts``."""
        total = max(self.global_step - self._segment_start, 0)
        explosions, vanishing, loss = rule_counts(e.kind for e in self.events)
        return training_summary(total, self.counters["anomalous_steps"], explosions, vanishing, loss)

    # -- how a session reads in a notebook or a debugger -----------------------------------------
    @property
    def status(self) -> str:
        """``"not started"`` (before ``with``), ``"active"``, or ``"closed"`` (after ``with``)."""
        if not self._entered:
            return "not started"
        return "closed" if self._closed else "active"

    def _findings(self) -> tuple[int, list[RuleEvent]]:
        """(anomalies so far, the warning/error rule events so far)."""
        return len(self.anomalies), [e for e in self.events if e.severity != "info"]

    def __repr__(self) -> str:
        n, warned = self._findings()
        where = f", run {self.run_dir}" if self.run_dir is not None else ""
        return (
            f"<Monitor {self.status}: step {self.global_step}, {n} anomal{'y' if n == 1 else 'ies'}, "
            f"{len(warned)} warning{'' if len(warned) == 1 else 's'}{where}>"
        )

    def verdict(self) -> dict[str, Any]:
        """The session's verdict, ranked as ``torchdebug show`` ranks a run's (the same function,
        :func:`torchdebug.views.verdict.judge`, over this session's anomalies and rule events).

        Returns:
            ``judge``'s dict: ``"text"`` (one sentence: ``"running: step 12, no anomalies so far"``,
            ``"finished: 30 steps, no anomalies"``, ``"failed at step 6: nan born in ..."``),
            ``"level"`` (ok | running | warning | error) and ``"findings"`` ranked.

        Example:
            >>> import torch, torchdebug as td
            >>> model = torch.nn.Linear(2, 1)
            >>> with td.watch(model, run=False, announce=False) as mon:
            ...     for _ in range(2):
            ...         model(torch.ones(1, 2)).sum().backward()
            ...         _ = mon.step()
            >>> mon.verdict()["text"]
            'finished: 2 steps, no anomalies'
        """
        from ..views.verdict import judge

        status = "running" if not self._closed else getattr(self, "_end_status", None) or "finished"
        anomalies = [{**a.to_dict(), "step": a.step} for a in self.anomalies]
        events = [
            {
                "kind": e.kind,
                "severity": e.severity,
                "message": e.message,
                "step": e.step,
                "data": {"modules": list(e.modules), "evidence": dict(e.evidence)},
            }
            for e in self.events
        ]
        last = self.global_step - 1 if self.global_step else None
        return judge(status, steps=self.global_step, last_step=last, anomalies=anomalies, events=events)

    def _repr_html_(self) -> str:
        """The session in a notebook: the verdict first (as ``torchdebug show`` says it), then status,
        step, the first anomaly, the warnings so far, the run folder."""
        from ..events import html_table

        n, warned = self._findings()
        said = self.verdict()
        rows: list[tuple[str, Any]] = [
            ("verdict", said["text"]),
            ("status", self.status),
            ("step", self.global_step),
            ("anomalies", n if n == 0 else f"{n}, first: {self.anomalies[0].summary()}"),
            (
                "warnings",
                len(warned)
                if not warned
                else f"{len(warned)}: {', '.join(sorted({e.kind for e in warned}))}",
            ),
            ("run folder", self.run_dir if self.run_dir is not None else "none"),
        ]
        level = said["level"]
        colour = "#c0392b" if level == "error" else ("#b9770e" if level == "warning" else "#1e8449")
        title = f"torchdebug watch of {type(self.model).__name__}"
        return html_table(title, colour, rows, "torchdebug-monitor")

    # -- instruments -----------------------------------------------------------------------------
    def _wanted(self) -> set[str]:
        # an instrument recorded within another that runs (GradientHealth's activations and details:
        # one set of hooks) is not built on its own
        return {n for n in self._enabled if spec(n).within not in self._enabled}

    def _build_instrument(self, name: str) -> None:
        entry = spec(name)
        if not entry.built:
            return  # the session holds it from its start (the sentinel)
        try:
            cls = entry.load()
        except (ImportError, AttributeError):
            return  # not available in this build, or its extra is not installed
        if any(type(i) is cls for i in self.instruments):
            return
        try:
            inst = cls()
        except Exception as exc:
            self._disable(cls, exc)
            return
        self.instruments.append(inst)
        self._call(inst, "install")

    def _regroup(self, roots: dict[str, nn.Module]) -> None:
        """The session watches these models now (as one ModuleDict, each by name): names, parameters,
        root hooks and instruments again. Only before its first forward (``watch_also``). ``roots``:
        the modules the loop calls; a ``torch.compile`` wrapper among them is named and watched as the
        module it compiles (no ``_orig_mod.``), its root hooks stay on the wrapper that is called."""
        container = nn.ModuleDict({n: _compiled_orig(m) or m for n, m in roots.items()})
        self.roots = roots
        self.model = self._called = container
        self.names = {m: n for n, m in container.named_modules()}
        named = [(n, p) for n, p in container.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._param_ids = {id(p) for p in container.parameters()}
        self.uses_cuda = any(p.is_cuda for p in self.params)
        self.sentinel.reindex(self.params, self.param_names)
        self._plain.model = self._plain.root = container
        self._plain.hook_roots(list(roots.values()))
        self._apply_level(self.config.level)  # the instruments again, over every model

    def _apply_level(self, level: DebugLevel, **changes: Any) -> None:
        """Switch the instruments to a new level and options (on the training thread, between steps)."""
        self.config = self.config.replace(level=level, **changes)
        self._enabled = self.config.instruments()
        self.sentinel.config = self.config
        self.sentinel.active = "nonfinite" in self._enabled
        sync, reads = self.config.sync, self._async
        # switched live ("auto" keeps what the session chose as it started; "async" replaces its choice)
        if (sync == "blocking" and reads is not None) or (sync == "async" and (reads is None or reads.auto)):
            if reads is not None:
                reads.finish()  # the steps in flight are judged now (may raise)
            self._async = DeferredReads(cast(Session, self)) if sync == "async" else None
        ours = {entry.cls for entry in REGISTRY if entry.built}
        for inst in [i for i in self.instruments if type(i).__name__ in ours]:
            self.instruments.remove(inst)  # rebuilt below: their depth follows the level
            with contextlib.suppress(Exception):
                if hasattr(inst, "remove"):
                    inst.remove(self)
        for name in sorted(self._wanted()):
            self._build_instrument(name)
        self._plain.guard_module_hooks()
