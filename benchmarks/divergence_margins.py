"""The divergence rule's margins, measured on tiny real models (how the thresholds were chosen).

Trains a word_language_model-style Transformer, an MLP and a CNN (tests/fixtures/divergence_models.py)
with sane learning rates (SGD, SGD with momentum, Adam; an MLP initialised 20x too small, whose
gradient norm rises ~20x over its first steps; a deep tanh MLP) and with too-high ones, 100 steps each,
three seeds for the healthy runs. The Transformer at word_language_model's own default (SGD lr 20 with
clip 0.25) is printed apart, "not learning": its loss sits at 1.35x its first value (above chance)
for its whole run; it counts neither as healthy nor as diverging. For each run it prints, over every window the rule judges, the largest robust growth
rate (x a step) and growth (last / first value) among windows that reach a new high, per metric, and
the step the rule (``GrowthRule``) fires versus the first non-finite value.

    PYTHONPATH=src:. python benchmarks/divergence_margins.py

Results: docs/reading.md ("The divergence event"). ~40 s on a 2-core VM.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.divergence_models import (
    DIVERGING,
    HEALTHY,
    NOT_LEARNING,
    Case,
    TransformerLM,
    ce_loss,
    lm_loss,
    mlp,
    mlp_batches,
    token_batches,
    trace,
)

from torchdebug.health.divergence import (
    GROWTH_ORDERS,
    GROWTH_RATE,
    GROWTH_WINDOW,
    GrowthRule,
    _Series,
    repeated_median,
)


def small_init_mlp() -> nn.Module:
    m = mlp()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.05)
    return m


def deep_tanh() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(20, 20), nn.Tanh()]
    m = nn.Sequential(*layers, nn.Linear(20, 5))
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.3)
    return m


HEALTHY_EXTRA = [
    Case(
        "mlp small init adam 1e-2",
        small_init_mlp,
        mlp_batches,
        ce_loss,
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
    ),
    Case(
        "mlp small init sgd 1 mom",
        small_init_mlp,
        mlp_batches,
        ce_loss,
        lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9),
    ),
    Case("deep tanh adam 1e-2", deep_tanh, mlp_batches, ce_loss, lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    Case(
        "deep tanh sgd 0.5 mom",
        deep_tanh,
        mlp_batches,
        ce_loss,
        lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
    ),
]
DIVERGING_EXTRA = [
    Case(
        "transformer adam lr 1000",
        TransformerLM,
        token_batches,
        lm_loss,
        lambda ps: torch.optim.Adam(ps, lr=1000.0),
    ),
]


def worst(xs: list[float]) -> tuple[float, float, float]:
    """Over the windows the rule judges that reach a new high: the largest rate, the largest growth,
    and the closest call ``min(rate / GROWTH_RATE, growth / 10**GROWTH_ORDERS)`` (>= 1 fires)."""
    s = _Series(GROWTH_WINDOW)
    rate = growth = close = 0.0
    for i, x in enumerate(xs):
        s.push(i, x)
        pts = s.points
        if len(pts) == GROWTH_WINDOW and pts[-1][1] > s.high:
            r = 10 ** repeated_median(list(pts))
            g = 10 ** (pts[-1][1] - pts[0][1])
            rate, growth = max(rate, r), max(growth, g)
            close = max(close, min(r / GROWTH_RATE, g / 10**GROWTH_ORDERS))
    return rate, growth, close


def fires(losses: list[float], norms: list[float]) -> int | None:
    rule = GrowthRule()
    for i, (lo, no) in enumerate(zip(losses, norms)):
        event = rule.update(i, lo, no)
        if event is not None and event.kind == "divergence":
            return i
    return None


def main() -> None:
    torch.set_num_threads(1)
    print(
        f"GrowthRule: window {GROWTH_WINDOW}, rate >= {GROWTH_RATE}x a step, growth >= {10**GROWTH_ORDERS:g}x"
    )
    print(
        f"{'run':36} {'seed':>4} {'loss rate':>10} {'growth':>9} {'norm rate':>10} {'growth':>9} {'closest':>8} {'fires':>6} {'first NaN':>9}"
    )
    top = {"loss rate": 0.0, "loss growth": 0.0, "norm rate": 0.0, "norm growth": 0.0, "closest call": 0.0}
    groups = (
        ("healthy", HEALTHY + HEALTHY_EXTRA),
        ("not learning", NOT_LEARNING),
        ("diverging", DIVERGING + DIVERGING_EXTRA),
    )
    for group, cases in groups:
        healthy = group == "healthy"
        print(f"-- {group}")
        for case in cases:
            for seed in (0, 1, 2) if healthy else (0,):
                losses, norms = trace(case, 100, seed=seed)
                lr_, lg, lc = worst(losses)
                nr, ng, nc = worst(norms)
                bad = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(losses, norms))
                        if not (math.isfinite(a) and math.isfinite(b))
                    ),
                    None,
                )
                at = fires(losses, norms)
                if healthy:
                    for k, v in zip(top, (lr_, lg, nr, ng, max(lc, nc))):
                        top[k] = max(top[k], v)
                print(
                    f"{case.name:36} {seed:>4} {lr_:>10.3g} {lg:>9.3g} {nr:>10.3g} {ng:>9.3g} {max(lc, nc):>8.3g} "
                    f"{'-' if at is None else at:>6} {'-' if bad is None else bad:>9}"
                )
    print("healthy worst:", ", ".join(f"{k} {v:.3g}" for k, v in top.items()))


if __name__ == "__main__":
    main()
