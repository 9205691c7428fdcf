"""The report and the dashboard in a real headless Chromium: verdict, groups, charts, weight, dark mode, live.

Runs come from the real ``watch()`` on tiny models (``watched_runs`` in conftest); the dashboard is
the real server on a free port.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("playwright.sync_api")

from tests.fixtures.runs import train_steps
from torchdebug.store import create_run
from torchdebug.views.report import render_report
from torchdebug.views.server import serve

pytestmark = pytest.mark.browser

REPORT_BUDGET = 1_000_000  # bytes: one self-contained report file
PAGE_BUDGET = 1_500_000  # bytes transferred: a dashboard page and everything it loads


@pytest.fixture(scope="module")
def reports(watched_runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("reports")
    paths = {}
    for name, run in watched_runs.items():
        paths[name] = out / f"{name}.html"
        render_report(run, "html", path=paths[name])
    return paths


def _open(browser: Any, url: str, width: int = 1366, scheme: str = "light") -> tuple[Any, list[str]]:
    page = browser.new_page(viewport={"width": width, "height": 900}, color_scheme=scheme)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_function(
        "window.tdCharts !== undefined && document.querySelector('.chart svg, .chart.is-empty')"
    )
    return page, errors


# --------------------------------------------------------------------------------- verdict and groups


@pytest.mark.parametrize(
    ("name", "level", "start"),
    [
        ("failed", "error", "failed at step 3: nan born in forward of blocks.1.act (LogAct): aten.log at "),
        ("diverged", "warning", "finished, but diverged at step 10"),
        ("healthy", "ok", "finished: 140 steps, no anomalies"),
    ],
)
def test_the_verdict_comes_first_in_report_and_dashboard(
    browser: Any, reports: dict[str, Path], watched_runs: dict[str, Path], name: str, level: str, start: str
) -> None:
    page, errors = _open(browser, reports[name].as_uri())
    try:
        verdict = page.locator("main > *").first
        assert verdict.get_attribute("id") == "verdict"  # before the summary, charts and cards
        assert page.inner_text("#verdict").startswith(start)
        assert page.locator(f"#verdict .verdict.{level}").count() == 1
        assert level in (page.get_attribute("#status", "class") or "").split()
    finally:
        page.close()
    with serve(watched_runs[name].parent, port=0) as h:
        page, errors2 = _open(browser, f"{h.url}/runs/{watched_runs[name].name}")
        try:
            assert page.inner_text("#verdict").startswith(start)
            assert page.locator(f"#verdict .verdict.{level}").count() == 1
        finally:
            page.close()
    assert errors == [] and errors2 == []


def test_repeated_anomalies_are_grouped_above_the_charts(browser: Any, reports: dict[str, Path]) -> None:
    page, errors = _open(browser, reports["warned"].as_uri())
    try:
        # 30 anomalies (steps 10..39): the first traced at blocks.1.act, 29 then seen in the weights
        assert page.locator("#cards .card.anomaly").count() == 2
        assert "30 anomalies in 2 groups" in page.inner_text("#cards")
        second = page.locator("#cards .card.anomaly").nth(1).inner_text()
        assert "29× on 29 steps, first at step 11, last at step 39" in second
        charts_y = page.locator("h2", has_text="Charts").bounding_box()["y"]
        cards_y = page.locator("h2", has_text="Anomalies").bounding_box()["y"]
        assert cards_y < charts_y
    finally:
        page.close()
    assert errors == []


_ORDER_JS = """() => ['#verdict', '#cards', '#summary', '.chart'].map(s => document.querySelector(s).getBoundingClientRect().top + window.scrollY)"""


@pytest.mark.parametrize(
    ("name", "target", "card_text"),
    [
        # DeepLogNet's blocks.1.act logs x + shift; shift -1e6 at step 3 makes every input negative
        ("failed", "card-1", ("hint: log of negative input", "input[0]", "last module calls before it")),
        ("warned", "card-1", ("hint: log of negative input", "input[0]", "last module calls before it")),
        # no anomaly: the card is the divergence event the verdict names (lr 0.01 -> 10 at step 100)
        ("diverged", "answer-event", ("divergence at step 102", "lr 10 in param group 0 of Adam")),
    ],
)
def test_the_answer_comes_before_the_tiles_and_the_charts(
    browser: Any,
    reports: dict[str, Path],
    watched_runs: dict[str, Path],
    name: str,
    target: str,
    card_text: tuple[str, ...],
) -> None:
    with serve(watched_runs[name].parent, port=0) as h:
        for url in (reports[name].as_uri(), f"{h.url}/runs/{watched_runs[name].name}"):
            page, errors = _open(browser, url)
            try:
                verdict, card, tiles, chart = page.evaluate(_ORDER_JS)
                assert verdict < card < tiles < chart, url
                link = page.locator("#verdict a.to-card")
                assert link.get_attribute("href") == f"#{target}"
                text = page.inner_text(f"#{target}")
                assert all(t in text for t in card_text), text
                link.click()
                page.wait_for_function(f"location.hash === '#{target}'")
                top = page.evaluate(f"document.getElementById('{target}').getBoundingClientRect().top")
                assert abs(top) < 2  # scrolled to the card
                assert page.evaluate(f"document.querySelector('#{target}:target') !== null")
            finally:
                page.close()
            assert errors == []


def test_a_healthy_verdict_links_nowhere(browser: Any, reports: dict[str, Path]) -> None:
    page, errors = _open(browser, reports["healthy"].as_uri())
    try:
        assert page.locator("#verdict a").count() == 0
        assert page.locator("#cards .card").count() == 0
    finally:
        page.close()
    assert errors == []


# --------------------------------------------------------------------------------- charts


_OVERFLOW_JS = """() => {
  const bad = [];
  for (const svg of document.querySelectorAll('.chart svg')) {
    const box = svg.getBoundingClientRect();
    const ticks = [];
    for (const t of svg.querySelectorAll('text')) {
      const r = t.getBoundingClientRect();
      if (!r.width) continue;
      if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
        bad.push(svg.closest('.chart').id + ': "' + t.textContent + '" outside its chart');
      ticks.push([t.textContent, r]);
    }
    for (let i = 0; i < ticks.length; i++) for (let j = i + 1; j < ticks.length; j++) {
      const a = ticks[i][1], b = ticks[j][1];
      const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
      const hgt = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
      if (w > 1 && hgt > 1) bad.push(svg.closest('.chart').id + ': "' + ticks[i][0] + '" overprints "' + ticks[j][0] + '"');
    }
  }
  for (const svg of document.querySelectorAll('.chart svg')) {  // event / NaN markers inside their lane
    const lane = svg.querySelector('rect.lane');
    const marks = svg.querySelectorAll('g.marks path');
    if (!lane) { if (marks.length) bad.push(svg.closest('.chart').id + ': markers without a lane'); continue; }
    const f = lane.getBoundingClientRect();
    for (const m of marks) {
      const r = m.getBoundingClientRect();
      if (r.left < f.left - 0.5 || r.right > f.right + 0.5 || r.top < f.top - 0.5 || r.bottom > f.bottom + 0.5)
        bad.push(svg.closest('.chart').id + ': a marker outside its lane');
    }
  }
  if (document.documentElement.scrollWidth > window.innerWidth) bad.push('page scrolls sideways');
  return bad;
}"""


_TICK_VALUES_JS = """(sel) => {
  const sup = {'⁻': '-', '⁰': '0', '¹': '1', '²': '2', '³': '3', '⁴': '4', '⁵': '5', '⁶': '6', '⁷': '7', '⁸': '8', '⁹': '9'};
  const ticks = [...document.querySelectorAll(sel + ' text.tick.y')].map(t => [t.getBoundingClientRect().top, t.textContent]);
  ticks.sort((a, b) => a[0] - b[0]);
  return ticks.map(([_, s]) => /^10[⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+$/.test(s) ? Math.pow(10, Number([...s.slice(2)].map(c => sup[c]).join(''))) : Number(s));
}"""


@pytest.mark.parametrize("width", [800, 1366])
@pytest.mark.parametrize("name", ["diverged", "warned"])
def test_no_label_is_cut_or_overprinted(
    browser: Any, reports: dict[str, Path], name: str, width: int
) -> None:
    page, errors = _open(browser, reports[name].as_uri(), width=width)
    try:
        assert page.locator(".chart svg").count() >= 4
        assert page.locator("g.marks path").count() >= 1  # markers drawn (and checked below)
        assert page.evaluate(_OVERFLOW_JS) == []
        # log axes read as powers of ten or whole numbers, never a bare minor digit
        # log axes: every label is the full value at its height (a bare minor digit "2" between
        # "10⁻³" and "10⁻²" would break the order), read top to bottom
        for chart in ("grad_norm", "update_ratio"):
            values = page.evaluate(_TICK_VALUES_JS, f"#chart-{chart}")
            assert len(values) >= 2 and values == sorted(values, reverse=True), values
            assert len(set(values)) == len(values)
    finally:
        page.close()
    assert errors == []


def test_charts_have_a_text_alternative_and_no_empty_plot(browser: Any, reports: dict[str, Path]) -> None:
    page, errors = _open(browser, reports["healthy"].as_uri())
    try:
        for fig in page.locator(".chart.has-plot").all():
            assert fig.locator(".chart-title").inner_text()
            assert fig.locator(".chart-summary").inner_text()
            label = fig.locator("svg").get_attribute("aria-label") or ""
            assert label.startswith(fig.locator(".chart-title").inner_text() + ". ")
        # no NaN/Inf in a healthy run: one line of text, no chart
        assert page.locator("#chart-nonfinite svg").count() == 0
        assert page.inner_text("#chart-nonfinite") == "NaN / Inf counts: none in this run"
        assert page.inner_text("#chart-loss .chart-summary").startswith("loss 1.401 at step 0 -> ")
    finally:
        page.close()
    assert errors == []


def test_log_toggle_smoothing_and_legend_below_the_plot(browser: Any, reports: dict[str, Path]) -> None:
    page, errors = _open(browser, reports["diverged"].as_uri())
    try:
        before = page.locator("#chart-loss text.tick.y").all_text_contents()
        page.check("#chart-loss input[data-tool=log]")
        after = page.locator("#chart-loss text.tick.y").all_text_contents()
        assert before != after and any(t.startswith("10") and len(t) > 2 for t in after)  # 10⁻¹, 10²...
        paths = page.locator("#chart-loss svg path").count()
        page.select_option("#chart-loss select[data-tool=smooth]", "0.9")
        assert page.locator("#chart-loss svg path").count() == paths + 1  # the smoothed line over the raw one
        plot = page.locator("#chart-update_ratio svg").bounding_box()
        legend = page.locator("#chart-update_ratio .legend").bounding_box()
        assert legend["y"] >= plot["y"] + plot["height"] - 0.5  # below, never over the plot
    finally:
        page.close()
    assert errors == []


def test_dark_mode_follows_the_system(browser: Any, reports: dict[str, Path]) -> None:
    lum = "(c => { const [r, g, b] = c.match(/\\d+/g).map(Number); return (0.2126*r + 0.7152*g + 0.0722*b) / 255; })"
    page, errors = _open(browser, reports["diverged"].as_uri(), scheme="dark")
    try:
        bg = page.evaluate(f"{lum}(getComputedStyle(document.body).backgroundColor)")
        card = page.evaluate(f"{lum}(getComputedStyle(document.querySelector('.chart')).backgroundColor)")
        tick = page.evaluate(f"{lum}(getComputedStyle(document.querySelector('#chart-loss text.tick')).fill)")
        assert bg < 0.15 and card < 0.2 and tick > 0.5
    finally:
        page.close()
    page, _ = _open(browser, reports["diverged"].as_uri(), scheme="light")
    try:
        assert page.evaluate(f"{lum}(getComputedStyle(document.body).backgroundColor)") > 0.9
    finally:
        page.close()
    assert errors == []


# --------------------------------------------------------------------------------- charts tell the truth


def test_nan_chart_names_the_anomaly_of_a_run_that_raised(browser: Any, reports: dict[str, Path]) -> None:
    # the failed run raised at step 3 before its numbers were written: no metric holds the NaN
    page, errors = _open(browser, reports["failed"].as_uri())
    try:
        assert "none in this run" not in page.inner_text("main")
        assert page.inner_text("#chart-nonfinite .chart-summary") == (
            "1 NaN/Inf anomaly on 1 step, first at step 3; no recorded metric holds a NaN/Inf"
        )
        assert page.locator("#chart-nonfinite g.marks path").count() == 1
        assert page.evaluate(_OVERFLOW_JS) == []
    finally:
        page.close()
    assert errors == []


def test_a_series_of_one_point_is_drawn(browser: Any, reports: dict[str, Path]) -> None:
    # 3 steps: one memory sample (step 0) and one detail step (step 0) for the update ratios
    page, errors = _open(browser, reports["failed"].as_uri())
    try:
        for chart in ("memory", "update_ratio"):
            traces = page.evaluate(f"document.getElementById('chart-{chart}').data.map(t => t.x.length)")
            assert traces and set(traces) == {1}, (chart, traces)
            assert page.locator(f"#chart-{chart} circle.lone").count() == len(traces)
        # a series of several points is a line, not dots
        assert page.locator("#chart-loss circle.lone").count() == 0
    finally:
        page.close()
    assert errors == []


@pytest.mark.parametrize("name", ["healthy", "diverged", "failed", "warned"])
def test_no_step_tick_is_negative(browser: Any, reports: dict[str, Path], name: str) -> None:
    page, errors = _open(browser, reports[name].as_uri())
    try:
        ticks = page.locator("text.tick.x").all_text_contents()
        assert ticks and all(float(t) >= 0 for t in ticks), ticks
    finally:
        page.close()
    assert errors == []


def test_markers_sit_on_a_lane_below_the_plot(browser: Any, reports: dict[str, Path]) -> None:
    page, errors = _open(browser, reports["warned"].as_uri())
    try:
        for chart in ("loss", "grad_norm"):
            frame = page.locator(f"#chart-{chart} rect.frame").bounding_box()
            lane = page.locator(f"#chart-{chart} rect.lane").bounding_box()
            assert lane["y"] >= frame["y"] + frame["height"]  # its own strip, under the data
            assert page.locator(f"#chart-{chart} g.marks path").count() >= 2
        assert page.evaluate(_OVERFLOW_JS) == []  # every marker inside its lane
        # each marker trace has a row: the loss chart's "loss NAN" and "anomaly" rows differ
        rows = page.evaluate(
            "[...document.querySelectorAll('#chart-loss g.marks path')].map(p => p.getAttribute('transform').split(',')[1])"
        )
        assert len(set(rows)) == 2
        # the lane answers the hover: a marker reads out what it marks
        page.locator("#chart-loss").scroll_into_view_if_needed()
        box = page.locator("#chart-loss g.marks path").last.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        tip = page.locator("#chart-loss .tip")
        assert tip.is_visible() and "anomaly: nan in " in tip.inner_text()
    finally:
        page.close()
    assert errors == []


def test_the_learning_rate_is_not_drawn_in_a_marker_colour(browser: Any, reports: dict[str, Path]) -> None:
    page, errors = _open(browser, reports["warned"].as_uri())
    try:
        lr = page.evaluate(
            "[...document.querySelectorAll('#chart-loss svg path[stroke-dasharray]')].map(p => p.getAttribute('stroke'))"
        )
        marks = set(
            page.evaluate(
                "[...document.querySelectorAll('#chart-loss g.marks path')].map(p => p.getAttribute('stroke'))"
            )
        )
        assert len(lr) == 1 and "#d62728" in marks  # the NaN markers are red
        assert lr[0] not in marks and lr[0].lower() != "#d62728"
        lines = page.evaluate(
            "[...document.querySelectorAll('#chart-loss svg g[clip-path] path')].map(p => p.getAttribute('stroke'))"
        )
        assert len(set(lines)) == len(lines) == 2  # loss and lr, two colours
    finally:
        page.close()
    assert errors == []


def _spike_run(root: Path) -> tuple[Path, list[float]]:
    """100 real SGD steps of a linear model with clipped gradients; step 60's batch has its targets
    scaled by 1000 (a bad batch): one loss spike, the model barely moved by it (clip at 1.0)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    writer = create_run(root=root, name="spike")
    losses = []
    for step in range(100):
        target = y * 1000 if step == 60 else y
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        writer.log_scalar("loss", step, losses[-1])
    writer.close()
    return writer.path, losses


def test_one_spike_does_not_flatten_the_loss_axis(browser: Any, tmp_path: Path) -> None:
    run, losses = _spike_run(tmp_path)
    spike = losses[60]
    rest = losses[:60] + losses[61:]
    assert spike > 1000 * max(rest)  # the data: ~1e6 against ~1
    path = tmp_path / "spike.html"
    render_report(run, "html", path=path)
    page, errors = _open(browser, path.as_uri())
    try:
        ticks = page.evaluate(_TICK_VALUES_JS, "#chart-loss")
        assert max(ticks) < 10 * max(rest) and max(ticks) >= max(rest) * 0.5  # the curve fills the axis
        assert page.inner_text("#chart-loss label:has(input[data-tool=outliers])").strip() == (
            "ignore outliers (1 off the axis)"
        )
        page.uncheck("#chart-loss input[data-tool=outliers]")
        assert max(page.evaluate(_TICK_VALUES_JS, "#chart-loss")) >= spike * 0.9
    finally:
        page.close()
    assert errors == []


def test_a_divergence_that_lasts_stays_on_the_axis(browser: Any, reports: dict[str, Path]) -> None:
    # 40 steps of 140 above the old level are a regime, not outliers: the axis keeps them
    page, errors = _open(browser, reports["diverged"].as_uri())
    try:
        assert page.is_checked("#chart-loss input[data-tool=outliers]")
        assert max(page.evaluate(_TICK_VALUES_JS, "#chart-loss")) >= 4000  # max loss 5927 at step 102
        assert "off the axis" not in page.inner_text("#chart-loss .chart-tools")
    finally:
        page.close()
    assert errors == []


# the heatmap's drawn cells (the image's left and right edge) and its step ticks, in SVG pixels
_HEAT_GEOMETRY_JS = """() => {
  const svg = document.querySelector('#chart-layers svg'), img = svg.querySelector('image');
  const ticks = {};
  svg.querySelectorAll('text.tick.x').forEach(t => { ticks[t.textContent] = +t.getAttribute('x'); });
  return {left: +img.getAttribute('x'), right: +img.getAttribute('x') + +img.getAttribute('width'), ticks};
}"""


def test_a_gan_heatmap_has_no_blank_column(browser: Any, tmp_path: Path) -> None:
    from tests.fixtures.watched_runs import gan_run

    run = gan_run(tmp_path)
    path = tmp_path / "gan.html"
    render_report(run, "html", path=path)
    page, errors = _open(browser, path.as_uri())
    try:
        heat = page.evaluate("document.getElementById('chart-layers').data[0]")
        # parameters only, recorded at steps 0, 10 and 20: one column each, every cell filled
        assert heat["y"] == [f"{m}.{i}.{p}" for m in "DG" for i in (0, 2) for p in ("bias", "weight")]
        assert heat["x"] == [0, 10, 20]
        assert all(v is not None for row in heat["z"] for v in row)
        # each model's total norm is a line beside the sum
        names = page.evaluate("document.getElementById('chart-grad_norm').data.map(t => t.name)")
        assert names == ["grad_norm", "‖g‖ of D", "‖g‖ of G"]
    finally:
        page.close()
    assert errors == []
    # report and dashboard: each column starts at its step, the first at the step-0 tick (not half
    # a column before it); the last lasts as long as the gap before it: steps 20-30
    with serve(run.parent, port=0) as h:
        for url in (path.as_uri(), f"{h.url}/runs/{run.name}"):
            page, errors = _open(browser, url)
            try:
                page.wait_for_selector("#chart-layers svg image")
                geo = page.evaluate(_HEAT_GEOMETRY_JS)
            finally:
                page.close()
            assert errors == []
            assert geo["left"] == pytest.approx(geo["ticks"]["0"], abs=0.01)
            assert geo["right"] == pytest.approx(geo["ticks"]["30"], abs=0.01)
            assert min(float(t) for t in geo["ticks"]) == 0  # no tick before step 0


# --------------------------------------------------------------------------------- weight and network


def test_report_weight_is_under_the_budget(reports: dict[str, Path]) -> None:
    for name, path in reports.items():
        assert path.stat().st_size < REPORT_BUDGET, name


def test_dashboard_stays_on_its_own_origin_and_under_the_weight_budget(
    browser: Any, watched_runs: dict[str, Path]
) -> None:
    run = watched_runs["diverged"]
    with serve(run.parent, port=0) as h:
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        requests: list[Any] = []
        page.on("requestfinished", lambda r: requests.append(r))
        page.goto(f"{h.url}/runs/{run.name}")
        page.wait_for_selector("#chart-loss svg")
        page.wait_for_load_state("networkidle")
        try:
            origin = urlsplit(h.url).netloc
            assert requests and all(urlsplit(r.url).netloc == origin for r in requests), [
                r.url for r in requests
            ]
            moved = sum(r.sizes()["responseBodySize"] + r.sizes()["responseHeadersSize"] for r in requests)
            assert moved < PAGE_BUDGET
            script = next(r for r in requests if r.url.endswith("/static/tdcharts.js"))
            headers = script.response().all_headers()
            assert headers.get("content-encoding") == "gzip" and headers.get("etag")
            assert "max-age" in headers.get("cache-control", "")
            # nothing that uploads or shares: no form, no link off the machine, no "share" control
            assert page.locator("form").count() == 0
            hosts = page.evaluate("[...document.querySelectorAll('a[href]')].map(a => new URL(a.href).host)")
            assert all(x == origin for x in hosts)
            text = page.inner_text("body").lower()
            assert "share" not in text and "cloud" not in text
        finally:
            page.close()


# --------------------------------------------------------------------------------- live updates


def test_live_page_appends_new_steps_without_reloading(browser: Any, tmp_path: Path) -> None:
    writer = create_run(root=tmp_path, name="live", flush_interval=0.1)
    train_steps(writer, 5)
    writer.flush()
    stop = threading.Event()

    def training() -> None:
        step = 5
        while not stop.is_set() and step < 300:
            train_steps(writer, 1, start=step, seed=step)
            step += 1
            time.sleep(0.05)

    thread = threading.Thread(target=training, daemon=True)
    try:
        with serve(tmp_path, port=0) as h:
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            views: list[str] = []
            page.on("request", lambda r: views.append(r.url) if "/views" in r.url else None)
            page.goto(f"{h.url}/runs/{writer.path.name}")
            page.wait_for_selector("#chart-loss svg")
            page.evaluate("window.__kept = 42")
            first = page.evaluate("document.getElementById('chart-loss').data[0].x.length")
            thread.start()
            page.wait_for_function(
                f"document.getElementById('chart-loss').data[0].x.length > {first} + 5", timeout=20_000
            )
            assert page.evaluate("window.__kept") == 42  # the same document: no reload
            assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
            assert views and all("since_step=" in u for u in views)  # only new steps asked for
            xs = page.evaluate("document.getElementById('chart-loss').data[0].x")
            assert xs == sorted(set(xs))  # appended in order, no step twice
            page.close()
    finally:
        stop.set()
        thread.join(30)
        writer.close()


def test_run_list_updates_in_place(browser: Any, tmp_path: Path) -> None:
    first = create_run(root=tmp_path, name="first")
    train_steps(first, 2)
    first.close()
    with serve(tmp_path, port=0) as h:
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        page.goto(f"{h.url}/")
        page.evaluate("window.__kept = 7")
        page.focus("#runs-body a")
        second = create_run(root=tmp_path, name="second")
        train_steps(second, 3)
        second.close()
        try:
            page.wait_for_function("document.querySelectorAll('#runs-body tr').length === 2", timeout=20_000)
            assert page.evaluate("window.__kept") == 7
            assert page.evaluate("document.activeElement.textContent") == "first"  # focus kept
            assert page.locator("#runs-body tr").first.locator("a").inner_text() == "second"
        finally:
            page.close()
