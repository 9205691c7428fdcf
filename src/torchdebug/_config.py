"""DebugConfig, DebugMode, DebugLevel: every option, validated at the boundary, from kwargs/dict/file/env.

Precedence when options come from several places (``DebugConfig.load``):

    defaults  <  file (YAML / TOML / JSON)  <  environment (TORCHDEBUG_*)  <  keyword arguments
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from ._errors import ConfigError
from ._instruments import LEVELS, REGISTRY

__all__ = [
    "ENV_PREFIX",
    "INSTRUMENTS",
    "INSTRUMENTS_BY_LEVEL",
    "INSTRUMENTS_BY_MODE",
    "INSTRUMENTS_BY_SWITCH",
    "DebugConfig",
    "DebugLevel",
    "DebugMode",
    "coerce_config",
]

ENV_PREFIX = "TORCHDEBUG_"
# TORCHDEBUG_* variables that are not options: TORCHDEBUG_CONFIG names a config file.
_RESERVED_ENV = frozenset({"TORCHDEBUG_CONFIG"})

#: the trackers ``report_to`` may name (besides "all" and "none"); ``torchdebug.sinks`` builds them
REPORT_TO_NAMES = ("tensorboard", "wandb", "mlflow", "logging")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})


def _normalise(value: str) -> str:
    """``" Full-Debug "`` -> ``"full_debug"``: the spelling enum values and option strings use."""
    return value.strip().lower().replace("-", "_")


_E = TypeVar("_E", bound=enum.Enum)


def _member(cls: type[_E], value: object, aliases: Mapping[str, str] | None = None) -> _E | None:
    """The member whose value matches a string case-insensitively (``-`` as ``_``), after aliases."""
    if not isinstance(value, str):
        return None
    key = _normalise(value)
    key = (aliases or {}).get(key, key)
    return next((m for m in cls if m.value == key), None)


class DebugMode(str, enum.Enum):
    """Which areas are instrumented; see ``DebugConfig`` for the table. Strings match case-insensitively."""

    NONE = "none"
    ANOMALY_DETECTION = "anomaly_detection"
    GRADIENT_CHECKING = "gradient_checking"
    MEMORY_PROFILING = "memory_profiling"
    PERFORMANCE_PROFILING = "performance_profiling"
    PROFILING = "profiling"
    FULL_DEBUG = "full_debug"

    @classmethod
    def _missing_(cls, value: object) -> DebugMode | None:
        return _member(cls, value)

    def __str__(self) -> str:
        return self.value


class DebugLevel(str, enum.Enum):
    """How deep within each area; ordered ``BASIC < INTERMEDIATE < ADVANCED < EXPERT``.

    ``"extreme"`` (the seed-era name of the deepest level) is accepted as ``EXPERT``.
    Comparisons order by depth, not alphabetically; they also accept level strings.
    """

    BASIC = "basic"
    INTERMEDIATE = "intermediate"
    ADVANCED = "advanced"
    EXPERT = "expert"

    @classmethod
    def _missing_(cls, value: object) -> DebugLevel | None:
        return _member(cls, value, aliases={"extreme": "expert"})

    def __str__(self) -> str:
        return self.value

    @property
    def depth(self) -> int:
        """0 for BASIC up to 3 for EXPERT."""
        return _LEVEL_ORDER.index(self)

    def _compare(self, other: object) -> int | None:
        """-1/0/1 by depth against a level or level string; None for anything else."""
        if not isinstance(other, (DebugLevel, str)):
            return None
        d = DebugLevel(other).depth
        return (self.depth > d) - (self.depth < d)

    # str's own comparisons would order levels alphabetically ("advanced" < "basic")
    def __lt__(self, other: object) -> bool:
        c = self._compare(other)
        return NotImplemented if c is None else c < 0

    def __le__(self, other: object) -> bool:
        c = self._compare(other)
        return NotImplemented if c is None else c <= 0

    def __gt__(self, other: object) -> bool:
        c = self._compare(other)
        return NotImplemented if c is None else c > 0

    def __ge__(self, other: object) -> bool:
        c = self._compare(other)
        return NotImplemented if c is None else c >= 0


_LEVEL_ORDER = tuple(DebugLevel(v) for v in LEVELS)  # the registry's order: basic .. expert

# The config's view of the instrument registry (``_instruments.REGISTRY``, the one declaration of
# each instrument): nothing here names an instrument that the registry does not.

# Instrument names a mode runs, in the order reports list them.
INSTRUMENTS: tuple[str, ...] = tuple(s.name for s in REGISTRY if s.modes)

# Areas each mode switches on (at EXPERT depth; the level then trims them).
INSTRUMENTS_BY_MODE: dict[DebugMode, frozenset[str]] = {
    mode: frozenset(s.name for s in REGISTRY if mode.value in s.modes) for mode in DebugMode
}

# Instruments each level allows (cumulative: each level holds the ones before it).
INSTRUMENTS_BY_LEVEL: dict[DebugLevel, frozenset[str]] = {
    level: frozenset(
        s.name for s in REGISTRY if s.level is not None and LEVELS.index(s.level) <= LEVELS.index(level.value)
    )
    for level in _LEVEL_ORDER
}

# Instruments a mode keeps at every level: PROFILING exists to run the profiler.
_MODE_CORE: dict[DebugMode, frozenset[str]] = {
    mode: frozenset(s.name for s in REGISTRY if mode.value in s.always_in) for mode in DebugMode
}

# Seed-era schedule names and the engine schedule each one is (setting either sets both).
SEED_SCHEDULES: dict[str, str] = {
    "gradient_checking_frequency": "detail_every",
    "memory_profiling_frequency": "memory_every",
}


def _silenced(area: str) -> tuple[frozenset[str], tuple[str, ...]]:
    names = [s for s in REGISTRY if s.area == area]
    return frozenset(s.name for s in names), tuple(sw for s in names for sw in s.switches)


# What log_memory=False / log_performance=False keep from running (an area's instruments), and the
# switches they contradict (those instruments' switches).
_SILENCED: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "log_memory": _silenced("memory"),
    "log_performance": _silenced("perf"),
}

# Explicit switches and the instruments each starts whatever the mode and level. Seed flags that
# default to True (log_memory, log_performance) are deliberately absent: they would switch areas on
# in every config; False switches areas off instead (_SILENCED).
INSTRUMENTS_BY_SWITCH: dict[str, tuple[str, ...]] = {
    switch: tuple(s.name for s in REGISTRY if switch in s.switches)
    for one in REGISTRY
    for switch in one.switches
}


def _instrument_table() -> str:
    """The mode x level table printed in DebugConfig's docstring (a test keeps the two equal)."""
    rows = [["mode", *(lv.value for lv in _LEVEL_ORDER)]]
    for mode in DebugMode:
        row, before = [mode.value], frozenset[str]()
        for level in _LEVEL_ORDER:
            now = _instruments(mode, level)
            added = ",".join(n for n in INSTRUMENTS if n in now - before)
            row.append(("+" if before and added else "") + (added or "-"))
            before = now
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _instruments(mode: DebugMode, level: DebugLevel) -> frozenset[str]:
    return (INSTRUMENTS_BY_MODE[mode] & INSTRUMENTS_BY_LEVEL[level]) | _MODE_CORE.get(mode, frozenset())


