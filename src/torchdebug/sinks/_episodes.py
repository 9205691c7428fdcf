"""One incident, one alert: anomalies and rule events grouped into episodes before any sink sees them.

An episode is a run of findings of one incident, each within ``GAP`` steps of the one before:
non-finite values (anomalies: the first is the traced origin; the steps after it often name where
the NaN has spread to, the weights, which is the same incident) or the same rule (events: kind and
severity). 196 NaN steps are one episode: a tracker gets its first record (the origin, with its
hint) as an alert, an artifact or a text, the later ones as repeats it may ignore, and an :class:`EpisodeEnd` with the count and the steps when the episode
closes (a finding of the same key more than ``GAP`` steps later, a record of any kind more than
``GAP`` steps past its last step, or the end of the run).

The grouper runs on one producer thread (the hub's ``put``, or ``deliver``); what it hands on is
immutable, so the sinks' threads read it safely.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..views.verdict import anomaly_text
from ._records import Finding, Record

#: steps without a finding of the same origin or rule after which its episode is over
GAP = 100
#: W&B refuses alert titles of 64 characters or more
TITLE_MAX = 63


def episode_key(rec: Finding) -> tuple[Any, ...]:
    """What makes two findings one incident: non-finite values (any anomaly: the verdict's groups
    keep the origins apart), or an event's rule."""
    if rec.kind == "anomaly":
        return ("anomaly",)
    return ("event", rec.name, rec.severity)


def episode_title(rec: Finding) -> str:
    """A title that is the same for every record of an episode (no step in it), under 64 characters:
    ``torchdebug: nan in act (LogAct)``, ``torchdebug: gradient_explosion``."""
    if rec.kind == "anomaly":
        w = rec.where()
        where = w["module"] or rec.doc.get("parameter") or rec.doc.get("symptom") or w["phase"]
        title = f"torchdebug: {rec.name} in {where}" if where else f"torchdebug: {rec.name}"
    else:
        title = f"torchdebug: {rec.name}"
    return title if len(title) <= TITLE_MAX else title[: TITLE_MAX - 3] + "..."


@dataclass(frozen=True)
class EpisodeEnd:
    """An episode closed: its first record (the origin), how many records it held, its steps."""

    number: int
    first: Finding
    count: int
    last_step: int | None

    @property
    def step(self) -> int | None:
        return self.last_step

    @property
    def title(self) -> str:
        return episode_title(self.first)

    def summary(self) -> str:
        """``nan born in forward of act (LogAct): aten.log at m.py:49: 30 steps, 10-39``."""
        what = anomaly_text(self.first.doc) if self.first.kind == "anomaly" else self.first.headline
        first = self.first.step
        span = f"step {first}" if first == self.last_step else f"steps {first}-{self.last_step}"
        return f"{what}: {self.count} records, {span}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "episode": self.number,
            "record": self.first.kind,
            "kind": self.first.name,
            "count": self.count,
            "first_step": self.first.step,
            "last_step": self.last_step,
            "title": self.title,
            "summary": self.summary(),
        }


#: what the sinks receive: the records, marked, and the episodes' ends
Item = Record | EpisodeEnd


@dataclass
class _Open:
    number: int
    first: Finding
    count: int
    last_step: int | None

    def end(self) -> EpisodeEnd:
        return EpisodeEnd(self.number, self.first, self.count, self.last_step)


class Episodes:
    """Groups a stream of records into episodes (see the module docstring).

    ``see(records)`` returns them with each finding marked: the first of its episode with
    ``episode=n``, a later one also with ``repeat=True``; and an :class:`EpisodeEnd` before the
    record that closed an episode. ``close()`` ends the open episodes (the run's end).

    Example: 30 NaN steps born at the same op, then a ``gradient_explosion``: two episodes; the
    sinks get two first records, 29 repeats and two ``EpisodeEnd`` (counts 30 and 1).
    Cost: a dict lookup per finding, and a look over the open episodes (a handful) per record.
    """

    def __init__(self, gap: int = GAP) -> None:
        self.gap = gap
        self.count = 0  # episodes opened
        self._open: dict[tuple[Any, ...], _Open] = {}

    def _expired(self, step: int) -> list[EpisodeEnd]:
        done = [
            k for k, ep in self._open.items() if ep.last_step is not None and step > ep.last_step + self.gap
        ]
        return [self._open.pop(k).end() for k in done]

    def see(self, records: list[Record]) -> list[Item]:
        out: list[Item] = []
        for rec in records:
            step = getattr(rec, "step", None)
            if self._open and isinstance(step, int):
                out += self._expired(step)
            if not isinstance(rec, Finding):
                out.append(rec)
                continue
            key = episode_key(rec)
            ep = self._open.get(key)
            if ep is not None:
                ep.count += 1
                if isinstance(step, int):
                    ep.last_step = step if ep.last_step is None else max(ep.last_step, step)
                out.append(dataclasses.replace(rec, episode=ep.number, repeat=True))
                continue
            self.count += 1
            self._open[key] = _Open(self.count, rec, 1, step if isinstance(step, int) else None)
            out.append(dataclasses.replace(rec, episode=self.count))
        return out

    def close(self) -> list[Item]:
        """End every open episode (in the order they opened)."""
        ends: list[Item] = [ep.end() for ep in sorted(self._open.values(), key=lambda e: e.number)]
        self._open.clear()
        return ends
