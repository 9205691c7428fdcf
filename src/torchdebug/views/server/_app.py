"""The FastAPI app: run list and live run pages, the JSON API, the seed-era endpoints, auth and errors."""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import json
import math
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..._errors import RunStoreError
from ..._version import __version__
from ...events import is_anomalous, rule_counts, training_summary
from ..report import build_report, collect_views, fragments, render_page
from ..report._format import json_safe
from ..report._html import charts_js
from ..report._rankview import render_rank_selector
from ..verdict import verdict_of
from ._cache import CachedRun, SeriesCache, ViewsCache

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
# library code and the browser's icon probe, no run data: loadable by <script> without a header
_PUBLIC = {"/static/tdcharts.js", "/favicon.ico"}
CHARTS_URL = "/static/tdcharts.js"
DEFAULT_MAX_POINTS = 2000
# Host names every dashboard answers to: loopback. IP literals are accepted too (a DNS-rebinding page
# reaches the server under its own domain name, never under an address).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _split_host(value: str) -> str:
    """The host of a Host header or an origin's netloc, lower-cased, without port or IPv6 brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


# RFC 9110 Host = uri-host [ ":" port ]: a bracketed IPv6 literal or a name/IPv4 of letters, digits,
# ".", "-", "_" (no userinfo "@", no path, no spaces), then at most one port of 1-5 digits.
_HOST_HEADER = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::(?P<port>[0-9]{1,5}))?$")


def parse_host(value: str) -> str | None:
    """The host of a ``Host`` header, lower-cased and without port or brackets; None when malformed.

    Example: ``parse_host("[::1]:6007")`` -> ``"::1"``; ``parse_host("localhost:80@evil.com")`` -> None.
    """
    m = _HOST_HEADER.match(value)
    if m is None or (m.group("port") is not None and int(m.group("port")) > 65535):
        return None
    if m.group("v6") is not None:
        try:
            ipaddress.IPv6Address(m.group("v6"))
        except ValueError:
            return None
        return m.group("v6").lower()
    return m.group("name").lower()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class RequestGuard:
    """Which requests the dashboard accepts: a known Host, and no state change from a foreign page.

    - ``Host`` must be an IP literal, a loopback name or one of ``allowed_hosts`` (``"*"``: any),
      so a page on another domain cannot read the API through DNS rebinding.
    - POST/PUT/PATCH/DELETE with an ``Origin`` header must come from the dashboard's own origin
      (scheme ``http``, the request's Host) or one of ``allowed_origins``; requests without
      ``Origin`` (curl, scripts) pass: browsers always send it on such requests.
    """

    def __init__(self, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()) -> None:
        self.hosts = {_split_host(h) for h in (*LOOPBACK_HOSTS, *allowed_hosts) if h.strip()}
        self.origins = {o.strip().rstrip("/").lower() for o in allowed_origins if o.strip()}

    def check_host(self, host_header: str | None) -> tuple[int, str | None]:
        """``(200, None)`` when the Host header may go on, else the status and the reason: 400 for a
        header that is not ``host[:port]`` (userinfo, empty host, bad port), 403 for a foreign host."""
        if host_header is None:  # HTTP/1.0 without Host: not a browser
            return 200, None
        host = parse_host(host_header)
        if host is None:
            return 400, (
                f"bad request: Host {host_header[:100]!r} is not host[:port] (a name, an IPv4 address or "
                "a bracketed IPv6 address, then an optional port 0-65535)"
            )
        if not ("*" in self.hosts or host in self.hosts or _is_ip(host)):
            return 403, (
                f"forbidden: Host {host_header[:100]!r} is not an address of this dashboard (protection "
                "against DNS rebinding); to allow it pass td.serve(..., allowed_hosts=[...]) or "
                "torchdebug serve --allowed-host NAME"
            )
        return 200, None

    def verdict(self, method: str, host_header: str | None, origin: str | None) -> tuple[int, str] | None:
        """None when the request may go on, else ``(status, reason)``: 400 malformed Host, 403 refused."""
        status, why = self.check_host(host_header)
        if why is not None:
            return status, why
        why = self.refusal(method, host_header, origin)
        return None if why is None else (403, why)

    def refusal(self, method: str, host_header: str | None, origin: str | None) -> str | None:
        """None when the request may go on, else the reason it is refused."""
        _, why = self.check_host(host_header)
        if why is not None:
            return why
        if method.upper() in _UNSAFE_METHODS and origin is not None:
            given = origin.strip().rstrip("/").lower()
            own = (host_header or "").strip().lower()
            if given not in (f"http://{own}", f"https://{own}") and given not in self.origins:
                return (
                    f"forbidden: a {method.upper()} from the page {origin[:100]!r} may not change this "
                    "dashboard; only its own pages may (pass allowed_origins=[...] to trust another)"
                )
        return None


class ApiError(Exception):
    """An expected failure answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


def _json(payload: Any, status: int = 200) -> Response:
    # json.dumps directly: FastAPI's encoder walks every list element in Python (slow for 100k points)
    # and Starlette's JSONResponse refuses NaN; payloads here are already JSON-safe.
    body = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    return Response(body, status_code=status, media_type="application/json")


def _safe_values(values: list[float]) -> list[Any]:
    """NaN/Inf as strings, so JSON stays strict and no point is dropped."""
    return [v if math.isfinite(v) else ("nan" if v != v else ("inf" if v > 0 else "-inf")) for v in values]


class Catalog:
    """The runs a server may show: one run folder, or the run folders directly under a folder.

    Run ids are folder names. ``path(id)`` accepts only a name that is a run folder directly inside
    the served folder (no separators, no ``..``, no symlink leading outside).
    """

    def __init__(self, target: Path | None) -> None:
        self.target = None if target is None else target.resolve()
        self.single = self.target is not None and (self.target / "meta.json").is_file()
        self.base = None if self.target is None else (self.target.parent if self.single else self.target)

    def infos(self) -> list[Any]:
        from ...store import list_runs

        if self.target is None or self.base is None:
            return []
        infos = list_runs(self.base)
        if self.single:
            infos = [i for i in infos if Path(i.path).name == self.target.name]
        return infos

    def path(self, run_id: str) -> Path:
        if not _ID.match(run_id) or ".." in run_id:
            raise ApiError(404, f"no run {run_id!r}: run ids are folder names from /api/runs")
        if self.base is None or (self.single and run_id != self.target.name):  # type: ignore[union-attr]
            raise ApiError(404, f"no run {run_id!r} in this server (see /api/runs)")
        p = self.base / run_id
        if not (p / "meta.json").is_file() or p.resolve().parent != self.base:
            raise ApiError(404, f"no run {run_id!r} in this server (see /api/runs)")
        from ...store.reader import outside_root

        why = outside_root(p, self.base)  # meta.json or a database linking outside: not served
        if why is not None:
            raise ApiError(404, f"no run {run_id!r} in this server: a file of it links outside its folder")
        return p

    def default_id(self) -> str:
        """The run the seed endpoints talk about: the single run, else the newest one."""
        infos = self.infos()
        if not infos:
            raise ApiError(404, "no run to summarize: this server has no runs yet")
        return Path(infos[-1].path).name


def _levels() -> list[str]:
    from ..._config import DebugLevel

    return [lv.value for lv in DebugLevel]


def training_summary_from_run(run: Any) -> dict[str, Any]:
    """The seed's training summary computed from a stored run, since its last history segment.

    ``total_steps``: steps recorded since the segment started; ``anomaly_steps``: distinct steps
    that ``events.is_anomalous`` calls anomalous (an anomaly record, or a warning/error event), the
    live session's definition; ``gradient_explosions`` / ``gradient_vanishing`` / ``loss_anomalies``:
    rule events of the kinds the rules emit (``events.rule_counts``); rates divide by total_steps.
    """
    segments = run.segments()
    start = segments[-1]["start_step"] if segments else 0
    s = run.summary()
    if start == 0:
        total = s["steps"]
    else:
        total = max(0, (s["last_step"] if s["last_step"] is not None else start - 1) + 1 - start)
    events = [e for e in run.events() if e.get("step") is None or e["step"] >= start]
    by_step: dict[int, tuple[Any, list[str]]] = {}
    for a in run.anomalies():
        if a.get("step") is not None and a["step"] >= start:
            by_step.setdefault(a["step"], (a, []))
    for e in events:
        if e.get("step") is not None:
            by_step.setdefault(e["step"], (None, []))[1].append(str(e.get("severity")))
    anomaly_steps = sum(is_anomalous(a, sev) for a, sev in by_step.values())
    kinds = [e["kind"] for e in events]
    return training_summary(total, anomaly_steps, *rule_counts(kinds))


def _run_row(i: Any, token_q: str, verdict: dict[str, Any]) -> str:
    """One run of the index: its status in the colour of its verdict's level (green only when there is
    nothing to act on), and the verdict's sentence."""
    rid = html.escape(Path(i.path).name)
    lost = f" <b>incomplete: {i.lost} records lost</b>" if i.lost else ""
    level = html.escape(str(verdict.get("level", "warning")))
    return (
        f'<tr data-id="{rid}"><td><a href="/runs/{rid}{token_q}">{html.escape(i.name)}</a></td>'
        f'<td data-k="status"><span class="badge {level}">{html.escape(i.status)}</span>{lost}</td>'
        f'<td data-k="verdict" class="verdict-cell {level}">{html.escape(str(verdict.get("text", "")))}</td>'
        f'<td class=num data-k="steps">{i.steps}</td><td class=num data-k="anomalies">{i.anomalies}</td>'
        f"<td>{html.escape(i.created or '-')}</td><td><code>{rid}</code></td></tr>"
    )


# The run list refreshes itself in place: new runs are inserted, changed cells rewritten; rows the
# user is on (focus, scroll) stay the same elements.
_RUNS_JS = """
(function () {
  var tok = new URLSearchParams(location.search).get('token');
  var headers = tok ? {'Authorization': 'Bearer ' + tok} : {};
  var q = tok ? '?token=' + encodeURIComponent(tok) : '';
  function cell(tr, k) { return tr.querySelector('[data-k="' + k + '"]'); }
  async function poll() {
    try {
      var r = await fetch('/api/runs', {headers: headers, cache: 'no-store'});
      if (r.ok) {
        var runs = (await r.json()).runs, body = document.getElementById('runs-body');
        runs.forEach(function (run) {
          var tr = body.querySelector('tr[data-id="' + CSS.escape(run.id) + '"]');
          if (!tr) {
            tr = document.createElement('tr'); tr.dataset.id = run.id;
            var a = document.createElement('a'); a.href = '/runs/' + encodeURIComponent(run.id) + q; a.textContent = run.name;
            var c0 = document.createElement('td'); c0.appendChild(a); tr.appendChild(c0);
            ['status', 'verdict', 'steps', 'anomalies'].forEach(function (k) {
              var td = document.createElement('td'); td.dataset.k = k;
              if (k === 'steps' || k === 'anomalies') td.className = 'num'; tr.appendChild(td);
            });
            var c4 = document.createElement('td'); c4.textContent = run.created || '-'; tr.appendChild(c4);
            var c5 = document.createElement('td'), code = document.createElement('code'); code.textContent = run.id;
            c5.appendChild(code); tr.appendChild(c5);
            body.insertBefore(tr, body.firstChild);
            var none = document.getElementById('no-runs'); if (none) none.remove();
          }
          var st = cell(tr, 'status'), badge = st.querySelector('.badge');
          if (!badge) { badge = document.createElement('span'); st.appendChild(badge); }
          if (badge.textContent !== run.status) badge.textContent = run.status;
          if (badge.className !== 'badge ' + run.level) badge.className = 'badge ' + run.level;
          var vc = cell(tr, 'verdict');
          if (vc.textContent !== run.verdict) { vc.textContent = run.verdict; vc.className = 'verdict-cell ' + run.level; }
          if (cell(tr, 'steps').textContent !== String(run.steps)) cell(tr, 'steps').textContent = run.steps;
          if (cell(tr, 'anomalies').textContent !== String(run.anomalies)) cell(tr, 'anomalies').textContent = run.anomalies;
        });
      }
    } catch (e) {}
    setTimeout(poll, 5000);
  }
  setTimeout(poll, 5000);
})();
"""


def _runs_page(infos: list[Any], token_q: str, judge: Callable[[Any], dict[str, Any]]) -> str:
    rows = "".join(_run_row(i, token_q, judge(i)) for i in reversed(infos))
    from ..report._html import _CSS

    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>torchdebug runs</title>"
        '<meta name="color-scheme" content="light dark">'
        f"<style>{_CSS}</style></head><body><header><h1>torchdebug runs</h1>"
        f"<small>torchdebug {html.escape(__version__)}</small></header><main><table><thead><tr><th>run</th><th>status</th><th>verdict</th>"
        f'<th>steps</th><th>anomalies</th><th>created</th><th>folder</th></tr></thead><tbody id="runs-body">{rows}</tbody></table>'
        f"{'' if infos else '<p class=empty id=no-runs>No runs yet.</p>'}</main><script>{_RUNS_JS}</script></body></html>"
    )