def _opt(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    plain_name: bool = False,
    path: bool = False,
) -> Any:
    """A dataclass field with a range (or, for names, no path separator; for paths, only characters
    the OS accepts) checked on every assignment."""
    meta = {"ge": ge, "gt": gt, "le": le, "plain_name": plain_name, "path": path or plain_name}
    return field(default=default, metadata=meta)


Policy = Literal["raise", "warn", "skip"]
AnomalyMode = Literal["warn", "raise"]
OnOOM = Literal["raise", "retry_half"]
Sync = Literal["blocking", "async", "auto"]
OnSpike = Literal["warn", "rollback", "raise", "off"]


@dataclass(kw_only=True, repr=False)
class DebugConfig:
    """Every option of torchdebug, validated on construction and on every assignment.

    Build one from keyword arguments, ``from_dict``, ``from_file`` (YAML/TOML/JSON), ``from_env``
    (``TORCHDEBUG_<FIELD>``) or ``load`` (all of them; precedence defaults < file < environment <
    keyword arguments). Strings are accepted for enum options case-insensitively. An unknown
    option, a wrong type or an out-of-range value raises ``ConfigError`` naming the option.

    The default is ``mode=FULL_DEBUG, level=INTERMEDIATE``: unlike the seed systems, whose default
    ``NONE`` did nothing, torchdebug's per-step instruments are cheap enough to leave on.

    Which instruments run (``config.instruments()``): the mode picks areas, the level the depth
    within them (``+`` marks what each level adds), then explicit switches add on top::

        mode                   basic                              intermediate       advanced                          expert
        none                   -                                  -                  -                                 -
        anomaly_detection      nonfinite                          -                  -                                 -
        gradient_checking      nonfinite,gradients                +gradient_details  -                                 -
        memory_profiling       nonfinite,memory                   -                  +module_memory                    -
        performance_profiling  nonfinite,timing                   -                  +flops                            +module_time
        profiling              nonfinite,timing,profiler          -                  -                                 +module_time
        full_debug             nonfinite,gradients,memory,timing  +gradient_details  +module_memory,flops,activations  +module_time,profiler

    Instruments: ``nonfinite`` (NaN/Inf sentinel), ``gradients`` (total norm every step, rules),
    ``gradient_details`` (per-parameter norms, update/weight ratio, weight norms every
    ``detail_every``), ``memory`` (samples every ``memory_every``, leak test), ``timing`` (step
    breakdown, throughput), ``flops``, ``activations``, ``module_memory``, ``module_time``,
    ``profiler`` (torch.profiler). ``profiling`` always runs the profiler: it is the mode's point.

    Switches that add an instrument whatever the mode (``INSTRUMENTS_BY_SWITCH``, read from the
    instrument registry ``torchdebug._instruments.REGISTRY``):
    enable_anomaly_detection / enable_autograd_anomaly -> nonfinite; enable_gradient_checking /
    debug_gradient_norms / debug_backward_pass / debug_mixed_precision / log_gradients ->
    gradients; log_weights -> gradient_details; enable_memory_profiling / debug_memory_usage ->
    memory; enable_performance_profiling / debug_data_loading -> timing; enable_autograd_profiler /
    enable_tensorboard_profiler -> profiler; flops; activation_stats / log_activations /
    debug_forward_pass -> activations; per_module_memory -> module_memory; per_module_time ->
    module_time; ``log_memory=False`` / ``log_performance=False`` take the memory / performance
    instruments away again. A gradient instrument (gradients, gradient_details) always brings nonfinite along:
    a NaN/Inf gradient never passes silently while gradients are watched. Each switch records on
    its own: activations and gradient_details run as instruments of their own when gradients is
    off. debug_device_placement -> device_placement (devices of
    parameters, buffers and the first inputs, CUDA name/capability/memory; a mix is a warning).
    debug_lr_scheduling, debug_early_stopping and debug_validation -> gradients (the training-health
    instrument: the LR timeline and its rules, the state of ``watch(early_stopping=...)``, and
    ``mon.observe(name, value)`` for validation metrics). debug_forward_pass, debug_mixed_precision,
    debug_data_loading, debug_validation and debug_lr_scheduling also start step_details (the
    forward's shapes, devices and loss; autocast and its dtype; each DataLoader's dataset size, batch
    size and workers; validation forwards, samples and RSS; each scheduler's type), as info events.

    Options (defaults in brackets):

    - mode [full_debug], level [intermediate]: see above.
    - seed ``DebugConfig`` options, kept for the facades: enable_anomaly_detection,
      enable_gradient_checking, enable_memory_profiling, enable_performance_profiling [False];
      anomaly_detection_mode "warn"|"raise" ["warn"]; gradient_checking_frequency [10] is
      ``detail_every`` and memory_profiling_frequency [50] is ``memory_every`` (one schedule, two
      names: setting either sets both; two different values raise); performance_profiling_frequency
      [10] cannot mean anything (step timing runs every step) and any other value raises;
      save_debug_info [False: the seed's True wrote into the working folder unasked] makes the
      seed-era facades append each operation's ``DebugInfo`` as a JSON line to
      ``<debug_output_dir>/debug_info.jsonl``; debug_output_dir ["debug_outputs"] (also where
      ``create_debug_plots`` writes); log_gradients, log_activations, log_weights [False] (switches,
      below); log_memory, log_performance [True]: False keeps the memory (memory, module_memory) /
      performance (timing, flops, module_time, profiler) instruments from running, and contradicts a
      switch that turns one of them on (ConfigError).
    - seed engine flags, all [False]: enable_autograd_anomaly, enable_autograd_profiler,
      enable_tensorboard_profiler, debug_memory_usage, debug_gradient_norms, debug_forward_pass,
      debug_backward_pass, debug_device_placement, debug_mixed_precision, debug_data_loading,
      debug_validation, debug_early_stopping, debug_lr_scheduling.
    - on a non-finite value: policy "raise"|"warn"|"skip" ["raise"]; replay [True] (re-run the
      step under op-level tracing to find the origin); frames [16] (module calls kept, 0..10000);
      cause_budget [300.0 seconds, > 0: the most the search for whose fault it is (the compiler's
      module-by-module compiles) may take; what it tried by then is reported]; compiler_bisect
      [False: True also runs torch's CompilerBisector on the module the compiler made it in, naming
      the backend, subsystem and pass; some 20 more compiles].
    - sync "blocking"|"async"|"auto" ["auto"]: when the step's numbers are read. "blocking" reads
      them once per step as the update starts (one device-to-host sync); "async" copies them without
      blocking and reads them one step later while a fused optimizer skips a bad update on the
      device (``watch(..., sync=)``; other optimizers fall back to "blocking" with one warning).
      "auto": "async" where it is safe and pays (the parameters on a CUDA device, one fused
      optimizer, no GradScaler, one process, a plain loop, no clip_on_spike), else "blocking",
      silently: on a CPU the blocking read costs nothing to wait for.
    - run store: store [True] (write a run folder); run_dir ["runs"]; run_name [None: the model's
      class name]; announce [True: ``watch`` prints the run folder once on stderr as it starts, one
      line, rank 0 only; False: silent]; tensorboard [False; True or a log directory: the
      TensorBoard sink, writing there]; report_to [(): the trackers the run's records are sent to,
      names from "tensorboard", "wandb", "mlflow", "logging", or "all" (those installed) / "none"; a
      string or a list; in ``TORCHDEBUG_REPORT_TO`` comma-separated]; trace_loss [True].
    - schedules: detail_every [10], memory_every [50] (>= 1).
    - opt-in depth: flops, activation_stats, per_module_memory, per_module_time [False];
      peak_flops [None: FLOP/s for utilisation, > 0].
    - gradient rules: explode_mads [10.0], explode_abs [1e4], explode_warmup [20 steps],
      vanish_threshold [1e-8], vanish_patience [5], dead_unit_fraction [0.95, in (0, 1]],
      update_ratio_min [1e-5] < update_ratio_max [1.0]; clip_on_spike [None: max norm to clip
      to on a spike].
    - loss rules: loss_spike_mads [10.0], loss_plateau_window [200, 2..10000], loss_plateau_rel [1e-4].
    - loss spikes (docs/spikes.md): on_spike "warn"|"rollback"|"raise"|"off" ["warn": every spike gets a
      ``SpikeReport`` naming its cause; "rollback" also restores the last snapshot before the spike and
      goes on; "raise" raises ``LossSpikeError``]; snapshot_every [50 steps between rollback snapshots,
      >= 1]; max_rollbacks [3: a spike after that many rollbacks raises]; rollback_lr_scale [1.0, in
      (0, 1]: the learning rate is multiplied by it for rollback_lr_steps [0] updates after a rollback].
    - mixed precision: scale_floor [1.0], scale_shrink_steps [5].
    - input_bound_fraction [0.3, in (0, 1]]; slowdown_factor [1.5, > 1]; leak_window [50 samples, 2..1000];
      leak_every [4: steps between leak-test samples, or memory_every when smaller; the window spans
      leak_window * leak_every = 200 steps, so a 64 KiB/step leak is reported ~150 steps after it
      starts]; leak_min_bytes_per_step [65536: smaller growth is not a leak]; leak_warmup [5 samples
      ignored];
      memory_history [False: record CUDA allocation history for OOM snapshots, costs];
      tokens_per_step [None: tokens per step for tokens/s, else inferred from (B, T) integer input];
      on_oom "raise"|"retry_half" ["raise"]; rank [None: from torch.distributed / RANK].
    - distributed: hang_timeout [None: seconds without a completed step before the hang watchdog
      records every thread's stack; None = max(300 s, 20 x the median step time), > 0];
      parameter_hash_every [None: off; N >= 1: every N steps each DDP replica's parameters are hashed
      (``torch.hash_tensor``, on the device) and the hashes ride in the step's all-reduce, two numbers
      per rank; a rank whose weights silently diverged is named in a ``replica_divergence`` event.
      Costs one small kernel per parameter tensor on the checked step and the step before it].

    Floats must be finite; integers fit 64 bits. Mutating a field validates it
    (``config.policy = "warn"``); change several related fields at once with ``replace``.

    Examples:
        >>> cfg = DebugConfig(policy="warn", level="advanced", detail_every=5)
        >>> sorted(cfg.instruments())[:3]
        ['activations', 'flops', 'gradient_details']
        >>> DebugConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    mode: DebugMode = DebugMode.FULL_DEBUG
    level: DebugLevel = DebugLevel.INTERMEDIATE
    # seed-era DebugConfig (001)
    enable_anomaly_detection: bool = False
    enable_gradient_checking: bool = False
    enable_memory_profiling: bool = False
    enable_performance_profiling: bool = False
    anomaly_detection_mode: AnomalyMode = "warn"
    gradient_checking_frequency: int = _opt(10, ge=1)
    memory_profiling_frequency: int = _opt(50, ge=1)
    performance_profiling_frequency: int = _opt(10, ge=1)
    save_debug_info: bool = False
    debug_output_dir: str = _opt("debug_outputs", path=True)
    log_gradients: bool = False
    log_activations: bool = False
    log_weights: bool = False
    log_memory: bool = True
    log_performance: bool = True
    # seed-era engine flags (000)
    enable_autograd_anomaly: bool = False
    enable_autograd_profiler: bool = False
    enable_tensorboard_profiler: bool = False
    debug_memory_usage: bool = False
    debug_gradient_norms: bool = False
    debug_forward_pass: bool = False
    debug_backward_pass: bool = False
    debug_device_placement: bool = False
    debug_mixed_precision: bool = False
    debug_data_loading: bool = False
    debug_validation: bool = False
    debug_early_stopping: bool = False
    debug_lr_scheduling: bool = False
    # engine: what happens on a non-finite value
    policy: Policy = "raise"
    sync: Sync = "auto"
    replay: bool = True
    frames: int = _opt(16, ge=0, le=10_000)
    cause_budget: float = _opt(300.0, gt=0)
    compiler_bisect: bool = False
    # engine: run store and exports
    run_dir: str = _opt("runs", path=True)
    run_name: str | None = _opt(None, plain_name=True)
    store: bool = True
    announce: bool = True
    tensorboard: bool | str = _opt(False, path=True)
    report_to: tuple[str, ...] = ()
    trace_loss: bool = True
    # engine: schedules and opt-in depth
    detail_every: int = _opt(10, ge=1)
    memory_every: int = _opt(50, ge=1)
    flops: bool = False
    activation_stats: bool = False
    per_module_memory: bool = False
    per_module_time: bool = False
    peak_flops: float | None = _opt(None, gt=0)
    # engine: rule thresholds
    explode_mads: float = _opt(10.0, gt=0)
    explode_abs: float = _opt(1e4, gt=0)
    explode_warmup: int = _opt(20, ge=0)
    vanish_threshold: float = _opt(1e-8, ge=0)
    vanish_patience: int = _opt(5, ge=1)
    loss_spike_mads: float = _opt(10.0, gt=0)
    loss_plateau_window: int = _opt(200, ge=2, le=10_000)  # sorted every step: O(window log window)
    loss_plateau_rel: float = _opt(1e-4, ge=0)
    on_spike: OnSpike = "warn"
    snapshot_every: int = _opt(50, ge=1)
    max_rollbacks: int = _opt(3, ge=0)
    rollback_lr_scale: float = _opt(1.0, gt=0, le=1)
    rollback_lr_steps: int = _opt(0, ge=0)
    dead_unit_fraction: float = _opt(0.95, gt=0, le=1)
    update_ratio_min: float = _opt(1e-5, ge=0)
    update_ratio_max: float = _opt(1.0, gt=0)
    scale_floor: float = _opt(1.0, gt=0)
    scale_shrink_steps: int = _opt(5, ge=1)
    input_bound_fraction: float = _opt(0.3, gt=0, le=1)
    slowdown_factor: float = _opt(1.5, gt=1)
    leak_window: int = _opt(50, ge=2, le=1_000)  # Theil-Sen slope: O(window**2) when memory grows
    leak_every: int = _opt(4, ge=1)
    leak_min_bytes_per_step: int = _opt(65536, ge=0)
    leak_warmup: int = _opt(5, ge=0)
    memory_history: bool = False
    tokens_per_step: int | None = _opt(None, ge=1)
    clip_on_spike: float | None = _opt(None, gt=0)
    on_oom: OnOOM = "raise"
    rank: int | None = _opt(None, ge=0)
    hang_timeout: float | None = _opt(None, gt=0)
    parameter_hash_every: int | None = _opt(None, ge=1)

    def __new__(cls, *args: Any, **kwargs: Any) -> DebugConfig:
        # before the generated __init__, so a typo raises ConfigError with a suggestion, not TypeError
        for key in kwargs:
            if key not in _SPECS:
                raise ConfigError(_unknown_message(key))
        return super().__new__(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        spec = _SPECS.get(name)
        if spec is None:
            if name.startswith("_"):
                object.__setattr__(self, name, value)
                return
            raise ConfigError(_unknown_message(name))
        value = spec.check(value, name)
        if not self.__dict__.get("_ready"):
            object.__setattr__(self, name, value)  # inside __init__: __post_init__ checks relations
            return
        previous = self.__dict__[name]
        partner = _SCHEDULE_PARTNER.get(name)
        partner_before = self.__dict__[partner] if partner else None
        object.__setattr__(self, name, value)
        if partner:
            object.__setattr__(self, partner, value)  # one schedule, two names
        try:
            self._check_relations()
        except ConfigError:
            object.__setattr__(self, name, previous)  # a failed assignment leaves the config as it was
            if partner:
                object.__setattr__(self, partner, partner_before)
            raise

    def __post_init__(self) -> None:
        for seed, engine in SEED_SCHEDULES.items():
            a, b = getattr(self, seed), getattr(self, engine)
            if a != b and a != _DEFAULTS[seed] and b != _DEFAULTS[engine]:
                raise ConfigError(
                    f"{seed}={a} and {engine}={b} name the same schedule ({seed} is the seed-era name "
                    f"of {engine}); set one of them"
                )
            value = a if a != _DEFAULTS[seed] else b
            object.__setattr__(self, seed, value)
            object.__setattr__(self, engine, value)
        self._check_relations()
        self._ready = True

    def _check_relations(self) -> None:
        if self.performance_profiling_frequency != _DEFAULTS["performance_profiling_frequency"]:
            raise ConfigError(
                f"performance_profiling_frequency={self.performance_profiling_frequency} cannot mean anything "
                "in torchdebug: step timing runs on every step (a few clock reads, no schedule to thin); "
                "per-module timing (per_module_time) measures steps 1..3 and the profiler has its own "
                "schedule. Leave the option out"
            )
        for flag, (_, switches) in _SILENCED.items():
            on = [sw for sw in switches if getattr(self, sw)]
            if not getattr(self, flag) and on:
                raise ConfigError(
                    f"{flag}=False contradicts {', '.join(f'{sw}=True' for sw in on)}: {flag}=False keeps "
                    f"those instruments from running; drop one of the two"
                )
        if self.update_ratio_min >= self.update_ratio_max:
            raise ConfigError(
                f"update_ratio_min ({self.update_ratio_min}) must be below update_ratio_max "
                f"({self.update_ratio_max}); to change both use config.replace(update_ratio_min=..., "
                "update_ratio_max=...)"
            )

    def __repr__(self) -> str:
        # only what differs from the defaults, enums as their strings: eval-able and short
        changed = [
            f"{name}={value!r}"
            for name, value in self.to_dict().items()
            if value != _DEFAULTS[name] and name not in SEED_SCHEDULES  # aliases follow their engine name
        ]
        return f"DebugConfig({', '.join(changed)})"

    def instruments(self) -> frozenset[str]:
        """Names of the instruments this config runs: the mode/level table plus explicit switches.

        Example:
            >>> sorted(DebugConfig(mode="none", log_gradients=True).instruments())
            ['gradients', 'nonfinite']
        """
        names = set(_instruments(self.mode, self.level))
        for switch, started in INSTRUMENTS_BY_SWITCH.items():
            if getattr(self, switch):
                names.update(started)
        for flag, (silenced, _) in _SILENCED.items():
            if not getattr(self, flag):
                names -= silenced
        # a gradient instrument brings the sentinel: a NaN/Inf gradient never passes silently
        names.update(other for s in REGISTRY if s.name in names for other in s.brings)
        return frozenset(names)

    def to_dict(self) -> dict[str, Any]:
        """Every option as plain JSON-ready values (enums as their strings).

        ``DebugConfig.from_dict(config.to_dict()) == config`` holds for every config.
        """
        return {f.name: _plain_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> DebugConfig:
        """A validated copy with ``changes`` applied (several related fields at once).

        Raises:
            ConfigError: an unknown option or an invalid value.

        Example:
            >>> DebugConfig().replace(update_ratio_min=0.2, update_ratio_max=0.5).update_ratio_max
            0.5
        """
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> DebugConfig:
        """A config from a mapping of option names to values (types checked strictly).

        Raises:
            ConfigError: an unknown key (with a suggestion), wrong type or invalid value.
            TypeError: ``options`` is not a mapping.

        Example:
            >>> DebugConfig.from_dict({"policy": "warn", "detail_every": 5}).detail_every
            5
        """
        if not isinstance(options, Mapping):
            raise TypeError(f"from_dict expects a mapping of option names, got {type(options).__name__}")
        for key in options:
            if not isinstance(key, str):
                raise ConfigError(f"option names must be strings, got {key!r}")
        return cls(**options)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> DebugConfig:
        """A config from a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON (``.json``) file.

        Options may sit at the top level or under a ``torchdebug`` table (``[torchdebug]`` in TOML,
        ``torchdebug:`` in YAML), or under ``[tool.torchdebug]`` so pyproject.toml works; with a
        table, the file's other top-level keys belong to other tools and are ignored.

        Raises:
            FileNotFoundError: no such file.
            ImportError: YAML without pyyaml (``pip install torchdebug[config]``), TOML on
                Python 3.10 without tomli.
            ConfigError: unreadable content, unknown option or invalid value (names the file).

        Example:
            >>> DebugConfig.from_file("torchdebug.toml")  # doctest: +SKIP
        """
        return cls(**_read_file(Path(path)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DebugConfig:
        """A config from ``TORCHDEBUG_<FIELD>`` environment variables (defaults for the others).

        Values are parsed from text: booleans 1/0/true/false/yes/no/on/off, numbers as written,
        ``none``/``null``/empty for optional options, enum options case-insensitively.
        ``TORCHDEBUG_CONFIG`` is not read here (see ``load``).

        Args:
            environ: the variables to read; ``os.environ`` when None.

        Raises:
            ConfigError: an unknown ``TORCHDEBUG_*`` variable or an unparsable/invalid value
                (names the variable).

        Example:
            >>> DebugConfig.from_env({"TORCHDEBUG_POLICY": "warn"}).policy
            'warn'
        """
        return cls(**_read_env(os.environ if environ is None else environ))

    @classmethod
    def load(
        cls,
        file: str | os.PathLike[str] | None = None,
        env: bool | Mapping[str, str] = True,
        **overrides: Any,
    ) -> DebugConfig:
        """A config from all sources: defaults < file < environment < keyword arguments.

        Args:
            file: a YAML/TOML/JSON file; when None and ``env`` is on, ``TORCHDEBUG_CONFIG`` may name
                one.
            env: True reads ``os.environ``, a mapping reads that mapping, False reads no
                environment (not even ``TORCHDEBUG_CONFIG``).
            **overrides: options that win over everything else.

        Raises:
            ConfigError, FileNotFoundError, ImportError: as ``from_file`` / ``from_env``.

        Example:
            >>> DebugConfig.load(env={"TORCHDEBUG_DETAIL_EVERY": "5"}, policy="warn").detail_every
            5
        """
        return cls._load(file, env, overrides)

    @classmethod
    def _load(
        cls, file: str | os.PathLike[str] | None, env: bool | Mapping[str, str], overrides: Mapping[str, Any]
    ) -> DebugConfig:
        """``load`` with the overrides as a mapping, so option names cannot collide with ``file``/``env``."""
        if not isinstance(env, (bool, Mapping)):
            raise TypeError(f"env must be True, False or a mapping of variables, got {type(env).__name__}")
        environ: Mapping[str, str] = {} if env is False else os.environ if env is True else env
        for key in overrides:
            if not isinstance(key, str) or key not in _SPECS:
                raise ConfigError(_unknown_message(str(key)))
        if file is None and environ.get("TORCHDEBUG_CONFIG"):
            file = environ["TORCHDEBUG_CONFIG"]
            if not Path(file).is_file():
                raise FileNotFoundError(
                    f"TORCHDEBUG_CONFIG={file!r} names no file; fix the path or unset the variable"
                )
        options: dict[str, Any] = {}
        if file is not None:
            options.update(_read_file(Path(file)))
        options.update(_read_env(environ))
        options.update(overrides)
        return cls(**options)


@dataclass(frozen=True)
class _Spec:
    """How one option is checked: its kind, whether None is allowed, choices and range."""

    kind: str  # bool | int | float | str | choice | enum | bool_or_str | names
    optional: bool = False
    choices: tuple[str, ...] = ()
    enum_type: type[enum.Enum] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    plain_name: bool = False  # a folder-name prefix: no path separator
    path: bool = False  # a file system path (or part of one): only characters the OS accepts

    def allowed(self) -> str:
        """Human description of the accepted values, for error messages."""
        if self.kind in ("choice", "enum"):
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind == "bool_or_str":
            text = "True/False or a directory path"
        elif self.kind == "names":
            text = "a name or a list of names from " + ", ".join(repr(c) for c in self.choices)
        else:
            text = {"bool": "True or False", "int": "an integer", "float": "a finite number"}.get(
                self.kind, "a non-empty string"
            )
            bounds = [
                f"{op} {v:g}"
                for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le))
                if v is not None and v != _INT_MAX  # the 64-bit cap is named only when exceeded
            ]
            if bounds:
                text += " " + " and ".join(bounds)
        return text + (" or None" if self.optional else "")

    def check(self, value: Any, label: str) -> Any:
        """``value`` coerced to the option's type (strings to enums, int to float) or ConfigError."""
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{label}=None is not allowed; expected {self.allowed()}")
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
        elif self.kind == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return self._in_range(value, label)
        elif self.kind == "float":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    number = float(value)
                except OverflowError:  # an int beyond 1.8e308
                    raise ConfigError(
                        f"{label}={_short(value)} is too large for a float; expected {self.allowed()}"
                    ) from None
                if not math.isfinite(number):
                    raise ConfigError(f"{label}={_short(value)} must be finite; expected {self.allowed()}")
                return self._in_range(number, label)
        elif self.kind == "str":
            if isinstance(value, str) and value.strip():
                if self.plain_name and ("/" in value or "\\" in value):
                    raise ConfigError(f"{label}={value!r} must not contain a path separator")
                if self.path:
                    check_path(value, label)
                return value
        elif self.kind == "bool_or_str":
            if isinstance(value, bool) or (isinstance(value, str) and value.strip()):
                if self.path and isinstance(value, str):
                    check_path(value, label)
                return value
        elif self.kind == "names":
            return self._names(value, label)
        elif self.kind == "choice":
            if isinstance(value, str) and _normalise(value) in self.choices:
                return _normalise(value)
        elif self.kind == "enum" and self.enum_type is not None and isinstance(value, (str, enum.Enum)):
            try:
                return self.enum_type(value.value if isinstance(value, enum.Enum) else value)
            except ValueError:
                pass
        hint = ""
        if self.kind in ("bool", "int", "float") and isinstance(value, str):
            hint = " (text is parsed only from TORCHDEBUG_* variables)"
        raise ConfigError(
            f"{label}={_short(value)} ({type(value).__name__}) is not valid; expected {self.allowed()}{hint}"
        )

    def _names(self, value: Any, label: str) -> tuple[str, ...]:
        """A name or names (list/tuple) from ``choices``: normalised, deduplicated, ``"none"`` dropped."""
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ConfigError(
                f"{label}={_short(value)} ({type(value).__name__}) is not valid; expected {self.allowed()}"
            )
        out: list[str] = []
        for v in items:
            name = _normalise(v)
            if name not in self.choices:
                raise ConfigError(f"{label}: unknown name {v!r}; expected {self.allowed()}")
            if name != "none" and name not in out:
                out.append(name)
        return tuple(out)

    def _in_range(self, value: float, label: str) -> Any:
        if (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
        ):
            if self.le == _INT_MAX and value > _INT_MAX:
                raise ConfigError(
                    f"{label}={_short(value)} is too large: integer options fit 64 bits (<= 2**63 - 1)"
                )
            raise ConfigError(f"{label}={_short(value)} is out of range; expected {self.allowed()}")
        return value

    def parse(self, text: str, label: str) -> Any:
        """An environment variable's text turned into a value of the option's kind."""
        key = text.strip().lower()
        if self.optional and key in _NONE:
            return None
        try:
            if self.kind == "bool" or (self.kind == "bool_or_str" and key in _TRUE | _FALSE):
                if key in _TRUE:
                    return True
                if key in _FALSE:
                    return False
                raise ValueError
            if self.kind == "int":
                return int(key)
            if self.kind == "float":
                return float(key)
            if self.kind == "names":
                return [part for part in key.split(",") if part.strip()]
        except ValueError:
            expected = "1/0, true/false, yes/no or on/off" if self.kind == "bool" else self.allowed()
            raise ConfigError(f"{label}={_short(text)} cannot be read; expected {expected}") from None
        return text


