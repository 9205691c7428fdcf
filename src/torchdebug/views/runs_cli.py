"""The ``torchdebug runs`` and ``torchdebug show`` subcommands (registered by torchdebug.cli)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .._errors import RunStoreError
from .._term import printable
from ..store.reader import resolve_run

_MAX_METRICS = 20
_MAX_ANOMALIES = 20
# Table cells longer than this are cut ("..."): a run may name itself or its metrics at any length.
_MAX_NAME = 48
_MAX_METRIC = 60
# Shown first by `show`, in this order, when present; the rest follow alphabetically.
_MAIN_METRICS = ("loss", "val_loss", "grad_norm", "lr", "scale", "step_time")


def register(subparsers: Any) -> None:
    """Add ``runs`` and ``show`` to the torchdebug command line."""
    from ..cli import add_runs_option, int_in_range

    p = subparsers.add_parser("runs", help="list the runs in a folder (default ./runs)")
    add_runs_option(p)
    p.add_argument("dir", nargs="?", default=None, help=argparse.SUPPRESS)  # older spelling of --runs
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_runs)

    p = subparsers.add_parser("show", help="summarize one run: status, steps, metrics, anomalies, events")
    p.add_argument("run", metavar="RUN", help="run folder, or a run name looked up under --runs")
    add_runs_option(p, "--root", what="where to look RUN up by name")
    p.add_argument("--rank", type=int_in_range(0), default=None, help="which rank's database (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_show)


def _non_default(config: dict[str, Any]) -> dict[str, Any]:
    """The options that differ from today's DebugConfig defaults (a config from another version shows whole)."""
    try:
        from .._config import DebugConfig

        defaults = DebugConfig().to_dict()
    except Exception:
        return dict(config)
    return {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}