def _frag_version(frag: dict[str, str], status: str) -> str:
    """A short hash of the page fragments: the live page sends it back and gets them only when they changed."""
    h = hashlib.sha1(status.encode())
    for k in sorted(frag):
        h.update(frag[k].encode())
    return h.hexdigest()[:16]


def create_app(
    target: str | Path | None,
    *,
    monitor: Any = None,
    token: str | None = None,
    warm: int = 3,
    allowed_hosts: Iterable[str] = (),
    allowed_origins: Iterable[str] = (),
) -> FastAPI:
    """Build the dashboard app serving a run folder or a folder of runs (read-only).

    Args:
        target: a run folder or a folder of runs; None with ``monitor`` serves the monitor's run.
        monitor: a live ``Monitor`` (or a seed-era ``TrainingDebugger``) that the seed endpoints
            read and the seed POST endpoints (level, clear) act on.
        token: when set, every request needs ``Authorization: Bearer <token>`` (or ``?token=``).
        warm: precompute the pages of this many newest runs in a background thread, so the first
            visit to a big run is fast (its series are read once, then only new steps are read).
        allowed_hosts: Host names accepted besides loopback names and IP literals (``"*"``: any);
            see :class:`RequestGuard`.
        allowed_origins: other pages (``"https://tools.example"``) trusted to POST and to read the
            API from a browser (CORS); none by default.

    Raises:
        TypeError: ``monitor`` is neither a ``Monitor`` nor a ``TrainingDebugger``.

    Returns:
        The FastAPI app; its OpenAPI schema is at ``/openapi.json``, docs at ``/docs``.

    Raises:
        ValueError: ``token`` is empty or only whitespace.

    Example: ``uvicorn.run(create_app("runs"), port=6007)``.
    """
    if token is not None and not token.strip():
        raise ValueError("the dashboard token is empty or whitespace: pass a real secret, or no token")
    guard = RequestGuard(allowed_hosts, allowed_origins)
    monitor = live_session(monitor)  # a TrainingDebugger is served through its own summaries
    if target is None and monitor is not None and getattr(monitor, "run_dir", None) is not None:
        target = monitor.run_dir
    catalog = Catalog(None if target is None else Path(target))
    series_cache = SeriesCache()
    views_cache = ViewsCache()
    state: dict[str, Any] = {}

    app = FastAPI(
        title="torchdebug dashboard",
        version=__version__,
        description=(
            "Read-only JSON API over torchdebug run folders. Run ids are folder names (see /api/runs). "
            'Metric values are numbers, or the strings "nan", "inf", "-inf" for non-finite points '
            '(never dropped). Errors answer {"error": message}.'
        ),
    )

    # pages, JSON and the chart script travel compressed (the browser always asks for gzip)
    from starlette.middleware.gzip import GZipMiddleware

    app.add_middleware(GZipMiddleware, minimum_size=1000)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if token is not None and request.url.path not in _PUBLIC:
            header = request.headers.get("authorization", "")
            given = (
                header[7:] if header.lower().startswith("bearer ") else request.query_params.get("token", "")
            )
            if not hmac.compare_digest(given.encode(), token.encode()):
                return _json(
                    {"error": "unauthorized: send Authorization: Bearer <token> (or ?token=<token>)"}, 401
                )
        return await call_next(request)

    # added after _auth, so it runs first: a foreign Host or Origin is refused before anything else
    @app.middleware("http")
    async def _guard(request: Request, call_next: Any) -> Response:
        refused = guard.verdict(request.method, request.headers.get("host"), request.headers.get("origin"))
        if refused is not None:
            return _json({"error": refused[1]}, refused[0])
        return await call_next(request)

    # added last, so it runs outermost: every answer, refusals included, forbids framing by another
    # page (clickjacking: the level and clear buttons); the pages load nothing from elsewhere, and
    # this policy restricts nothing but framing
    @app.middleware("http")
    async def _no_frames(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Content-Security-Policy"] = "frame-ancestors 'none'"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    if guard.origins:  # CORS only when asked, for exactly these origins
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=sorted(guard.origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization"],
        )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _json({"error": str(exc), **exc.extra}, exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _json({"error": str(exc.detail)}, exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        details = [
            {"where": ".".join(str(x) for x in e.get("loc", ())), "problem": str(e.get("msg", ""))}
            for e in exc.errors()
        ]
        return _json({"error": "invalid parameters", "details": details}, 422)

    @app.exception_handler(RunStoreError)
    async def _store_error(request: Request, exc: RunStoreError) -> Response:
        return _json({"error": f"the run cannot be read: {exc}"}, 422)

    @app.exception_handler(KeyError)
    async def _key_error(request: Request, exc: KeyError) -> Response:
        return _json({"error": str(exc.args[0]) if exc.args else "not found"}, 404)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> Response:
        return _json({"error": str(exc)}, 400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        return _json({"error": f"internal error {type(exc).__name__}: {exc}"}, 500)

    @contextmanager
    def opened(run_id: str, rank: int | None = None) -> Iterator[Any]:
        from ...store import open_run

        run = open_run(catalog.path(run_id), rank=rank)
        try:
            yield CachedRun(run, series_cache)
        finally:
            run.close()

    verdicts = ViewsCache(max_entries=1024)

    def judged(i: Any) -> dict[str, Any]:
        """The run's verdict (``views.verdict``), computed again only when its files changed."""
        if i.status == "unreadable":
            return {"level": "error", "text": f"unreadable: {i.error}"}
        return verdicts.get(Path(i.path), "verdict", lambda: verdict_of(i.path))  # type: ignore[no-any-return]

    def info_dict(i: Any) -> dict[str, Any]:
        d = i.to_dict()
        d["id"] = Path(i.path).name
        del d["path"]  # absolute, machine-bound: the id is what the API takes
        v = judged(i)
        d["level"], d["verdict"] = v["level"], v["text"]
        return d

    # -- pages -------------------------------------------------------------------------------------

    def token_query(request: Request) -> str:
        t = request.query_params.get("token")
        return html.escape(f"?token={urllib.parse.quote(t, safe='')}") if t else ""

    @app.get("/", include_in_schema=False)
    def index(request: Request) -> Response:
        if catalog.single:
            return RedirectResponse(f"/runs/{catalog.target.name}{token_query(request)}")  # type: ignore[union-attr]
        return HTMLResponse(_runs_page(catalog.infos(), token_query(request), judged))

    @app.get("/runs/{run_id}", include_in_schema=False)
    def run_page(run_id: str, request: Request, rank: int | None = Query(None, ge=0)) -> Response:
        with opened(run_id, rank) as run:
            key = f"views:{DEFAULT_MAX_POINTS}" + (f":{run.rank}" if rank is not None else "")
            views = views_cache.get(run.path, key, lambda: _views(run, DEFAULT_MAX_POINTS))
            # several ranks: links that reopen this page with another rank's charts ("" for one rank)
            token = request.query_params.get("token")
            tok = f"&token={urllib.parse.quote(token, safe='')}" if token else ""
            base = f"/runs/{urllib.parse.quote(run_id, safe='')}"
            select = render_rank_selector(list(run.ranks), run.rank, lambda k: f"{base}?rank={k}{tok}")
        back = "" if catalog.single else f'<a href="/{token_query(request)}">all runs</a>'
        live = f"/api/runs/{run_id}/views" + (f"?rank={rank}" if rank is not None else "")
        state = {
            "last_step": views.get("last_step"),
            "frag": _frag_version(fragments(views), views["status"]),
        }
        page = render_page(
            views, charts_src=CHARTS_URL, live_url=live, nav=back, rank_select=select, live_state=state
        )
        return HTMLResponse(page)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)  # no icon; answered so browsers log no 404

    @app.get(CHARTS_URL, include_in_schema=False)
    def charts_bundle(request: Request) -> Response:
        if "charts" not in state:
            body = charts_js().encode()
            state["charts"] = (body, '"' + hashlib.sha1(body).hexdigest()[:20] + '"')
        body, etag = state["charts"]
        # cached for an hour, then revalidated: an upgrade's new script arrives within the hour
        headers = {"Cache-Control": "public, max-age=3600", "ETag": etag}
        if etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        return Response(body, media_type="application/javascript", headers=headers)

    def _views(run: Any, max_points: int, since_step: int | None = None) -> dict[str, Any]:
        v = collect_views(run, max_points=max_points, since_step=since_step)
        return json_safe(v)

    # -- JSON API ----------------------------------------------------------------------------------

    @app.get("/api/runs", summary="List runs", tags=["runs"])
    def api_runs() -> Response:
        """Every run served, oldest first: id, name, status, created, steps, anomalies, and the verdict
        (``level``: ok | running | warning | error, ``verdict``: its sentence)."""
        return _json({"runs": [info_dict(i) for i in catalog.infos()]})

    @app.get("/api/runs/{run_id}", summary="One run: meta, summary, metric names, segments", tags=["runs"])
    def api_run(
        run_id: str, rank: int | None = Query(None, ge=0, description="which rank's database (default 0)")
    ) -> Response:
        """meta.json, the store's summary counts, metric names and history segments of one run."""
        with opened(run_id, rank) as run:
            summary = run.summary()
            summary.pop("path", None)
            payload = {
                "id": run_id,
                "meta": run.meta,
                "status": summary["status"],
                "summary": summary,
                "metrics": run.metric_names(),
                "segments": run.segments(),
            }
        return _json(json_safe(payload))

    @app.get("/api/runs/{run_id}/metrics", summary="Metric series (downsampled)", tags=["runs"])
    def api_metrics(
        run_id: str,
        names: str | None = Query(
            None, description="comma-separated metric names; default all", max_length=100_000
        ),
        since_step: int | None = Query(None, ge=0, description="only steps >= this"),
        max_points: int = Query(
            DEFAULT_MAX_POINTS, ge=2, le=1_000_000, description="points per series (min/max envelopes)"
        ),
        wall_times: bool = Query(False, description="include each point's wall-clock time"),
        rank: int | None = Query(None, ge=0, description="which rank's database (default 0)"),
    ) -> Response:
        """``{"metrics": {name: {"steps", "values", "downsampled"}}}``; NaN/Inf values as strings.

        Downsampling keeps each bucket's lowest and highest point, so spikes and NaN survive.
        An unknown name answers 404 listing known ones.
        """
        with opened(run_id, rank) as run:
            known = run.metric_names()
            wanted = known if not names else [n.strip() for n in names.split(",") if n.strip()]
            missing = [n for n in wanted if n not in known]
            if missing:
                raise ApiError(404, f"unknown metric(s) {missing}; known: {known[:50]}")
            out = {}
            for n in wanted:
                s = run.series(n, since_step=since_step, max_points=max_points)
                d: dict[str, Any] = {
                    "steps": s.steps,
                    "values": _safe_values(s.values),
                    "downsampled": s.downsampled,
                }
                if wall_times:
                    d["wall_times"] = s.wall_times
                out[n] = d
        return _json({"run": run_id, "max_points": max_points, "since_step": since_step, "metrics": out})

    @app.get("/api/runs/{run_id}/anomalies", summary="Anomaly documents", tags=["runs"])
    def api_anomalies(
        run_id: str, rank: int | None = Query(None, ge=0, description="which rank's database (default 0)")
    ) -> Response:
        """Every anomaly (where the first NaN/Inf was born: phase, module, op, line, frames, hint)."""
        with opened(run_id, rank) as run:
            return _json({"anomalies": json_safe(run.anomalies())})

    @app.get("/api/runs/{run_id}/events", summary="Rule events", tags=["runs"])
    def api_events(
        run_id: str,
        kind: str | None = Query(None, max_length=200, description="only this kind"),
        rank: int | None = Query(None, ge=0, description="which rank's database (default 0)"),
    ) -> Response:
        """Rule events and log messages in the order logged: step, kind, severity, message, data."""
        with opened(run_id, rank) as run:
            return _json({"events": json_safe(run.events(kind))})

    @app.get("/api/runs/{run_id}/report.json", summary="The JSON report", tags=["runs"])
    def api_report(
        run_id: str, rank: int | None = Query(None, ge=0, description="which rank's database (default 0)")
    ) -> Response:
        """``torchdebug report --format json``: summary, analyses, anomalies, events, metric table."""
        with opened(run_id, rank) as run:
            rep = views_cache.get(run.path, f"report:{run.rank}", lambda: json_safe(build_report(run)))
        return _json(rep)

    @app.get(
        "/api/runs/{run_id}/ranks", summary="Every rank of a run: per-rank columns, anomalies", tags=["runs"]
    )
    def api_ranks(run_id: str) -> Response:
        """Per-rank step time, data wait, memory, grad norm; anomalies with their rank; hangs; stragglers;
        ``hang_verdict``: the verdict across ranks from their flight records (``HangVerdict.to_dict()``,
        ``null`` when no rank hung)."""
        from ...store.ranks import rank_overview
        from ..hangs import verdict_of_run

        def compute(run: Any) -> Any:
            hang = verdict_of_run(run.path, run.meta.get("world_size"))
            return json_safe({**rank_overview(run), "hang_verdict": hang.to_dict() if hang else None})

        with opened(run_id) as run:
            ov = views_cache.get(run.path, "ranks", lambda: compute(run))
        return _json(ov)

    @app.get(
        "/api/runs/{run_id}/views",
        summary="Dashboard payload (charts and page fragments)",
        tags=["dashboard"],
    )
    def api_views(
        run_id: str,
        max_points: int = Query(DEFAULT_MAX_POINTS, ge=2, le=100_000),
        rank: int | None = Query(None, ge=0, description="which rank's database (default 0)"),
        since_step: int | None = Query(
            None, ge=0, description="figures hold only steps >= this (the live page appends them)"
        ),
        frag: str | None = Query(
            None,
            max_length=64,
            description="the fragments' version the page holds: unchanged ones are left out",
        ),
    ) -> Response:
        """What the live page polls every 2 s: the verdict, the figures (with ``since_step``: only the
        new steps, to append) and the server-rendered HTML fragments when they changed.

        ``last_step`` is the run's last step: the page's next ``since_step``. ``frag`` is the
        fragments' version; when the request's ``frag`` equals it the ``*_html`` keys are left out.
        """
        with opened(run_id, rank) as run:
            if since_step is None:
                views = views_cache.get(
                    run.path, f"views:{max_points}:{run.rank}", lambda: _views(run, max_points)
                )
            else:
                views = _views(run, max_points, since_step)
        parts = fragments(views)
        version = _frag_version(parts, views["status"])
        payload: dict[str, Any] = {
            "status": views["status"],
            "level": views["verdict"]["level"],
            "verdict": views["verdict"]["text"],
            "last_step": views.get("last_step"),
            "since_step": since_step,
            "figures": views["figures"],
            "frag": version,
        }
        if frag != version:
            payload.update(parts)
        return _json(payload)

    # -- seed-era endpoints ------------------------------------------------------------------------

    def seed_run_id(run: str | None) -> str:
        if run is not None:
            return run
        if monitor is not None and catalog.single:
            return catalog.target.name  # type: ignore[union-attr]
        return catalog.default_id()

    def training_summary(run: str | None) -> dict[str, Any]:
        if monitor is not None and run is None:
            return dict(monitor.training_summary())
        with opened(seed_run_id(run)) as r:
            return training_summary_from_run(r)

    @app.get("/training-logs/debug/summary", summary="Seed-era debug summary", tags=["seed"])
    def seed_summary(
        run: str | None = Query(None, description="run id; default the live or newest run"),
    ) -> Response:
        """Seed shape: training_debugger / diffusion_debugger / general_debugger counts.

        ``diffusion_debugger`` counts the live session's ``diffusion_debugger`` attribute (a
        ``DiffusionModelDebugger`` attached to the served ``TrainingDebugger`` or ``Monitor``); zeros
        without one, and for stored runs.
        """
        # one source per response: the live session's own counts, or the stored run's (never a mix:
        # the store lags the live session by its unflushed batch)
        if monitor is not None and run is None:
            ts = dict(monitor.training_summary())
            anomalies, events = len(list(monitor.anomalies)), len(list(monitor.events))
        else:
            with opened(seed_run_id(run)) as r:
                ts = training_summary_from_run(r)
                anomalies, events = len(r.anomalies()), len(r.events())
        diff = getattr(monitor, "diffusion_debugger", None) if monitor is not None and run is None else None
        payload = {
            "training_debugger": {
                "total_anomalies": ts["anomaly_steps"],
                "debug_history_length": ts["total_steps"],
                "total_steps": ts["total_steps"],
                "anomaly_rate": ts["anomaly_rate"],
                "gradient_explosion_rate": ts["gradient_explosion_rate"],
            },
            "diffusion_debugger": {
                "total_anomalies": 0 if diff is None else int(diff.diffusion_anomalies),
                "debug_history_length": 0 if diff is None else len(list(diff.diffusion_history)),
            },
            "general_debugger": {"total_anomalies": anomalies, "debug_history_length": events},
        }
        return _json(json_safe(payload))

    @app.get("/training-logs/debug/training/summary", summary="Seed-era training summary", tags=["seed"])
    def seed_training_summary(
        run: str | None = Query(None, description="run id; default the live or newest run"),
    ) -> Response:
        """total_steps, anomaly_steps, gradient_explosions, gradient_vanishing, loss_anomalies and their rates."""
        return _json(json_safe(training_summary(run)))

    def live() -> Any:
        if monitor is None:
            raise ApiError(
                409,
                "no live training session: this server shows stored runs (read-only); start it with "
                "td.serve(monitor) inside the training process to change the level or clear history",
            )
        return monitor

    @app.post("/training-logs/debug/level/{level}", summary="Set the live debug level", tags=["seed"])
    def seed_level(level: str) -> Response:
        """Switch the live session's debug level (basic, intermediate, advanced, expert)."""
        mon = live()
        from ..._config import DebugLevel

        try:
            lv = DebugLevel(level)
        except ValueError:
            raise ApiError(422, f"unknown debug level {level!r}", allowed=_levels()) from None
        new = mon.set_level(lv)
        value = getattr(new, "value", str(new))
        return _json({"status": "ok", "level": value, "message": f"debug level set to {value}"})

    @app.post("/training-logs/debug/clear", summary="Clear the live debug history", tags=["seed"])
    def seed_clear() -> Response:
        """Start a new history segment in the live session; nothing stored is deleted."""
        mon = live()
        mon.clear()
        return _json(
            {
                "status": "ok",
                "message": "debug history cleared: a new history segment started (nothing was deleted)",
                "step": int(getattr(mon, "global_step", 0)),
            }
        )

    def _warm_up() -> None:
        # Best effort: a run that cannot be read is reported by the request that asks for it.
        try:
            ids = [Path(i.path).name for i in catalog.infos() if i.status != "unreadable"][-warm:]
        except Exception:
            return
        for run_id in reversed(ids):
            try:
                with opened(run_id) as run:
                    views_cache.get(
                        run.path, f"views:{DEFAULT_MAX_POINTS}", lambda: _views(run, DEFAULT_MAX_POINTS)
                    )
            except Exception:
                continue

    if warm > 0 and catalog.target is not None:
        threading.Thread(target=_warm_up, name="torchdebug-dashboard-warm", daemon=True).start()
    return app


def live_session(obj: Any) -> Any:
    """The live session ``serve``/``create_app`` talk to for ``obj``, or None for None.

    Accepted: a ``Monitor`` (``td.watch``) or anything with its ``training_summary``/``set_level``/
    ``clear`` methods, and an object that offers such a view through ``__torchdebug_session__()``
    (the seed-era ``TrainingDebugger``: its summaries, level and history). The server knows no facade.

    Raises:
        TypeError: anything else (a ``PyTorchDebugger`` or ``PyTorchDebugManager`` keeps no training
            summary to serve), naming what to pass instead.
    """
    if obj is None:
        return None
    adapter = getattr(obj, "__torchdebug_session__", None)
    if callable(adapter):
        return adapter()
    if all(callable(getattr(obj, m, None)) for m in ("training_summary", "set_level", "clear")):
        return obj
    hint = ""
    if type(obj).__name__ == "PyTorchDebugManager":
        hint = (
            "; a PyTorchDebugManager's steps go to the run folder opened by "
            "setup_training_logging(): serve that folder (manager.training_logger.path)"
        )
    raise TypeError(
        f"cannot serve a {type(obj).__name__}: pass a td.watch() Monitor, a TrainingDebugger, "
        f"a run folder or a folder of runs{hint}"
    )
