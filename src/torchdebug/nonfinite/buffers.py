"""The buffers a model's forward writes (BatchNorm's running statistics, a VQ-VAE codebook's EMA): kept
as each step began, and checked for NaN/Inf with the step's numbers.

A NaN the forward writes into a buffer (``self.embed.data.copy_(embed_avg / cluster_size)`` with an
empty cluster) leaves that step's loss and gradients finite: it shows one step later, when the forward
reads the buffer, and a replay of that later step finds it already in the buffer. So the buffers the
forward writes are copied as each step's first forward starts (one multi-tensor copy on the device, no
read) and their finiteness is probed with the step's numbers (one sum, in the existing read). A
non-finite probe in a step whose loss and gradients are finite is that step's anomaly: its first
micro-step is replayed from the copy, which names the op and line that wrote the value.

Which buffers: at the first step every floating buffer that is finite (a buffer holding +-Inf from the
start is a mask); from the second step on, those whose values the first step changed. Cost per step:
one ``_foreach_copy_`` and one probe over those buffers (none for a model without written buffers).
Known limitations: a buffer first written after the first step, or replaced by a new tensor, is not
watched; under ``sync="async"`` and with several ranks the buffers are not probed (their verdict
would come a step late, or from one rank alone).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._tensors import finite_probe


class WrittenBuffers:
    """The written buffers of one session's model, their copy as the step began and their probe."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []
        self.started = False
        self.settled = False  # the first step's writes are known: the list holds only written buffers
        self.said = False  # a buffer's NaN/Inf was reported (once per session)
        self.fresh = False  # the copies hold this step's start
        self.idle = False  # started, and nothing to watch (no written floating buffer): no call a step

    def begin_step(self, model: nn.Module, late: bool = False) -> None:
        """The step's first forward is about to run: keep the buffers as they are (device copies);
        ``late``: the step is judged a step late or by one rank alone, not probed."""
        self.fresh = False
        if late:
            return
        if not self.started:
            self.started = True
            found = [
                (n, b)
                for n, b in model.named_buffers()
                if type(b) is torch.Tensor
                and b.is_floating_point()
                and b.layout == torch.strided
                and not b.is_meta
                and b.numel() > 0
            ]
            with torch.no_grad():  # once, one read: a buffer holding +-Inf from the start is a mask
                dev = found[0][1].device if found else None
                ok = (
                    torch.stack([torch.isfinite(b).all().to(dev) for _, b in found]).tolist() if found else []
                )
                found = [nb for nb, fine in zip(found, ok) if fine]
                self.names = [n for n, _ in found]
                self.tensors = [b for _, b in found]
                self.copies = [b.clone() for b in self.tensors]
            self.fresh = bool(self.tensors)
            self.idle = not self.tensors
            return
        if not self.settled:  # after the first step: keep the buffers it wrote
            self.settled = True
            with torch.no_grad():  # once, one read: which the first step changed (NaN counts as changed)
                dev = self.tensors[0].device
                changed = torch.stack([(b != c).any().to(dev) for b, c in zip(self.tensors, self.copies)])
                keep = [i for i, x in enumerate(changed.tolist()) if x]
            self.names = [self.names[i] for i in keep]
            self.tensors = [self.tensors[i] for i in keep]
            self.copies = [self.copies[i] for i in keep]
            if not self.tensors:
                self.idle = True
                return
        with torch.no_grad():
            torch._foreach_copy_(self.copies, self.tensors)  # one multi-tensor copy, no host read
        self.fresh = True

    def probe(self) -> torch.Tensor | None:
        """One device number, finite iff every watched buffer is (an overflowing sum is confirmed
        exactly later); None when there is nothing to probe or it was said already."""
        if not self.fresh or self.said or not self.tensors:
            return None
        if len({t.device for t in self.tensors}) > 1:
            return None  # buffers on several devices: not checked here
        return finite_probe(self.tensors).sum()

    def judge(self, value: float | None) -> list[str]:
        """After the read (``value``: the probe): the watched buffers that are non-finite, confirmed
        exactly (rare path, a read each); ``[]`` the usual answer. Said once per session."""
        if value is None or math.isfinite(value) or self.said:
            return []
        with torch.no_grad():
            bad = [n for n, t in zip(self.names, self.tensors) if not bool(torch.isfinite(t).all())]
        self.said = bool(bad)  # (none: the sum overflowed on finite values)
        return bad

    def start_values(self) -> dict[int, torch.Tensor]:
        """id(buffer) -> its copy from the step's start (a replay of the step's first micro-step starts
        from it); empty when the copy is not this step's."""
        if not self.fresh:
            return {}
        return {id(t): c for t, c in zip(self.tensors, self.copies)}
