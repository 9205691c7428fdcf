"""What seed 000's debug flags promised to record: forward shapes, autocast, data loaders, validation, schedulers.

One instrument, ``StepDetails`` (name ``"step_details"``), started by any of ``debug_forward_pass``,
``debug_mixed_precision``, ``debug_data_loading``, ``debug_validation``, ``debug_lr_scheduling``; each
flag records its own info-level events (never a warning: a healthy run stays silent):

- ``forward_pass`` (debug_forward_pass), on the first step and every ``detail_every`` steps: the root
  call's input and output shapes, dtypes and devices, and the step's loss;
- ``mixed_precision`` (debug_mixed_precision), on the first step and whenever it changes: autocast on
  or off per device type and its dtype, the GradScaler's presence;
- ``data_loader`` (debug_data_loading), once per ``DataLoader`` iterated while watched: dataset size,
  batch size, number of workers, batches per epoch;
- ``validation`` (debug_validation), when a run of validation forwards (grad disabled or the model in
  eval mode) ends: how many forwards and samples, the process RSS after them, and the values
  ``mon.observe`` received meanwhile (the validation loss);
- ``lr_scheduler`` (debug_lr_scheduling), once per scheduler: its type and the learning rates before and
  after its first ``step()``.

Cost: metadata reads (shapes, flags) on schedule; a Python check per root forward; the DataLoader and
scheduler ``step`` wrappers are installed only while the instrument is.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .._step import SessionView
from .._trees import named_inputs, tensor_leaves
from ..events import RuleEvent

_FLAGS = (
    "debug_forward_pass",
    "debug_mixed_precision",
    "debug_data_loading",
    "debug_validation",
    "debug_lr_scheduling",
)
_MAX_TENSORS = 8  # tensors described per forward input/output


def _describe(obj: Any) -> list[dict[str, Any]]:
    return [
        {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device)}
        for t in tensor_leaves(obj)[:_MAX_TENSORS]
    ]


def _describe_inputs(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``inputs`` (as ``_describe``) and ``input_names`` of a call's arguments (``input[0]`` by
    position; keywords and a dict batch's keys by name: ``input_ids``, ``attention_mask``, ``labels``)."""
    named = named_inputs(args, kwargs)[:_MAX_TENSORS]
    return {"inputs": _describe([t for _, t in named]), "input_names": [n for n, _ in named]}


def _autocast_state() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dev in ("cpu", "cuda"):
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        on = torch.is_autocast_enabled(dev)
        out[dev] = {
            "enabled": on,
            "dtype": str(torch.get_autocast_dtype(dev)).removeprefix("torch.") if on else None,
        }
    return out


