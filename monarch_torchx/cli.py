"""``monarch-torchx`` (and ``torchx pool``): manage warm pools from a shell.

monarch-torchx pool create NAME -s monarch_local -cfg hosts=2
monarch-torchx pool list | status NAME | stop NAME
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from .errors import (
    AccessError,
    CreateInterrupted,
    HomeUnusable,
    HostLost,
    HostUnreachable,
    MonarchError,
    PoolNotFound,
    StartTimeout,
)

if TYPE_CHECKING:
    from .pool import Pool

# `torchx` builds every sub-command's parser on each start, ours included: keep this module's
# import-time cost to argparse; the pool machinery is imported when a command runs.

DEFAULT_SCHEDULER = "monarch_local"
EXEC_HELP = "run one command on some or all hosts of a pool, its output as it comes (exit code: the worst host's)"


class UsageError(MonarchError):
    """An argument the command cannot take (``sql --timeout 0``): exit status 2, as argparse's."""


# The ``kind`` of the JSON object a ``--json`` command prints on stdout when it fails, by the
# error's type (the first that matches). Stable: scripts branch on it; README "Errors in --json".
ERROR_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (PoolNotFound, "pool_not_found"),
    (HomeUnusable, "home_unusable"),
    (AccessError, "access_denied"),
    (HostUnreachable, "host_unreachable"),
    (HostLost, "host_lost"),
    (StartTimeout, "start_timeout"),
    (UsageError, "usage"),
    (KeyboardInterrupt, "interrupted"),
    (MonarchError, "refused"),
)


def error_kind(e: BaseException) -> str:
    return next(kind for cls, kind in ERROR_KINDS if isinstance(e, cls))


def fail(message: str, kind: str, code: int, as_json: bool, prog: str = "error") -> None:
    """Ends the command with one line: ``PROG: MESSAGE`` on stderr, or under ``--json`` one JSON
    object ``{"error", "kind"}`` on stdout (what a script reading stdout parses)."""
    if as_json:
        print(json.dumps({"error": message, "kind": kind}))
    else:
        print(f"{prog}: {message}", file=sys.stderr)
    sys.exit(code)


def interrupted_message(e: KeyboardInterrupt) -> str:
    """What Ctrl-C left behind, as one line: a pool whose creation it cut short is stopped, or
    the command that stops it is named."""
    if isinstance(e, CreateInterrupted):
        if e.stopped:
            return f"interrupted: pool {e.pool!r} was being created; what it had started is stopped"
        return f"interrupted: pool {e.pool!r} may still be starting: `monarch-torchx pool stop {e.pool}` stops it"
    return "interrupted"


