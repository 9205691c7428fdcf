"""A dashboard no other site can drive: Host allow-list, no foreign state changes, no CORS (issue 13, item 8)."""

from __future__ import annotations

import subprocess
import sys
import time
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
from tests.fixtures.runs import TinyMLP, write_small_run  # noqa: E402
from torchdebug.views.server import bound_hosts, check_bind, serve  # noqa: E402
from torchdebug.views.server._app import RequestGuard  # noqa: E402


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A live session (3 steps, level intermediate) and its dashboard on a loopback port."""
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
        with serve(mon, port=0, warm=0) as handle:
            yield mon, handle


def test_a_foreign_origin_cannot_change_the_live_session(live: tuple[Any, Any]) -> None:
    # the probe: this POST was accepted and switched the session to "expert"
    mon, h = live
    r = httpx.post(f"{h.url}/training-logs/debug/level/expert", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    assert r.json()["error"].startswith(
        "forbidden: a POST from the page 'http://evil.example' may not change this dashboard"
    )
    assert "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{h.url}/training-logs/debug/clear", headers={"Origin": "null"})  # sandboxed page
    assert r.status_code == 403
    # the live session is unchanged: no level pending, no override, no new history segment
    assert (
        mon.controls.pending_level is None and mon.level_overrides == [] and mon.controls.segment_start == 0
    )
    assert mon.config.level.value == "intermediate"


def test_the_dashboards_own_page_and_scripts_still_drive_it(live: tuple[Any, Any]) -> None:
    mon, h = live
    own = f"http://127.0.0.1:{h.port}"
    r = httpx.post(f"{h.url}/training-logs/debug/level/basic", headers={"Origin": own})
    assert r.status_code == 200 and r.json()["level"] == "basic"
    # opened as http://localhost:PORT, the page's origin is that: same origin again
    r = httpx.post(
        f"{h.url}/training-logs/debug/clear",
        headers={"Host": f"localhost:{h.port}", "Origin": f"http://localhost:{h.port}"},
    )
    assert r.status_code == 200 and r.json()["status"] == "ok"
    # a script or curl sends no Origin: not a browser page, allowed (the token guards those)
    assert httpx.post(f"{h.url}/training-logs/debug/level/advanced").status_code == 200
    assert mon.level_overrides == ["basic", "advanced"]


def test_a_foreign_host_is_refused(live: tuple[Any, Any]) -> None:
    # the probe: a request with Host: attacker.example (DNS rebinding) got the run list
    _, h = live
    for path in ("/api/runs", "/", "/training-logs/debug/summary", "/openapi.json"):
        r = httpx.get(f"{h.url}{path}", headers={"Host": "attacker.example"})
        assert r.status_code == 403, path
        assert r.json()["error"].startswith(
            "forbidden: Host 'attacker.example' is not an address of this dashboard"
        )
        assert "--allowed-host" in r.json()["error"]
    r = httpx.get(f"{h.url}/api/runs", headers={"Host": f"attacker.example:{h.port}"})
    assert r.status_code == 403
    for host in ("127.0.0.1", f"127.0.0.1:{h.port}", f"localhost:{h.port}", f"[::1]:{h.port}", "LOCALHOST"):
        assert httpx.get(f"{h.url}/api/runs", headers={"Host": host}).status_code == 200, host


def test_no_cors_unless_asked(live: tuple[Any, Any]) -> None:
    _, h = live
    r = httpx.get(f"{h.url}/api/runs", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # the browser hides it
    pre = httpx.options(
        f"{h.url}/training-logs/debug/clear",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in pre.headers


def test_allowed_hosts_and_origins_are_configurable(tmp_path: Path) -> None:
    write_small_run(tmp_path, name="ok")
    with serve(
        tmp_path,
        port=0,
        warm=0,
        allowed_hosts=["dash.example"],
        allowed_origins=["https://tools.example"],
    ) as h:
        assert httpx.get(f"{h.url}/api/runs", headers={"Host": "dash.example"}).status_code == 200
        assert httpx.get(f"{h.url}/api/runs", headers={"Host": "other.example"}).status_code == 403
        r = httpx.get(f"{h.url}/api/runs", headers={"Origin": "https://tools.example"})
        assert r.headers["access-control-allow-origin"] == "https://tools.example"
        r = httpx.get(f"{h.url}/api/runs", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        # trusted to POST; with no live session the endpoint answers 409, not 403
        r = httpx.post(f"{h.url}/training-logs/debug/clear", headers={"Origin": "https://tools.example"})
        assert r.status_code == 409
        r = httpx.post(f"{h.url}/training-logs/debug/clear", headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
    with serve(tmp_path, port=0, warm=0, allowed_hosts=["*"]) as h:
        assert httpx.get(f"{h.url}/api/runs", headers={"Host": "any.example"}).status_code == 200


def test_request_guard_rules() -> None:
    g = RequestGuard(["dash.example"])
    assert g.refusal("GET", "dash.example:80", None) is None
    assert g.refusal("GET", "10.1.2.3:6007", None) is None  # an address is never a rebinding name
    assert g.refusal("GET", "[fe80::1]:6007", None) is None
    assert g.refusal("GET", None, None) is None  # HTTP/1.0 without Host: not a browser
    assert g.refusal("GET", "evil.example", None) is not None
    assert g.refusal("GET", "127.0.0.1:1", "http://evil.example") is None  # reading is the browser's job
    assert g.refusal("DELETE", "127.0.0.1:1", "http://evil.example") is not None
    assert g.refusal("PUT", "127.0.0.1:1", "http://127.0.0.1:1") is None
    assert g.refusal("POST", "127.0.0.1:1", "https://127.0.0.1:1/") is None  # behind a TLS proxy
    assert g.refusal("POST", "127.0.0.1:1", "http://127.0.0.1:2") is not None  # another local port


def test_bound_hosts() -> None:
    import socket

    assert bound_hosts("127.0.0.1") == ["127.0.0.1"]
    assert bound_hosts("localhost", [" dash.example "]) == ["localhost", "dash.example"]
    wide = bound_hosts("0.0.0.0")
    assert wide[0] == "0.0.0.0" and socket.gethostname() in wide
    with pytest.raises(ValueError, match="allowed_hosts entries must be host names"):
        bound_hosts("127.0.0.1", [""])


@pytest.mark.parametrize("token", ["", " ", "\t\n"], ids=["empty", "space", "whitespace"])
def test_a_blank_token_is_refused(tmp_path: Path, token: str) -> None:
    with pytest.raises(ValueError, match="token is empty or whitespace"):
        check_bind("127.0.0.1", token)
    with pytest.raises(ValueError, match="token is empty or whitespace"):
        serve(tmp_path, port=0, token=token)
    with pytest.raises(ValueError, match="token is empty or whitespace"):
        serve(tmp_path, host="0.0.0.0", port=0, token=token)


ALLOW = ("--allowed-host", "dash.example")


def test_cli_allowed_host_and_blank_token(tmp_path: Path) -> None:
    write_small_run(tmp_path, name="ok")
    bad = subprocess.run(
        [sys.executable, "-m", "torchdebug", "serve", str(tmp_path), "--token", "  "],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("torchdebug: error: the dashboard token is empty")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchdebug", "serve", str(tmp_path), "--port", str(port), *ALLOW],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                ok = httpx.get(
                    f"http://127.0.0.1:{port}/api/runs", headers={"Host": "dash.example"}, timeout=2
                )
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "torchdebug serve did not start"
                time.sleep(0.1)
        assert ok.status_code == 200 and [r["name"] for r in ok.json()["runs"]] == ["ok"]
        no = httpx.get(f"http://127.0.0.1:{port}/api/runs", headers={"Host": "attacker.example"}, timeout=5)
        assert no.status_code == 403
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_no_foreign_page_can_frame_the_dashboard(live: tuple[Any, Any]) -> None:
    # every answer, pages, JSON, scripts and refusals alike, forbids framing (clickjacking): the
    # old header for old browsers, CSP frame-ancestors for the rest
    _, h = live
    answers = [
        httpx.get(f"{h.url}/"),  # 307 to the run's page
        httpx.get(f"{h.url}/", follow_redirects=True),
        httpx.get(f"{h.url}/api/runs"),
        httpx.get(f"{h.url}/training-logs/debug/summary"),
        httpx.get(f"{h.url}/api/runs/nope"),  # 404
        httpx.post(f"{h.url}/training-logs/debug/clear", headers={"Origin": "http://evil.example"}),  # 403
    ]
    assert [r.status_code for r in answers] == [307, 200, 200, 200, 404, 403]
    for r in answers:
        assert r.headers["x-frame-options"] == "DENY", r.url
        assert r.headers["content-security-policy"] == "frame-ancestors 'none'", r.url
        assert r.headers["x-content-type-options"] == "nosniff", r.url
