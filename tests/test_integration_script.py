"""`torchdebug run SCRIPT ...`: an unmodified nanoGPT-style script watched from outside."""

from __future__ import annotations

import json
import os

import pytest
import torch

import torchdebug as td
from tests.fixtures.models import origin_line
from torchdebug.cli import main
from torchdebug.store import open_run

SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "nanogpt_script.py")


def meta(run_root) -> dict:
    (run,) = [p for p in run_root.iterdir() if p.is_dir()]
    return json.loads((run / "meta.json").read_text())


def assert_clean_exit() -> None:
    assert td.session.driver._ACTIVE == [] and td.session.driver._ORIGINALS == {}
    assert torch.optim.Optimizer.__init__.__qualname__ == "Optimizer.__init__"


def test_run_finds_model_and_optimizer_and_names_the_injected_fault(tmp_path, capsys):
    code = main(["run", "--run-dir", str(tmp_path), SCRIPT, "--iters", "6", "--bad-iter", "3"])
    err = capsys.readouterr().err
    assert code == 3  # found a NaN/Inf: told apart from 1 (the script failed) and 4 (torchdebug failed)
    # iteration 3 is step 3; the first block's attention softmax over an all-padding row
    assert "nan born in forward of transformer.h.0.attn (CausalSelfAttention): aten._softmax" in err
    assert f"at {origin_line('script_softmax', SCRIPT)} (step 3)" in err
    assert "watched GPT with AdamW: 3 steps, 1 anomalies" in err
    assert meta(tmp_path)["status"] == "failed"
    assert_clean_exit()


def test_run_clean_script_counts_its_optimizer_steps(tmp_path, capsys):
    code = main(["run", "--run-dir", str(tmp_path), SCRIPT, "--iters", "5"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("done: loss ")
    assert "watched GPT with AdamW: 5 steps, 0 anomalies" in err
    assert meta(tmp_path)["status"] == "finished"
    assert_clean_exit()


def test_run_says_what_it_cannot_find(tmp_path, capsys):
    script = tmp_path / "no_opt.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 2)\nm(torch.ones(1, 2)).sum().backward()\n")
    assert main(["run", "--run-dir", str(tmp_path / "runs"), str(script)]) == 0
    err = capsys.readouterr().err
    assert "created no torch.optim optimizer, so no model was found; nothing was watched" in err
    assert "`with td.watch(model, optimizer) as mon:`" in err
    assert_clean_exit()


def test_run_missing_script_is_a_one_line_error(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.py")]) == 1
    assert "no such script" in capsys.readouterr().err


LOADS_NAN_CHECKPOINT = """
import sys
import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
if sys.argv[2] == "before":
    model.load_state_dict(torch.load(sys.argv[1]))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
if sys.argv[2] == "after":
    model.load_state_dict(torch.load(sys.argv[1]))  # resumed after the optimizer was made
with torch.no_grad():
    print("evaluated", model(torch.randn(3, 4)).sum().item())
torch.save(model.state_dict(), sys.argv[1] + ".resaved")
"""


@pytest.mark.parametrize(
    "when", ["before", "after"], ids=["loaded-before-optimizer", "loaded-after-optimizer"]
)
def test_run_reports_a_nan_checkpoint_before_the_model_is_evaluated_or_saved(tmp_path, capsys, when):
    torch.manual_seed(0)
    good = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = good.state_dict()
    state["2.weight"][1, 5] = float("nan")  # one NaN in the head
    ckpt = tmp_path / "ckpt.pt"
    torch.save(state, ckpt)
    script = tmp_path / "resume.py"
    script.write_text(LOADS_NAN_CHECKPOINT)
    code = main(["run", "--run-dir", str(tmp_path / "runs"), str(script), str(ckpt), when])
    out, err = capsys.readouterr()
    assert code == 3
    assert "evaluated" not in out and not (tmp_path / "ckpt.pt.resaved").exists()  # stopped before both
    assert "nan born in parameter of 2.weight (step 0)" in err
    when = "when the session started" if when == "before" else "when load_state_dict put it in the model"
    assert f"2.weight already holds 1 NaN / 0 Inf {when}, before any use" in err
    assert "watched Sequential with AdamW: 0 steps, 1 anomalies" in err
    assert_clean_exit()


GAN = os.path.join(os.path.dirname(__file__), "fixtures", "gan_script.py")


@pytest.mark.parametrize(
    ("bad", "compiled", "where"),
    [("D", False, "D.1"), ("G", True, "G.main.1")],
    ids=["D", "G-compiled"],
)
def test_run_watches_every_optimizer_of_a_gan_and_names_the_model(tmp_path, capsys, bad, compiled, where):
    args = [GAN, "--iters", "4", "--bad-iter", "2", "--bad-model", bad] + (
        ["--compile-g"] if compiled else []
    )
    code = main(["run", "--run-dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 3
    # D is watched too (its optimizer came second); one step per G-and-D iteration: iteration 2 is step 2.
    # G = torch.compile(Generator()): watched first as the wrapper, then one of two models: still named
    # G (not Generator, not _orig_mod) and its forward captured (before, its NaN was named in D)
    assert f"nan born in forward of {where} (Fault): aten.sqrt" in err
    assert f"at {origin_line('fault_forward', GAN)} (step 2)" in err
    assert "watched G and D with Adam and Adam: 2 steps, 1 anomalies" in err
    assert_clean_exit()


def test_run_of_a_clean_gan_counts_one_step_per_iteration(tmp_path, capsys):
    code = main(["run", "--run-dir", str(tmp_path), GAN, "--iters", "3"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("done: loss_d ")
    assert "watched G and D with Adam and Adam: 3 steps, 0 anomalies" in err
    assert meta(tmp_path)["status"] == "finished"
    assert_clean_exit()


DCGAN = os.path.join(os.path.dirname(__file__), "fixtures", "dcgan_script.py")


def test_run_of_the_dcgan_example_goes_on_past_a_loss_spike(tmp_path, capsys, monkeypatch):
    """pytorch/examples' dcgan order: the spike at D's update is replayed per row (G's forward again,
    BatchNorm) while G's graph waits for errG.backward(); the script runs to its end and exits 0."""
    monkeypatch.setenv("TORCHDEBUG_EXPLODE_WARMUP", "3")  # the spike rule's warm-up: 3 losses, not 20
    with pytest.warns(td.TorchDebugWarning):
        code = main(["run", "--run-dir", str(tmp_path), DCGAN, "--niter", "8", "--spike-iter", "5"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("done: 8 iterations")
    assert "watched netD and netG with Adam and Adam: 8 steps, 0 anomalies" in err
    assert meta(tmp_path)["status"] == "finished"
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with open_run(run) as r:
        (report,) = r.events(kind="spike_report")
    assert report["step"] == 5 and report["data"]["evidence"]["evidence"]["rows"]["count"] == 8
    assert_clean_exit()
