"""Tests of torchdebug._config: DebugConfig options, validation, sources and the instruments table."""

from __future__ import annotations

import copy
import inspect
import json
import pickle
import sys
import textwrap
from pathlib import Path

import pytest

from torchdebug._config import (
    INSTRUMENTS,
    INSTRUMENTS_BY_LEVEL,
    INSTRUMENTS_BY_MODE,
    DebugConfig,
    DebugLevel,
    DebugMode,
    _instrument_table,
    coerce_config,
)
from torchdebug._errors import ConfigError

# ---------------------------------------------------------------- defaults and enums

EXPECTED_DEFAULTS = {
    # seed 001 DebugConfig (mode/level differ on purpose: see the DebugConfig docstring)
    "mode": DebugMode.FULL_DEBUG,
    "level": DebugLevel.INTERMEDIATE,
    "enable_anomaly_detection": False,
    "enable_gradient_checking": False,
    "enable_memory_profiling": False,
    "enable_performance_profiling": False,
    "anomaly_detection_mode": "warn",
    "gradient_checking_frequency": 10,  # = detail_every (one schedule)
    "memory_profiling_frequency": 50,
    "performance_profiling_frequency": 10,
    "save_debug_info": False,  # opt-in: writes into debug_output_dir
    "debug_output_dir": "debug_outputs",
    "log_gradients": False,
    "log_activations": False,
    "log_weights": False,
    "log_memory": True,
    "log_performance": True,
    # seed 000 flags
    **dict.fromkeys(
        [
            "enable_autograd_anomaly",
            "enable_autograd_profiler",
            "enable_tensorboard_profiler",
            "debug_memory_usage",
            "debug_gradient_norms",
            "debug_forward_pass",
            "debug_backward_pass",
            "debug_device_placement",
            "debug_mixed_precision",
            "debug_data_loading",
            "debug_validation",
            "debug_early_stopping",
            "debug_lr_scheduling",
        ],
        False,
    ),
    # engine
    "policy": "raise",
    "sync": "auto",
    "replay": True,
    "frames": 16,
    "cause_budget": 300.0,
    "compiler_bisect": False,
    "run_dir": "runs",
    "run_name": None,
    "store": True,
    "announce": True,
    "detail_every": 10,
    "memory_every": 50,
    "flops": False,
    "activation_stats": False,
    "per_module_memory": False,
    "per_module_time": False,
    "explode_mads": 10.0,
    "explode_abs": 1e4,
    "explode_warmup": 20,
    "vanish_threshold": 1e-8,
    "vanish_patience": 5,
    "loss_spike_mads": 10.0,
    "loss_plateau_window": 200,
    "loss_plateau_rel": 1e-4,
    "on_spike": "warn",
    "snapshot_every": 50,
    "max_rollbacks": 3,
    "rollback_lr_scale": 1.0,
    "rollback_lr_steps": 0,
    "dead_unit_fraction": 0.95,
    "update_ratio_min": 1e-5,
    "update_ratio_max": 1.0,
    "scale_floor": 1.0,
    "scale_shrink_steps": 5,
    "input_bound_fraction": 0.3,
    "slowdown_factor": 1.5,
    "leak_window": 50,
    "leak_every": 4,
    "leak_min_bytes_per_step": 65536,
    "leak_warmup": 5,
    "memory_history": False,
    "tokens_per_step": None,
    "clip_on_spike": None,
    "on_oom": "raise",
    "tensorboard": False,
    "report_to": [],
    "trace_loss": True,
    "peak_flops": None,
    "rank": None,
    "hang_timeout": None,
    "parameter_hash_every": None,
}


def test_defaults_are_exactly_the_documented_ones():
    cfg = DebugConfig()
    assert cfg.to_dict() == {k: getattr(v, "value", v) for k, v in EXPECTED_DEFAULTS.items()}
    assert cfg.mode is DebugMode.FULL_DEBUG and cfg.level is DebugLevel.INTERMEDIATE
    assert repr(cfg) == "DebugConfig()"


