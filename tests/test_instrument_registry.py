"""One instrument registry: every entry imports, and the config, the session and the docs read it.

The config decides which names run (``config.instruments()``), the session builds a class for each
name; both take them from ``torchdebug._instruments.REGISTRY``, so neither can name an instrument the
other does not know.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug import _config
from torchdebug._config import INSTRUMENTS, INSTRUMENTS_BY_SWITCH, DebugConfig, DebugLevel, DebugMode
from torchdebug._instruments import REGISTRY, spec
from torchdebug._step import Instrument

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "torchdebug"
NAMES = [s.name for s in REGISTRY]


def test_the_registry_holds_each_instrument_once_in_report_order() -> None:
    assert NAMES == [
        "nonfinite",
        "gradients",
        "gradient_details",
        "memory",
        "module_memory",
        "timing",
        "flops",
        "module_time",
        "activations",
        "profiler",
        "device_placement",
        "step_details",
    ]
    with pytest.raises(KeyError, match="no instrument 'nope'; known: nonfinite, gradients"):
        spec("nope")


@pytest.mark.parametrize("entry", REGISTRY, ids=NAMES)
def test_every_entry_imports_and_is_the_instrument_it_names(entry) -> None:
    cls = entry.load()
    assert inspect.isclass(cls) and cls.__name__ == entry.cls and cls.__module__ == entry.module
    assert entry.area == entry.module.split(".")[1]  # the capability folder it lives in
    assert entry.cost and entry.records
    if entry.built:  # the session builds it with no arguments
        inst = cls()
        assert isinstance(inst, Instrument) and inst.name == entry.name
    else:
        assert entry.name == "nonfinite" and cls is td.nonfinite.sentinel.Sentinel


@pytest.mark.parametrize("entry", REGISTRY, ids=NAMES)
def test_every_named_level_mode_switch_and_neighbour_exists(entry) -> None:
    fields = {f.name: f for f in dataclasses.fields(DebugConfig)}
    assert entry.level is None or DebugLevel(entry.level).value == entry.level
    assert entry.modes or entry.level is None  # a level only means something through a mode
    for mode in (*entry.modes, *entry.always_in):
        assert DebugMode(mode).value == mode
    for switch in entry.switches:
        assert fields[switch].default is False, switch  # a switch that defaults on would start it always
    for other in (*entry.brings, *([entry.within] if entry.within else [])):
        assert other in NAMES


def _every_config() -> list[DebugConfig]:
    configs = [DebugConfig(mode=m, level=lv) for m in DebugMode for lv in DebugLevel]
    configs += [DebugConfig(mode="none", **{switch: True}) for switch in INSTRUMENTS_BY_SWITCH]
    return configs


def test_the_config_names_only_registered_instruments() -> None:
    named = set().union(*(c.instruments() for c in _every_config()))
    assert named == set(NAMES)  # and every registered one is reachable from some config
    assert tuple(n for n in NAMES if n not in ("device_placement", "step_details")) == INSTRUMENTS
    assert set(INSTRUMENTS_BY_SWITCH) == {sw for s in REGISTRY for sw in s.switches}


@pytest.mark.parametrize(
    ("switch", "started"),
    [
        ("debug_device_placement", {"device_placement"}),
        ("debug_forward_pass", {"activations", "step_details"}),
        ("debug_data_loading", {"timing", "step_details"}),
        ("log_weights", {"gradient_details", "nonfinite"}),  # a gradient instrument brings the sentinel
        ("per_module_time", {"module_time"}),
    ],
)
def test_a_switch_alone_starts_what_the_registry_says(switch, started) -> None:
    assert DebugConfig(mode="none", **{switch: True}).instruments() == frozenset(started)


def test_no_other_module_declares_instruments() -> None:
    """Outside the registry no module-level table names instruments: the config's are derived."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "_instruments.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if not any(isinstance(t, ast.Name) and "INSTRUMENT" in t.id for t in targets):
                continue
            literals = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
            if literals & set(NAMES):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == []
    assert not hasattr(importlib.import_module("torchdebug.session.control"), "INSTRUMENTS")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.act = nn.ReLU()
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


