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
        "| option | default | accepts | environment |",
        "| --- | --- | --- | --- |",
    ]
    for f in dataclasses.fields(cfg):
        default = getattr(cfg, f.name)
        shown = getattr(default, "value", default)
        spec = c._SPECS[f.name]
        lines.append(
            f"| `{f.name}` | `{shown!r}` | {_cell(spec.allowed())} | `{c.ENV_PREFIX}{f.name.upper()}` |"
        )
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


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add the generated configuration reference to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "configuration.md", content=configuration_page()))
    return files


if __name__ == "__main__":
    print(configuration_page())
