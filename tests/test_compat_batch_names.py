"""A Hugging Face batch's keyword names (``input_ids``, ``attention_mask``, ``labels``) are recorded by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchdebug as td
from torchdebug._trees import named_inputs

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def test_forward_pass_and_placement_name_the_batch_keys(tmp_path: Path) -> None:
    model = _gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, 8, dtype=torch.long), "labels": ids.clone()}
    cfg = td.DebugConfig(mode="none", debug_forward_pass=True, debug_device_placement=True)
    with td.watch(model, opt, config=cfg, run=tmp_path) as mon:
        outputs = model(**batch)  # the Hugging Face way
        outputs.loss.backward()
        opt.step()
        mon.step()
    (fwd,) = [e for e in mon.events if e.kind == "forward_pass"]
    assert fwd.evidence["input_names"] == ["input_ids", "attention_mask", "labels"]
    assert [t["shape"] for t in fwd.evidence["inputs"]] == [[2, 8], [2, 8], [2, 8]]
    assert fwd.message.startswith("input input_ids (2, 8), attention_mask (2, 8), labels (2, 8) -> output ")
    (placed,) = [e for e in mon.events if e.kind == "device_placement"]
    assert placed.evidence["inputs"] == {
        "cpu": {"count": 3, "names": ["input_ids", "attention_mask", "labels"]}
    }


def test_named_inputs_positions_keywords_and_dicts() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.ones(2)
    assert [n for n, _ in named_inputs((a, [b, c]), {})] == ["input[0]", "input[1][0]", "input[1][1]"]
    assert [n for n, _ in named_inputs(({"input_ids": a, "extra": {"mask": b}},), {"labels": c})] == [
        "input_ids",
        "extra.mask",
        "labels",
    ]