@pytest.mark.parametrize(
    ("text", "member"),
    [
        ("full_debug", DebugMode.FULL_DEBUG),
        ("FULL_DEBUG", DebugMode.FULL_DEBUG),
        (" Anomaly-Detection ", DebugMode.ANOMALY_DETECTION),
        ("profiling", DebugMode.PROFILING),
    ],
)
def test_mode_strings_case_insensitive(text, member):
    assert DebugMode(text) is member


def test_level_extreme_alias_and_case():
    assert DebugLevel("extreme") is DebugLevel.EXPERT
    assert DebugLevel("EXTREME") is DebugLevel.EXPERT
    assert DebugLevel("Advanced") is DebugLevel.ADVANCED
    assert DebugConfig(level="extreme").level is DebugLevel.EXPERT
    with pytest.raises(ValueError):
        DebugLevel("deep")


def test_levels_order_by_depth_not_alphabet():
    levels = [DebugLevel.EXPERT, DebugLevel.BASIC, DebugLevel.ADVANCED, DebugLevel.INTERMEDIATE]
    assert sorted(levels) == [
        DebugLevel.BASIC,
        DebugLevel.INTERMEDIATE,
        DebugLevel.ADVANCED,
        DebugLevel.EXPERT,
    ]
    assert DebugLevel.ADVANCED > DebugLevel.BASIC  # "advanced" < "basic" as strings
    assert DebugLevel.EXPERT >= "advanced" and DebugLevel.BASIC <= "basic" and DebugLevel.BASIC < "extreme"
    with pytest.raises(TypeError):
        _ = DebugLevel.BASIC < 3


def test_enums_compare_and_serialise_as_strings():
    cfg = DebugConfig(mode="Memory_Profiling")
    assert type(cfg.mode) is DebugMode and cfg.mode == "memory_profiling"
    assert str(cfg.mode) == "memory_profiling"
    assert json.dumps(cfg.to_dict()["mode"]) == '"memory_profiling"'


def test_seed_style_construction_still_works():
    # the example of seed 001, verbatim apart from the names' module
    cfg = DebugConfig(
        mode=DebugMode.FULL_DEBUG,
        level=DebugLevel.ADVANCED,
        enable_anomaly_detection=True,
        enable_gradient_checking=True,
        enable_memory_profiling=True,
        enable_performance_profiling=True,
    )
    assert cfg.level is DebugLevel.ADVANCED and cfg.enable_memory_profiling


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        DebugConfig("full_debug")  # type: ignore[misc]


# ---------------------------------------------------------------- instruments()

B = {"nonfinite", "gradients", "memory", "timing"}
FULL = set(INSTRUMENTS)
EXPECTED_INSTRUMENTS = {
    # mode: [basic, intermediate, advanced, expert]
    "none": [set(), set(), set(), set()],
    "anomaly_detection": [{"nonfinite"}] * 4,
    "gradient_checking": [{"nonfinite", "gradients"}] + [{"nonfinite", "gradients", "gradient_details"}] * 3,
    "memory_profiling": [{"nonfinite", "memory"}] * 2 + [{"nonfinite", "memory", "module_memory"}] * 2,
    "performance_profiling": [{"nonfinite", "timing"}] * 2
    + [{"nonfinite", "timing", "flops"}, {"nonfinite", "timing", "flops", "module_time"}],
    # profiling runs the profiler at every level: it is the point of the mode
    "profiling": [{"nonfinite", "timing", "profiler"}] * 3
    + [{"nonfinite", "timing", "profiler", "module_time"}],
    "full_debug": [
        B,
        B | {"gradient_details"},
        B | {"gradient_details", "activations", "module_memory", "flops"},
        FULL,
    ],
}


@pytest.mark.parametrize("mode", list(EXPECTED_INSTRUMENTS))
@pytest.mark.parametrize("level", ["basic", "intermediate", "advanced", "expert"])
def test_instruments_by_mode_and_level(mode, level):
    expected = EXPECTED_INSTRUMENTS[mode][["basic", "intermediate", "advanced", "expert"].index(level)]
    assert DebugConfig(mode=mode, level=level).instruments() == frozenset(expected)


