"""The session applies the sentinel's verdicts: anomalies recorded, the policy, skipped steps counted and said.

The sentinel (:mod:`torchdebug.nonfinite.sentinel`) decides what a step is (:class:`~torchdebug._step.Verdict`:
ok, skip, anomaly) and never acts on the session; here the session records an anomaly (its list,
counters and the run store), applies ``config.policy`` (``raise`` raises :class:`NonFiniteError`,
``skip`` drops the gradients of the update about to run, ``warn`` warns) and keeps the skipped-step
bookkeeping (a run of skipped steps is said once when it starts and once when it ends). It also
applies the verdict on weights already non-finite as the session starts or as ``load_state_dict``
loads them (``check_weights``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from .._errors import NonFiniteError, TorchDebugWarning
from .._frames import warn_at_user
from .._step import SCALER_SKIP, SessionView, Update, Verdict
from .._tensors import unwrap_optimizer
from ..events import Anomaly, RuleEvent
from ..nonfinite.hyperparams import model_of
from ..nonfinite.tied import label_tied, tied_labels

_MAX_ANOMALIES = 1000


class Verdicts:
    """Applies verdicts to one session (``mon.verdicts``); see the module docstring."""

    def __init__(self, mon: SessionView) -> None:
        self.mon = mon
        self.skip_run: list[int] | None = None  # policy="skip": [first step, count] of the current run
        # sync="async", while a step is judged one step later: its update already ran or was skipped on
        # the device, so there are no gradients to drop
        self.update_held = False
        self.skipped_on_device = False  # and the device skipped it (the flag was up): said by "warn"

    def apply(self, verdict: Verdict) -> None:
        """Act on a verdict (may raise :class:`NonFiniteError` under ``policy="raise"``)."""
        if verdict.kind == "ok":
            return
        if verdict.kind == "skip":
            self.mark_skipped(verdict.reason, scaler=verdict.by_scaler)
            return
        mon = self.mon
        anomaly = verdict.anomaly
        assert anomaly is not None  # an "anomaly" verdict carries it
        policy = mon.config.policy
        if not verdict.fresh:  # recorded earlier in the step: only the update about to run is new
            if policy == "skip" and verdict.opt is not None:
                self.drop_grads(verdict.opt)
            return
        anomaly = self.record(anomaly)
        if policy == "raise":
            mon.flush_store()
            raise NonFiniteError(anomaly)
        if verdict.late:  # the update ran already: nothing to skip
            mon.warn_once("anomaly", f"torchdebug: {anomaly.summary()}")
        elif policy == "skip":
            if verdict.opt is not None:
                self.drop_grads(verdict.opt)
            elif verdict.by_scaler:
                self.mark_skipped(f"skipped by the GradScaler: {anomaly.summary()}", severity="info")
            else:
                mon.warn_once(
                    "skip-needs-opt", "policy='skip' needs the optimizer's step to skip it; recorded only"
                )
        else:
            how = "training goes on"
            if self.update_held and self.skipped_on_device:
                how += (
                    "; under sync='async' the step's update was skipped on the device, where the "
                    "blocking read applies it"
                )
            mon.warn_once("anomaly", f"torchdebug: {anomaly.summary()} (policy='warn': {how})")

    def record(self, anomaly: Anomaly) -> Anomaly:
        """The step's anomaly: kept (the first 1000 of a session), counted and stored; returns it as kept
        (tied weights named by all their names, ``nonfinite/tied.py``: a walk of the model, rare path)."""
        mon = self.mon
        anomaly = label_tied(anomaly, tied_labels(mon.model))
        mon.state.step_anomaly = anomaly
        mon.counters["anomaly_steps"] += 1
        if len(mon.anomalies) < _MAX_ANOMALIES:
            mon.anomalies.append(anomaly)
        if mon.writer is not None:
            with contextlib.suppress(Exception):
                mon.writer.log_anomaly(anomaly.step, anomaly.to_dict())
        return anomaly

    def check_weights(self, judge: Callable[[str], Verdict], close: Callable[..., None]) -> None:
        """Session start: weights already non-finite (a NaN checkpoint) are said now, before the model is
        used (``judge``: the sentinel's ``check_at_start``), and when a ``load_state_dict`` into the model
        puts such weights in while the session runs (a post-hook, removed on exit). A ``NonFiniteError``
        at start (``policy="raise"``) ends the session first (``close``: its ``__exit__``)."""
        mon = self.mon
        with contextlib.suppress(Exception):  # an odd root module: the start's check alone
            hook = lambda module, keys: self.apply(judge("when load_state_dict put it in the model"))  # noqa: E731
            mon.installs.hook(mon.model.register_load_state_dict_post_hook(hook))
        for opt in mon.optimizers:  # a poisoned optimizer checkpoint loaded during the session
            with contextlib.suppress(Exception):
                on_opt = lambda o: self.apply(judge("when load_state_dict put it in the optimizer"))  # noqa: E731
                mon.installs.hook(unwrap_optimizer(opt).register_load_state_dict_post_hook(on_opt))
        try:
            self.apply(judge("when the session started"))
        except NonFiniteError as err:
            close(type(err), err, err.__traceback__)  # everything installed comes off
            raise

    def drop_grads(self, opt: Any) -> None:
        """``policy="skip"``: the update about to run does nothing (parameters and state unchanged)."""
        if not self.update_held:  # sync="async": the device skipped the update already
            for g in unwrap_optimizer(opt).param_groups:
                for p in g["params"]:
                    p.grad = None  # the optimizer skips parameters without grads: no update, no state change
        self.mon.state.skipped_updates.append(unwrap_optimizer(opt))
        anomaly = self.mon.state.step_anomaly
        self.mark_skipped(f"skipped by policy: {anomaly.summary() if anomaly else ''}", severity="info")

    # -- skipped steps ----------------------------------------------------------------------------------
    def mark_skipped(self, reason: str, scaler: bool = False, severity: str = "warning") -> None:
        mon = self.mon
        mon.state.skip_reason = reason or "skipped"
        mon.counters["skipped_steps"] += 1
        if not scaler:
            mon.emit(RuleEvent("skipped_step", mon.global_step, reason, severity))

    def note_scaler_skip(self) -> None:
        """Step end: a step the GradScaler skipped is a skipped step (never an anomaly by itself)."""
        st = self.mon.state
        if st.update is Update.SCALER_SKIPPED and not st.skipped:
            self.mark_skipped(SCALER_SKIP, scaler=True)

    def _unchanged(self, st: Any) -> str:
        """What a skipped step left as it was: every update, or (several optimizers) the dropped ones only."""
        opts = self.mon.optimizers
        dropped = [o for o in opts if any(o is d for d in st.skipped_updates)]
        if len(opts) < 2 or not dropped or len(dropped) == len(opts):
            return "the parameters and the optimizer state are unchanged"
        names = [model_of(self.mon.roots, o) or f"opt{opts.index(o)}" for o in dropped]
        return (
            f"the parameters and the optimizer state of {', '.join(names)} are unchanged; the other "
            "optimizers' updates ran"
        )

    def say_skips(self, at_exit: bool = False) -> None:
        """policy="skip": say a run of skipped steps once when it starts and once, with its count, when it ends."""
        mon = self.mon
        st = mon.state
        run = self.skip_run
        if not at_exit and st.skipped and st.skip_reason.startswith("skipped by policy"):
            if run is not None:
                run[1] += 1
                return
            self.skip_run = [mon.global_step, 1]
            warn_at_user(
                TorchDebugWarning(
                    f"torchdebug: step {mon.global_step} {st.skip_reason}; {self._unchanged(st)} "
                    "(policy='skip'). Skipped steps in a row are counted and said once when they stop"
                )
            )
            return
        if run is None:
            return
        self.skip_run = None
        first, n = run
        span = f"step {first}" if n == 1 else f"steps {first}-{first + n - 1}"
        after = "when the run ended" if at_exit else f"training resumed at step {mon.global_step}"
        message = f"{n} step{'s' if n != 1 else ''} skipped by policy='skip' ({span}); {after}"
        mon.emit(
            RuleEvent(
                "skipped_steps", mon.global_step, message, "info", evidence={"first": first, "count": n}
            )
        )
        warn_at_user(TorchDebugWarning(f"torchdebug: {message}"))
