"""``monarch-torchx dashboard``: a live page of the pools on 127.0.0.1, served by aiohttp.

The page (``dashboard.html``, plain HTML and JavaScript) asks this server's JSON endpoints every
two seconds: pools and hosts (state, heartbeat, warm modules, CPU/memory/GPU capacity and who holds
it), the queue, apps and replicas (the ``procs`` table: state, attempts), the log tail with a
search (``logs``), a timeline (``events``), per-host load over time (``metrics``) drawn as lines,
and a replica's py-spy stacks on click. Every request needs the one-time token printed in the URL
(a query parameter, then a cookie the first page sets); anything else is 403. It listens on
127.0.0.1 unless ``--bind`` says otherwise. Its reads are the CLI's own (``pool_summary``,
``telemetry.query.run``), run on threads so one slow host never stalls the page.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hmac
import secrets
import threading
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Callable

COOKIE = "monarch_torchx_dashboard"
SQL_TIMEOUT_S = 10.0
LOG_ROWS = 200


@dataclass
class DashboardConfig:
    """What one dashboard serves, and to whom."""

    token: str
    pool: str | None = None  # only this pool (else every pool of the registry home)
    bind: str = "127.0.0.1"
    port: int = 0


def new_token() -> str:
    return secrets.token_urlsafe(24)


def _plain(v: Any) -> Any:
    return v.isoformat() if isinstance(v, (datetime.datetime, datetime.date)) else v


def _rows(pool_name: str, sql: str) -> list[dict[str, Any]]:
    from .pool import attach
    from .telemetry.query import run

    res = run(attach(pool_name), sql, timeout=SQL_TIMEOUT_S)
    return [{k: _plain(v) for k, v in r.items()} for r in res.table.to_pylist()]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class DashboardData:
    """The page's data, one method per endpoint (blocking: called on threads)."""

    def __init__(self, only: str | None):
        self.only = only

    def pools(self) -> list[dict[str, Any]]:
        from .cli import pool_summary
        from .pool import Pool
        from .registry import Registry

        reg = Registry()
        out = []
        for rec in reg.list():
            if self.only and rec.name != self.only:
                continue
            out.append(pool_summary(Pool(rec, reg)))
        if self.only and not out:
            return [{"name": self.only, "state": "stopped", "hosts": [], "stopped": True}]
        return out

    def replicas(self, pool: str) -> list[dict[str, Any]]:
        return _rows(
            pool,
            "SELECT app_id, role, replica, host, pid, state, attempts, exit_code, msg, started, ended, cpu_s, "
            "rss_bytes FROM procs ORDER BY started DESC LIMIT 200",
        )

    def logs(self, pool: str, search: str = "") -> list[dict[str, Any]]:
        where = f"WHERE line LIKE {_quote('%' + search + '%')} " if search else ""
        rows = _rows(
            pool,
            f"SELECT ts, host, app_id, role, replica, stream, line FROM logs {where}ORDER BY ts DESC LIMIT {LOG_ROWS}",
        )
        return list(reversed(rows))

    def events(self, pool: str) -> list[dict[str, Any]]:
        return _rows(pool, "SELECT ts, host, kind, name, app_id, duration_s FROM events ORDER BY ts DESC LIMIT 100")

    def load(self, pool: str) -> list[dict[str, Any]]:
        return _rows(
            pool,
            "SELECT ts, host, value FROM metrics WHERE name = 'host.load1' ORDER BY ts DESC LIMIT 2000",
        )

    def stacks(self, pool: str, app: str) -> list[dict[str, Any]]:
        from .pool import attach

        p = attach(pool)
        p.ask("telemetry.stacks", range(p.record.num_hosts), timeout=30.0, app_id=app)
        rows = _rows(
            pool,
            f"SELECT ts, host, role, replica, pid, thread, depth, function, file, line FROM stacks "
            f"WHERE app_id = {_quote(app)} ORDER BY host, pid, thread, depth",
        )
        latest: dict[int, Any] = {}
        for r in rows:
            latest[r["host"]] = max(latest.get(r["host"], r["ts"]), r["ts"])
        return [r for r in rows if r["ts"] == latest[r["host"]]]