class StepDetails:
    """Records what seed 000's ``debug_*`` flags name (see the module docstring)."""

    name = "step_details"

    def __init__(self) -> None:
        self.flags: set[str] = set()
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []
        self._forward: dict[str, Any] | None = None
        self._amp: dict[str, Any] | None = None
        self._val = {"forwards": 0, "samples": 0}
        self._val_observed: dict[str, float] = {}
        self._loaders: weakref.WeakSet[Any] = weakref.WeakSet()
        self._schedulers: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- setup ---------------------------------------------------------------------------------------
    def install(self, mon: SessionView) -> None:
        self.mon = mon
        self.flags = {f for f in _FLAGS if getattr(mon.config, f, False)}
        if "debug_validation" in self.flags:
            self._handles.append(mon.model.register_forward_hook(self._root_forward))
        if "debug_data_loading" in self.flags:
            from torch.utils.data import DataLoader

            self._patch(DataLoader, "__iter__", self._loader_iter)
        if "debug_lr_scheduling" in self.flags:
            from torch.optim import lr_scheduler

            self._patch(lr_scheduler.LRScheduler, "step", self._scheduler_step)
            self._patch(lr_scheduler.ReduceLROnPlateau, "step", self._scheduler_step)

    def remove(self, mon: SessionView) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for owner, attr, orig in reversed(self._patched):
            setattr(owner, attr, orig)
        self._patched.clear()

    def _patch(self, owner: Any, attr: str, make: Any) -> None:
        orig = owner.__dict__[attr]
        setattr(owner, attr, make(orig))
        self._patched.append((owner, attr, orig))

    # -- forward, autocast ---------------------------------------------------------------------------
    def on_forward_start(self, mon: SessionView, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._end_validation(mon)
        if "debug_mixed_precision" in self.flags:
            autocast = _autocast_state()
            state: dict[str, Any] = {"autocast": autocast, "grad_scaler": mon.scaler is not None}
            if state != self._amp:
                self._amp = state
                on = [f"{d} {s['dtype']}" for d, s in autocast.items() if s["enabled"]]
                text = f"autocast {'on: ' + ', '.join(on) if on else 'off'}"
                text += ", GradScaler" if state["grad_scaler"] else ""
                mon.emit(RuleEvent("mixed_precision", mon.global_step, text, "info", (), state))
        if "debug_forward_pass" in self.flags and (mon.global_step == 0 or mon.due(mon.config.detail_every)):
            self._forward = _describe_inputs(args, kwargs)

    def on_forward_end(self, mon: SessionView, module: nn.Module, output: Any) -> None:
        if self._forward is not None and "outputs" not in self._forward:
            self._forward["outputs"] = _describe(output)

    def on_step_end(self, mon: SessionView, record: Any, values: dict[str, float]) -> None:
        fwd, self._forward = self._forward, None
        if fwd is not None:
            fwd["loss"] = values.get("loss")
            shapes = ", ".join(
                f"{n} {tuple(t['shape'])}" for n, t in zip(fwd["input_names"], fwd["inputs"][:3])
            )
            devices = sorted({t["device"] for t in fwd["inputs"] + fwd.get("outputs", [])})
            text = f"input {shapes} -> output {', '.join(str(tuple(t['shape'])) for t in fwd.get('outputs', [])[:2])}"
            text += f" on {', '.join(devices)}; loss {fwd['loss']}"
            mon.emit(RuleEvent("forward_pass", record.step, text, "info", (), fwd))

    # -- validation ----------------------------------------------------------------------------------
    def _root_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and module.training:
            return  # a training forward: the session's boundary, not validation
        self._val["forwards"] += 1
        first = next(iter(tensor_leaves(args)), None)
        self._val["samples"] += int(first.shape[0]) if first is not None and first.dim() > 0 else 1

    def on_observe(self, mon: SessionView, name: str, value: float) -> None:
        if self._val["forwards"]:
            self._val_observed[name] = value
            self._end_validation(mon)

    def on_exit(self, mon: SessionView) -> None:
        self._end_validation(mon)

    def _end_validation(self, mon: SessionView) -> None:
        if not self._val["forwards"]:
            return
        from ..memory.analysis import memory_sample

        observed = dict(self._val_observed)
        data: dict[str, Any] = {**self._val, "rss": memory_sample()["rss"], "observed": observed}
        self._val = {"forwards": 0, "samples": 0}
        self._val_observed = {}
        seen = ", ".join(f"{k} {v:.4g}" for k, v in observed.items())
        text = f"{data['forwards']} validation forwards, {data['samples']} samples" + (
            f"; {seen}" if seen else ""
        )
        mon.emit(RuleEvent("validation", mon.global_step, text, "info", (), data))

    # -- data loaders, schedulers ---------------------------------------------------------------------
    def _loader_iter(self, orig: Any) -> Any:
        inst = self

        def __iter__(loader: Any) -> Any:
            if loader not in inst._loaders:
                inst._loaders.add(loader)
                try:
                    size: int | None = len(loader.dataset)
                except TypeError:  # an iterable dataset
                    size = None
                try:
                    batches: int | None = len(loader)
                except TypeError:
                    batches = None
                data = {
                    "dataset": type(loader.dataset).__name__,
                    "dataset_size": size,
                    "batch_size": loader.batch_size,
                    "num_workers": loader.num_workers,
                    "batches_per_epoch": batches,
                    "drop_last": loader.drop_last,
                }
                text = (
                    f"{data['dataset']} of {size} samples, batch size {loader.batch_size}, "
                    f"{loader.num_workers} workers, {batches} batches per epoch"
                )
                inst.mon.emit(RuleEvent("data_loader", inst.mon.global_step, text, "info", (), data))
            return orig(loader)

        return __iter__

    def _scheduler_step(self, orig: Any) -> Any:
        inst = self

        def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
            if sched in inst._schedulers:
                return orig(sched, *args, **kwargs)
            inst._schedulers.add(sched)
            before = [float(g["lr"]) for g in sched.optimizer.param_groups]
            out = orig(sched, *args, **kwargs)
            after = [float(g["lr"]) for g in sched.optimizer.param_groups]
            data = {"type": type(sched).__name__, "lr_before": before, "lr_after": after}
            inst.mon.emit(
                RuleEvent(
                    "lr_scheduler",
                    inst.mon.global_step,
                    f"{data['type']}: lr {before} -> {after} at its first step",
                    "info",
                    (),
                    data,
                )
            )
            return out

        return step


__all__ = ["StepDetails"]