def _plain_value(value: Any) -> Any:
    """An option's value as JSON has it: enums as their strings, tuples (``report_to``) as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


# Characters Windows refuses in a file name besides NUL and control characters (":" only after a drive).
_WINDOWS_REFUSED = set('<>"|?*')


def check_path(value: str | bytes, label: str) -> None:
    """ConfigError unless the OS can take ``value`` as a path: no NUL, nothing the filesystem encoding
    cannot hold (a lone surrogate), and on Windows none of ``<>"|?*`` nor control characters."""
    fix = "pick a folder name of ordinary characters"
    if isinstance(value, bytes):
        if b"\x00" in value:
            raise ConfigError(f"{label}={value!r:.60} cannot be a path: it holds a NUL byte; {fix}")
        return
    if "\x00" in value:
        raise ConfigError(f"{label}={_short(value)} cannot be a path: it holds a NUL character; {fix}")
    try:
        os.fsencode(value)
    except UnicodeError as exc:
        bad = value[exc.start : exc.end] if isinstance(exc, UnicodeEncodeError) else ""
        raise ConfigError(
            f"{label}={_short(value)} cannot be a path: {bad!r} has no encoding in this file system's "
            f"{sys.getfilesystemencoding()!r}; {fix}"
        ) from None
    if sys.platform == "win32":
        rest = value[2:] if value[1:2] == ":" else value
        bad_chars = sorted({c for c in rest if c in _WINDOWS_REFUSED or ord(c) < 32})
        if bad_chars:
            raise ConfigError(
                f"{label}={_short(value)} cannot be a path: Windows refuses {''.join(bad_chars)!r}; {fix}"
            )


