"""The step's path stays short: the state is handed over, never reached for (docs/architecture.md,
"The step's path").

A tracer (``sys.setprofile``) over one ordinary step of a fixed model and loop under the default
``watch`` counts the Python functions of torchdebug that run (comprehensions and lambdas left out: they
are inlined from Python 3.12 on) and the calls back into a file already on the stack (``a.py`` calls
``b.py``, which calls back into ``a.py``). Like a benchmark it is a regression test: the numbers say
whether the house got simpler. Measured on this loop: 271 calls and 31 call-backs when the sentinel
reached the step through the session (``mon.transfer``, ``sentinel.st``), 179 and 4 since the step is
handed over, 135 and 0 since the instruments' and rules' per-step Python was cut. The static half pins what keeps it so: the sentinel holds no session, the coordinator
never calls the sentinel, the step state has no flags, and no class of the core is over 600 lines with
the bases it inherits from the package (the session holds its parts as members: ``Step``, ``Models``,
``Recording``, ``Controls``).
"""

from __future__ import annotations

import ast
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchdebug as td
from tests._imports import ROOT

MAX_CALLS = 135  # torchdebug's Python calls in one ordinary step of the loop below
MAX_CALL_BACKS = 10  # calls into a file already on the stack, in that step
MAX_CLASS_LINES = 600  # a class of session/, nonfinite/ or _step.py, with the bases it inherits from them


def _trace_step(tmp_path: Path, index: int = 3) -> tuple[int, int, list[str]]:
    """(calls, call-backs, the call-backs' names) of step ``index`` (an ordinary one: not the first,
    not a detail step) of a two-layer MLP with Adam under the default watch, recording to a run folder."""
    src = str(Path(td.__file__).parent)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    calls = backs = 0
    where: list[str] = []
    stack: list[str | None] = []  # the file of each frame the tracer saw called, None: not torchdebug's

    def prof(frame: types.FrameType, event: str, arg: Any) -> None:
        nonlocal calls, backs
        if event == "call":
            f = frame.f_code.co_filename
            ours = f.startswith(src)
            if ours and not frame.f_code.co_name.startswith("<"):
                calls += 1
                caller = stack[-1] if stack else None
                if caller is not None and caller != f and f in stack:
                    backs += 1
                    where.append(f"{Path(caller).name} -> {Path(f).name}:{frame.f_code.co_name}")
            stack.append(f if ours else None)
        elif event == "return" and stack:
            stack.pop()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with td.watch(model, opt, run=str(tmp_path / "runs"), announce=False) as mon:
            # the machine's contention is read at steps 0, 1, 2, 4, ... and every 0.25 s (one call
            # more on such a step): on a loaded machine step 3 could pass 0.25 s; only the former here
            for inst in mon.instruments:
                if inst.name == "timing":
                    inst.contention_every_s = float("inf")
            for i in range(index + 1):
                traced = i == index
                if traced:
                    sys.setprofile(prof)
                try:
                    opt.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    mon.step()
                finally:
                    if traced:
                        sys.setprofile(None)
    assert mon.global_step == index + 1 and mon.anomalies == []
    return calls, backs, where


def test_one_ordinary_step_makes_few_calls_and_few_call_backs(tmp_path: Path) -> None:
    calls, backs, where = _trace_step(tmp_path)
    # the tracer sees the step's path at all: forward, backward, update and step end each call in
    assert calls > 60
    assert calls <= MAX_CALLS, f"{calls} torchdebug calls in one ordinary step (at most {MAX_CALLS})"
    assert backs <= MAX_CALL_BACKS, f"{backs} call-backs into a file on the stack: {where}"


def _src(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


def test_the_sentinel_holds_no_session() -> None:
    texts = {f.name: f.read_text(encoding="utf-8") for f in sorted((ROOT / "nonfinite").glob("*.py"))}
    assert "sentinel.py" in texts and "edits.py" in texts
    assert {n: t.count("self.mon") for n, t in texts.items() if "self.mon" in t} == {}
    tree = ast.parse(texts["sentinel.py"])
    init = next(
        n
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and c.name == "Sentinel"
        for n in c.body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    assert [a.arg for a in init.args.args] == ["self", "params", "names", "config"]


def test_the_coordinator_never_calls_the_sentinel() -> None:
    text = _src("session/distributed.py")
    assert "def agree(" in text  # the coordinator's one step between the read and the verdict
    assert text.count("mon.sentinel") == 0 and text.count(".sentinel.") == 0


def test_the_step_state_has_no_flags() -> None:
    tree = ast.parse(_src("_step.py"))
    state = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "StepState")
    fields = {
        n.target.id: ast.unparse(n.annotation)
        for n in state.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert {"phase", "update", "found", "transfer"} <= set(fields)  # the parser sees the fields
    assert {k: a for k, a in fields.items() if a == "bool"} == {}


def test_no_class_of_the_core_is_over_600_lines_with_its_package_bases() -> None:
    files = [*sorted((ROOT / "session").glob("*.py")), *sorted((ROOT / "nonfinite").glob("*.py"))]
    files.append(ROOT / "_step.py")
    classes: dict[str, tuple[int, list[str]]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                # two classes of one name (in two files): the larger one is measured
                classes[node.name] = max(
                    classes.get(node.name, (0, [])), (lines, [ast.unparse(b) for b in node.bases])
                )

    def size(name: str) -> int:
        lines, bases = classes[name]
        return lines + sum(size(b) for b in bases if b in classes and b != name)

    assert {"Monitor", "Sentinel", "Step", "StepState", "Coordinator", "Models", "Controls"} <= set(classes)
    # the session holds its parts (members, not mixins): none of its bases is a class of the package
    assert {
        k: b for k in ("Monitor", "Sentinel", "Step") if (b := [x for x in classes[k][1] if x in classes])
    } == {}
    assert {k: size(k) for k in classes if size(k) > MAX_CLASS_LINES} == {}