def quiet_broken_pipe() -> None:
    """``monarch-torchx ... | head -1``: the reader has what it wanted. As the Python docs
    recommend for SIGPIPE: no traceback, stdout pointed at /dev/null so that the flush at exit
    does not fail again, exit status 1."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(1)


class Progress:
    """Progress of long work (a sync, a pool's start) on stderr.

    On a terminal, rich's live line (a spinner, the latest message, the time so far) shows the
    work is moving through a silent stretch; ``echo`` messages also stay as lines above it.
    Elsewhere (a pipe, a log file, CI) only the ``echo`` messages are printed, one line each:
    nothing redraws itself into a log."""

    def __init__(self, echo: bool):
        self.echo = echo
        self._live: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress as Live
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            self._live = Live(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._live.start()
            self._task = self._live.add_task("starting", total=None)
        return self

    def __call__(self, message: str) -> None:
        if self._live is not None:
            self._live.update(self._task, description=message)
            if self.echo:
                self._live.console.print(message, highlight=False, markup=False)
        elif self.echo:
            print(message, file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.stop()


def _ago(ts: float) -> str:
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])


def _scheduler(name: str) -> Any:
    from .schedulers import PROVISIONERS

    if name not in PROVISIONERS:
        raise MonarchError(f"unknown scheduler {name!r}: use one of {', '.join(PROVISIONERS)}")
    from torchx.schedulers import get_scheduler_factories

    return get_scheduler_factories()[name]("default")


def pool_summary(pool: Pool) -> dict[str, Any]:
    """Everything `pool status` shows, as data (also what `--json` prints)."""
    from .registry import Registry

    rec = pool.record
    health = pool.health()
    hosts = []
    for h in health:
        a = h.addr
        state = "ok" if h.ok else ("stopped" if a and a.exited else h.state)
        hosts.append(
            {
                "index": h.index,
                "state": state,
                "address": a.address if a else None,
                "hostname": a.hostname if a else None,
                "pid": a.pid if a else None,
                "running": h.info.get("running"),
                "idle_s": h.info.get("idle_s"),
                "warm": h.info.get("warm", {}).get("preloaded") if h.ok else None,
                "warm_state": h.info.get("warm", {}).get("state") if h.ok else None,
                "capacity": _capacity_summary(h.info.get("load")) if h.ok else None,
                "last_seen": time.time() if h.ok else (a.heartbeat if a else None),  # (it just answered)
                "error": (a.exit_reason if a and a.exited else h.error) if not h.ok else "",
                "warning": "; ".join(
                    w
                    for w in (
                        h.info.get("heartbeat_error"),
                        h.info.get("log_error"),
                        h.info.get("warm", {}).get("error"),
                    )
                    if w
                )
                if h.ok
                else "",  # e.g. its disk is full, a preload failed
            }
        )
    from .pool import get_provisioner

    engine = get_provisioner(rec.scheduler).describe(rec)
    ok = sum(1 for h in hosts if h["state"] == "ok")
    state = "healthy" if ok == len(hosts) else "stopped" if all(h["state"] == "stopped" for h in hosts) else "degraded"
    if ok == 0 and engine.get("state") in ("PENDING", "CONFIGURING"):
        state = "pending"
    return {
        "name": rec.name,
        "scheduler": rec.scheduler,
        "state": state,
        "hosts": hosts,
        "spec": rec.spec,
        "options": rec.options,
        "allocation": engine,
        "created": rec.created,
        "apps": len(Registry.list_apps(rec)),
        "state_dir": rec.state_dir,
        "tls": bool(rec.tls_pem),
    }


def _capacity_summary(load: dict[str, Any] | None) -> dict[str, Any] | None:
    """A host's capacity, what is held of it and by whom (``resources.HostLoad``), as `pool
    status` shows it; None from an agent that does not say."""
    if not load:
        return None
    from .resources import HostLoad

    hl = HostLoad.from_wire(load)
    cap = hl.capacity
    return {
        "total": cap.total.to_wire(),
        "used": hl.used.to_wire(),
        "free": hl.free.to_wire(),
        "sources": cap.sources,
        "gpus": [
            {
                "id": g.visible_id,
                "uuid": g.uuid,
                "name": g.name,
                "healthy": g.healthy,
                "problem": g.problem,
                "held_by": next((h.owner for h in hl.holdings if g.visible_id in h.gpu_ids), None),
            }
            for g in cap.gpus
        ],
        "gpu_note": cap.gpu_note,
        "holdings": [{"owner": h.owner, **h.resources.to_wire(), "gpu_ids": h.gpu_ids} for h in hl.holdings],
        "queued": hl.queued,
    }


def _capacity_line(c: dict[str, Any]) -> str:
    """E.g. "cpus 1/2 used, mem 1024/23000 MB, gpus 2/2 (0,1: app/python/0)"."""
    t, u = c["total"], c["used"]
    line = f"cpus {u['cpus']:g}/{t['cpus']:g}, mem {u['mem_mb']}/{t['mem_mb']} MB"
    if c["gpus"]:
        held = sum(1 for g in c["gpus"] if g["held_by"])
        line += f", gpus {held}/{len(c['gpus'])} used"
        bad = [f"{g['id']}: {g['problem']}" for g in c["gpus"] if not g["healthy"]]
        if bad:
            line += f" (out of placement: {'; '.join(bad)})"
    if c["queued"]:
        line += f"; {c['queued']} app(s) in the pool's queue"
    return line


def cmd_create(args: argparse.Namespace) -> None:
    from .pool import ensure_pool
    from .torchx_cli import check_run_options

    sched = _scheduler(args.scheduler)
    check_run_options(args.scheduler, args.cfg)
    cfg = sched.run_opts().resolve(sched.run_opts().cfg_from_str(args.cfg or ""))
    cfg["pool"] = args.name
    req = sched._pool_request(dict(cfg), 1)
    if args.scheduler == "monarch_local" and req.spec.get("hosts"):
        from .schedulers.local import check_local_hosts

        check_local_hosts(req.spec["hosts"])  # before anything is made (as a run's plan checks it)
    with Progress(echo=True) as progress:
        pool = ensure_pool(req, defaults={"hosts": 1, "preload": "torch"}, progress=progress)
    print(f"pool {pool.name!r} ready: {pool.record.num_hosts} host(s) on {pool.record.scheduler}")


def cmd_list(args: argparse.Namespace) -> None:
    from .pool import Pool
    from .registry import Registry

    recs = Registry().list()
    if args.json:
        print(json.dumps([pool_summary(Pool(r, Registry())) for r in recs], indent=1))
        return
    if not recs:
        print("no pools; create one with `torchx pool create NAME` or `torchx run -s monarch_local ...`")
        return
    rows = []
    for r in recs:
        s = pool_summary(Pool(r, Registry()))
        ok = sum(1 for h in s["hosts"] if h["state"] == "ok")
        rows.append([r.name, r.scheduler, f"{ok}/{len(s['hosts'])}", s["state"], _ago(r.created), s["apps"]])
    print(_table(rows, ["POOL", "SCHEDULER", "HOSTS", "STATE", "AGE", "APPS"]))


def cmd_status(args: argparse.Namespace) -> None:
    from .pool import attach, give_back_idled

    shrunk = give_back_idled(args.name)
    if shrunk and not args.json:
        print(shrunk)
    s = pool_summary(attach(args.name))
    if args.json:
        print(json.dumps(s, indent=1))
        return
    print(
        f"pool {s['name']} on {s['scheduler']}: {s['state']}, {len(s['hosts'])} host(s), {s['apps']} app(s), "
        f"up {_ago(s['created'])}, idle timeout {s['options'].get('idle_timeout', 0):.0f}s, "
        f"{'TLS' if s['tls'] else 'plaintext (loopback)'} connections"
    )
    parts = s["allocation"].get("allocations") or []
    alloc = {
        k: v for k, v in s["allocation"].items() if v not in (None, "", {}) and k not in ("allocations", "autoscale")
    }
    if len(parts) > 1 or any(p.get("successor") for p in parts):
        # a grown or renewing SLURM pool: each allocation, the hosts it holds and its walltime left
        print(f"allocations ({len(parts)}):")
        rows = []
        for p in parts:
            rows.append(
                [p["job_id"], p["hosts"], p["nodes"], p["state"] or "?", p["time_left"] or "-", p["reason"] or "-"]
            )
            succ = p.get("successor")
            if succ:  # (renew: it takes those hosts over as they go idle, or at the walltime)
                why = succ["reason"] or f"{succ['armed']}/{p['nodes']} agent(s) ready to take over"
                left = succ["time_left"] or "-"
                rows.append([f"-> {succ['job_id']}", p["hosts"], p["nodes"], succ["state"] or "?", left, why])
        print(_table(rows, ["JOB", "HOSTS", "NODES", "STATE", "TIME LEFT", "REASON"]))
    elif alloc and ("job_id" in alloc or "kind" in alloc):
        print("allocation: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in alloc.items()))
    auto = s["allocation"].get("autoscale")
    if auto:  # a SLURM pool made with max_nodes or renew: what its allocator (host 0) is doing
        does = []
        if auto["max_nodes"]:
            does.append(
                f"grows by itself: up to {auto['max_nodes']} nodes, for apps that waited {auto['backlog_s']:g}s"
            )
        if auto.get("renew"):
            does.append(f"renews its allocations before their walltime ({auto.get('renewed', 0)} so far)")
        print(f"{'; '.join(does)}; {auto['phase']}{': ' + auto['reason'] if auto['reason'] else ''}")
    rows = []
    for h in s["hosts"]:
        warm = "importing" if h.get("warm_state") == "importing" else ",".join(h["warm"] or []) or "-"
        detail = h["error"] if h["error"] else f"running={h['running']} idle={h['idle_s']}s warm={warm}"
        if h.get("capacity"):
            detail += f"; {_capacity_line(h['capacity'])}"
        if h.get("warning"):
            detail += f"; warning: {h['warning']}"
        seen = _ago(h["last_seen"]) + " ago" if h["last_seen"] else "-"
        rows.append([h["index"], h["state"], h["address"] or "-", h["hostname"] or "-", h["pid"] or "-", seen, detail])
    print(_table(rows, ["HOST", "STATE", "ADDRESS", "HOSTNAME", "PID", "LAST SEEN", "DETAIL"]))
    gpu_rows = [
        [h["index"], g["id"], g["name"] or "-", g["held_by"] or "-", "ok" if g["healthy"] else g["problem"]]
        for h in s["hosts"]
        for g in (h.get("capacity") or {}).get("gpus", [])
    ]
    if gpu_rows:
        print(_table(gpu_rows, ["HOST", "GPU", "NAME", "HELD BY", "HEALTH"]))
    if s["state"] == "degraded":
        print("the next run on this pool restarts lost hosts; `torchx pool stop` releases it", file=sys.stderr)


def cmd_resize(args: argparse.Namespace) -> None:
    from .pool import resize_pool
    from .syncfs.replay import replay_syncs

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    pool = resize_pool(args.name, args.replicas, progress=say, on_join=replay_syncs)
    print(f"pool {pool.name!r} has {pool.record.num_hosts} host(s)")


def cmd_sync(args: argparse.Namespace) -> None:
    from .pool import attach
    from .syncfs import sync

    pool = attach(args.pool)
    hosts = [int(x) for x in args.hosts.split(",")] if args.hosts else None
    with Progress(echo=False) as progress:  # (on a terminal only: a live line of files, bytes, rate)
        report = sync(pool, args.src, args.to, hosts=hosts, exclude=args.exclude, progress=progress)
    if args.json:
        print(report.to_json())
    else:
        for h in report.hosts:
            print(
                f"host {h.index}: generation {h.generation} at {h.path} ({h.bytes_sent / 1e6:.1f} MB sent)"
                f"{_copy_note(h.served_by)}"
                if h.ok
                else f"FAILED {h.error}"
            )  # the error names its host
        print(
            f"{report.files} file(s), {report.bytes / 1e6:.1f} MB; sent {report.bytes_sent / 1e6:.1f} MB, "
            f"skipped {report.bytes_skipped / 1e6:.1f} MB in {report.seconds:.2f} s ({report.transfer})"
        )
    if not report.ok:
        sys.exit(1)


def _copy_note(served_by: str) -> str:
    """What a host serving the tree without FUSE costs (``--json``'s ``served_by`` says the same):
    a symlinked copy of every file next to the chunk store, so the tree takes twice its size on
    that host's disk."""
    if not served_by or served_by == "fuse":
        return ""
    why = served_by.partition("(")[2].rstrip(")") or "FUSE unavailable"
    return f"; copied, not mounted ({why}): the tree takes 2x its size on the host's disk"


def add_sync_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="directory to sync (a checkout, a virtualenv, ...)")
    _pool_names(p.add_argument("--pool", required=True, help="pool whose hosts receive it"))
    p.add_argument(
        "--to",
        required=True,
        help="target path on every host: relative = in the pool's own sync area; absolute = under an "
        "allowed root (/workspace, /env, $MONARCH_TORCHX_SYNC_ROOTS)",
    )
    p.add_argument("--hosts", default="", help="comma-separated host indices (default: all)")
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out paths matching PATTERN (fnmatch, relative to SRC; repeatable); "
        "SRC/.torchxignore is always honoured",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(pool_fn=cmd_sync)


def cmd_stop(args: argparse.Namespace) -> None:
    from .pool import force_stop, stop_pool
    from .registry import Registry

    try:
        hint = "" if args.force else " (Ctrl-C, then `pool stop --force` ends it at once)"
        left = stop_pool(args.name, on_wait=lambda m: print(m + hint, file=sys.stderr), wait=not args.force)
    except PoolNotFound:
        if not Registry().stopped(args.name):
            raise
        print(f"pool {args.name!r} is already stopped")  # what was asked is so: exit 0
        return
    except MonarchError:
        if not args.force:
            raise
        done = force_stop(args.name)
        print(f"pool {args.name!r} forced to stop: {'; '.join(done) or 'nothing of it was found'}")
        return
    for line in left:
        print(f"ended what a dead agent left: {line}", file=sys.stderr)
    print(f"pool {args.name!r} stopped")


def cmd_sql(args: argparse.Namespace) -> None:
    import csv
    import datetime

    from .pool import attach
    from .telemetry.query import run

    if not args.timeout > 0:  # (0 would give every host no time at all: "unreachable", wrongly)
        raise UsageError(f"--timeout {args.timeout:g} is not a time to wait: give seconds above 0, e.g. --timeout 30")
    res = run(attach(args.pool), args.query, timeout=args.timeout)
    for i, why in sorted(res.missing.items()):
        print(f"partial result: host {i} is missing ({why})", file=sys.stderr)
    rows = res.table.to_pylist()
    cols = res.table.column_names

    def plain(v: Any) -> Any:
        return v.isoformat() if isinstance(v, (datetime.datetime, datetime.date)) else v

    if args.arrow:
        import pyarrow as pa

        with pa.ipc.new_file(args.arrow, res.table.schema) as writer:
            writer.write_table(res.table)
        print(f"{res.table.num_rows} rows written to {args.arrow} (Arrow IPC file)", file=sys.stderr)
    elif args.json:
        print(json.dumps([{k: plain(v) for k, v in r.items()} for r in rows], default=str))
    elif args.csv:
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        for r in rows:
            w.writerow([plain(r[c]) for c in cols])
    else:
        shown = rows if args.max_rows <= 0 else rows[: args.max_rows]
        print(_table([["" if r[c] is None else str(plain(r[c])) for c in cols] for r in shown], cols))
        if len(shown) < len(rows):
            print(
                f"({len(rows)} rows, first {len(shown)} shown: --max-rows 0 shows all, --json/--csv print all)",
                file=sys.stderr,
            )


def cmd_stacks(args: argparse.Namespace) -> None:
    from .pool import attach
    from .telemetry.query import run

    pool = attach(args.pool)
    app = args.app.rstrip("/").rsplit("/", 1)[-1] if args.app else None  # a handle or POOL:APP or APP
    app = app.split(":", 1)[1] if app and ":" in app else app
    results = pool.ask("telemetry.stacks", range(pool.record.num_hosts), timeout=60.0, app_id=app)
    for i, res, err in results:
        if err:
            print(f"host {i}: {err}", file=sys.stderr)
            continue
        for e in res["errors"]:
            print(f"host {i}: {e}", file=sys.stderr)
    where = f"WHERE app_id = '{app}' " if app else ""
    q = f"SELECT ts, host, pid, thread, depth, function, file, line FROM stacks {where}"
    q += "ORDER BY host, pid, thread, depth"
    rows = run(pool, q).table.to_pylist()
    latest: dict[int, Any] = {}  # each host's own latest dump (hosts' clocks and dump times differ)
    for r in rows:
        latest[r["host"]] = max(latest.get(r["host"], r["ts"]), r["ts"])
    rows = [r for r in rows if r["ts"] == latest[r["host"]]]
    last = None
    for r in rows:
        key = (r["host"], r["pid"], r["thread"])
        if key != last:
            print(f"\nhost {r['host']} pid {r['pid']} thread {r['thread']}")
            last = key
        print(f"    {r['function']} ({r['file']}:{r['line']})")
    if not rows:
        print("no Python stacks (nothing running, or not Python)", file=sys.stderr)
    else:
        print(
            "\nall dumps stay queryable: monarch-torchx sql --pool "
            f'{args.pool} "SELECT function, count(*) c FROM stacks GROUP BY 1 ORDER BY c DESC"',
            file=sys.stderr,
        )


def _host_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of host indices, e.g. 0,2,3") from None


def cmd_exec(args: argparse.Namespace) -> None:
    """One command on some or all hosts (``pool_exec.py``): lines prefixed with their host as
    they come, the worst exit code of the hosts as ours."""
    from .pool import attach
    from .pool_exec import choose_hosts, run_exec
    from .resources import Resources

    argv = list(args.command)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError("no command: give it after --, e.g. `monarch-torchx exec --pool P --all -- hostname`")
    if args.hosts is None and not args.all:
        raise UsageError("say where: --all (every host) or --hosts 0,2")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g} is not a time to run: give seconds above 0")
    pool = attach(args.pool)
    try:
        hosts = choose_hosts(pool, args.hosts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    ask = Resources(cpus=args.cpus, gpus=args.gpus) if args.cpus or args.gpus else None
    width = len(str(max(hosts)))

    def line(host: int, text: str) -> None:
        if not args.json:
            print(f"[{host:>{width}}] {text}", flush=True)

    def error(host: int, why: str) -> None:
        if not args.json:
            print(f"[{host:>{width}}] monarch-torchx: {why}", file=sys.stderr, flush=True)

    try:
        res = run_exec(
            pool,
            _scheduler(pool.record.scheduler),
            argv,
            hosts,
            line,
            error,
            keep_output=args.json,
            resources=ask,
            timeout_s=args.timeout,
        )
    except KeyboardInterrupt:
        fail("interrupted: the command was ended on every host", "interrupted", 130, args.json, prog="monarch-torchx")
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        bad = [h for h in res.hosts if h.exit_code != 0 and h.state != "NOT_STARTED"]  # (those were said)
        if bad and (len(hosts) > 1 or any(h.error for h in bad)):
            said = ", ".join(f"host {h.host}: {h.exit_code}" + (f" ({h.error})" if h.error else "") for h in bad)
            print(f"monarch-torchx: exit codes {said} (of {len(hosts)} host(s))", file=sys.stderr)
    sys.stdout.flush()
    sys.exit(res.exit_code)


def add_exec_arguments(p: argparse.ArgumentParser) -> None:
    _pool_names(p.add_argument("--pool", required=True))
    where = p.add_mutually_exclusive_group()
    where.add_argument("--all", action="store_true", help="every host of the pool")
    where.add_argument("--hosts", type=_host_list, metavar="I,J", help="these hosts, by index (e.g. 0,2)")
    p.add_argument("--json", action="store_true", help="one JSON object at the end: each host's exit code and output")
    p.add_argument("--timeout", type=float, default=None, help="seconds it may run on a host before it is killed")
    p.add_argument("--cpus", type=float, default=0.0, help="CPUs it holds on each host while it runs (default none)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs it holds on each host (its own CUDA_VISIBLE_DEVICES)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    p.set_defaults(pool_fn=cmd_exec)


def cmd_shell(args: argparse.Namespace) -> None:
    """An interactive shell on one host (``pool_shell.py``); our exit code is the shell's."""
    from .pool import attach
    from .pool_shell import run_shell

    argv = list(args.command)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    pool = attach(args.pool)
    if not 0 <= args.host < pool.record.num_hosts:
        raise UsageError(f"pool {args.pool!r} has hosts 0..{pool.record.num_hosts - 1}; no host {args.host}")
    code = run_shell(pool, args.host, argv or None)
    sys.stdout.flush()
    sys.exit(code)


def _target(text: str) -> tuple[int, int]:
    host, sep, pid = text.partition(":")
    if not sep or not host.isdigit() or not pid.isdigit():
        raise UsageError(f"{text!r} is not HOST:PID (as `monarch-torchx debug --pool P` lists them), e.g. 1:4242")
    return int(host), int(pid)


def cmd_debug(args: argparse.Namespace) -> None:
    """Paused processes of a pool: list them, attach to one, or cast a pdb command to several."""
    from .pool import attach
    from .pool_debug import attach as attach_pdb
    from .pool_debug import cast, paused

    pool = attach(args.pool)
    if args.attach:
        host, pid = _target(args.attach)
        try:
            import readline  # noqa: F401  (input() then keeps a history and edits lines)
        except ImportError:
            pass
        print(attach_pdb(pool, host, pid), file=sys.stderr)
        return
    found, errors = paused(pool)
    for i, why in sorted(errors.items()):
        print(f"host {i}: {why}", file=sys.stderr)
    command = "c" if args.resume else args.cast
    if command is None:
        if args.json:
            print(json.dumps([{**vars(p), "where": p.where} for p in found]))
        elif not found:
            print("no process of this pool is paused at a breakpoint", file=sys.stderr)
        else:
            rows = [
                [f"{p.host}:{p.pid}", p.app_id or "-", f"{p.role}/{p.replica}" if p.role else "-", p.where, p.function]
                + ["attached" if p.attached else ""]
                for p in found
            ]
            print(_table(rows, ["HOST:PID", "APP", "ROLE/RANK", "WHERE", "FUNCTION", ""]))
        return
    wanted = {_target(t) for t in args.to.split(",")} if args.to != "all" else None
    targets = [p for p in found if wanted is None or (p.host, p.pid) in wanted]
    if wanted is not None and len(targets) < len(wanted):
        missing = sorted(wanted - {(p.host, p.pid) for p in targets})
        raise MonarchError(f"not paused at a breakpoint: {', '.join(f'{h}:{p}' for h, p in missing)}")
    if not targets:
        raise MonarchError(f"no process of pool {args.pool!r} is paused at a breakpoint")
    answers = cast(pool, targets, command)
    if args.json:
        print(
            json.dumps(
                [{**vars(a.target), "output": a.output, "continued": a.continued, "error": a.error} for a in answers]
            )
        )
    else:
        for a in answers:
            head = (
                f"[{a.target.host}:{a.target.pid} {a.target.role}/{a.target.replica}]"
                if a.target.role
                else f"[{a.target.host}:{a.target.pid}]"
            )
            if a.error:
                print(f"{head} {a.error}", file=sys.stderr)
                continue
            for line in a.output.splitlines():
                print(f"{head} {line}".rstrip())
            if a.continued:
                print(f"{head} continued")
    if any(a.error for a in answers):
        sys.exit(1)


def cmd_dashboard(args: argparse.Namespace) -> None:
    """Serves the live page (``dashboard.py``) until Ctrl-C; prints its URL (with its token)."""
    import asyncio

    from .dashboard import DashboardConfig, new_token, serve
    from .registry import Registry

    if args.pool:
        Registry().require(args.pool)  # (an unknown pool: one line now, not an empty page)
    if args.bind not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: serving on {args.bind}: anyone who can reach it and has the URL's token sees the pools",
            file=sys.stderr,
        )
    config = DashboardConfig(new_token(), args.pool, args.bind, args.port)

    def ready(url: str) -> None:
        print(url, flush=True)
        print("dashboard: open the URL above (its token is the key; Ctrl-C stops it)", file=sys.stderr, flush=True)

    try:
        asyncio.run(serve(config, ready))
    except OSError as e:
        raise MonarchError(f"cannot serve on {args.bind}:{args.port}: {e.strerror or e}") from None


def cmd_top(args: argparse.Namespace) -> None:
    """The pool's hosts and replicas in the terminal (``top.py``), redrawn until Ctrl-C."""
    from .registry import Registry
    from .top import run

    Registry().require(args.pool)
    if args.interval <= 0:
        raise MonarchError(f"--interval {args.interval:g}: give a positive number of seconds")
    run(args.pool, args.interval, args.once)


def cmd_skill(args: argparse.Namespace) -> None:
    """The guide for AI agents (docs/SKILL.md, shipped in the package)."""
    from importlib.resources import files

    print(files("monarch_torchx").joinpath("SKILL.md").read_text(), end="")


def cmd_tables(args: argparse.Namespace) -> None:
    from .telemetry.schema import describe_tables

    print(describe_tables())


def _pool_names(action: argparse.Action) -> argparse.Action:
    """Shell completion of a pool argument: the pools of this registry home (argcomplete)."""

    def pools(**_: Any) -> list[str]:
        from .registry import Registry

        return [r.name for r in Registry().list()]

    action.completer = pools  # type: ignore[attr-defined]
    return action


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="pool_cmd", metavar="{create,list,status,resize,sync,exec,stop}")
    sub.required = True
    p = sub.add_parser("create", help="create a warm pool (torchx run also creates on first use)")
    p.add_argument("name", help="pool name")
    p.add_argument("-s", "--scheduler", default=DEFAULT_SCHEDULER, help=f"pool engine (default {DEFAULT_SCHEDULER})")
    p.add_argument("-cfg", "--cfg", default="", help="run options as for `torchx run`, e.g. hosts=2,idle_timeout=1h")
    p.set_defaults(pool_fn=cmd_create)
    p = sub.add_parser("list", help="list pools")
    p.add_argument("--json", action="store_true")
    p.set_defaults(pool_fn=cmd_list)
    p = sub.add_parser("status", help="hosts, health and activity of one pool")
    _pool_names(p.add_argument("name", help="pool name"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(pool_fn=cmd_status)
    p = sub.add_parser(
        "resize",
        help="grow or shrink a pool in place (monarch_slurm: a further allocation joins, or whole allocations "
        "are released; monarch_kubernetes: pods); running hosts are kept",
    )
    _pool_names(p.add_argument("name", help="pool name"))
    p.add_argument("--replicas", "--hosts", dest="replicas", type=int, required=True, help="the new number of hosts")
    p.set_defaults(pool_fn=cmd_resize)
    add_sync_arguments(sub.add_parser("sync", help="sync a directory to every host (same as `monarch-torchx sync`)"))
    add_exec_arguments(sub.add_parser("exec", help=EXEC_HELP))
    p = sub.add_parser("stop", help="stop a pool: kills its apps, releases its hosts")
    _pool_names(p.add_argument("name", help="pool name"))
    p.add_argument(
        "--force",
        action="store_true",
        help="if the pool's record cannot be read, or another process holds the pool (a grow waiting for "
        "SLURM): end its local agents and the SLURM allocations it names, and remove the record",
    )
    p.set_defaults(pool_fn=cmd_stop)


def run_pool(args: argparse.Namespace) -> None:
    """Runs one sub-command; whatever ends it early is one line (a JSON object under ``--json``)."""
    as_json = bool(getattr(args, "json", False))
    try:
        args.pool_fn(args)
        sys.stdout.flush()  # here, so that a closed pipe is met inside the try
    except BrokenPipeError:
        quiet_broken_pipe()
    except UsageError as e:
        fail(str(e), error_kind(e), 2, as_json)
    except MonarchError as e:
        fail(str(e), error_kind(e), 1, as_json)
    except KeyboardInterrupt as e:
        fail(interrupted_message(e), error_kind(e), 130, as_json, prog="monarch-torchx")


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, read only when asked (importing
    ``importlib.metadata`` is not free, and every ``torchx`` start builds our parsers)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any):
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="print the version of monarch-torchx and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import version

        print(f"monarch-torchx {version('monarch-torchx')}")
        parser.exit()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="monarch-torchx", description="Warm pools for TorchX, submitit and actors.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(
        dest="cmd", metavar="{pool,sync,exec,shell,debug,dashboard,top,sql,stacks,tables,skill}"
    )
    sub.required = True
    add_pool_arguments(sub.add_parser("pool", help="create, list, inspect and stop warm pools"))
    add_sync_arguments(sub.add_parser("sync", help="sync a directory (code, a virtualenv) to every host of a pool"))
    add_exec_arguments(sub.add_parser("exec", help=EXEC_HELP))
    p = sub.add_parser("shell", help="an interactive shell on one host of a pool, on a real terminal there")
    _pool_names(p.add_argument("--pool", required=True))
    p.add_argument("--host", type=int, default=0, help="the host's index (default 0)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- a program to run instead of the login shell")
    p.set_defaults(pool_fn=cmd_shell)
    p = sub.add_parser("debug", help="processes paused at a breakpoint(): list, attach with pdb, cast a command")
    _pool_names(p.add_argument("--pool", required=True))
    what = p.add_mutually_exclusive_group()
    what.add_argument("--attach", metavar="HOST:PID", help="an interactive pdb session on this paused process")
    what.add_argument("--cast", metavar="CMD", help="one pdb command (e.g. 'p loss') to the paused processes of --to")
    what.add_argument("--continue", dest="resume", action="store_true", help="let the paused processes of --to go on")
    p.add_argument("--to", default="all", metavar="HOST:PID,...", help="which paused processes (default: all)")
    p.add_argument("--json", action="store_true", help="the list (or each answer) as JSON")
    p.set_defaults(pool_fn=cmd_debug)
    p = sub.add_parser("dashboard", help="a live page of the pools (hosts, queue, apps, logs, timeline, load, stacks)")
    _pool_names(p.add_argument("--pool", help="only this pool (default: every pool)"))
    p.add_argument("--bind", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    p.set_defaults(pool_fn=cmd_dashboard)
    p = sub.add_parser("top", help="a pool's hosts (load, capacity, GPUs) and replicas in the terminal, redrawn live")
    _pool_names(p.add_argument("--pool", required=True))
    p.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default 2)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit (the default when not a terminal)")
    p.set_defaults(pool_fn=cmd_top)
    p = sub.add_parser("sql", help="ask every host of a pool one SQL question (logs, procs, events)")
    p.add_argument("query", help="a SELECT over the tables of `monarch-torchx tables`")
    _pool_names(p.add_argument("--pool", required=True))
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="JSON records, all rows")
    fmt.add_argument("--csv", action="store_true", help="CSV, all rows")
    fmt.add_argument("--arrow", metavar="PATH", help="write all rows to an Arrow IPC file")
    p.add_argument("--max-rows", type=int, default=100, help="rows shown as a table (0 = all; default 100)")
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds the query may run: a host past it is stopped and named as missing, and work "
        "finished here (a join, a sort) past it fails the query (default 30)",
    )
    p.set_defaults(pool_fn=cmd_sql)
    p = sub.add_parser("stacks", help="py-spy dump of every running Python process of a pool (rows in `stacks`)")
    _pool_names(p.add_argument("--pool", required=True))
    p.add_argument("--app", default=None, help="only this app (its id or handle)")
    p.set_defaults(pool_fn=cmd_stacks)
    p = sub.add_parser("tables", help="the telemetry tables and their columns")
    p.set_defaults(pool_fn=cmd_tables)
    p = sub.add_parser("skill", help="a compact guide for AI agents: every command, its --json, recipes")
    p.set_defaults(pool_fn=cmd_skill)
    if "_ARGCOMPLETE" in os.environ:  # a shell asks for completions (`register-python-argcomplete monarch-torchx`)
        import argcomplete

        argcomplete.autocomplete(parser)
    run_pool(parser.parse_args(argv))


if __name__ == "__main__":
    main()