# Every integer option fits a 64-bit integer (SQLite, C sizes): 10**30 is a typo, not a setting.
_INT_MAX = 2**63 - 1


def _short(value: Any) -> str:
    """``repr`` of an option's value, kept short for huge ints (repr fails beyond 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'-' if value < 0 else ''}<an integer of {digits} digits>"
    if isinstance(value, str) and len(value) > 80:
        return f"{value[:40]!r}... ({len(value)} characters)"
    return repr(value)


def _spec_for(f: dataclasses.Field[Any], hint: Any) -> _Spec:
    """Derive the check of one field from its type hint and range metadata."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]  # noqa: UP007
        args = typing.get_args(hint)
    bounds = {
        k: f.metadata[k] for k in ("ge", "gt", "le", "plain_name", "path") if f.metadata.get(k) is not None
    }
    if typing.get_origin(hint) is Literal:
        return _Spec("choice", optional, choices=tuple(args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _Spec("enum", optional, choices=tuple(m.value for m in hint), enum_type=hint)
    if set(args) == {bool, str}:
        return _Spec("bool_or_str", optional, path=bool(f.metadata.get("path")))
    if typing.get_origin(hint) is tuple:  # report_to: names of trackers
        return _Spec("names", optional, choices=(*REPORT_TO_NAMES, "all", "none"))
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    if hint not in kinds:
        raise TypeError(f"DebugConfig.{f.name}: no validation for type {hint!r}")
    if hint is int:
        bounds.setdefault("le", _INT_MAX)
    return _Spec(kinds[hint], optional, **bounds)


_HINTS = typing.get_type_hints(DebugConfig)
_SPECS: dict[str, _Spec] = {f.name: _spec_for(f, _HINTS[f.name]) for f in dataclasses.fields(DebugConfig)}
_DEFAULTS: dict[str, Any] = {f.name: _plain_value(f.default) for f in dataclasses.fields(DebugConfig)}
_SCHEDULE_PARTNER: dict[str, str] = {**SEED_SCHEDULES, **{v: k for k, v in SEED_SCHEDULES.items()}}


def _unknown_message(key: str, *, env: bool = False) -> str:
    """``unknown option 'detial_every'; did you mean 'detail_every'?`` (or the TORCHDEBUG_ spelling)."""
    if env:
        names = [ENV_PREFIX + n.upper() for n in _SPECS] + sorted(_RESERVED_ENV)
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; options are {ENV_PREFIX}<OPTION>"
        return f"unknown environment variable {key}{hint} (unset it or fix the name)"
    close = difflib.get_close_matches(key, list(_SPECS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "; see the DebugConfig docstring for the options"
    return f"unknown option {key!r}{hint}"


def _read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Parsed and checked options from the ``TORCHDEBUG_*`` variables of ``environ``."""
    options: dict[str, Any] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in _RESERVED_ENV:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        spec = _SPECS.get(name)
        if spec is None:
            raise ConfigError(_unknown_message(var, env=True))
        text = environ[var]
        # a mapping given by hand may hold typed values; os.environ only holds text
        options[name] = spec.check(spec.parse(text, var) if isinstance(text, str) else text, var)
    return options


def _read_file(path: Path) -> dict[str, Any]:
    """Checked options from a YAML/TOML/JSON file (top level, ``torchdebug`` or ``tool.torchdebug``)."""
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ConfigError(f"{path}: unknown config file type {suffix!r}; use .yaml, .yml, .toml or .json")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "save the config file as UTF-8"
        ) from None
    try:
        if suffix == ".toml":
            data: Any = _toml().loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = _yaml().safe_load(text)
    except ImportError:
        raise
    except Exception as exc:  # each parser has its own error class
        raise ConfigError(f"{path}: cannot parse {suffix[1:].upper()}: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of options, got {type(data).__name__}")
    if isinstance(data.get("torchdebug"), dict):
        data = data["torchdebug"]
    elif isinstance(data.get("tool"), dict) and isinstance(data["tool"].get("torchdebug"), dict):
        data = data["tool"]["torchdebug"]
    options: dict[str, Any] = {}
    for key, value in data.items():
        spec = _SPECS.get(key) if isinstance(key, str) else None
        if spec is None:
            raise ConfigError(f"{path}: {_unknown_message(str(key))}")
        try:
            options[key] = spec.check(value, key)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return options


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ImportError(
            "reading a YAML config needs pyyaml: pip install torchdebug[config] (or use a .toml file)"
        ) from None
    return yaml


def _toml() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ImportError(
                "reading a TOML config on Python 3.10 needs tomli: pip install torchdebug[config]"
            ) from None
    return tomllib


def coerce_config(config: DebugConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> DebugConfig:
    """The config an entry point (``watch``, the facades, the CLI) should use.

    - a ``DebugConfig``: returned as is (the caller chose every value);
    - None: ``DebugConfig.load()``, so ``TORCHDEBUG_*`` variables and ``TORCHDEBUG_CONFIG`` apply;
    - a mapping: as ``DebugConfig.load(**mapping)``: the environment fills what the mapping leaves;
    - a path (str or PathLike): ``DebugConfig.load(file=path)``: the environment wins over the file.

    Raises:
        TypeError: any other type (names the accepted ones).
        ConfigError, FileNotFoundError, ImportError: as ``DebugConfig.load``.

    Example:
        >>> coerce_config({"policy": "warn"}).policy  # doctest: +SKIP
        'warn'
    """
    if isinstance(config, DebugConfig):
        return config
    if config is None:
        return DebugConfig.load()
    if isinstance(config, Mapping):
        return DebugConfig._load(None, True, config)
    if isinstance(config, (str, os.PathLike)):
        return DebugConfig.load(file=config)
    raise TypeError(
        "config must be a DebugConfig, a dict of options, a path to a YAML/TOML/JSON file, or None; "
        f"got {type(config).__name__}"
    )