def _built(cfg: DebugConfig, tmp_path: Path) -> dict[str, str]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, config=cfg.replace(store=False)) as mon:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step()
        built = {i.name: type(i).__name__ for i in mon.instruments if i.name in NAMES}
    return built


def test_the_session_builds_the_registered_class_for_each_name_the_config_runs(tmp_path: Path) -> None:
    # full_debug at expert plus both switch-only instruments: everything but what runs within
    # GradientHealth (activations and gradient_details: one set of hooks) and the sentinel (held by
    # the session from its start, not in the instrument list)
    cfg = DebugConfig(mode="full_debug", level="expert", debug_device_placement=True, debug_validation=True)
    assert cfg.instruments() == frozenset(NAMES)
    assert _built(cfg, tmp_path) == {
        "gradients": "GradientHealth",
        "memory": "MemoryInstrument",
        "module_memory": "ModuleMemoryInstrument",
        "timing": "TimingInstrument",
        "flops": "FlopsInstrument",
        "module_time": "ModuleTimeInstrument",
        "profiler": "ProfilerInstrument",
        "device_placement": "DevicePlacementInstrument",
        "step_details": "StepDetails",
    }


def test_parts_of_gradient_health_run_alone_without_it(tmp_path: Path) -> None:
    cfg = DebugConfig(mode="none", log_weights=True, activation_stats=True)
    assert cfg.instruments() == {"nonfinite", "gradient_details", "activations"}
    assert _built(cfg, tmp_path) == {
        "gradient_details": "WeightInstrument",
        "activations": "ActivationInstrument",
    }


def _hooks():
    loader = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_the_configuration_reference_lists_each_instrument_from_the_registry() -> None:
    page = _hooks().configuration_page()
    section = page.split("## Instruments\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == NAMES
    assert rows[NAMES.index("profiler")].startswith(
        "| `profiler` | a torch.profiler trace (Perfetto) and the top ops and modules by self time | expert | "
        "`profiling`, `full_debug` | `enable_autograd_profiler`, `enable_tensorboard_profiler` |"
    )
    assert "| `device_placement` | " in page and "| switches only | - | `debug_device_placement` |" in page


def test_the_config_docstring_maps_each_switch_as_the_registry_does() -> None:
    """Every ``a / b -> name`` in DebugConfig's docstring agrees with the registry, and every switch is named."""
    doc = " ".join((DebugConfig.__doc__ or "").split())
    pairs = re.findall(r"((?:\w+ / )*\w+) -> (\w+)", doc)
    assert len(pairs) == 11  # the groups of the paragraph "Switches that add an instrument"
    for switches, name in pairs:
        for switch in switches.split(" / "):
            assert name in INSTRUMENTS_BY_SWITCH[switch], (switch, name)
    for switch in INSTRUMENTS_BY_SWITCH:
        assert switch in doc, switch
    assert _config._instrument_table().splitlines()[0].split() == [
        "mode",
        "basic",
        "intermediate",
        "advanced",
        "expert",
    ]


@pytest.mark.parametrize("entry", REGISTRY, ids=NAMES)
def test_each_instrument_receives_the_typed_session_view(entry) -> None:
    """Every method of an instrument that takes the session takes it as ``SessionView`` (mypy checks
    the rest: what it reads is a member of the view, and ``Monitor`` satisfies the view)."""
    methods = {n: f for n, f in vars(entry.load()).items() if inspect.isfunction(f)}
    typed = {
        n: f.__annotations__["mon"] for n, f in methods.items() if "mon" in inspect.signature(f).parameters
    }
    assert typed or not entry.built
    assert {n: a for n, a in typed.items() if a not in ("SessionView", "SessionView | None")} == {}


def test_nothing_in_the_package_takes_the_session_as_any() -> None:
    loose = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                named = [(a.arg, a.annotation) for a in node.args.args + node.args.kwonlyargs]
            elif isinstance(node, ast.AnnAssign):
                named = [(ast.unparse(node.target).removeprefix("self."), node.annotation)]
            else:
                continue
            for arg, annotation in named:
                if arg == "mon" and (annotation is None or ast.unparse(annotation) == "Any"):
                    loose.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert loose == []
