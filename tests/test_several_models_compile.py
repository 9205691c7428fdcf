"""Several models, one of them ``torch.compile``d: ``td.watch([torch.compile(G), D], [opt_g, opt_d])``.

Names stay model-qualified without ``_orig_mod``; the compiled model stays compiled (its graphs counted
with a backend that records each graph Dynamo hands it and runs it as is: the graphs of
``backend="eager"``, no codegen); a fault in either model, the compiled one included, is located.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import gan_script
from tests.fixtures.dynamo import counting_backend, fresh_dynamo  # noqa: F401 (fresh_dynamo: autouse)
from tests.fixtures.gan_script import Discriminator, Generator, gan_step
from tests.fixtures.models import origin_line
from torchdebug.store import open_run

BAD_STEP = 2


def _run(
    backend: Any, fault: str = "", steps: int = 4, in_place: bool = False, **watch_kw: Any
) -> tuple[Any, nn.Module, nn.Module]:
    """The DCGAN loop of tests/test_several_models.py with G compiled (``torch.compile(G)``, or
    ``G.compile()`` in place); ``fault`` switched on at BAD_STEP."""
    torch.manual_seed(0)
    if in_place:
        G = g_net = Generator()
        G.compile(backend=backend)
        compiled_call = G._compiled_call_impl
    else:
        G = torch.compile(Generator(), backend=backend)
        g_net = G._orig_mod
    D = Discriminator()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(1)
    mon = td.watch([G, D], [opt_g, opt_d], **watch_kw)
    try:
        with mon:
            for step in range(steps):
                x, z = torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)
                if step == BAD_STEP:
                    if fault == "D.forward":
                        D[1].mode = "forward"
                    elif fault == "G.forward":
                        g_net.main[1].mode = "forward"
                    elif fault == "G.backward":
                        g_net.main[1].mode = "backward"
                gan_step(G, D, opt_g, opt_d, x, z)
                mon.step()
    finally:
        # everything comes off the compiled wrapper and both models, also when the fault raised
        assert all(
            not m._forward_pre_hooks and not m._forward_hooks for m in [G, *g_net.modules(), *D.modules()]
        )
        if in_place:
            assert G._compiled_call_impl is compiled_call  # its compiled call as it was
    return mon, G, D


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapper", "in-place"])
def test_a_compiled_model_is_named_as_itself_and_stays_one_graph(tmp_path: Path, in_place: bool) -> None:
    graphs: list[int] = []
    cfg = td.DebugConfig(mode="gradient_checking", detail_every=2)
    mon, G, _ = _run(counting_backend(graphs), in_place=in_place, run=tmp_path, config=cfg)
    assert mon.anomalies == [] and [e for e in mon.events if e.severity != "info"] == []
    assert mon.param_names == [
        "G.main.0.weight",
        "G.main.0.bias",
        "G.main.2.weight",
        "G.main.2.bias",
        "D.0.weight",
        "D.0.bias",
        "D.2.weight",
        "D.2.bias",
    ]
    assert sorted(mon.names.values()) == ["", "D", "D.0", "D.1", "D.2", "D.3", "G", "G.main"] + [
        f"G.main.{k}" for k in range(3)
    ]
    assert mon.roots is not None and mon.roots["G"] is G  # its forward is seen where the loop calls it
    # G compiled once for its 4 steps; the session knows one of its models runs compiled, so the
    # per-module instruments stand down (their hooks would see nothing inside it)
    assert mon.compiled and len(graphs) == 1
    assert [r.micro_steps for r in mon.records] == [2, 2, 2, 2]
    with open_run(mon.run_dir) as run:
        stored = run.metric_names()
        assert not [n for n in stored if "_orig_mod" in n]
        assert "update_ratio/G.main.0.weight" in stored and "update_ratio/D.0.weight" in stored
        assert run.series("lr/G/0").values == [1e-3] * 4 and run.series("lr/D/0").values == [2e-3] * 4


CASES = [
    # fault, phase, module, op, origin tag (tests/fixtures/gan_script.py)
    ("D.forward", "forward", "D.1", "aten.sqrt", "fault_forward"),
    ("G.forward", "forward", "G.main.1", "aten.sqrt", "fault_forward"),
    ("G.backward", "backward", "G.main.1", "SqrtBackward0", "fault_backward"),
]


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapper", "in-place"])
@pytest.mark.parametrize(("fault", "phase", "module", "op", "tag"), CASES, ids=[c[0] for c in CASES])
def test_a_fault_in_either_model_is_located_with_the_compiled_one_replayed_eagerly(
    fault: str, phase: str, module: str, op: str, tag: str, in_place: bool
) -> None:
    # aot_eager: the forward and backward graphs traced by AOTAutograd, as inductor would get them.
    # In place (G.compile()): before, G's forward fault was named in D and its backward's replay failed
    with pytest.raises(td.NonFiniteError) as info:
        _run("aot_eager", fault, in_place=in_place, run=False)
    a = info.value.anomaly
    assert (a.phase, a.module, a.op, a.step) == (phase, module, op, BAD_STEP), str(a)
    assert a.location == origin_line(tag, gan_script.__file__)
