"""The local dashboard and REST API (extra ``[dashboard]``): ``serve`` and ``create_app``.

Known limitations:
- Read-only on the store; the only writes are the seed POST endpoints acting on a live monitor
  (``set_level``, ``clear``), called from the server thread while training runs.
- The live page polls every 2 s; a run's page shows at most 2000 points per series (min/max envelopes).
- The first visit to a run reads each chart from the rollups (about 1 ms per metric whatever the
  run's length; a cold ``/views`` of a 1,000,000-step run takes about 0.3 s of CPU); later requests
  are served from a cache that only reads new steps. While a run is written, each poll recomputes
  its summary (SQL aggregates over the rollups and the memory samples).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..._errors import TorchDebugWarning

DASHBOARD_EXTRA = "pip install 'torchdebug[dashboard]'"


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback bind without a token; warn when one is used with a token.

    Raises:
        ValueError: ``host`` is not loopback and ``token`` is None; ``token`` is empty or whitespace.
    """
    if token is not None and not token.strip():
        raise ValueError(
            "the dashboard token is empty or whitespace, which anyone can guess: pass a real secret "
            "(--token T / token=T), or no token on 127.0.0.1"
        )
    if is_loopback(host):
        return
    if not token:
        raise ValueError(
            f"binding {host} exposes your runs to the network: pass a token (--token T / token=T) "
            "or bind 127.0.0.1"
        )
    warnings.warn(
        f"torchdebug dashboard listening on {host}: anyone who can reach it and knows the token can read "
        "your runs; prefer 127.0.0.1 with an SSH tunnel",
        TorchDebugWarning,
        stacklevel=3,
    )


def bound_hosts(host: str, extra: Iterable[str] = ()) -> list[str]:
    """The Host names a dashboard bound to ``host`` answers to (besides loopback names and IP literals).

    The bind address itself, and for a non-loopback bind the machine's host name and FQDN, then
    ``extra`` (``--allowed-host``; ``"*"`` accepts any Host). Anything else is refused with 403.

    Example:
        >>> bound_hosts("127.0.0.1", ["dash.lan"])
        ['127.0.0.1', 'dash.lan']
    """
    names = [host]
    if not is_loopback(host):
        names += [socket.gethostname(), socket.getfqdn()]
    for name in extra:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"allowed_hosts entries must be host names, got {name!r}")
        names.append(name.strip())
    return list(dict.fromkeys(names))


def _import_deps() -> Any:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ImportError(f"the dashboard needs fastapi and uvicorn: {DASHBOARD_EXTRA}") from e
    return uvicorn


class ServerHandle:
    """A dashboard running in a background thread: ``.url``, ``.port``, ``.stop()``; a context manager."""

    def __init__(self, server: Any, thread: threading.Thread, host: str, port: int) -> None:
        self._server = server
        self._thread = thread
        self.host = host
        self.port = port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the server to exit and wait for its thread (idempotent)."""
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle({self.url!r})"


def serve(
    monitor_or_path: Any = "runs",
    host: str = "127.0.0.1",
    port: int = 6007,
    token: str | None = None,
    *,
    warm: int = 3,
    startup_timeout: float = 15.0,
    allowed_hosts: Iterable[str] = (),
    allowed_origins: Iterable[str] = (),
) -> ServerHandle:
    """Start the dashboard in a background thread and return once it accepts connections.

    Args:
        monitor_or_path: a live ``Monitor`` (its run is shown and the seed POST endpoints act on it),
            a seed-era ``TrainingDebugger`` (the seed endpoints answer from its summaries), a run
            folder, or a folder of runs.
        host: bind address; anything but loopback requires ``token``.
        port: TCP port; 0 picks a free one (see ``handle.port``).
        token: bearer token required on every request (``Authorization: Bearer <token>``; pages
            also accept ``?token=``).
        warm: precompute the pages of this many newest runs in the background (0: none).
        startup_timeout: seconds to wait for the server to accept connections.
        allowed_hosts: more Host names to answer to (a DNS name or proxy in front of it; ``"*"``:
            any). By default only the bind address, loopback names, IP literals and, for a
            non-loopback bind, this machine's name (see :func:`bound_hosts`): other Hosts get 403.
        allowed_origins: other web pages trusted to change the live session (POST) and to read the
            API (CORS), e.g. ``["https://tools.example"]``; none by default.

    Returns:
        A ``ServerHandle`` with ``.url`` and ``.stop()``.

    Raises:
        ImportError: fastapi/uvicorn missing (names ``pip install 'torchdebug[dashboard]'``).
        ValueError: non-loopback host without a token; an empty or whitespace token.
        TypeError: an object that is none of those (refused before the server starts).
        RuntimeError: the server did not start (port in use ...).

    Example::

        with td.watch(model, opt) as mon:
            handle = td.serve(mon)          # open handle.url in a browser
            ...
        handle.stop()

    Cost: one thread running an asyncio loop; requests read the store read-only.
    """
    uvicorn = _import_deps()
    check_bind(host, token)
    from ._app import create_app

    guard = {"allowed_hosts": bound_hosts(host, allowed_hosts), "allowed_origins": list(allowed_origins)}
    if isinstance(monitor_or_path, (str, os.PathLike)):
        app = create_app(Path(monitor_or_path), token=token, warm=warm, **guard)
    else:
        app = create_app(None, monitor=monitor_or_path, token=token, warm=warm, **guard)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="torchdebug-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the dashboard could not start on {host}:{port} (is the port in use?)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the dashboard did not start on {host}:{port} within {startup_timeout} s")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return ServerHandle(server, thread, host, int(bound))


def create_app(*args: Any, **kwargs: Any) -> Any:
    """Build the FastAPI app (see ``torchdebug.views.server._app.create_app``); for your own ASGI server."""
    _import_deps()
    from ._app import create_app as _create

    return _create(*args, **kwargs)


__all__ = ["DASHBOARD_EXTRA", "ServerHandle", "bound_hosts", "create_app", "is_loopback", "serve"]
