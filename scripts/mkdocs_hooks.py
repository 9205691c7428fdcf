"""mkdocs hooks for the docs site (mkdocs.yml ``hooks:``): a generated configuration reference and optional pages.

- ``configuration.md`` is written at build time from ``DebugConfig`` itself (every field, its
  default, the values it accepts and its environment variable, then the class's own option notes),
  so the reference cannot drift from the code.
- Pages that other parts of the project add (``OPTIONAL_PAGES``) get their nav entry only when
  their file exists, so ``mkdocs build --strict`` passes with or without them.

Run ``python scripts/mkdocs_hooks.py`` to print the generated page.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# (nav title, file under docs/, the nav title it follows)
OPTIONAL_PAGES = [
    ("Trackers", "trackers.md", "Integrations"),
    ("Compatibility", "compatibility.md", "Configuration reference"),
]


# the options a new user sets first, in this order (the configuration reference's first table)
FIRST_OPTIONS = [
    "policy",
    "run_dir",
    "run_name",
    "mode",
    "level",
    "sync",
    "on_spike",
    "report_to",
    "detail_every",
    "store",
    "replay",
    "trace_loss",
]


def _config_module() -> Any:
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)  # this checkout's torchdebug, not another installed one
    from torchdebug import _config

    return _config


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def configuration_page() -> str:
    """The configuration reference, generated from ``DebugConfig``'s fields, specs and docstring."""
    c = _config_module()
    cfg = c.DebugConfig()
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated from torchdebug._config.DebugConfig by scripts/mkdocs_hooks.py at build time: "
        "edit the code, not this page -->",
        "",
        "`td.DebugConfig` holds every option. Build it from keyword arguments, a dict, a YAML/TOML/JSON "
        "file or `TORCHDEBUG_*` environment variables; precedence is defaults < file < environment < "
        "keyword arguments (`DebugConfig.load(file, **overrides)`). An unknown key, a wrong type or an "
        "unknown option string raises `td.ConfigError` (a `ValueError`) naming the field and the "
        "allowed values.",
        "",
        "```python",
        "import torchdebug as td",
        "",
        'cfg = td.DebugConfig(policy="warn", level="advanced", detail_every=5)',
        'cfg = td.DebugConfig.load("debug.yaml", policy="skip")   # file, then environment, then these',
        "```",
        "",
        "## Modes and levels",
        "",
        "`mode` chooses the areas and `level` the depth; the instruments each pair runs "
        "(`+` marks what a level adds to the one before):",
        "",
        "```",
        c._instrument_table(),
        "```",
        "",
        "In words: the default, `full_debug` at `intermediate`, is the cheap always-on set plus detailed "
        "statistics every `detail_every` steps.",
        "",
        "| mode | instruments |",
        "| --- | --- |",
        "| `none` | nothing |",
        "| `anomaly_detection` | the NaN/Inf sentinel |",
        "| `gradient_checking` | sentinel + gradient health |",
        "| `memory_profiling` | sentinel + memory samples and leak test (+ per-module memory at ADVANCED) |",
        "| `performance_profiling` | sentinel + step-time breakdown (+ FLOPs at ADVANCED, per-module time at EXPERT) |",
        "| `profiling` | sentinel + timing + `torch.profiler` |",
        "| `full_debug` | all areas |",
        "",
        "| level | adds |",
        "| --- | --- |",
        "| `basic` | per-step cheap checks: sentinel, total gradient norm, memory samples, timing |",
        "| `intermediate` | per-parameter norms, update/weight ratios, weight norms every `detail_every` steps |",
        "| `advanced` | activation statistics, per-module memory, FLOPs |",
        "| `expert` (alias `extreme`) | per-module time, profiler |",
        "",
        "## Instruments",
        "",
        "Each instrument as the registry declares it (`torchdebug._instruments.REGISTRY`, the table the "
        "config and the session both read): the level from which its modes run it, and the switches "
        "that start it whatever the mode and level.",
        "",
        "| instrument | records | from level | modes | switches | cost |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| `{s.name}` | {_cell(s.records)} | {s.level or 'switches only'} | "
            f"{', '.join(f'`{m}`' for m in dict.fromkeys((*s.modes, *s.always_in))) or '-'} | "
            f"{', '.join(f'`{w}`' for w in s.switches)} | {_cell(s.cost)} |"
            for s in c.REGISTRY
        ),
        "",
        f"## Every option ({len(dataclasses.fields(cfg))})",
        "",
        "In the order a new user needs them: the options most runs set, then the rest of the engine's, "
        "then the seed-era switches kept for the older facades.",
        "",
    ]
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    first = [n for n in FIRST_OPTIONS if n in fields]
    # the seed-era switches: every field declared between `level` and `policy` (the seed 000/001
    # DebugConfig's options, kept for the facades; see DebugConfig's docstring)
    names = list(fields)
    seed = [n for n in names[names.index("level") + 1 : names.index("policy")] if n not in first]
    rest = [n for n in names if n not in first and n not in seed]
    for title, group in (
        ("Start here", first),
        ("Everything else", rest),
        ("Seed-era switches (kept for the older facades)", seed),
    ):
        lines += [
            f"### {title}",
            "",
            "| option | default | accepts | environment |",
            "| --- | --- | --- | --- |",
        ]
        for name in group:
            default = getattr(cfg, name)
            shown = getattr(default, "value", default)
            spec = c._SPECS[name]
            lines.append(
                f"| `{name}` | `{shown!r}` | {_cell(spec.allowed())} | `{c.ENV_PREFIX}{name.upper()}` |"
            )
        lines.append("")
    doc = inspect.getdoc(c.DebugConfig) or ""
    notes = doc.split("Options (defaults in brackets):", 1)
    lines += ["", "## What each option does", ""]
    if len(notes) == 2:
        body = re.split(r"\nExamples?:", notes[1], maxsplit=1)[0]
        lines += [body.strip(), ""]
    lines += ["## How modes, levels and switches combine", "", notes[0].strip(), ""]
    return "\n".join(lines)


def on_config(config: Any, **kwargs: Any) -> Any:
    """Add each optional page to the nav, after its neighbour, when its file exists."""
    docs = Path(config["docs_dir"])
    nav = config["nav"]
    for title, path, after in OPTIONAL_PAGES:
        if not (docs / path).is_file():
            continue
        names = [next(iter(item)) if isinstance(item, dict) else item for item in nav]
        at = names.index(after) + 1 if after in names else len(nav)
        nav.insert(at, {title: path})
    return config


# a Sphinx role left in a docstring (":func:`judge`", ":class:`~torch.Tensor`") as the API pages
# render it: the role's name, then the code; a reader sees the code alone (with "~": the last name)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def strip_roles(html: str) -> str:
    """``:func:<code>judge</code>`` -> ``<code>judge</code>``; ``~a.b.C`` keeps ``C``."""
    return _ROLE.sub(
        lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html
    )


def on_page_content(html: str, **kwargs: Any) -> str:
    """The rendered page without raw Sphinx roles (the API reference renders docstrings that use them)."""
    return strip_roles(html)


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add the generated configuration reference to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "configuration.md", content=configuration_page()))
    return files


if __name__ == "__main__":
    print(configuration_page())
