"""The instrument registry: each instrument declared once (name, class, area, level, switches, cost).

The config (``_config.py``: which instruments a mode, a level and the switches run, and the table in
``DebugConfig``'s docstring), the session (which class it builds for a name) and the generated
configuration reference read this one table; ``tests/test_instrument_registry.py`` checks that every
entry imports and that the config and the session cannot disagree about a name.

Levels and modes are spelled as their config strings (``"advanced"``, ``"full_debug"``) so this module
imports nothing of the package and ``_config.py`` can build its enums' tables from it.

Example:
    >>> spec("flops").level, spec("flops").modes
    ('advanced', ('performance_profiling', 'full_debug'))
    >>> spec("flops").load().__name__
    'FlopsInstrument'
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["REGISTRY", "Area", "InstrumentSpec", "spec"]

Area = Literal["nonfinite", "health", "memory", "perf", "session"]

#: the levels in order, as ``DebugLevel``'s values (a spec's ``level`` and every deeper one run it)
LEVELS = ("basic", "intermediate", "advanced", "expert")


@dataclass(frozen=True)
class InstrumentSpec:
    """One instrument as the config, the session and the docs know it.

    Attributes:
        name: the name ``config.instruments()`` gives and the instrument's ``name`` attribute.
        module, cls: where its class lives (imported only when the session builds it).
        area: the capability folder it belongs to; ``log_memory=False`` silences the ``memory`` area
            and ``log_performance=False`` the ``perf`` area.
        level: the lowest level at which its modes run it; None: only a switch starts it.
        modes: the modes that run it from ``level`` on.
        always_in: modes that run it at every level (``profiling`` exists to run the profiler).
        switches: config options that start it whatever the mode and level.
        brings: instruments that run whenever this one does (a gradient instrument brings the NaN/Inf
            sentinel: a NaN/Inf gradient never passes silently while gradients are watched).
        within: an instrument that records this one's numbers itself when both would run (one set of
            hooks): the session then builds only that one.
        built: the session builds it from this table with no arguments; False for the sentinel, which
            the session holds from its start and builds from the parameters.
        cost: what it costs, in a few words (the class docstring has the detail).
        records: what it records, in a few words.
    """

    name: str
    module: str
    cls: str
    area: Area
    level: str | None
    modes: tuple[str, ...]
    switches: tuple[str, ...]
    cost: str
    records: str
    always_in: tuple[str, ...] = ()
    brings: tuple[str, ...] = ()
    within: str | None = None
    built: bool = True

    def load(self) -> type[Any]:
        """The instrument's class (imports its module).

        Raises:
            ImportError: its module or an extra it needs is not installed.
            AttributeError: the module has no such class.
        """
        cls: type[Any] = getattr(importlib.import_module(self.module), self.cls)
        return cls


_DETAIL_FLAGS = (  # seed 000's flags that also record their own details as info events
    "debug_forward_pass",
    "debug_mixed_precision",
    "debug_data_loading",
    "debug_validation",
    "debug_lr_scheduling",
)

# In the order reports and the mode x level table list them.
REGISTRY: tuple[InstrumentSpec, ...] = (
    InstrumentSpec(
        "nonfinite",
        "torchdebug.nonfinite.sentinel",
        "Sentinel",
        "nonfinite",
        "basic",
        (
            "anomaly_detection",
            "gradient_checking",
            "memory_profiling",
            "performance_profiling",
            "profiling",
            "full_debug",
        ),
        ("enable_anomaly_detection", "enable_autograd_anomaly"),
        cost="one device reduction of the gradients and one host read a step; the replay only on a NaN/Inf",
        records="where the first NaN/Inf was born (module, op, line), the step's verdict",
        built=False,
    ),
    InstrumentSpec(
        "gradients",
        "torchdebug.health.instrument",
        "GradientHealth",
        "health",
        "basic",
        ("gradient_checking", "full_debug"),
        (
            "enable_gradient_checking",
            "debug_gradient_norms",
            "debug_backward_pass",
            "debug_mixed_precision",
            "log_gradients",
            # the training-health rules also keep the LR timeline (lr_change, lr_zero), the state of
            # watch(early_stopping=...) and mon.observe() values (validation)
            "debug_lr_scheduling",
            "debug_early_stopping",
            "debug_validation",
        ),
        cost="host rules on the step's read numbers; its details on detail steps only",
        records="total gradient norm every step, the explosion, spike, plateau, divergence, LR and AMP rules",
        brings=("nonfinite",),
    ),
    InstrumentSpec(
        "gradient_details",
        "torchdebug.health.standalone",
        "WeightInstrument",
        "health",
        "intermediate",
        ("gradient_checking", "full_debug"),
        ("log_weights",),
        cost="on detail steps: a copy of the weights before the update and fused norms",
        records="per-parameter gradient norm, weight norm and update/weight ratio every detail_every steps",
        brings=("nonfinite",),
        within="gradients",
    ),
    InstrumentSpec(
        "memory",
        "torchdebug.memory.instrument",
        "MemoryInstrument",
        "memory",
        "basic",
        ("memory_profiling", "full_debug"),
        ("enable_memory_profiling", "debug_memory_usage"),
        cost="about 15 µs a due step; a census and a capture only after a leak suspicion",
        records="host and CUDA memory every memory_every steps, the leak test, OOM forensics",
    ),
    InstrumentSpec(
        "module_memory",
        "torchdebug.memory.instrument",
        "ModuleMemoryInstrument",
        "memory",
        "advanced",
        ("memory_profiling", "full_debug"),
        ("per_module_memory",),
        cost="a Python hook per module call and per saved tensor on the first 3 due steps only",
        records="per-module activation, parameter, gradient and state bytes",
    ),
    InstrumentSpec(
        "timing",
        "torchdebug.perf.timing",
        "TimingInstrument",
        "perf",
        "basic",
        ("performance_profiling", "profiling", "full_debug"),
        ("enable_performance_profiling", "debug_data_loading"),
        cost="a few clock reads a step (CUDA events on CUDA: no sync)",
        records="the step's data / forward / backward / optimizer / other time, throughput, slowdowns",
    ),
    InstrumentSpec(
        "flops",
        "torchdebug.perf.flops",
        "FlopsInstrument",
        "perf",
        "advanced",
        ("performance_profiling", "full_debug"),
        ("flops",),
        cost="one step counted under FlopCounterMode (a few x that step), once",
        records="FLOPs per module of one step, the ops not counted, MFU",
    ),
    InstrumentSpec(
        "module_time",
        "torchdebug.perf.timing",
        "ModuleTimeInstrument",
        "perf",
        "expert",
        ("performance_profiling", "profiling", "full_debug"),
        ("per_module_time",),
        cost="a hook per module call on steps 1..3 only",
        records="per-module forward and backward time, ranked",
    ),
    InstrumentSpec(
        "activations",
        "torchdebug.health.standalone",
        "ActivationInstrument",
        "health",
        "advanced",
        ("full_debug",),
        ("activation_stats", "log_activations", "debug_forward_pass"),
        cost="a forward hook per leaf module; a few reductions per module on detail steps",
        records="activation mean, std, zero, dead and saturated fractions per module, the dead-unit rule",
        within="gradients",
    ),
    InstrumentSpec(
        "profiler",
        "torchdebug.perf.profiler",
        "ProfilerInstrument",
        "perf",
        "expert",
        ("profiling", "full_debug"),
        ("enable_autograd_profiler", "enable_tensorboard_profiler"),
        cost="the profiled steps (3 after 2) run 1.2-3x slower, once",
        records="a torch.profiler trace (Perfetto) and the top ops and modules by self time",
        always_in=("profiling",),
    ),
    InstrumentSpec(
        "device_placement",
        "torchdebug.session.placement",
        "DevicePlacementInstrument",
        "session",
        None,
        (),
        ("debug_device_placement",),
        cost="metadata only, once per session",
        records="the devices of parameters, buffers and the first inputs; a mix is a warning",
    ),
    InstrumentSpec(
        "step_details",
        "torchdebug.health.details",
        "StepDetails",
        "health",
        None,
        (),
        _DETAIL_FLAGS,
        cost="metadata on the first step and every detail_every steps",
        records="forward shapes and devices, autocast, DataLoader sizes, validation runs, schedulers",
    ),
)

_BY_NAME = {s.name: s for s in REGISTRY}


def spec(name: str) -> InstrumentSpec:
    """The registry's entry for an instrument name.

    Raises:
        KeyError: not an instrument (the message lists the known names).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no instrument {name!r}; known: {', '.join(_BY_NAME)}") from None
