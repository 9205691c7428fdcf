"""``torchdebug compare``: two real run folders written by ``watch()`` (conftest's ``watched_runs``).

``healthy`` and ``diverged`` are the same seeded MLP on the same batch with Adam at lr 1e-2; the
diverged run's learning rate jumps to 10.0 at step 100. Both are deterministic on the CPU, so their
numbers are equal up to step 100 (the loss and gradients of step 100 come before its update) and
part at step 101, the first step after the update with the higher learning rate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import torchdebug as td
from torchdebug.cli import main
from torchdebug.store import open_run
from torchdebug.views.compare import compare_runs, parting, render_compare_html, render_compare_text


def test_parting_needs_a_gap_beyond_noise_that_stays() -> None:
    steps = [0, 1, 2, 3, 4, 5]
    flat = [1.0] * 6
    # no jitter in either run (noise 0): any lasting gap parts them; here from step 2 on
    assert parting(steps, flat, steps, [1.0, 1.0, 2.0, 2.0, 2.0, 2.0])["step"] == 2
    # a gap at step 1 only (a crossing) is no parting
    assert parting(steps, flat, steps, [1.0, 2.0, 1.0, 1.0, 1.0, 1.0]) is None
    # jitter: A moves by a factor e each step, |log| change 1; a gap of 2 (< 3 x 1) is noise, 4 is not
    import math

    a = [math.exp(k % 2) for k in range(6)]  # 1, e, 1, e, 1, e
    near = [v * math.exp(2) for v in a]
    far = [v * math.exp(4) for v in a]
    assert parting(steps, a, steps, near) is None
    assert parting(steps, a, steps, far)["step"] == 0
    # a NaN against a number is apart; no common step: None
    assert parting(steps, flat, steps, [1.0, 1.0, 1.0, float("nan"), 5.0, 5.0])["step"] == 3
    assert parting([0, 1], [1.0, 1.0], [5, 6], [1.0, 1.0]) is None


def _data(run: Path) -> dict[str, Any]:
    with open_run(run) as r:
        return {m: r.series(m) for m in ("loss", "grad_norm", "lr/0")}


def test_a_higher_learning_rate_parts_the_runs_at_the_step_after_it(watched_runs: dict[str, Path]) -> None:
    a, b = _data(watched_runs["healthy"]), _data(watched_runs["diverged"])
    for m in ("loss", "grad_norm"):  # the data: equal to the bit up to step 100, apart from 101
        assert a[m].values[:101] == b[m].values[:101]
        assert b[m].values[101] > 100 * a[m].values[101]
    with open_run(watched_runs["healthy"]) as ra, open_run(watched_runs["diverged"]) as rb:
        c = compare_runs(ra, rb)
    assert c["parting"]["loss"]["step"] == 101
    assert c["parting"]["grad_norm"]["step"] == 101
    assert c["parting"]["loss"]["a"] == a["loss"].values[101]
    assert c["parting"]["loss"]["b"] == b["loss"].values[101]
    assert c["learning_rates"] == [{"name": "lr/0", "step": 100, "a": 0.01, "b": 10.0}]
    assert c["config"] == [{"key": "run_name", "a": "healthy", "b": "diverged"}]
    assert c["environment"] == []
    assert c["a"]["verdict"]["text"] == "finished: 140 steps, no anomalies"
    assert c["b"]["verdict"]["text"].startswith("finished, but diverged at step 100")
    text = render_compare_text(c)
    assert "  loss: A and B part at step 101 (A 0.01884, B 6.013; gap 5.766 > 3 x noise " in text
    assert "  lr/0: first differs at step 100 (A 0.01, B 10)" in text
    n_options = len(td.DebugConfig().to_dict())  # every option of the config, as recorded
    assert f"config: 1 of {n_options} options differ:\n  run_name: A healthy, B diverged\n" in text
    assert text.endswith("environment: the same (torch, torchdebug, python, host, world_size)\n")


def test_a_run_compared_with_itself_never_parts(watched_runs: dict[str, Path]) -> None:
    with open_run(watched_runs["healthy"]) as ra, open_run(watched_runs["healthy"]) as rb:
        c = compare_runs(ra, rb)
    assert c["parting"] == {"loss": None, "grad_norm": None}
    assert c["learning_rates"] == [] and c["config"] == [] and c["environment"] == []
    assert "loss: A and B never part beyond noise" in render_compare_text(c)


def test_cli_compare_text_json_and_html(
    watched_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(watched_runs["healthy"].parent)
    names = [watched_runs["healthy"].name, watched_runs["diverged"].name]
    assert main(["compare", *names, "--runs", root]) == 0  # looked up by name under --runs
    out = capsys.readouterr().out
    assert out.startswith(f"A  healthy  {watched_runs['healthy']}\nB  diverged  {watched_runs['diverged']}\n")
    assert main(["compare", *names, "--runs", root, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["parting"]["loss"]["step"] == 101 and "series" not in doc
    page = tmp_path / "cmp.html"
    assert main(["compare", *names, "--runs", root, "-o", str(page)]) == 0
    assert page.read_text().startswith("<!doctype html>")
    assert main(["compare", names[0], "no-such-run", "--runs", root]) == 1
    assert "torchdebug: error:" in capsys.readouterr().err


@pytest.mark.browser
def test_compare_page_overlays_the_two_runs(
    browser: Any, watched_runs: dict[str, Path], tmp_path: Path
) -> None:
    with open_run(watched_runs["healthy"]) as ra, open_run(watched_runs["diverged"]) as rb:
        c = compare_runs(ra, rb)
    page_path = tmp_path / "cmp.html"
    page_path.write_text(render_compare_html(c), encoding="utf-8")
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(page_path.as_uri())
    page.wait_for_selector("#chart-cmp-loss svg")
    try:
        assert page.locator("#verdicts .verdict.ok").count() == 1
        assert page.locator("#verdicts .verdict.warning").count() == 1
        names = page.evaluate("document.getElementById('chart-cmp-loss').data.map(t => t.name)")
        assert names == ["A loss", "B loss", "they part"]
        assert page.evaluate("document.getElementById('chart-cmp-loss').data[2].x") == [101]
        assert page.locator("#chart-cmp-loss g.marks path").count() == 1  # on the lane
        assert page.locator("#chart-cmp-grad-norm svg").count() == 1
        assert page.locator("#chart-cmp-lr-0 svg").count() == 1
        assert page.inner_text("#config").count("run_name") == 1
        assert requests == [page_path.as_uri()]  # nothing from the network
    finally:
        page.close()
    assert errors == []
