"""A real headless Chromium on the live dashboard and on the self-contained HTML report (no network)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("playwright.sync_api")

from tests.fixtures.runs import ANOMALY, train_steps, write_small_run
from torchdebug.store import create_run
from torchdebug.views.report import render_report
from torchdebug.views.server import serve

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def _points(page: Any, chart: str) -> int:
    """Points in the first trace of a drawn plotly chart (plotly keeps the data on the div)."""
    return int(page.evaluate(f"(document.getElementById('chart-{chart}').data || [{{x: []}}])[0].x.length"))


def test_live_dashboard_draws_charts_and_shows_a_new_anomaly(browser: Any, tmp_path: Path) -> None:
    writer = create_run(root=tmp_path, name="live", flush_interval=0.1)
    train_steps(writer, 5)
    writer.flush()
    stop = threading.Event()
    logged_anomaly = threading.Event()

    def training() -> None:  # the "training process": keeps writing while the page is open
        step = 5
        while not stop.is_set() and step < 200:
            train_steps(writer, 1, start=step, seed=step)
            if step == 15:
                writer.log_anomaly(step, dataclasses.replace(ANOMALY, step=step))
                logged_anomaly.set()
            step += 1
            time.sleep(0.05)

    thread = threading.Thread(target=training, daemon=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        with serve(tmp_path, port=0) as h:
            page.goto(f"{h.url}/runs/{writer.path.name}")
            page.wait_for_function("document.getElementById('chart-loss').data !== undefined", timeout=15_000)
            first = _points(page, "loss")
            assert first >= 5
            assert "No anomaly recorded" in page.inner_text("#cards")
            assert page.inner_text("#status") == "running"
            thread.start()
            assert logged_anomaly.wait(30)
            page.wait_for_selector("#cards .card.anomaly", timeout=15_000)  # within a few polls
            card = page.inner_text("#cards .card.anomaly")
            assert "nan born in forward of fc2 (Linear): aten.addmm at train.py:42 (step 15)" in card
            assert "hint: fc1 output reached 1.5e38" in card
            page.wait_for_function(
                f"document.getElementById('chart-loss').data[0].x.length > {first}", timeout=15_000
            )
            assert page.locator("#chart-layers svg image").count() == 1  # the heatmap drew too
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard_live.png"), full_page=True)
            stop.set()
            thread.join(30)
            writer.close()
            page.wait_for_function(
                "document.getElementById('status').textContent === 'finished'", timeout=15_000
            )
    finally:
        stop.set()
        page.close()
        writer.close()
    assert errors == []


def test_report_opens_from_file_with_the_network_blocked(browser: Any, tmp_path: Path) -> None:
    run = write_small_run(tmp_path / "runs")
    html_path = tmp_path / "report.html"
    render_report(run, "html", path=html_path)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    requested: list[str] = []

    def block_network(route: Any) -> None:
        url = route.request.url
        if url.startswith("file:"):
            route.continue_()
        else:
            requested.append(url)
            route.abort()

    page.route("**/*", block_network)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(html_path.as_uri())
        page.wait_for_function(
            "document.getElementById('chart-grad_norm').data !== undefined", timeout=15_000
        )
        assert _points(page, "loss") == 8
        assert page.locator(".chart svg").count() == 8  # every chart drawn
        assert "aten.addmm at train.py:42" in page.inner_text("#cards")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report_offline.png"), full_page=True)
    finally:
        page.close()
    assert requested == []  # nothing tried to reach the network
    assert errors == []
