"""FLOPs: hand-worked matmul counts, per-module split, the uncounted-op list, the instrument and MFU."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import torchdebug.session.monitor as tdm
from tests.fixtures.memory_models import known_saves_model
from torchdebug.perf.flops import count_flops, peak_flops_for
from torchdebug.store import open_run


def test_linear_forward_and_backward_by_hand():
    torch.manual_seed(0)
    B, i, o = 8, 64, 32
    lin = nn.Linear(i, o)
    # forward addmm (B, i) @ (i, o): 2*B*i*o = 2*8*64*32 = 32768
    assert count_flops(lin, torch.randn(B, i), backward=False).forward == 32768
    rep = count_flops(lin, torch.randn(B, i))
    # backward, input needs no grad: only grad_W = grad_out^T @ x, (o, B) @ (B, i): 2*o*B*i = 32768
    assert (rep.forward, rep.backward, rep.total) == (32768, 32768, 65536)
    rep = count_flops(lin, torch.randn(B, i, requires_grad=True))
    # ... and with grad_x = grad_out @ W, (B, o) @ (o, i): another 32768
    assert rep.backward == 65536
    assert rep.by_op == {"aten.mm": 65536, "aten.addmm": 32768}
    assert lin.weight.grad is None  # count_flops leaves gradients as they were


def test_per_module_split_and_uncounted_ops():
    model = known_saves_model()  # Linear(64, 32) -> ReLU -> Linear(32, 4)
    rep = count_flops(model, torch.randn(8, 64))
    # "0": fwd 2*8*64*32 = 32768; bwd grad_W only (input needs no grad) 32768
    # "2": fwd 2*8*32*4 = 2048; bwd grad_x (8,4)@(4,32) 2048 + grad_W (4,8)@(8,32) 2048 = 4096
    assert rep.by_module["0"] == {"forward": 32768, "backward": 32768}
    assert rep.by_module["2"] == {"forward": 2048, "backward": 4096}
    assert rep.by_module[""] == {"forward": 34816, "backward": 36864}
    assert "1" not in rep.by_module  # ReLU: no counted FLOPs
    # relu and its backward have no FLOP formula: listed, not silently counted as zero
    assert rep.uncounted["aten.relu"] == {"calls": 1, "output_elements": 8 * 32}
    assert rep.uncounted["aten.threshold_backward"]["calls"] == 1
    # views and copies are 0 FLOPs by definition, not "uncounted"
    assert not {"aten.t", "aten.view", "aten.detach", "aten.expand"} & set(rep.uncounted)
    assert "not counted (no FLOP formula): " in str(rep) and "aten.relu x1" in str(rep)
    d = rep.to_dict()
    assert d["total"] == 71680 and d["mfu"] is None


def test_conv_total_matches_flop_counter_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GELU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    x = torch.randn(2, 3, 8, 8)
    rep = count_flops(model, x)
    with FlopCounterMode(display=False) as ref:
        model(x).sum().backward()
    assert rep.total == ref.get_total_flops()
    # conv forward: 2 * B * C_out * H_out * W_out * C_in * k * k = 2*2*8*6*6*3*3*3 = 31104
    assert rep.by_module["0"]["forward"] == 31104
    assert "aten.gelu" in rep.uncounted


def test_count_flops_needs_a_differentiable_output():
    with torch.no_grad(), pytest.raises(ValueError, match="backward=False"):
        count_flops(nn.Linear(2, 2), torch.randn(1, 2))


def test_flops_instrument_counts_one_step_and_reports_mfu(tmp_path):
    model = known_saves_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = {"mode": "profiling", "level": "basic", "flops": True, "peak_flops": 1e9, "run_dir": str(tmp_path)}
    with tdm.watch(model, opt, config=cfg) as mon:
        for _ in range(14):
            for _micro in range(2):
                model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        inst = next(i for i in mon.instruments if i.name == "flops")
        run_dir = mon.run_dir
    rep = inst.report
    assert rep is not None and rep.step == 0
    # two micro-steps of the 71680-FLOP step above (pow/mean add no counted FLOPs)
    assert (rep.forward, rep.backward, rep.total) == (2 * 34816, 2 * 36864, 2 * 71680)
    assert rep.by_module["0"] == {"forward": 65536, "backward": 65536}
    # the monitor's own bookkeeping (gradient norms, flags) is not the model's work
    assert "aten._foreach_norm" not in rep.uncounted
    assert {"aten.relu", "aten.pow", "aten.mean"} <= set(rep.uncounted)
    assert rep.step_time_s is not None and rep.step_time_s > 0
    assert rep.mfu == pytest.approx(rep.total / rep.step_time_s / 1e9)
    run = open_run(run_dir)
    ev = run.events(kind="flops")
    assert len(ev) == 1 and ev[0]["data"]["total"] == 143360
    assert run.series("flops/mfu").values[0] == pytest.approx(rep.mfu)


def test_known_peaks():
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("Some New Accelerator") is None


class _Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.fail:
            raise ValueError("boom in forward")
        return h


@pytest.mark.parametrize("fail_step", [0, 1])
def test_exception_mid_step_leaves_no_mode_or_hook_behind(tmp_path, fail_step):
    from torch.nn.modules import module as module_mod
    from torch.overrides import _get_current_function_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    torch.manual_seed(0)
    model = _Boom()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = {
        "mode": "profiling",
        "level": "basic",
        "flops": True,  # counts step 0
        "per_module_time": True,  # measures steps 1..3
        "per_module_memory": True,  # measures due steps
        "debug_memory_usage": True,
        "memory_every": 1,
        "run_dir": str(tmp_path),
    }
    with pytest.raises(ValueError, match="boom"), tdm.watch(model, opt, config=cfg) as mon:
        for step in range(3):
            model.fail = step == fail_step
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    assert {i.name for i in mon.instruments} >= {"flops", "module_time", "module_memory", "memory"}
    assert _get_current_dispatch_mode() is None
    assert _get_current_function_mode() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not module_mod._global_forward_hooks and not module_mod._global_forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
