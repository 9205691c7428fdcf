"""`torchdebug demo`: a small GPT trained on synthetic data until a bad batch makes a NaN, caught and explained.

The bug is a classic one: a key-padding mask fills padded keys with -inf before the softmax. A batch
holding a sequence made only of padding leaves a whole attention row at -inf, and softmax of a fully
-inf row is 0/0 = NaN. The sentinel catches it at the optimizer step, replays the step under op-level
tracing, and names the attention module, the softmax op, the source line and the mask that caused it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PAD = 0


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)
        )  # (B, H, T, D)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        masked = causal | key_pad[:, None, None, :]  # padded keys are never attended to
        att = att.masked_fill(masked, float("-inf"))
        att = att.softmax(dim=-1)  # a row whose keys are all padding is all -inf here: NaN
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), key_pad)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, tied head."""

    def __init__(
        self, vocab: int = 64, d: int = 64, n_layer: int = 2, n_head: int = 4, block: int = 32
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        key_pad = idx == PAD
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x, key_pad)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def synthetic_batch(step: int, *, batch: int, block: int, vocab: int, bad_step: int | None) -> torch.Tensor:
    """Sequences counting up modulo vocab (learnable), right-padded; at ``bad_step`` one is all padding."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(1, vocab, (batch, 1), generator=g)
    seq = (start + torch.arange(block)) % (vocab - 1) + 1  # tokens 1..vocab-1, never PAD
    noise = torch.rand(batch, block, generator=g) < 0.2  # 20% random tokens: the loss cannot reach 0
    seq = torch.where(noise, torch.randint(1, vocab, (batch, block), generator=g), seq)
    lengths = torch.randint(block // 2, block + 1, (batch,), generator=g)
    seq = seq.masked_fill(torch.arange(block) >= lengths[:, None], PAD)
    if step == bad_step:
        seq[3] = PAD  # an empty example slipped through the data pipeline
    return seq


def _progress(step: int, total: int, loss: float | None, width: int = 28) -> str:
    done = int(width * step / max(total, 1))
    shown = "  loss --" if loss is None else f"  loss {loss:6.3f}"
    return f"\r  [{'#' * done}{'.' * (width - done)}] step {step:>4}/{total}{shown}"


def run_demo(
    *,
    steps: int = 300,
    bad_step: int | None = 200,
    policy: str = "raise",
    run_dir: str = "runs",
    seed: int = 0,
    out: Any = None,
) -> int:
    """Train, hit the bad batch, print what the sentinel found. Returns the process exit code (0)."""
    import torchdebug as td

    out = out or sys.stdout
    tty = hasattr(out, "isatty") and out.isatty()
    torch.manual_seed(seed)
    vocab, block, batch = 64, 32, 16
    model = TinyGPT(vocab=vocab, block=block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(
        f"torchdebug demo: TinyGPT ({sum(p.numel() for p in model.parameters()):,} parameters), "
        f"{steps} steps on synthetic data, policy={policy!r}",
        file=out,
    )
    if bad_step is not None:
        print(f"  a batch holding an all-padding sequence arrives at step {bad_step}", file=out)
    anomaly = None
    mon = td.watch(model, opt, policy=policy, run=run_dir, config=td.DebugConfig(run_name="demo"))
    t0 = time.perf_counter()
    last_loss: float | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", td.TorchDebugWarning)
        try:
            with mon:
                for step in range(steps):
                    idx = synthetic_batch(step, batch=batch, block=block, vocab=vocab, bad_step=bad_step)
                    logits = model(idx[:, :-1])
                    target = idx[:, 1:]
                    loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), ignore_index=PAD)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    rec = mon.step()
                    last_loss = rec.loss if rec.loss is not None and math.isfinite(rec.loss) else last_loss
                    if tty or step % 50 == 0 or step == steps - 1:
                        print(_progress(step + 1, steps, rec.loss) + ("" if tty else "\n"), end="", file=out)
                    if rec.skipped:
                        print(f"\n  step {step}: update skipped ({rec.skip_reason})", file=out)
        except td.NonFiniteError as err:
            anomaly = err.anomaly
    elapsed = time.perf_counter() - t0
    print("", file=out)
    if anomaly is None and mon.anomalies:
        anomaly = mon.anomalies[0]
    if anomaly is not None:
        verb = "stopped training" if policy == "raise" else "recorded it and training went on"
        print(f"\nThe sentinel caught a non-finite value and {verb}. Where it was born:\n", file=out)
        print(str(anomaly), file=out)
    else:
        print("\nNo NaN/Inf: training was healthy.", file=out)
    others = [w for w in caught if "nan born" not in str(w.message) and "inf born" not in str(w.message)]
    if others:
        print("\nOther things torchdebug noticed:", file=out)
        for w in others[:8]:
            print(f"  {w.message}", file=out)
    print(
        f"\n{mon.global_step} steps in {elapsed:.1f} s; last finite loss {last_loss if last_loss is None else round(last_loss, 4)}",
        file=out,
    )
    if mon.run_dir is not None:
        print(f"run folder: {mon.run_dir}", file=out)
        print(f"  torchdebug show {mon.run_dir}", file=out)
        print(f"  torchdebug report {mon.run_dir} --format html -o report.html", file=out)
    return 0


def register(subparsers: Any) -> None:
    """Add ``demo`` to the torchdebug command line."""
    p = subparsers.add_parser("demo", help="train a small GPT until a bad batch makes a NaN, and explain it")
    p.add_argument(
        "scenario",
        nargs="?",
        default=None,
        choices=["autograd", "gradient", "memory", "training", "comprehensive"],
        help="a quick-start scenario (default: this GPT demo, also called 'autograd')",
    )
    from .cli import int_in_range

    p.add_argument("--steps", type=int_in_range(1), default=300, help="training steps (default 300)")
    p.add_argument(
        "--bad-step",
        type=_bad_step,
        default=200,
        help="step in [0, steps) whose batch holds an all-padding sequence, or 'none' (default 200)",
    )
    p.add_argument(
        "--policy",
        choices=["raise", "warn", "skip"],
        default="raise",
        help="what the sentinel does: raise (stop), warn (go on), skip (skip the update)",
    )
    p.add_argument("--runs", default="runs", help="folder for the run (default ./runs)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run, demo_parser=p)


def _bad_step(text: str) -> int | None:
    """``--bad-step``: a step >= 0 or ``none``; the upper bound (``--steps``) is checked in ``_run``."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a step >= 0 or 'none' (no bad batch), got {text[:40]!r}")
    return value


def _run(args: argparse.Namespace) -> int:
    bad = args.bad_step
    if bad is not None and bad >= args.steps and getattr(args, "scenario", None) in (None, "autograd"):
        try:  # the parser's own usage line and exit code 2, as for a bad value of any other option
            args.demo_parser.error(
                f"argument --bad-step: expected a step in [0, {args.steps}) (--steps {args.steps}) or "
                f"'none' (no bad batch), got {bad}"
            )
        except SystemExit as usage:
            return int(usage.code or 2)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    if getattr(args, "scenario", None) not in (None, "autograd"):
        from .demos import run_scenario

        return run_scenario(args.scenario, run_dir=args.runs, seed=args.seed)
    return run_demo(steps=args.steps, bad_step=bad, policy=args.policy, run_dir=args.runs, seed=args.seed)
