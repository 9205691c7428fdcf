"""Tests of the dashboard server: real uvicorn on a loopback port, the JSON API, seed endpoints, safety."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torchdebug as td  # noqa: E402
from tests.fixtures.runs import TinyMLP, train_steps, write_small_run  # noqa: E402
from torchdebug._errors import TorchDebugWarning  # noqa: E402
from torchdebug.store import create_run, open_run  # noqa: E402
from torchdebug.views.report import build_report  # noqa: E402
from torchdebug.views.report._format import json_safe  # noqa: E402
from torchdebug.views.server import check_bind, serve  # noqa: E402


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("served")
    write_small_run(root, name="golden")
    w = create_run(root=root, name="tiny")
    train_steps(w, 3)
    w.close()
    return root


@pytest.fixture(scope="module")
def small_id(runs_dir: Path) -> str:
    return next(p.name for p in runs_dir.iterdir() if p.name.startswith("golden-"))


@pytest.fixture(scope="module")
def client(runs_dir: Path) -> Iterator[Any]:
    handle = serve(runs_dir, port=0)
    try:
        with httpx.Client(base_url=handle.url, timeout=30) as c:
            yield c
    finally:
        handle.stop()


def _error(r: Any, status: int) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    return str(r.json()["error"])


def test_serves_on_loopback_and_lists_runs(client: Any, small_id: str) -> None:
    assert client.base_url.host == "127.0.0.1"
    runs = client.get("/api/runs").json()["runs"]
    assert [r["name"] for r in runs] == ["golden", "tiny"]
    golden = runs[0]
    assert golden["id"] == small_id and "path" not in golden  # no absolute paths leave the server
    assert (golden["status"], golden["steps"], golden["anomalies"]) == ("finished", 8, 1)
    # the verdict with it: finished with a NaN is an error, never green
    assert golden["level"] == "error" and golden["verdict"].startswith(
        "finished, but non-finite values at step 6"
    )


def test_the_index_colours_each_run_by_its_verdict(client: Any, small_id: str) -> None:
    index = client.get("/").text
    row = index[index.index(f'<tr data-id="{small_id}">') :]
    row = row[: row.index("</tr>")]
    # the badge's class is the verdict's level (styled), its text the status; the sentence beside it
    assert '<span class="badge error">finished</span>' in row
    assert '<td data-k="verdict" class="verdict-cell error">finished, but non-finite values at step 6' in row
    from torchdebug.views.report._html import _CSS

    for level in ("ok", "running", "warning", "error"):
        assert f".badge.{level} {{" in _CSS


def test_run_detail(client: Any, small_id: str) -> None:
    d = client.get(f"/api/runs/{small_id}").json()
    assert d["id"] == small_id and d["status"] == "finished"
    assert d["meta"]["config"]["level"] == "advanced"
    assert "loss" in d["metrics"] and "grad_norm/fc1.weight" in d["metrics"]
    assert d["summary"]["steps"] == 8 and "path" not in d["summary"]


def test_metrics_keep_nan_and_inf_as_strings(client: Any, small_id: str) -> None:
    r = client.get(f"/api/runs/{small_id}/metrics", params={"names": "loss,grad_norm"})
    m = json.loads(r.text)["metrics"]  # strict JSON
    assert set(m) == {"loss", "grad_norm"}
    assert m["loss"]["steps"] == list(range(8))
    assert m["loss"]["values"] == [2.5, 2.0, 1.5, 1.25, 1.0, 8.0, "nan", 0.75]
    assert m["grad_norm"]["values"][6] == "inf"
    assert m["loss"]["downsampled"] is False


def test_metrics_since_step_max_points_and_defaults(client: Any, small_id: str) -> None:
    m = client.get(f"/api/runs/{small_id}/metrics", params={"names": "loss", "since_step": 5}).json()[
        "metrics"
    ]
    assert m["loss"]["steps"] == [5, 6, 7]
    # max_points=2: one bucket keeps its lowest (the NaN, step 6) and highest (8.0, step 5) point
    m = client.get(f"/api/runs/{small_id}/metrics", params={"names": "loss", "max_points": 2}).json()[
        "metrics"
    ]
    assert m["loss"]["steps"] == [5, 6] and m["loss"]["values"] == [8.0, "nan"]
    assert m["loss"]["downsampled"] is True
    every = client.get(f"/api/runs/{small_id}/metrics").json()
    assert every["max_points"] == 2000 and len(every["metrics"]) == 9
    walls = client.get(f"/api/runs/{small_id}/metrics", params={"names": "lr/0", "wall_times": "true"}).json()
    assert len(walls["metrics"]["lr/0"]["wall_times"]) == 8


@pytest.mark.parametrize(
    ("params", "status", "fragment"),
    [
        ({"max_points": 1}, 422, "invalid parameters"),
        ({"max_points": "many"}, 422, "invalid parameters"),
        ({"since_step": -1}, 422, "invalid parameters"),
        ({"names": "loss,nope"}, 404, "unknown metric(s) ['nope']"),
    ],
    ids=["max_points-too-small", "max_points-not-int", "negative-since", "unknown-metric"],
)
def test_bad_metric_parameters_are_4xx_json(
    client: Any, small_id: str, params: dict[str, Any], status: int, fragment: str
) -> None:
    assert fragment in _error(client.get(f"/api/runs/{small_id}/metrics", params=params), status)


@pytest.mark.parametrize(
    "path",
    [
        "/api/runs/..%2F..%2Fetc%2Fpasswd",
        "/api/runs/..%2Fserved0",
        "/api/runs/%2Fetc%2Fpasswd",
        "/api/runs/%2E%2E",
        "/api/runs/%2E%2E/metrics",
        "/api/runs/nope-20200101-000000",
        "/runs/..%2F..%2Fetc",
        "/api/runs/.hidden",
    ],
)
def test_path_traversal_and_unknown_runs_are_404(client: Any, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 404, (path, r.status_code, r.text)
    assert r.json()["error"]


def test_symlink_leading_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    real = write_small_run(outside, name="secret")
    served = tmp_path / "served"
    served.mkdir()
    (served / "link").symlink_to(real, target_is_directory=True)
    with serve(served, port=0) as h:
        r = httpx.get(f"{h.url}/api/runs/link")
    assert r.status_code == 404 and "no run" in r.json()["error"]


def test_anomalies_events_report(client: Any, small_id: str, runs_dir: Path) -> None:
    an = client.get(f"/api/runs/{small_id}/anomalies").json()["anomalies"]
    assert [(a["phase"], a["module"], a["op"], a["location"]) for a in an] == [
        ("forward", "fc2", "aten.addmm", "train.py:42")
    ]
    ev = client.get(f"/api/runs/{small_id}/events").json()["events"]
    assert [e["kind"] for e in ev] == [
        "input_bound",
        "gradient_explosion",
        "loss_spike",
        "nonfinite_gradients",
        "memory_leak",
    ]
    only = client.get(f"/api/runs/{small_id}/events", params={"kind": "loss_spike"}).json()["events"]
    assert [e["step"] for e in only] == [5]
    rep = client.get(f"/api/runs/{small_id}/report.json").json()
    with open_run(runs_dir / small_id) as run:
        assert rep == json_safe(build_report(run))


def test_views_and_pages(client: Any, small_id: str) -> None:
    v = client.get(f"/api/runs/{small_id}/views").json()
    assert v["status"] == "finished"
    assert [f["id"] for f in v["figures"]][:3] == ["loss", "grad_norm", "nonfinite"]
    assert "aten.addmm at train.py:42" in v["cards_html"]
    assert v["last_step"] == 7 and v["verdict"].startswith("finished, but non-finite values at step 6")
    # the live page's poll: only steps >= since_step, and no fragments when its version is current
    inc = client.get(f"/api/runs/{small_id}/views", params={"since_step": 7, "frag": v["frag"]}).json()
    loss = next(f for f in inc["figures"] if f["id"] == "loss")
    assert loss["data"][0]["x"] == [7] and "cards_html" not in inc and inc["frag"] == v["frag"]
    layers = next(f for f in inc["figures"] if f["id"] == "layers")
    assert layers["data"][0]["x"] == [7.0]  # one new heatmap column
    late = client.get(f"/api/runs/{small_id}/views", params={"since_step": 8}).json()  # nothing new yet
    assert late["figures"][0]["data"][0]["x"] == [] and "cards_html" in late  # no version sent: all of them
    index = client.get("/")
    assert index.status_code == 200 and f'href="/runs/{small_id}"' in index.text
    page = client.get(f"/runs/{small_id}")
    assert '<script src="/static/tdcharts.js"></script>' in page.text
    assert f"/api/runs/{small_id}/views" in page.text
    js = client.get("/static/tdcharts.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("application/javascript")


def test_openapi_documents_the_api(client: Any) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for p in (
        "/api/runs",
        "/api/runs/{run_id}",
        "/api/runs/{run_id}/metrics",
        "/api/runs/{run_id}/anomalies",
        "/api/runs/{run_id}/events",
        "/api/runs/{run_id}/report.json",
        "/training-logs/debug/summary",
        "/training-logs/debug/training/summary",
        "/training-logs/debug/level/{level}",
        "/training-logs/debug/clear",
    ):
        assert p in paths, p
    names = {q["name"] for q in paths["/api/runs/{run_id}/metrics"]["get"]["parameters"]}
    assert {"names", "since_step", "max_points"} <= names


def test_seed_endpoints_on_a_stored_run(client: Any, small_id: str) -> None:
    ts = client.get("/training-logs/debug/training/summary", params={"run": small_id}).json()
    # 8 steps; anomalous steps (events.is_anomalous: an anomaly or a warning/error event): step 5
    # (explosion + spike), 6 (the anomaly and its error event), 7 (memory leak) = 3; gradient_explosion
    # (explosion), loss_spike (loss anomaly); rates / 8
    assert ts == {
        "total_steps": 8,
        "anomaly_steps": 3,
        "gradient_explosions": 1,
        "gradient_vanishing": 0,
        "loss_anomalies": 1,
        "anomaly_rate": 0.375,
        "loss_anomaly_rate": 0.125,
        "gradient_explosion_rate": 0.125,
        "gradient_vanishing_rate": 0.0,
    }
    s = client.get("/training-logs/debug/summary", params={"run": small_id}).json()
    assert s["training_debugger"] == {
        "total_anomalies": 3,
        "debug_history_length": 8,
        "total_steps": 8,
        "anomaly_rate": 0.375,
        "gradient_explosion_rate": 0.125,
    }
    assert s["diffusion_debugger"] == {"total_anomalies": 0, "debug_history_length": 0}
    assert s["general_debugger"] == {"total_anomalies": 1, "debug_history_length": 5}
    # without ?run= the newest run ("tiny", 3 clean steps) is summarized
    assert client.get("/training-logs/debug/training/summary").json()["total_steps"] == 3
    assert "no live training session" in _error(client.post("/training-logs/debug/level/advanced"), 409)
    assert "no live training session" in _error(client.post("/training-logs/debug/clear"), 409)


def test_token_is_required_on_every_request(runs_dir: Path, small_id: str) -> None:
    with serve(runs_dir, port=0, token="s3cret") as h:
        assert httpx.get(f"{h.url}/api/runs").status_code == 401
        bad = httpx.get(f"{h.url}/api/runs", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and "unauthorized" in bad.json()["error"]
        assert httpx.get(f"{h.url}/openapi.json").status_code == 401
        assert httpx.get(f"{h.url}/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{h.url}/runs/{small_id}", params={"token": "s3cret"}).status_code == 200
        assert httpx.get(f"{h.url}/static/tdcharts.js").status_code == 200  # library code, no run data
        assert httpx.post(f"{h.url}/training-logs/debug/clear").status_code == 401


def test_non_loopback_bind_needs_a_token() -> None:
    with pytest.raises(ValueError, match="pass a token"):
        check_bind("0.0.0.0", None)
    with pytest.warns(TorchDebugWarning, match="listening on 0.0.0.0"):
        check_bind("0.0.0.0", "t")
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    with pytest.raises(ValueError, match="pass a token"):
        serve("runs", host="0.0.0.0", port=0)


def test_unreadable_run_is_listed_and_answers_422(tmp_path: Path) -> None:
    ok = write_small_run(tmp_path, name="ok")
    broken = tmp_path / "broken-20200101-000000"
    shutil.copytree(ok, broken)
    (broken / "rank0.sqlite").write_bytes(b"garbage" * 100)
    with serve(tmp_path, port=0) as h:
        runs = httpx.get(f"{h.url}/api/runs").json()["runs"]
        assert {r["id"]: r["status"] for r in runs}[broken.name] == "unreadable"
        r = httpx.get(f"{h.url}/api/runs/{broken.name}/metrics")
        assert r.status_code == 422 and "not a SQLite database" in r.json()["error"]


def test_live_run_updates_through_the_cache(tmp_path: Path) -> None:
    w = create_run(root=tmp_path, name="live")
    train_steps(w, 5)
    w.flush()
    with serve(w.path, port=0) as h, httpx.Client(base_url=h.url) as c:
        rid = w.path.name
        home = c.get("/", follow_redirects=True)  # a single run: redirected to its page
        assert home.status_code == 200 and str(home.url).endswith(f"/runs/{rid}")
        first = c.get(f"/api/runs/{rid}/metrics", params={"names": "loss"}).json()["metrics"]["loss"]
        assert first["steps"] == [0, 1, 2, 3, 4]
        assert c.get(f"/api/runs/{rid}/views").json()["status"] == "running"
        losses = train_steps(w, 5, start=5, seed=1)
        w.flush()
        again = c.get(f"/api/runs/{rid}/metrics", params={"names": "loss"}).json()["metrics"]["loss"]
        assert again["steps"] == list(range(10))
        assert again["values"][5:] == losses  # only the new steps were read, appended in order
        w.close()
        assert c.get(f"/api/runs/{rid}/views").json()["status"] == "finished"


def test_live_monitor_level_and_clear(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with td.watch(model, opt, run=tmp_path) as mon:
        for _ in range(3):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        with serve(mon, port=0) as h, httpx.Client(base_url=h.url) as c:
            r = c.post("/training-logs/debug/level/EXPERT")
            assert r.status_code == 200 and r.json()["level"] == "expert"
            assert mon.config.level.value == "intermediate"  # applied on the training thread, in step()
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
            assert mon.config.level.value == "expert"
            assert "ModuleTimeInstrument" in {type(i).__name__ for i in mon.instruments}  # expert-only
            bad = c.post("/training-logs/debug/level/ludicrous")
            assert _error(bad, 422) == "unknown debug level 'ludicrous'"
            assert bad.json()["allowed"] == ["basic", "intermediate", "advanced", "expert"]
            assert c.get("/training-logs/debug/training/summary").json()["total_steps"] == 4
            assert c.post("/training-logs/debug/clear").json()["status"] == "ok"
            assert c.get("/training-logs/debug/training/summary").json()["total_steps"] == 0
            mon.writer.flush()
            rid = mon.run_dir.name
            segs = c.get(f"/api/runs/{rid}").json()["segments"]
            # one new segment after the 4 recorded steps (0..3), starting at the next step
            assert len(segs) == 1 and segs[0]["start_step"] == 4
            events = c.get(f"/api/runs/{rid}/events", params={"kind": "level_change"}).json()["events"]
            assert [e["data"]["level"] for e in events] == ["expert"]
            assert (
                len(
                    c.get(f"/api/runs/{rid}/metrics", params={"names": "loss"}).json()["metrics"]["loss"][
                        "steps"
                    ]
                )
                == 4
            )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_serve_runs_in_the_foreground_and_refuses_open_binds(runs_dir: Path) -> None:
    import subprocess
    import sys
    import time

    bad = subprocess.run(
        [sys.executable, "-m", "torchdebug", "serve", str(runs_dir), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "pass a token" in bad.stderr
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchdebug", "serve", str(runs_dir), "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "torchdebug serve did not start"
                time.sleep(0.1)
        assert [x["name"] for x in r.json()["runs"]] == ["golden", "tiny"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert f"torchdebug dashboard: http://127.0.0.1:{port}" in err


def test_cli_serve_on_a_busy_port_fails_with_one_line(runs_dir: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "torchdebug", "serve", "--runs", str(runs_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    # exit 1 (failed), not uvicorn's 3 (which torchdebug documents as "a NaN was found")
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"torchdebug: error: cannot listen on 127.0.0.1:{port}: ")
    assert "choose another with --port" in done.stderr


def test_live_monitor_without_a_store(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with td.watch(model, opt, run=False) as mon:
        for _ in range(2):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
        with serve(mon, port=0) as h, httpx.Client(base_url=h.url) as c:
            assert c.get("/api/runs").json() == {"runs": []}
            s = c.get("/training-logs/debug/summary").json()
            assert s["training_debugger"]["total_steps"] == 2
            assert s["general_debugger"] == {"total_anomalies": 0, "debug_history_length": 0}
            assert c.post("/training-logs/debug/level/basic").json()["level"] == "basic"