def test_tables_cover_every_mode_and_level_and_are_in_the_docstring():
    assert set(INSTRUMENTS_BY_MODE) == set(DebugMode) and set(INSTRUMENTS_BY_LEVEL) == set(DebugLevel)
    assert INSTRUMENTS_BY_LEVEL[DebugLevel.EXPERT] == frozenset(INSTRUMENTS)
    # the hand-kept docstring table (a literal block indented by 4) is the generated one
    assert textwrap.indent(_instrument_table(), "    ") in inspect.cleandoc(DebugConfig.__doc__ or "")
    row = _instrument_table().splitlines()[3].split()
    assert row == ["gradient_checking", "nonfinite,gradients", "+gradient_details", "-", "-"]


@pytest.mark.parametrize(
    ("switch", "instrument"),
    [
        ("enable_anomaly_detection", "nonfinite"),
        ("enable_autograd_anomaly", "nonfinite"),
        ("enable_gradient_checking", "gradients"),
        ("debug_gradient_norms", "gradients"),
        ("log_gradients", "gradients"),
        ("log_weights", "gradient_details"),
        ("enable_memory_profiling", "memory"),
        ("debug_memory_usage", "memory"),
        ("enable_performance_profiling", "timing"),
        ("enable_autograd_profiler", "profiler"),
        ("enable_tensorboard_profiler", "profiler"),
        ("flops", "flops"),
        ("activation_stats", "activations"),
        ("log_activations", "activations"),
        ("per_module_memory", "module_memory"),
        ("per_module_time", "module_time"),
    ],
)
def test_explicit_switch_adds_its_instrument_even_in_mode_none(switch, instrument):
    # a gradient instrument brings the NaN/Inf sentinel along (a NaN gradient never passes silently)
    sentinel = {"nonfinite"} if instrument in ("gradients", "gradient_details") else set()
    assert DebugConfig(mode="none", **{switch: True}).instruments() == {instrument} | sentinel
    # on top of a mode: nonfinite from the mode, the switch's own from the switch
    assert DebugConfig(mode="anomaly_detection", level="basic", **{switch: True}).instruments() == {
        "nonfinite",
        instrument,
    }


