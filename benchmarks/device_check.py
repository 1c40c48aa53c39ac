"""What this project's build machines cannot check, run once on a machine with NVIDIA GPUs.

    make device-check      # or: .venv/bin/python benchmarks/device_check.py [--budget-s 230] [--out PATH]

It needs no network (everything runs on local pools, ``monarch_local``, and TorchX's ``local_cwd``)
and takes at most ``--budget-s`` seconds (default 230, for a 4-minute slot): each check has its own
timeout, and the checks the budget leaves no time for read ``SKIPPED (budget)``. On a machine
without a GPU it prints one line and exits 2. It has **not** been run on a GPU by this project's
build machines (they have none): it was written to be right by reading, and what it prints (and
writes as JSON to ``--out``, default ``benchmarks/device_check.json``) is the record to keep.

Every step goes through the real CLIs (``torchx``, ``monarch-torchx``) in a private home
(``MONARCH_TORCHX_HOME``, a 0700 temp dir removed at the end; its pools are stopped in any case).
The checks, each PASS/FAIL/SKIPPED with its numbers:

1. detection: a local pool finds the GPUs through NVML, as many as ``nvidia-smi -L`` lists;
2. no long-lived pool process (agent, fork servers, torchrun nodes) maps ``libcuda`` after all the
   GPU runs below (run last; replicas may map it, and have exited by then);
3. a forked ``utils.python`` uses CUDA twice in a row (the fork server holds no CUDA context);
4. two concurrent apps get disjoint ``CUDA_VISIBLE_DEVICES`` (one GPU: the second is PENDING until
   the first ends, then runs on the same device);
5. ``dist.ddp`` warm (``monarch_local``) against stock (``local_cwd``), interleaved, 2 rounds each:
   NCCL 1x1; gloo on CUDA tensors 1x2 and 2x1 on a 2-host pool (2 GPUs or more): time to the first
   step and to completion, and stock/warm;
6. the ``gpus`` telemetry table has a row per device, queried while check 4 holds a GPU.

Exit status: 0 when nothing failed, 1 when a check failed, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent  # the venv's bin: not resolved, a venv's python is a symlink


def cli(script: str, module: str) -> list[str]:
    """The console script next to this interpreter; where there is none (the packages on PYTHONPATH,
    e.g. carried wheels on an image whose python holds torch), the same main through ``python -m``."""
    path = BIN / script
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


TORCHX = cli("torchx", "torchx.cli.main")
MONARCH_TORCHX = cli("monarch-torchx", "monarch_torchx.cli")
POOL, POOL2 = "dc", "dc2"
CLEANUP_RESERVE_S = 20.0  # kept out of every check's time: stopping the pools must fit the budget
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}

CUDA_TWICE = (
    "import torch,os; x=torch.ones(1,device='cuda'); print('ok', x.item(), os.environ.get('CUDA_VISIBLE_DEVICES'))"
)

# Rank's first (and only) step: one all_reduce on a CUDA tensor, over BACKEND (nccl or gloo).
TRAIN = """\
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group(os.environ["BACKEND"])
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
t = torch.ones(1, device=f"cuda:{local}")
dist.all_reduce(t)
torch.cuda.synchronize()
cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
print(f"first step at {time.time()} rank {dist.get_rank()} sum {t.item()} cvd {cvd}", flush=True)
dist.destroy_process_group()
"""
FIRST_STEP = re.compile(r"first step at ([0-9.]+) rank (\d+) sum ([0-9.]+) cvd (\S+)")

# (name, -j, --gpu per replica, BACKEND, pool, GPUs needed). The 2-host case is gloo: both local
# "hosts" see the same devices, so each may pick GPU 0, and NCCL refuses two ranks on one GPU.
DDP_CASES = [
    ("nccl 1x1", "1x1", 1, "nccl", POOL, 1),
    ("gloo on CUDA 1x2", "1x2", 2, "gloo", POOL, 2),
    ("gloo on CUDA 2x1, 2-host pool", "2x1", 1, "gloo", POOL2, 2),
]


class CheckTimeout(Exception):
    """A check ran past its own timeout (or the global budget's share of it)."""


class Deadline:
    """The point in time one check's commands and waits are bounded by, so no check overruns."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def cap(self, timeout: float) -> float:
        """``timeout`` cut to what is left; raises once nothing is."""
        t = min(timeout, self.left())
        if t <= 0:
            raise CheckTimeout("the check's time is up")
        return t


@dataclass
class Out:
    """What one command did: exit status, output, and how long it took."""

    rc: int
    stdout: str
    stderr: str
    seconds: float

    def tail(self, n: int = 400) -> str:
        return (self.stderr.strip() or self.stdout.strip())[-n:]


@dataclass
class Result:
    """One check's verdict (PASS, FAIL, SKIPPED), its numbers in one line, and what backs them."""

    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


@dataclass
class Session:
    """What the checks share: the private home, the env every CLI runs in, what was learnt so far."""

    work: Path
    env: dict[str, str]
    budget: Deadline
    expected_gpus: int
    out: Path
    report: dict[str, Any]
    gpu_ids: list[str] = field(default_factory=list)
    agents: list[int] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    releases: list[Path] = field(default_factory=list)
    results: dict[int, Result] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)