def _runs(args: argparse.Namespace) -> int:
    from .._term import style, use_colour
    from ..cli import default_runs_dir
    from ..store.reader import list_runs
    from .verdict import verdict_of

    root = Path(args.runs or args.dir or default_runs_dir())
    if not root.exists():
        raise RunStoreError(
            f"{root} does not exist; runs are written under ./runs by default, pass their folder: "
            "torchdebug runs --runs DIR"
        )
    infos = list_runs(root)
    # the verdict of each readable run: a finished run with 790 NaN steps is not green
    judged = [
        verdict_of(i.path)
        if i.status != "unreadable"
        else {"level": "error", "text": f"unreadable: {i.error}"}
        for i in infos
    ]
    if args.json:
        docs = [
            {**i.to_dict(), "verdict": {"level": v["level"], "text": v["text"]}}
            for i, v in zip(infos, judged, strict=True)
        ]
        print(json.dumps(docs, indent=2))
        return 0
    if not infos:
        print(f"no runs in {root}")
        return 0
    rows: list[tuple[str, ...]] = [("NAME", "STATUS", "VERDICT", "STEPS", "ANOMALIES", "CREATED", "PATH")]
    for i, v in zip(infos, judged, strict=True):
        created = (i.created or "-").replace("T", " ")[:19]
        status = f"{i.status}, incomplete" if i.lost else i.status
        cells = (i.name, status, str(v["level"]), str(i.steps), str(i.anomalies), created)
        rows.append((*(printable(c, _MAX_NAME) for c in cells), printable(i.path)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    numeric = {3, 4}
    colour = use_colour(sys.stdout)
    for n, r in enumerate(rows):
        padded = [r[c].rjust(widths[c]) if c in numeric else r[c].ljust(widths[c]) for c in range(len(r))]
        if n:  # status and verdict in the verdict's colour (green only with nothing to act on)
            level = judged[n - 1]["level"]
            padded[1] = style(padded[1], level, colour)
            padded[2] = style(padded[2], level, colour)
            if infos[n - 1].anomalies:
                padded[4] = style(padded[4], "error", colour)
        print("  ".join(padded).rstrip())
    for i in infos:
        if i.error:
            print(printable(f"  {i.path}: {i.error}"))
        if i.lost:
            print(printable(f"  {i.path}: {lost_line(i.lost, i.lost_from_step, i.write_error)}"))
    return 0


def lost_line(lost: int, from_step: int | None, error: str | None = None) -> str:
    """The one line that says a run is incomplete because records could not be written."""
    at = f" from step {from_step} on" if from_step is not None else ""
    why = f" (write failed: {error})" if error else " (the writer could not write them)"
    return f"{lost} records were lost{at}{why}: this run is incomplete"


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _anomaly_line(a: dict[str, Any]) -> str:
    text = a.get("summary")
    if isinstance(text, str) and text:  # events.Anomaly.summary(): already names the step
        return text
    where = a.get("parameter") or a.get("module") or "?"
    text = f"{a.get('kind', 'anomaly')} in {a.get('phase', '?')} of {where}"
    if a.get("op"):
        text += f": {a['op']}"
    at = f"step {a['step']}: " if a.get("step") is not None else ""
    return at + text


def _show(args: argparse.Namespace) -> int:
    from ..cli import default_runs_dir
    from ..store.ranks import rank_overview
    from ..store.reader import open_run
    from .hangs import verdict_of_run
    from .report._format import cause_text
    from .verdict import verdict

    path = resolve_run(args.run, args.runs or default_runs_dir())
    with open_run(path, rank=args.rank) as run:
        judged = verdict(run)
        summary = run.summary()
        last = run.last_values()
        anomalies = run.anomalies()
        overview = rank_overview(run) if len(summary["ranks"]) > 1 else None
        hang = verdict_of_run(path, run.meta.get("world_size")) if Path(path).is_dir() else None
        if args.json:
            if overview is not None:
                summary["all_ranks"] = overview
            summary["hang_verdict"] = hang.to_dict() if hang is not None else None
            summary["meta"] = run.meta
            summary["last_values"] = {k: {"step": s, "value": v} for k, (s, v) in last.items()}
            summary["anomaly_list"] = anomalies
            summary["verdict"] = {k: judged[k] for k in ("status", "level", "text", "anomaly_steps")}
            from ..events import plain

            print(json.dumps(plain(summary), indent=2, default=str))
            return 0
        meta = run.meta
        out = [
            *([f"hang: {hang}"] if hang is not None else []),  # across ranks, from the flight records
            judged["text"],  # the verdict first: status and the most important finding
            f"run        {run.name}  (id {run.run_id})",
            f"path       {path}",
            f"status     {summary['status']}"
            + (", INCOMPLETE: records were lost" if summary["lost"] else ""),
            f"created    {meta.get('created')}" + (f"   ended {meta['ended']}" if meta.get("ended") else ""),
            f"host       {meta.get('host')}  pid {meta.get('pid')}",
            f"versions   torch {meta.get('torch')}  python {meta.get('python')}  "
            f"torchdebug {meta.get('torchdebug', '?')}  schema {summary['schema_version']}",
            f"ranks      {', '.join(map(str, summary['ranks']))} (world size {meta.get('world_size', 1)}), "
            f"showing rank {run.rank}",
            f"steps      {summary['steps']}"
            + (f" (last step {summary['last_step']})" if summary["last_step"] is not None else ""),
        ]
        if summary["read_note"]:
            out.append(f"partial    {summary['read_note']}")
        if summary["lost"]:
            out.append(
                "lost       " + lost_line(summary["lost"], summary["lost_from_step"], summary["write_error"])
            )
        if summary["dropped"]:
            out.append(f"dropped    {summary['dropped']} low-priority samples (writer queue was full)")
        config = meta.get("config") or {}
        if config:
            changed = _non_default(config)
            shown = "  ".join(f"{k}={_fmt(v)}" for k, v in sorted(changed.items())) or "all defaults"
            out.append(f"config     {shown}  (torchdebug show --json for all {len(config)} options)")
        order = [m for m in _MAIN_METRICS if m in last] + sorted(m for m in last if m not in _MAIN_METRICS)
        out.append("")
        out.append(f"metrics ({len(last)}), last value")
        if order:
            shown_names = {m: printable(m, _MAX_METRIC) for m in order[:_MAX_METRICS]}
            width = max(len(n) for n in shown_names.values())
            for m, label in shown_names.items():
                step, value = last[m]
                out.append(f"  {label.ljust(width)}  {_fmt(value):>12}  at step {step}")
            if len(order) > _MAX_METRICS:
                out.append(f"  ... and {len(order) - _MAX_METRICS} more (torchdebug show --json)")
        else:
            out.append("  none")
        out.append("")
        groups = judged["groups"]
        folded = f", {len(groups)} groups by origin" if len(groups) < len(anomalies) else ""
        out.append(f"anomalies ({len(anomalies)}{folded})")
        for g in groups[:_MAX_ANOMALIES]:
            line = f"  {_anomaly_line(g['anomaly'])}"
            if g["count"] > 1:
                line += f"  [{g['count']}x, steps {g['first_step']}-{g['last_step']}]"
            out.append(line)
            why = cause_text(g["anomaly"])
            if why:
                out.append(f"    cause {why}")
        if len(groups) > _MAX_ANOMALIES:
            out.append(f"  ... and {len(groups) - _MAX_ANOMALIES} more groups")
        if not anomalies:
            out.append("  none")
        out.append("")
        events = summary["events"]
        out.append(f"events ({sum(events.values())})")
        out.extend(f"  {kind}  {n}" for kind, n in sorted(events.items(), key=lambda kv: (-kv[1], kv[0])))
        if not events:
            out.append("  none")
        if any(k in events for k in ("spike_report", "rollback")):
            from .spikes import spike_lines

            out += ["", *spike_lines(run.events())]
        if summary["segments"]:
            out.append("")
            out.append(f"segments   {summary['segments']} (history cleared from the dashboard)")
        if overview is not None:  # several ranks: one view of all of them
            from .ranks import overview_lines

            out.append("")
            out += overview_lines(overview)
    # Names, messages and config values come from the run: escape what a terminal would obey.
    print("\n".join(printable(line) for line in out))
    return 0