def test_seed_flags_that_default_true_switch_nothing_on():
    cfg = DebugConfig(mode="none", log_memory=True, log_performance=True, save_debug_info=True)
    assert cfg.instruments() == frozenset()
    # the training flags are not ignored: they start training health, which brings the sentinel, and
    # the details they name (validation forwards, the scheduler's type)
    both = DebugConfig(mode="none", debug_validation=True, debug_lr_scheduling=True)
    assert both.instruments() == frozenset({"nonfinite", "gradients", "step_details"})


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"detial_every": 5}, r"unknown option 'detial_every'; did you mean 'detail_every'\?"),
        ({"xyzzy": 1}, r"unknown option 'xyzzy'; see the DebugConfig docstring"),
        ({"detail_every": True}, r"detail_every=True \(bool\) is not valid; expected an integer >= 1"),
        ({"detail_every": 5.0}, r"detail_every=5.0 \(float\) is not valid"),
        ({"detail_every": 0}, r"detail_every=0 is out of range; expected an integer >= 1"),
        ({"gradient_checking_frequency": 0}, r"gradient_checking_frequency=0 is out of range"),
        ({"frames": -1}, r"frames=-1 is out of range; expected an integer >= 0"),
        ({"replay": "true"}, r"replay='true' \(str\).*text is parsed only from TORCHDEBUG_\* variables"),
        ({"replay": 1}, r"replay=1 \(int\) is not valid; expected True or False"),
        ({"explode_abs": True}, r"explode_abs=True \(bool\)"),
        ({"explode_abs": float("nan")}, r"explode_abs=nan must be finite"),
        ({"explode_abs": float("inf")}, r"explode_abs=inf must be finite"),
        (
            {"dead_unit_fraction": 0},
            r"dead_unit_fraction=0.0 is out of range; expected a finite number > 0 and <= 1",
        ),
        ({"input_bound_fraction": 1.5}, r"input_bound_fraction=1.5 is out of range"),
        ({"slowdown_factor": 1.0}, r"slowdown_factor=1.0 is out of range; expected a finite number > 1"),
        ({"update_ratio_min": 2.0}, r"update_ratio_min \(2.0\) must be below update_ratio_max \(1.0\)"),
        (
            {"policy": "explode"},
            r"policy='explode' \(str\) is not valid; expected one of 'raise', 'warn', 'skip'",
        ),
        ({"on_oom": "retry"}, r"expected one of 'raise', 'retry_half'"),
        ({"anomaly_detection_mode": "skip"}, r"expected one of 'warn', 'raise'"),
        (
            {"mode": "debug"},
            r"mode='debug' \(str\) is not valid; expected one of 'none', 'anomaly_detection'",
        ),
        ({"level": 2}, r"level=2 \(int\) is not valid; expected one of 'basic', 'intermediate', 'advanced'"),
        ({"mode": DebugLevel.BASIC}, r"mode=<DebugLevel.BASIC: 'basic'>"),
        ({"run_name": "a/b"}, r"run_name='a/b' must not contain a path separator"),
        ({"run_dir": ""}, r"run_dir='' \(str\) is not valid; expected a non-empty string"),
        ({"run_dir": None}, r"run_dir=None is not allowed"),
        ({"tensorboard": 1}, r"tensorboard=1 \(int\) is not valid; expected True/False or a directory path"),
        ({"rank": -1}, r"rank=-1 is out of range; expected an integer >= 0 or None"),
        ({"peak_flops": 0}, r"peak_flops=0.0 is out of range; expected a finite number > 0 or None"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_invalid_options_raise_config_error_naming_the_field(options, message):
    with pytest.raises(ConfigError, match=message) as info:
        DebugConfig(**options)
    assert isinstance(info.value, ValueError)


def test_accepted_conversions():
    cfg = DebugConfig(
        explode_abs=100, dead_unit_fraction=1, tensorboard="tb", peak_flops=10**15, run_name="exp1"
    )
    assert cfg.explode_abs == 100.0 and type(cfg.explode_abs) is float  # int for float is fine
    assert cfg.dead_unit_fraction == 1.0 and cfg.tensorboard == "tb" and cfg.peak_flops == 1e15
    assert DebugConfig(policy="WARN").policy == "warn"


def test_assignment_is_validated_and_a_failed_one_changes_nothing():
    cfg = DebugConfig()
    cfg.policy = "Skip"  # type: ignore[assignment]
    cfg.level = "advanced"  # type: ignore[assignment]
    assert cfg.policy == "skip" and cfg.level is DebugLevel.ADVANCED
    with pytest.raises(ConfigError, match="out of range"):
        cfg.detail_every = 0
    with pytest.raises(ConfigError, match="must be below update_ratio_max"):
        cfg.update_ratio_min = 2.0
    assert cfg.detail_every == 10 and cfg.update_ratio_min == 1e-5
    with pytest.raises(ConfigError, match="did you mean 'detail_every'"):
        cfg.detial_every = 3  # type: ignore[attr-defined]


def test_replace_returns_a_validated_copy():
    cfg = DebugConfig(policy="warn")
    new = cfg.replace(update_ratio_min=0.2, update_ratio_max=0.5, level="basic")
    assert (new.update_ratio_min, new.update_ratio_max, new.level, new.policy) == (0.2, 0.5, "basic", "warn")
    assert cfg.update_ratio_max == 1.0  # original untouched
    with pytest.raises(ConfigError, match="did you mean 'policy'"):
        cfg.replace(polcy="skip")
    with pytest.raises(ConfigError, match="out of range"):
        cfg.replace(memory_every=0)


# ---------------------------------------------------------------- dict, JSON, repr, copies


def test_to_dict_round_trip_and_strict_json():
    cfg = DebugConfig(
        mode="profiling",
        level="expert",
        policy="skip",
        run_name="exp",
        tensorboard="tb",
        report_to=["wandb", "logging"],
        clip_on_spike=1.0,
        rank=3,
        detail_every=1,
    )
    d = cfg.to_dict()
    assert d["report_to"] == ["wandb", "logging"]  # a list, as JSON has it
    assert d["mode"] == "profiling" and d["level"] == "expert" and type(d["mode"]) is str
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert DebugConfig.from_dict(d) == cfg
    assert DebugConfig.from_dict(json.loads(json.dumps(d))) == cfg


def test_repr_lists_only_changes_and_evaluates_back():
    cfg = DebugConfig(level="extreme", replay=False, detail_every=5)
    assert repr(cfg) == "DebugConfig(level='expert', replay=False, detail_every=5)"
    assert eval(repr(cfg), {"DebugConfig": DebugConfig}) == cfg


def test_copy_and_pickle_keep_equality():
    cfg = DebugConfig(policy="warn", frames=4)
    assert copy.deepcopy(cfg) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg
    assert cfg != DebugConfig()


def test_from_dict_is_strict():
    with pytest.raises(TypeError, match="expects a mapping"):
        DebugConfig.from_dict([("policy", "warn")])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="option names must be strings"):
        DebugConfig.from_dict({1: "x"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="did you mean 'frames'"):
        DebugConfig.from_dict({"frame": 3})


# ---------------------------------------------------------------- files


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_toml_top_level(tmp_path):
    f = _write(
        tmp_path / "td.toml", 'policy = "warn"\ndetail_every = 5\nlevel = "Advanced"\nreplay = false\n'
    )
    cfg = DebugConfig.from_file(f)
    assert (cfg.policy, cfg.detail_every, cfg.level, cfg.replay) == ("warn", 5, DebugLevel.ADVANCED, False)


def test_toml_torchdebug_table_ignores_other_tools(tmp_path):
    f = _write(
        tmp_path / "conf.toml", "[other]\nx = 1\n\n[torchdebug]\nmemory_every = 7\nexplode_abs = 100\n"
    )
    cfg = DebugConfig.from_file(str(f))
    assert cfg.memory_every == 7 and cfg.explode_abs == 100.0


def test_pyproject_tool_table(tmp_path):
    f = _write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n\n[tool.torchdebug]\npolicy = "skip"\n')
    assert DebugConfig.from_file(f).policy == "skip"


def test_yaml_top_level_and_table(tmp_path):
    pytest.importorskip("yaml")
    top = DebugConfig.from_file(_write(tmp_path / "a.yaml", "mode: Gradient_Checking\nframes: 2\n"))
    assert (top.mode, top.frames) == (DebugMode.GRADIENT_CHECKING, 2)
    table = _write(tmp_path / "b.yml", "torchdebug:\n  tensorboard: logs/tb\n  rank: 0\nsomething_else: 1\n")
    cfg = DebugConfig.from_file(table)
    assert (cfg.tensorboard, cfg.rank) == ("logs/tb", 0)
    assert DebugConfig.from_file(_write(tmp_path / "empty.yaml", "")) == DebugConfig()


def test_json_file(tmp_path):
    f = _write(tmp_path / "c.json", json.dumps(DebugConfig(policy="warn", frames=3).to_dict()))
    assert DebugConfig.from_file(f) == DebugConfig(policy="warn", frames=3)


def test_file_errors_name_the_file(tmp_path):
    bad_key = _write(tmp_path / "k.toml", "detail_evrey = 3\n")
    with pytest.raises(
        ConfigError, match=r"k\.toml: unknown option 'detail_evrey'; did you mean 'detail_every'"
    ):
        DebugConfig.from_file(bad_key)
    bad_value = _write(tmp_path / "v.toml", 'policy = "panic"\n')
    with pytest.raises(ConfigError, match=r"v\.toml: policy='panic' \(str\) is not valid; expected one of"):
        DebugConfig.from_file(bad_value)
    broken = _write(tmp_path / "broken.toml", "policy = \n")
    with pytest.raises(ConfigError, match=r"broken\.toml: cannot parse TOML"):
        DebugConfig.from_file(broken)
    not_a_mapping = _write(tmp_path / "list.json", "[1, 2]")
    with pytest.raises(ConfigError, match="expected a mapping of options, got list"):
        DebugConfig.from_file(not_a_mapping)
    with pytest.raises(
        ConfigError, match=r"unknown config file type '\.ini'; use \.yaml, \.yml, \.toml or \.json"
    ):
        DebugConfig.from_file(_write(tmp_path / "x.ini", "a=1"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DebugConfig.from_file(tmp_path / "missing.toml")


def test_yaml_without_pyyaml_names_the_extra(tmp_path, monkeypatch):
    f = _write(tmp_path / "a.yaml", "policy: warn\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail as if not installed
    with pytest.raises(ImportError, match=r"pip install torchdebug\[config\]"):
        DebugConfig.from_file(f)


# ---------------------------------------------------------------- environment


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", True),
        ("0", False),
        ("TRUE", True),
        ("false", False),
        ("Yes", True),
        ("no", False),
        ("on", True),
        ("OFF", False),
    ],
)
def test_env_booleans(text, value):
    assert DebugConfig.from_env({"TORCHDEBUG_REPLAY": text}).replay is value


def test_env_parses_every_kind():
    cfg = DebugConfig.from_env(
        {
            "TORCHDEBUG_POLICY": "WARN",
            "TORCHDEBUG_DETAIL_EVERY": "5",
            "TORCHDEBUG_VANISH_THRESHOLD": "1e-6",
            "TORCHDEBUG_LEVEL": "extreme",
            "TORCHDEBUG_MODE": "memory-profiling",
            "TORCHDEBUG_RUN_NAME": "exp",
            "TORCHDEBUG_CLIP_ON_SPIKE": "none",
            "TORCHDEBUG_TENSORBOARD": "runs/tb",
            "TORCHDEBUG_RANK": "2",
            "TORCHDEBUG_CONFIG": "ignored-by-from_env.toml",
            "HOME": "/root",  # not ours
        }
    )
    assert (cfg.policy, cfg.detail_every, cfg.vanish_threshold) == ("warn", 5, 1e-6)
    assert (cfg.level, cfg.mode, cfg.run_name) == (DebugLevel.EXPERT, DebugMode.MEMORY_PROFILING, "exp")
    assert (cfg.clip_on_spike, cfg.tensorboard, cfg.rank) == (None, "runs/tb", 2)
    assert DebugConfig.from_env({"TORCHDEBUG_TENSORBOARD": "yes"}).tensorboard is True


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"TORCHDEBUG_DETAIL_EVRY": "5"},
            r"unknown environment variable TORCHDEBUG_DETAIL_EVRY; did you mean TORCHDEBUG_DETAIL_EVERY\?",
        ),
        (
            {"TORCHDEBUG_DETAIL_EVERY": "five"},
            r"TORCHDEBUG_DETAIL_EVERY='five' cannot be read; expected an integer >= 1",
        ),
        ({"TORCHDEBUG_DETAIL_EVERY": "0"}, r"TORCHDEBUG_DETAIL_EVERY=0 is out of range"),
        (
            {"TORCHDEBUG_REPLAY": "maybe"},
            r"TORCHDEBUG_REPLAY='maybe' cannot be read; expected 1/0, true/false, yes/no or on/off",
        ),
        (
            {"TORCHDEBUG_POLICY": "loud"},
            r"TORCHDEBUG_POLICY='loud' \(str\) is not valid; expected one of 'raise', 'warn', 'skip'",
        ),
        (
            {"TORCHDEBUG_RUN_DIR": ""},
            r"TORCHDEBUG_RUN_DIR='' \(str\) is not valid; expected a non-empty string",
        ),
    ],
    ids=["unknown", "not-int", "range", "not-bool", "choice", "empty-not-optional"],
)
def test_env_errors_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        DebugConfig.from_env(env)