def end_group(p: subprocess.Popen[str]) -> None:
    """Ends a command and everything it started (a stock torchrun and its workers hold GPUs)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_cmd(argv: list[str], s: Session, d: Deadline, timeout: float = 60, cwd: Path | None = None) -> Out:
    """Runs one command in its own session, so that a timeout ends what it started, not only itself."""
    t = d.cap(timeout)
    t0 = time.monotonic()
    p = subprocess.Popen(
        argv,
        env=s.env,
        cwd=cwd or s.work,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = p.communicate(timeout=t)
    except subprocess.TimeoutExpired:
        end_group(p)
        raise CheckTimeout(f"`{' '.join(Path(a).name for a in argv[:4])} ...` ran past {t:.0f} s") from None
    except BaseException:
        end_group(p)
        raise
    return Out(p.returncode, stdout, stderr, round(time.monotonic() - t0, 2))


def torchx(s: Session, d: Deadline, *args: str, timeout: float = 60) -> Out:
    """The real ``torchx`` CLI of this venv, in the session's home."""
    return run_cmd([*TORCHX, *args], s, d, timeout)


def handle_of(out: Out) -> str:
    """The app handle: ``torchx run`` prints it as its last stdout line."""
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if lines else ""


def app_state(s: Session, d: Deadline, handle: str) -> str:
    """``State:`` of ``torchx status HANDLE`` ("?" when there is no handle or no answer)."""
    if not handle:
        return "?"
    m = re.search(r"^\s*State: (\w+)", torchx(s, d, "status", handle, timeout=30).stdout, re.M)
    return m.group(1) if m else "?"


def app_log(s: Session, d: Deadline, handle: str) -> str:
    """Every replica's output so far (``torchx log HANDLE``)."""
    return torchx(s, d, "log", handle, timeout=30).stdout if handle else ""


def poll(d: Deadline, limit: float, probe: Callable[[], Any], every: float = 0.3) -> Any:
    """Calls ``probe`` until it returns something other than None, for at most ``limit`` seconds."""
    end = time.monotonic() + min(limit, max(d.left(), 0))
    while True:
        value = probe()
        if value is not None or time.monotonic() >= end:
            return value
        time.sleep(every)


def wait_state(s: Session, d: Deadline, handle: str, want: set[str], limit: float) -> str:
    """Waits for one of ``want`` (or the limit); the last state seen either way."""
    seen = ["?"]

    def probe() -> str | None:
        seen[0] = app_state(s, d, handle)
        return seen[0] if seen[0] in want else None

    poll(d, limit, probe, every=0.5)
    return seen[0]


