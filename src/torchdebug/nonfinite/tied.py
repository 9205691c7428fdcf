"""Tied weights (one tensor under several names, nanoGPT's ``wte.weight`` and ``lm_head.weight``) named
by all their names in an anomaly: ``transformer.wte.weight (= lm_head.weight)``."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torch import nn

from ..events import Anomaly


def tied_labels(model: nn.Module | None) -> dict[str, str]:
    """First name of each tied parameter -> ``"first (= second, ...)"``; empty when nothing is tied.

    The first name is the one ``model.named_parameters()`` gives (the session's and the tracer's name).
    Rare path: one walk over the parameters, when an anomaly is made.
    """
    if model is None:
        return {}
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {ns[0]: f"{ns[0]} (= {', '.join(ns[1:])})" for ns in names.values() if len(ns) > 1}


def label_tied(a: Anomaly, labels: dict[str, str]) -> Anomaly:
    """``a`` with every tied parameter it names (``parameter``, symptom, hint, related, noticed) given
    all its names. ``parameter`` then reads ``"first (= second)"``; the first name is the part before
    `` (= ``."""
    if not labels or a is None:
        return a
    pattern = re.compile(
        r"(?<![\w.])("
        + "|".join(re.escape(n) for n in sorted(labels, key=len, reverse=True))
        + r")(?![\w.]| \(=)"
    )

    def sub(text: Any) -> Any:
        return pattern.sub(lambda m: labels[m.group(1)], text) if isinstance(text, str) and text else text

    return dataclasses.replace(
        a,
        parameter=labels.get(a.parameter, a.parameter) if a.parameter else a.parameter,
        symptom=sub(a.symptom),
        hint=sub(a.hint),
        related=label_tied(a.related, labels) if a.related is not None else None,
        noticed=label_tied(a.noticed, labels) if a.noticed is not None else None,
    )
