"""``torchdebug serve [RUN_OR_RUNS_DIR]``: the local dashboard in the foreground (registered by cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand (cheap: fastapi/uvicorn are imported when it runs)."""
    p = subparsers.add_parser(
        "serve",
        help="live dashboard and JSON API for a run or a folder of runs",
        description="Serve a local dashboard (pages update live while a run is written) and its JSON API "
        "(OpenAPI schema at /openapi.json). Read-only on the runs.",
    )
    from ...cli import add_runs_option, int_in_range

    # a positional folder is the older spelling of --runs, kept working (hidden from the help)
    p.add_argument("path", nargs="?", default=None, help=argparse.SUPPRESS)
    add_runs_option(p, what="a folder of runs, or one run folder")
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default 127.0.0.1; others need --token)"
    )

    p.add_argument("--port", type=int_in_range(0, 65535), default=6007, help="TCP port (default 6007)")
    p.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (or ?token=TOKEN) on every request")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests for this Host name (repeatable; '*' for any). Default: the bind "
        "address, localhost, IP addresses and, off loopback, this machine's name",
    )
    p.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="URL",
        help="a web page (scheme://host[:port]) trusted to change a live session and read the API (CORS)",
    )
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import warnings

    from ...cli import default_runs_dir
    from . import _import_deps, bound_hosts, check_bind, is_loopback

    uvicorn = _import_deps()
    target = Path(args.runs or args.path or default_runs_dir())
    if not target.is_dir():
        raise ValueError(f"{target} is not a folder: pass a run folder or a folder of runs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_bind(args.host, args.token)
    for w in caught:
        print(f"torchdebug: warning: {w.message}", file=sys.stderr)
    from ._app import create_app

    app = create_app(
        target,
        token=args.token,
        allowed_hosts=bound_hosts(args.host, args.allowed_host),
        allowed_origins=args.allowed_origin,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    _check_port(args.host, args.port)
    suffix = f"/?token={args.token}" if args.token and is_loopback(args.host) else ""
    print(f"torchdebug dashboard: http://{host}:{args.port}{suffix} (Ctrl-C to stop)", file=sys.stderr)
    try:
        uvicorn.run(
            app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off"
        )
    except SystemExit as e:  # uvicorn exits 3 when it cannot start; 3 means "a NaN was found" here
        if e.code not in (None, 0):
            raise OSError(
                f"the dashboard could not start on {host}:{args.port} (see the line above)"
            ) from None
    return 0


def _check_port(host: str, port: int) -> None:
    """Raise ``OSError`` naming the fix when ``host:port`` cannot be listened on (a port in use):
    exit 1 with one line, instead of uvicorn's log line and its exit code 3."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(
                f"cannot listen on {host}:{port}: {e.strerror or e}; another program holds the port: "
                f"stop it or choose another with --port"
            ) from None
