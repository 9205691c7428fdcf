"""Input refused where it enters: paths the OS refuses (config), malformed Host headers (dashboard),
a demo bad step outside the run (CLI)."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

import torchdebug as td
from torchdebug._errors import ConfigError

# -- paths are validated when the config is built ------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("run_dir", "runs\x00evil"),
        ("run_dir", "runs/\udcff\ud800"),  # a lone surrogate: no filesystem encoding has it
        ("debug_output_dir", "out\x00"),
        ("tensorboard", "tb\x00logs"),
        ("run_name", "name\x00"),
    ],
    ids=["run_dir-nul", "run_dir-surrogate", "debug_output_dir-nul", "tensorboard-nul", "run_name-nul"],
)
def test_a_path_the_os_refuses_is_a_config_error_naming_the_option(option: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{option}=.* cannot be a path") as info:
        td.DebugConfig(**{option: value})
    assert "embedded null byte" not in str(info.value)
    cfg = td.DebugConfig()
    with pytest.raises(ConfigError, match=rf"^{option}="):  # on assignment too
        setattr(cfg, option, value)


def test_watch_with_a_nul_run_dir_fails_at_the_config_not_inside_the_with(tmp_path: Path) -> None:
    import torch

    model = torch.nn.Linear(2, 1)
    # the probe: this reached watch() and raised "ValueError: embedded null byte" from os.mkdir
    with pytest.raises(ConfigError, match=r"^run_dir='runs\\x00x' cannot be a path: it holds a NUL"):
        td.watch(model, config={"run_dir": "runs\x00x"})
    with pytest.raises(ConfigError, match=r"^run='runs\\x00x' cannot be a path: it holds a NUL"):
        td.watch(model, run="runs\x00x")
    with pytest.raises(ConfigError, match=r"^run=b'r\\x00' cannot be a path: it holds a NUL"):
        td.watch(model, run=b"r\x00")
    assert list(tmp_path.iterdir()) == []


def test_ordinary_paths_still_pass(tmp_path: Path) -> None:
    cfg = td.DebugConfig(run_dir=str(tmp_path / "rüns with spaces"), tensorboard=True, run_name="a.b-c")
    assert cfg.run_dir.endswith("rüns with spaces") and cfg.tensorboard is True


# -- the Host guard parses host[:port] strictly ----------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        "localhost:80@evil.com",
        "127.0.0.1:6007@evil.com",
        "user@localhost",
        ":6007",
        "",
        "localhost:",
        "localhost:99999",
        "localhost:80:80",
        "localhost:x",
        "[::1",
        "[::1]x",
        "[evil.com]:80",
        "local host",
        "localhost/evil",
    ],
)
def test_a_malformed_host_header_is_refused(header: str) -> None:
    from torchdebug.views.server._app import RequestGuard

    status, why = RequestGuard().check_host(header)
    assert status == 400 and why is not None and why.startswith("bad request: Host")


@pytest.mark.parametrize(
    "header",
    ["localhost", "localhost:6007", "127.0.0.1:1", "[::1]:6007", "[::1]", "LOCALHOST:80", "10.0.0.1"],
)
def test_a_wellformed_local_host_header_passes(header: str) -> None:
    from torchdebug.views.server._app import RequestGuard

    assert RequestGuard().check_host(header) == (200, None)


def test_the_server_answers_400_to_userinfo_in_host(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tests.fixtures.runs import write_small_run
    from torchdebug.views.server import create_app

    write_small_run(tmp_path, name="good")
    with TestClient(create_app(tmp_path, warm=0), base_url="http://127.0.0.1") as client:
        # the probe: 200 with the run list
        for host in ("localhost:80@evil.com", "127.0.0.1:6007@evil.com"):
            r = client.get("/api/runs", headers={"Host": host})
            assert r.status_code == 400, host
            assert r.json()["error"].startswith("bad request: Host")
        assert client.get("/api/runs", headers={"Host": "evil.com"}).status_code == 403
        assert client.get("/api/runs", headers={"Host": "localhost:6007"}).status_code == 200


# -- demo --bad-step outside [0, steps) is a usage error ---------------------------------------------


def _cli(*args: str) -> tuple[int, str]:
    from torchdebug.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


@pytest.mark.parametrize(("bad", "steps"), [("-1", "300"), ("300", "300"), ("10", "5"), ("x", "5")])
def test_a_bad_step_outside_the_run_is_a_usage_error(bad: str, steps: str, tmp_path: Path) -> None:
    code, err = _cli("demo", "--steps", steps, "--bad-step", bad, "--runs", str(tmp_path))
    assert code == 2, err
    assert err.startswith("torchdebug demo: error: argument --bad-step:") or err.startswith(
        "torchdebug: error: argument --bad-step:"
    ), err
    assert "none" in err  # says how to ask for no bad batch
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


def test_bad_step_none_runs_clean(tmp_path: Path) -> None:
    code, err = _cli("demo", "--steps", "3", "--bad-step", "none", "--runs", str(tmp_path))
    assert code == 0, err


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX paths")
def test_tensorboard_true_and_false_are_not_paths() -> None:
    assert td.DebugConfig(tensorboard=False).tensorboard is False