def test_env_mapping_given_by_hand_may_hold_typed_values():
    assert DebugConfig.from_env({"TORCHDEBUG_FRAMES": 4, "TORCHDEBUG_REPLAY": False}).frames == 4
    with pytest.raises(ConfigError, match=r"TORCHDEBUG_FRAMES=4.0 \(float\) is not valid"):
        DebugConfig.from_env({"TORCHDEBUG_FRAMES": 4.0})


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("TORCHDEBUG_MEMORY_EVERY", "9")
    assert DebugConfig.from_env().memory_every == 9


# ---------------------------------------------------------------- load precedence and coerce_config


@pytest.fixture
def layered(tmp_path):
    """A file and an environment that disagree, to test precedence."""
    f = _write(tmp_path / "td.toml", 'policy = "warn"\ndetail_every = 3\nframes = 8\n')
    env = {"TORCHDEBUG_DETAIL_EVERY": "5", "TORCHDEBUG_POLICY": "skip", "TORCHDEBUG_CONFIG": str(f)}
    return f, env


def test_load_precedence_defaults_file_env_kwargs(layered):
    f, env = layered
    cfg = DebugConfig.load(file=f, env=env, policy="raise")
    # frames from the file, detail_every from env (beats file), policy from kwargs (beats both)
    assert (cfg.frames, cfg.detail_every, cfg.policy, cfg.memory_every) == (8, 5, "raise", 50)


