"""``torchdebug demo <scenario>`` (seed 003's quick start): each ends with its run folder and report command."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from torchdebug import _demo_cli
from torchdebug.cli import build_parser
from torchdebug.demos import SCENARIOS, run_scenario


def _tail(text: str) -> list[str]:
    return text.rstrip().splitlines()[-3:]


@pytest.mark.parametrize("name", ["training", "gradient"])
def test_scenario_ends_with_run_folder_and_report_command(name: str, tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_scenario(name, run_dir=str(tmp_path), out=out) == 0
    text = out.getvalue()
    folder, report, _html = _tail(text)
    assert folder.startswith(f"run folder: {tmp_path}/demo-{name}-")
    run = Path(folder.removeprefix("run folder: "))
    assert (run / "meta.json").is_file()
    assert report == f"  torchdebug report {run}"
    if name == "training":
        assert "step 12: update skipped: nan born in input" in text
    else:
        assert "gradient_explosion [inp]" in text


def test_cli_takes_the_scenario_and_keeps_the_gpt_demo_as_default() -> None:
    parser = build_parser()
    assert parser.parse_args(["demo"]).scenario is None
    assert parser.parse_args(["demo", "memory"]).scenario == "memory"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "quantum"])
    # the GPT demo (``autograd``) is torchdebug.demo; the others torchdebug.demos: neither imports the other
    assert ("autograd", *SCENARIOS) == _demo_cli.SCENARIOS
    assert SCENARIOS == ("gradient", "memory", "training", "comprehensive")
    with pytest.raises(ValueError, match="unknown demo 'quantum'; choose one of gradient, memory"):
        run_scenario("quantum")


def test_demo_modules_do_not_import_each_other() -> None:
    import ast

    import torchdebug

    root = Path(torchdebug.__file__).parent
    for name, other in (("demo", "demos"), ("demos", "demo")):
        tree = ast.parse((root / f"{name}.py").read_text(encoding="utf-8"))
        imported = {
            n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module is not None
        } | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert other not in imported and f"torchdebug.{other}" not in imported, (name, imported)