def make_app(config: DashboardConfig) -> Any:
    """The aiohttp application: the page, its JSON endpoints, the token check in front of all."""
    from aiohttp import web

    data = DashboardData(config.pool)
    page = files("monarch_torchx").joinpath("dashboard.html").read_text()

    @web.middleware
    async def token_check(request: web.Request, handler: Callable[..., Any]) -> Any:
        given = request.query.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), config.token.encode()):
            return web.Response(status=403, text="forbidden: open the URL `monarch-torchx dashboard` printed\n")
        return await handler(request)

    async def blocking(fn: Callable[..., Any], *args: Any) -> web.Response:
        from .errors import MonarchError

        try:
            value = await _in_daemon_thread(fn, *args)
        except MonarchError as e:
            return web.json_response({"error": str(e)}, status=200)
        except Exception as e:  # noqa: BLE001 (a query a host refused: the page shows it in its panel)
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=200)
        return web.json_response(value, dumps=_dumps)

    async def index(request: web.Request) -> web.Response:
        resp = web.Response(text=page, content_type="text/html")
        resp.set_cookie(COOKIE, config.token, httponly=True, samesite="Strict")
        return resp

    def pool_of(request: web.Request) -> str:
        name = request.query.get("pool") or config.pool or ""
        if not name:
            raise web.HTTPBadRequest(text="which pool? (?pool=NAME)")
        return name

    async def pools(request: web.Request) -> web.Response:
        return await blocking(data.pools)

    async def replicas(request: web.Request) -> web.Response:
        return await blocking(data.replicas, pool_of(request))

    async def logs(request: web.Request) -> web.Response:
        return await blocking(data.logs, pool_of(request), request.query.get("q", ""))

    async def events(request: web.Request) -> web.Response:
        return await blocking(data.events, pool_of(request))

    async def load(request: web.Request) -> web.Response:
        return await blocking(data.load, pool_of(request))

    async def stacks(request: web.Request) -> web.Response:
        return await blocking(data.stacks, pool_of(request), request.query.get("app", ""))

    async def config_of(request: web.Request) -> web.Response:
        return web.json_response({"pool": config.pool})

    app = web.Application(middlewares=[token_check])
    app.add_routes(
        [
            web.get("/", index),
            web.get("/api/config", config_of),
            web.get("/api/pools", pools),
            web.get("/api/replicas", replicas),
            web.get("/api/logs", logs),
            web.get("/api/events", events),
            web.get("/api/load", load),
            web.get("/api/stacks", stacks),
        ]
    )
    return app


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` on a daemon thread of its own, as a future of this loop. Not the loop's
    executor: a query still waiting on a host (seconds, up to its timeout) would hold Ctrl-C's
    exit until it ends, as ``asyncio.run`` joins the executor's threads."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 (handed to the awaiting request)
            value, error = None, e
        with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile: no one waits any more)
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="monarch-torchx-dashboard-query", daemon=True).start()
    return fut


def _dumps(value: Any) -> str:
    import json

    return json.dumps(value, default=str)


async def serve(config: DashboardConfig, on_ready: Callable[[str], None]) -> None:
    """Serves until cancelled; ``on_ready(url)`` once it listens (the URL holds the token)."""
    from aiohttp import web

    # Ctrl-C ends it within a second: an open page's pending request (a log follow, a poll) would
    # otherwise hold the shutdown for aiohttp's default 60 s
    runner = web.AppRunner(make_app(config), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, config.bind, config.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else config.port
    host = "127.0.0.1" if config.bind in ("0.0.0.0", "") else config.bind
    on_ready(f"http://{host}:{port}/?token={config.token}")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