def wait_cvd(s: Session, d: Deadline, handle: str, limit: float) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` a holder app printed; None if it ended or ran out of time first."""

    def probe() -> str | None:
        m = re.search(r"cvd (\S+)", app_log(s, d, handle))
        if m:
            return m.group(1)
        return "" if app_state(s, d, handle) in TERMINAL else None

    return poll(d, limit, probe) or None


def pool_status(s: Session, d: Deadline, pool: str) -> dict[str, Any]:
    """``torchx pool status POOL --json``, parsed."""
    out = torchx(s, d, "pool", "status", pool, "--json", timeout=30)
    if out.rc != 0:
        raise RuntimeError(f"pool status {pool} exited {out.rc}: {out.tail()}")
    status: dict[str, Any] = json.loads(out.stdout)
    return status


def create_pool(s: Session, d: Deadline, pool: str, hosts: int) -> Out:
    """``torchx pool create`` with torch preloaded; the pool is stopped at the end whatever happens."""
    s.pools.append(pool)
    cfg = f"hosts={hosts},preload=torch"
    return torchx(s, d, "pool", "create", pool, "-s", "monarch_local", "-cfg", cfg, timeout=120)


def run_python(s: Session, d: Deadline, code: str, wait: bool) -> Out:
    """``torchx run utils.python --gpu 1 -c CODE`` on the pool (``-c`` takes no program arguments)."""
    flags = ["--wait"] if wait else []
    args = ["run", *flags, "-s", "monarch_local", "-cfg", f"pool={POOL}", "utils.python", "--gpu", "1", "-c", code]
    return torchx(s, d, *args, timeout=90)


def hold_code(release: Path) -> str:
    """A replica that says which devices it got, puts a tensor on one, and holds it until ``release`` exists."""
    return (
        "import os, time, pathlib, torch\n"
        "print('cvd', os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n"
        "x = torch.ones(1 << 20, device='cuda')\n"
        f"while not pathlib.Path({str(release)!r}).exists():\n"
        "    time.sleep(0.1)\n"
    )


# ---------------------------------------------------------------------------------------- checks


def check_detection(s: Session, d: Deadline) -> Result:
    """1. The pool's agents find the GPUs through NVML: as many as ``nvidia-smi -L`` lists, all healthy."""
    created = create_pool(s, d, POOL, 1)
    if created.rc != 0:
        return Result("FAIL", f"pool create {POOL} exited {created.rc}", {"error": created.tail(800)})
    host = pool_status(s, d, POOL)["hosts"][0]
    cap = host.get("capacity") or {}
    gpus = cap.get("gpus") or []
    source = (cap.get("sources") or {}).get("gpus", "")
    s.gpu_ids = [str(g["id"]) for g in gpus]
    s.agents = [int(host["pid"])] if host.get("pid") else []
    unhealthy = [f"{g['id']}: {g['problem']}" for g in gpus if not g.get("healthy")]
    ok = len(gpus) == s.expected_gpus and source.startswith("NVML") and not unhealthy
    summary = (
        f"{len(gpus)} GPU(s) in pool status, {s.expected_gpus} expected; source {source or '-'!r}; "
        f"{'all healthy' if not unhealthy else 'unhealthy: ' + '; '.join(unhealthy)}; pool create {created.seconds} s"
    )
    details = {"create_s": created.seconds, "gpus": gpus, "source": source, "gpu_note": cap.get("gpu_note")}
    return Result("PASS" if ok else "FAIL", summary, details)


def check_cuda_twice(s: Session, d: Deadline) -> Result:
    """3. Two forked ``utils.python`` in a row both use CUDA: the fork server never held a context."""
    runs = []
    for _ in range(2):
        out = run_python(s, d, CUDA_TWICE, wait=True)
        h = handle_of(out)
        state, log = app_state(s, d, h), app_log(s, d, h)
        m = re.search(r"ok 1\.0 (\S+)", log)
        device = m.group(1) if m else None
        good = state == "SUCCEEDED" and device is not None and device in s.gpu_ids
        runs.append({"handle": h, "state": state, "s": out.seconds, "device": device, "ok": good, "log": log[-300:]})
    summary = "; ".join(f"run {i + 1}: {r['state']} in {r['s']} s, 'ok 1.0 {r['device']}'" for i, r in enumerate(runs))
    return Result("PASS" if all(r["ok"] for r in runs) else "FAIL", summary, {"runs": runs})


def start_holders(s: Session, d: Deadline) -> list[str]:
    """Two holder apps, submitted back to back without ``--wait``; their handles."""
    handles = []
    for i in range(2):
        release = s.work / f"release-{i}"
        s.releases.append(release)
        handles.append(handle_of(run_python(s, d, hold_code(release), wait=False)))
    return handles


def release_and_wait(s: Session, d: Deadline, i: int, handle: str) -> str:
    """Lets holder ``i`` end; the state it ended in."""
    s.releases[i].touch()
    return wait_state(s, d, handle, TERMINAL, 30)


def check_disjoint(s: Session, d: Deadline) -> Result:
    """4. Two concurrent GPU apps never share a device; with one GPU the second waits its turn.

    Check 6 runs while the first app holds its GPU, so that the table has samples of a held device."""
    h = start_holders(s, d)
    first = wait_cvd(s, d, h[0], 60)
    if first:  # check 2's positive control: the holder, a pool descendant, maps libcuda now
        mapping = {pid: cmd[:120] for pid, cmd in pool_processes(s.agents).items() if libcuda_maps(pid)}
        s.report["libcuda_control"] = mapping
    details: dict[str, Any] = {"handles": h, "first": first}
    if len(s.gpu_ids) >= 2:
        second = wait_cvd(s, d, h[1], 60)
        run_check(s, 6, "gpus table", check_gpus_table, 30)
        ends = [release_and_wait(s, d, i, h[i]) for i in range(2)]
        ok = first is not None and second is not None and first != second and ends == ["SUCCEEDED"] * 2
        summary = f"app 1 got CUDA_VISIBLE_DEVICES={first}, app 2 got {second} at once; ended {ends[0]}, {ends[1]}"
        details.update(second=second, ends=ends)
        return Result("PASS" if ok else "FAIL", summary, details)
    pending = [app_state(s, d, h[1]) for _ in range(3)] if first else []
    msg = re.search(r"Msg: (.*)", torchx(s, d, "status", h[1], timeout=30).stdout)
    run_check(s, 6, "gpus table", check_gpus_table, 30)
    end1 = release_and_wait(s, d, 0, h[0])
    t0 = time.monotonic()
    second = wait_cvd(s, d, h[1], 45)
    started_after = round(time.monotonic() - t0, 1)
    end2 = release_and_wait(s, d, 1, h[1])
    ok = bool(pending) and set(pending) == {"PENDING"} and second == first and [end1, end2] == ["SUCCEEDED"] * 2
    summary = (
        f"app 1 got CUDA_VISIBLE_DEVICES={first}; app 2 read {'/'.join(pending) or '-'} while app 1 held it, "
        f"then ran on {second} {started_after} s after app 1 was released; ended {end1}, {end2}"
    )
    details.update(second=second, pending=pending, pending_msg=msg.group(1) if msg else None, ends=[end1, end2])
    details["second_started_after_s"] = started_after
    return Result("PASS" if ok else "FAIL", summary, details)


def check_gpus_table(s: Session, d: Deadline) -> Result:
    """6. The ``gpus`` table has at least one row per device (the query itself samples once)."""
    query = "select host, gpu, util_pct, mem_used_mb, held_by from gpus"
    rows: list[dict[str, Any]] = []
    for attempt in range(2):  # a second look, a moment later, in case the sampler had not run yet
        out = run_cmd([*MONARCH_TORCHX, "sql", "--pool", POOL, "--json", query], s, d, timeout=30)
        if out.rc != 0:
            return Result("FAIL", f"monarch-torchx sql exited {out.rc}", {"error": out.tail(800)})
        rows = json.loads(out.stdout)
        if {str(r["gpu"]) for r in rows} >= set(s.gpu_ids) or attempt:
            break
        time.sleep(2)
    seen = sorted({str(r["gpu"]) for r in rows})
    held = sorted({str(r["held_by"]) for r in rows if r.get("held_by")})
    ok = bool(s.gpu_ids) and set(seen) >= set(s.gpu_ids)
    summary = f"{len(rows)} row(s) for GPU(s) {seen or '-'} of {s.gpu_ids}; held by {held or 'nobody'}"
    return Result("PASS" if ok else "FAIL", summary, {"rows": len(rows), "sample": rows[-4:], "held_by": held})


def stock_first_steps(log_dir: Path, cli: Out) -> str:
    """A stock run's output: local_cwd forgets the app once its CLI exits, so it is read from its log_dir."""
    texts = [p.read_text(errors="replace") for p in sorted(log_dir.rglob("stdout.log"))]
    return "\n".join(texts) or cli.stdout + cli.stderr


def time_ddp(s: Session, d: Deadline, path: str, case: tuple[str, str, int, str, str, int], n: int) -> dict[str, Any]:
    """One ``torchx run --wait dist.ddp``: to the first step (the script's own timestamp) and to completion."""
    name, j, gpus, backend, pool, _ = case
    log_dir = s.work / "stock-logs" / f"{j}-{n}"
    if path == "warm":
        sched = ["-s", "monarch_local", "-cfg", f"pool={pool}"]
    else:
        sched = ["-s", "local_cwd", "-cfg", f"auto_set_cuda_visible_devices=True,log_dir={log_dir}"]
    comp = ["dist.ddp", "-j", j, "--gpu", str(gpus), "--env", f"BACKEND={backend}", "--script", "train.py"]
    t0 = time.time()
    out = torchx(s, d, "run", "--wait", *sched, *comp, timeout=120)
    done = time.time()
    h = handle_of(out)
    if path == "warm":
        state, log = app_state(s, d, h), app_log(s, d, h)
    else:
        m = re.search(r"job finished: (\w+)", out.stderr)
        state = m.group(1) if m else ("SUCCEEDED" if out.rc == 0 else f"exit {out.rc}")
        log = stock_first_steps(log_dir, out)
    steps = {int(r): (float(ts), float(total), cvd) for ts, r, total, cvd in FIRST_STEP.findall(log)}
    nodes, procs = (int(x) for x in j.split("x"))
    world = nodes * procs
    good = state == "SUCCEEDED" and len(steps) == world and all(v[1] == world for v in steps.values())
    row: dict[str, Any] = {"path": path, "handle": h, "state": state, "ok": good, "completion_s": round(done - t0, 2)}
    row["first_step_s"] = round(max(v[0] for v in steps.values()) - t0, 2) if steps else None
    row["devices"] = {r: v[2] for r, v in sorted(steps.items())}
    if not good:
        row["error"] = out.tail(600) if out.rc else log[-600:]
    return row


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """The median of the runs' ``key``, over the runs that have it."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 2) if values else None


def summarize_case(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A case's medians per path and stock/warm, or why it has none."""
    out: dict[str, Any] = {"runs": runs}
    for path in ("warm", "stock"):
        rows = [r for r in runs if r["path"] == path]
        out[path] = {"first_step_s": median_of(rows, "first_step_s"), "completion_s": median_of(rows, "completion_s")}
    for key in ("first_step_s", "completion_s"):
        w, st = out["warm"][key], out["stock"][key]
        out[f"stock_over_warm_{key[:-2]}"] = round(st / w, 2) if w and st else None
    ran = {r["path"] for r in runs}
    good = all(r["ok"] for r in runs) and ran == {"warm", "stock"}
    out["status"] = "SKIPPED (budget)" if not runs else "PASS" if good else "FAIL"
    return out


def case_line(name: str, c: dict[str, Any]) -> str:
    """One case's numbers for the printed report."""
    if "runs" not in c:
        return f"   {name}: {c['status']}" + (f": {c['error']}" if c.get("error") else "")
    w, st = c["warm"], c["stock"]
    return (
        f"   {name}: {c['status']}; first step warm {w['first_step_s']} s, stock {st['first_step_s']} s "
        f"(stock/warm {c['stock_over_warm_first_step']}); done warm {w['completion_s']} s, "
        f"stock {st['completion_s']} s (stock/warm {c['stock_over_warm_completion']}); {len(c['runs'])} run(s)"
    )


def run_case(s: Session, d: Deadline, case: tuple[str, str, int, str, str, int]) -> dict[str, Any]:
    """Warm, stock, warm, stock; a run is started only while the check has time for one more."""
    name, _, _, _, pool, _ = case
    if pool not in s.pools:
        created = create_pool(s, d, pool, 2)
        if created.rc != 0:
            return {"status": "FAIL", "error": f"pool create {pool}: {created.tail()}"}
    runs: list[dict[str, Any]] = []
    for n in range(2):
        for path in ("warm", "stock"):
            slowest = max([r["completion_s"] for r in runs] + [25.0])
            if d.left() < slowest * 1.3 + 5:
                return summarize_case(name, runs) | {"cut_short": "budget"}
            runs.append(time_ddp(s, d, path, case, n))
    return summarize_case(name, runs)


def check_ddp(s: Session, d: Deadline) -> Result:
    """5. ``dist.ddp`` on the warm pool against stock TorchX (``local_cwd``) on the same GPUs, interleaved."""
    (s.work / "train.py").write_text(TRAIN)
    cases: dict[str, dict[str, Any]] = {}
    for case in DDP_CASES:
        name, need = case[0], case[5]
        if len(s.gpu_ids) < need:
            cases[name] = {"status": f"SKIPPED ({len(s.gpu_ids)} GPU(s), needs {need})"}
            continue
        cases[name] = run_case(s, d, case)
    statuses = [c["status"] for c in cases.values()]
    status = "FAIL" if "FAIL" in statuses else "PASS" if "PASS" in statuses else "SKIPPED (budget)"
    ran = [f"{n}: stock/warm first step {c['stock_over_warm_first_step']}" for n, c in cases.items() if "runs" in c]
    lines = [case_line(n, c) for n, c in cases.items()]
    return Result(status, "; ".join(ran) or "no case ran", {"cases": cases}, lines)


def proc_cmdline(pid: int) -> str:
    """A process's command line, '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def proc_parents() -> dict[int, int]:
    """pid -> parent pid of every live process (from /proc/PID/stat; the name may hold spaces)."""
    parents = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def pool_processes(agents: list[int]) -> dict[int, str]:
    """The agents, their live descendants, and every process running ``monarch_torchx.agent``."""
    parents = proc_parents()
    found = {pid for pid in agents if pid in parents}
    grown = True
    while grown:
        more = {pid for pid, ppid in parents.items() if ppid in found} - found
        grown = bool(more)
        found |= more
    found |= {pid for pid in parents if "monarch_torchx.agent" in proc_cmdline(pid)}
    found.discard(os.getpid())
    return {pid: proc_cmdline(pid) for pid in sorted(found)}


def libcuda_maps(pid: int) -> list[str]:
    """The files named libcuda.so* that a process maps (none when it is gone)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if "libcuda.so" in line})


def check_no_libcuda(s: Session, d: Deadline) -> Result:
    """2. After every GPU run, no long-lived pool process maps libcuda: CUDA never reached a forking process."""
    agents: list[int] = []
    running, errors = 0, {}
    for pool in s.pools:
        try:
            hosts = poll(d, 20, idle_probe(s, d, pool), every=1.0) or pool_status(s, d, pool)["hosts"]
        except (RuntimeError, ValueError, KeyError) as e:  # e.g. dc2 was never created: check the others
            errors[pool] = str(e)[-300:]
            continue
        agents += [int(h["pid"]) for h in hosts if h.get("pid")]
        running += sum(int(h.get("running") or 0) for h in hosts)
    procs = pool_processes(agents)
    offenders = {pid: libcuda_maps(pid) for pid in procs}
    offenders = {pid: files for pid, files in offenders.items() if files}
    checked = [{"pid": pid, "cmd": cmd[:200], "agent": pid in agents} for pid, cmd in procs.items()]
    bad = [{"pid": pid, "cmd": procs[pid][:200], "maps": files} for pid, files in offenders.items()]
    ok = bool(agents) and not offenders
    control = s.report.get("libcuda_control")
    summary = (
        f"{len(procs)} pool process(es) checked ({len(agents)} agent(s), {running} replica(s) still running); "
        f"{len(offenders)} map libcuda" + (f": pids {sorted(offenders)}" if offenders else "")
    )
    if control is not None:  # the probe's positive control: a replica holding a GPU did map it
        summary += f"; control: {len(control)} process(es) mapped it while check 4 held a GPU"
    details = {"checked": checked, "offenders": bad, "pool_errors": errors, "control": control}
    return Result("PASS" if ok else "FAIL", summary, details)


def idle_probe(s: Session, d: Deadline, pool: str) -> Callable[[], list[dict[str, Any]] | None]:
    """A probe for ``poll``: the pool's hosts once none runs a replica (check 2 is about what stays)."""

    def probe() -> list[dict[str, Any]] | None:
        hosts: list[dict[str, Any]] = pool_status(s, d, pool)["hosts"]
        return hosts if all(not h.get("running") for h in hosts) else None

    return probe


# ------------------------------------------------------------------------------------- the run


def run_check(
    s: Session, num: int, title: str, fn: Callable[[Session, Deadline], Result], timeout: float, keep: float = 0
) -> None:
    """Runs one check within its timeout and the budget, fail-soft, prints it and saves the report so far.

    ``keep``: seconds of the budget this check leaves to the checks after it."""
    left = s.budget.left() - CLEANUP_RESERVE_S - keep
    t0 = time.monotonic()
    if left < 10:
        res = Result("SKIPPED (budget)", f"{max(left, 0):.0f} s of the budget left")
    elif num != 1 and not s.gpu_ids:
        res = Result("SKIPPED", f"pool {POOL} has no GPUs to use (check 1)")
    else:
        try:
            res = fn(s, Deadline(min(timeout, left)))
        except CheckTimeout as e:
            res = Result("FAIL", f"timed out ({timeout:.0f} s): {e}")
        except Exception as e:  # fail soft: one broken check must not cost the others their report
            res = Result("FAIL", f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc(limit=4)})
    res.details["seconds"] = round(time.monotonic() - t0, 1)
    s.results[num] = res
    print(f"{num}. {title}: {res.status}  {res.summary}", flush=True)
    for line in res.lines:
        print(line, flush=True)
    s.report["checks"][str(num)] = {"title": title, "status": res.status, "summary": res.summary, **res.details}
    save(s)


def save(s: Session) -> None:
    """Writes the report so far: a run cut off from outside still leaves what it had found."""
    s.report["elapsed_s"] = round(time.monotonic() - s.t0, 1)
    s.report["checks"] = dict(sorted(s.report["checks"].items()))
    try:
        s.out.parent.mkdir(parents=True, exist_ok=True)
        s.out.write_text(json.dumps(s.report, indent=1, default=str) + "\n")
    except OSError as e:
        print(f"could not write {s.out}: {e}", file=sys.stderr)


def cleanup(s: Session) -> dict[str, Any]:
    """Releases the holders, stops every pool this run made (always), and removes the private home."""
    for r in s.releases:
        r.touch(exist_ok=True)
    stops = {}
    for pool in s.pools:
        try:
            out = torchx(s, Deadline(20), "pool", "stop", pool, timeout=20)
            stops[pool] = "stopped" if out.rc == 0 else f"exit {out.rc}: {out.tail(200)}"
        except (CheckTimeout, OSError) as e:
            stops[pool] = f"not stopped: {e}"
    shutil.rmtree(s.work, ignore_errors=True)
    return {"pools": stops, "home_removed": not s.work.exists()}


def nvidia_smi_gpus() -> tuple[list[str], str]:
    """The lines ``nvidia-smi -L`` lists ("GPU 0: NVIDIA H200 (UUID: GPU-...)"), or why there are none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        if not Path("/dev/nvidiactl").exists():
            return [], "no nvidia-smi on PATH, no /dev/nvidiactl"
        return torch_gpus()
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi -L failed: {e}"
    lines = [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]
    first = (out.stderr.strip() or out.stdout.strip()).splitlines()[:1]
    return lines, "" if lines else f"nvidia-smi -L lists none (exit {out.returncode}: {first[0] if first else ''})"


def torch_gpus() -> tuple[list[str], str]:
    """Device count from torch, in a subprocess (CUDA is never initialised in this process)."""
    code = "import torch; print(torch.cuda.device_count())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        n = int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return [], f"no nvidia-smi, and torch could not count devices: {e}"
    return [f"GPU {i}: (from torch.cuda.device_count)" for i in range(n)], "" if n else "torch sees no CUDA device"


def granted(lines: list[str]) -> int:
    """How many of them a pool may use: CUDA_VISIBLE_DEVICES in this shell restricts its agents too."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return len(lines)
    wanted = [v.strip() for v in cvd.split(",") if v.strip()]
    return sum(1 for line in lines if any(line.startswith(f"GPU {w}:") or f"UUID: {w}" in line for w in wanted))


def versions() -> dict[str, str]:
    """The versions that the numbers belong to (read from metadata: torch is not imported here)."""
    found = {}
    for dist in ("torch", "torchx-nightly", "torchx", "monarch-torchx"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def driver() -> str:
    """The NVIDIA driver version, for the record ('' when nvidia-smi cannot say)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


def new_session(args: argparse.Namespace, lines: list[str], expected: int) -> Session:
    """A private 0700 home, and the env every CLI runs in: the venv's bin first on PATH (stock torchrun)."""
    work = Path(tempfile.mkdtemp(prefix="device-check-"))
    home = work / "home"
    home.mkdir(mode=0o700)
    os.chmod(home, 0o700)
    env = {**os.environ, "MONARCH_TORCHX_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    report: dict[str, Any] = {
        "script": "benchmarks/device_check.py",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "gpus": {"nvidia_smi": lines, "expected_in_pool": expected, "driver": driver()},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "versions": versions(),
        "budget_s": args.budget_s,
        "checks": {},
    }
    return Session(work, env, Deadline(args.budget_s), expected, args.out, report)


def finish(s: Session) -> int:
    """Prints the verdicts in check order, saves the report; the exit status (1 if any check failed)."""
    statuses = {num: r.status for num, r in sorted(s.results.items())}
    count = {k: sum(1 for v in statuses.values() if v.startswith(k)) for k in ("PASS", "FAIL", "SKIPPED")}
    s.report["verdicts"] = {str(k): v for k, v in statuses.items()}
    save(s)
    elapsed = s.report["elapsed_s"]
    print(
        f"summary: {' '.join(f'{k}={v}' for k, v in statuses.items())}; "
        f"{count['PASS']} PASS, {count['FAIL']} FAIL, {count['SKIPPED']} SKIPPED in {elapsed} s; report: {s.out}"
    )
    return 1 if count["FAIL"] else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """--budget-s (the whole run, cleanup included) and --out (the JSON report)."""
    ap = argparse.ArgumentParser(description="GPU checks of monarch-torchx (see the module docstring).")
    ap.add_argument("--budget-s", type=float, default=230.0, help="seconds for the whole run (default 230)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("device_check.json"), help="JSON report")
    return ap.parse_args(argv)


def on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM (a slot's end) raises SystemExit, so that ``finally`` still stops the pools."""
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Exits 2 at once without a GPU; else runs the checks, always cleaning up, and reports."""
    args = parse_args(argv)
    lines, why = nvidia_smi_gpus()
    expected = granted(lines)
    if not lines or not expected:
        print(f"no GPU here ({why or 'CUDA_VISIBLE_DEVICES grants none of them'}): nothing to check")
        return 2
    signal.signal(signal.SIGTERM, on_sigterm)
    s = new_session(args, lines, expected)
    print(f"device check: {expected} GPU(s) to use of {len(lines)} listed; budget {args.budget_s:.0f} s", flush=True)
    for line in lines:
        print(f"   {line}", flush=True)
    try:
        run_check(s, 1, "detection (NVML)", check_detection, 90)
        run_check(s, 3, "forked utils.python uses CUDA twice", check_cuda_twice, 60)
        run_check(s, 4, "concurrent apps get disjoint CUDA_VISIBLE_DEVICES", check_disjoint, 120)
        if 6 not in s.results:  # check 4 could not hold a GPU: the query still samples once
            run_check(s, 6, "gpus table", check_gpus_table, 30)
        run_check(s, 5, "dist.ddp warm vs stock", check_ddp, 150, keep=20)  # check 2 matters more
        run_check(s, 2, "no long-lived pool process maps libcuda", check_no_libcuda, 40)
    finally:
        s.report["cleanup"] = cleanup(s)
        save(s)
        print(f"cleanup: {s.report['cleanup']}", flush=True)
    return finish(s)


if __name__ == "__main__":
    sys.exit(main())