def test_load_finds_the_file_through_torchdebug_config(layered):
    _, env = layered
    cfg = DebugConfig.load(env=env)
    assert (cfg.frames, cfg.detail_every, cfg.policy) == (8, 5, "skip")
    assert DebugConfig.load(env=False) == DebugConfig()  # neither variables nor TORCHDEBUG_CONFIG


def test_load_explicit_file_wins_over_torchdebug_config(layered, tmp_path):
    _, env = layered
    other = _write(tmp_path / "other.toml", "frames = 2\n")
    assert DebugConfig.load(file=other, env=env).frames == 2


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="TORCHDEBUG_CONFIG="):
        DebugConfig.load(env={"TORCHDEBUG_CONFIG": str(tmp_path / "nope.toml")})
    with pytest.raises(ConfigError, match="did you mean 'frames'"):
        DebugConfig.load(env=False, frame=3)
    with pytest.raises(TypeError, match="env must be True, False or a mapping"):
        DebugConfig.load(env=1)  # type: ignore[arg-type]


def test_load_reads_os_environ(monkeypatch):
    monkeypatch.setenv("TORCHDEBUG_POLICY", "warn")
    assert DebugConfig.load().policy == "warn"
    assert DebugConfig.load(policy="skip").policy == "skip"


def test_coerce_config(monkeypatch, layered):
    f, _ = layered
    cfg = DebugConfig(frames=1)
    assert coerce_config(cfg) is cfg
    monkeypatch.setenv("TORCHDEBUG_MEMORY_EVERY", "7")
    assert coerce_config(None).memory_every == 7  # honours the environment
    from_dict = coerce_config({"policy": "skip", "memory_every": 9})
    assert (from_dict.policy, from_dict.memory_every) == ("skip", 9)  # dict beats env
    assert coerce_config({"policy": "skip"}).memory_every == 7  # env fills the rest
    for path in (f, str(f)):
        by_path = coerce_config(path)
        assert (by_path.frames, by_path.memory_every, by_path.policy) == (8, 7, "warn")
    with pytest.raises(
        TypeError, match=r"config must be a DebugConfig, a dict of options, a path .* got int"
    ):
        coerce_config(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown option 'file'"):
        coerce_config({"file": str(f)})


def test_report_to_names_from_every_source(tmp_path: Path) -> None:
    # a name or a list, normalised, deduplicated, "none" dropped; "all" kept (resolved when a session starts)
    assert DebugConfig(report_to="WandB").report_to == ("wandb",)
    assert DebugConfig(report_to=["mlflow", "none", "mlflow", "all"]).report_to == ("mlflow", "all")
    assert DebugConfig(report_to="none").report_to == ()
    assert DebugConfig.from_env({"TORCHDEBUG_REPORT_TO": "tensorboard, logging"}).report_to == (
        "tensorboard",
        "logging",
    )
    cfg = DebugConfig.from_file(_write(tmp_path / "c.yml", "report_to: [wandb, mlflow]\n"))
    assert cfg.report_to == ("wandb", "mlflow")
    assert DebugConfig.from_dict({"report_to": ["wandb"]}) == DebugConfig(report_to=("wandb",))
    with pytest.raises(
        ConfigError,
        match=r"report_to: unknown name 'neptune'; expected a name or a list of names from 'tensorboard', 'wandb', 'mlflow', 'logging', 'all', 'none'",
    ):
        DebugConfig(report_to=["wandb", "neptune"])
    with pytest.raises(ConfigError, match=r"report_to=3 \(int\) is not valid"):
        DebugConfig(report_to=3)
