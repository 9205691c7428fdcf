"""``td.compare_modes`` on a GPT-style model: the A/B table of NONE, AMP, COMPILATION, MEMORY_EFFICIENT, FULL.

GPT-style: 4 blocks, d=128, 4 heads, seq 64, batch 16, next-token cross entropy, AdamW. The same
batches and seeds for every mode; timing after one warm-up step (compile time apart).

    python benchmarks/modes.py [--steps 12] [--device cpu|cuda] [--backend inductor|aot_eager]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from torch import nn

import torchdebug as td


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int = 256, d: int = 128, heads: int = 4, layers: int = 4, seq: int = 64
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(x)  # (B, T, vocab)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT().to(args.device)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        idx = torch.randint(0, 256, (16, 65), generator=g).to(args.device)
        batches.append((idx[:, :-1], idx[:, 1:]))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    cmp = td.compare_modes(
        model,
        loss_fn,
        batches,
        modes=list(td.OptimizationMode),
        optimizer_fn=functools.partial(torch.optim.AdamW, lr=1e-3),
        compile_options={"backend": args.backend},
    )
    print(f"torch {torch.__version__}, {args.steps} steps, threads {torch.get_num_threads()}")
    print(cmp)


if __name__ == "__main__":
    main()
