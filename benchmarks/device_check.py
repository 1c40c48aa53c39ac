"""The GPU check of issue 40, ready to run once on a machine with NVIDIA GPUs: ``make device-check``.

No network, about 4 minutes (``--budget-s``). On a machine without a GPU it says so in one line
and exits 2. It has not been run on a GPU by this project's build machines (they have none): the
report it prints (and writes to ``--out``) is what to record in ``benchmarks/RESULTS.md``.

Checks, each PASS/FAIL/SKIPPED with its numbers:
1. a local pool finds the GPUs through NVML (as many as ``nvidia-smi -L`` lists);
2. a forked ``utils.python`` uses CUDA twice in a row (the fork server holds no CUDA context);
3. two concurrent apps get disjoint ``CUDA_VISIBLE_DEVICES`` (one GPU: the second waits, then runs);
4. the ``gpus`` table has a row per device while one is held;
5. ``dist.ddp`` warm (monarch_local) against stock ``local_cwd``, interleaved: NCCL 1x1, and gloo
   on CUDA tensors 1x2 (2 GPUs or more): time to the first step and to completion;
6. after all of it, no long-lived pool process (agent, fork servers) maps ``libcuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TORCHX = str(BIN / "torchx")
POOL = "devcheck"

TRAIN = """import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group(os.environ.get("BACKEND", "nccl"))
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
t = torch.ones(1, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("first step at", time.time(), "sum", t.item(), flush=True)
dist.destroy_process_group()
"""

HOLD = (
    "import os,sys,time\n"
    "print('cvd', os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.1)"
)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def gpu_count() -> tuple[int, str]:
    """How many GPUs ``nvidia-smi -L`` lists, and why none when none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "no nvidia-smi"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f"nvidia-smi failed: {e}"
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return n, "" if n else "nvidia-smi lists no GPU"


def tx(env: dict[str, str], *args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([TORCHX, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_python(env: dict[str, str], code: str, *args: str, wait: bool = False) -> str:
    """``torchx run`` of ``utils.python --gpu 1 -c CODE ARGS`` on the check's pool; its handle."""
    flags = ["--wait"] if wait else []
    cmd = ["run", *flags, "-s", "monarch_local", "-cfg", f"pool={POOL}", "utils.python", "--gpu", "1", "-c", code]
    return handle(tx(env, *cmd, *(["--", *args] if args else []), timeout=180))


def handle(res: subprocess.CompletedProcess) -> str:
    return res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""


def state(env: dict[str, str], h: str) -> str:
    m = re.search(r"State: (\w+)", tx(env, "status", h).stdout)
    return m.group(1) if m else "?"


def wait_state(env: dict[str, str], h: str, want: set[str], timeout: float) -> str:
    end = time.monotonic() + timeout
    s = state(env, h)
    while s not in want and time.monotonic() < end:
        time.sleep(0.5)
        s = state(env, h)
    return s


def check_detection(env: dict[str, str], n: int) -> dict:
    status = json.loads(tx(env, "pool", "status", POOL, "--json").stdout)
    cap = status["hosts"][0]["capacity"]
    found = len(cap["gpus"])
    return {
        "ok": found == n,
        "found": found,
        "listed": n,
        "source": cap["sources"].get("gpus"),
        "note": cap["gpu_note"],
    }


def check_forked_cuda_twice(env: dict[str, str]) -> dict:
    code = (
        "import torch,os; x=torch.ones(1,device='cuda'); print('ok', x.item(), os.environ.get('CUDA_VISIBLE_DEVICES'))"
    )
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        h = run_python(env, code, wait=True)
        runs.append(
            {
                "state": state(env, h),
                "s": round(time.perf_counter() - t0, 2),
                "log": tx(env, "log", h).stdout.strip()[-200:],
            }
        )
    return {"ok": all(r["state"] == "SUCCEEDED" and "ok 1.0" in r["log"] for r in runs), "runs": runs}


def check_disjoint(env: dict[str, str], n: int, work: Path) -> tuple[dict, list[Path]]:
    release = work / "release"
    hs = [run_python(env, HOLD, str(release)) for _ in range(2)]
    out: dict = {"handles": hs}
    if n >= 2:
        seen = []
        for h in hs:
            wait_state(env, h, {"RUNNING"}, 60)
            end = time.monotonic() + 30
            m = None
            while m is None and time.monotonic() < end:
                m = re.search(r"cvd (\S+)", tx(env, "log", h).stdout)
                time.sleep(0.3)
            seen.append(m.group(1) if m else None)
        out.update(ok=None not in seen and seen[0] != seen[1], devices=seen)
    else:
        out["second_while_first_runs"] = state(env, hs[1])
        out["ok"] = out["second_while_first_runs"] == "PENDING"
    return out, [release]


def check_gpus_table(env: dict[str, str], n: int) -> dict:
    res = subprocess.run(
        [
            str(BIN / "monarch-torchx"),
            "sql",
            "--pool",
            POOL,
            "--json",
            "select host, gpu, util_pct, mem_used_mb, held_by from gpus",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        rows = json.loads(res.stdout)
    except ValueError:
        return {"ok": False, "error": (res.stderr or res.stdout)[-300:]}
    gpus = {r["gpu"] for r in rows}
    return {"ok": len(gpus) >= n, "rows": len(rows), "devices": sorted(gpus), "sample": rows[:2]}


def time_ddp(env: dict[str, str], scheduler: str, cfg: str, j: str, gpus: int, backend: str, work: Path) -> dict:
    t0 = time.time()
    res = tx(
        env,
        "run",
        "--wait",
        "-s",
        scheduler,
        "-cfg",
        cfg,
        "dist.ddp",
        "-j",
        j,
        "--gpu",
        str(gpus),
        "--env",
        f"BACKEND={backend}",
        "--script",
        "train.py",
        cwd=work,
        timeout=240,
    )
    done = time.time()
    h = handle(res)
    log = tx(env, "log", h).stdout
    firsts = [float(x) for x in re.findall(r"first step at ([0-9.]+)", log)]
    return {
        "state": state(env, h),
        "first_step_s": round(min(firsts) - t0, 2) if firsts else None,
        "completion_s": round(done - t0, 2),
    }


def check_ddp(env: dict[str, str], n: int, work: Path, budget: Budget) -> dict:
    (work / "train.py").write_text(TRAIN)
    cases = [("nccl 1x1", "1x1", 1, "nccl")] + ([("gloo on CUDA 1x2", "1x2", 2, "gloo")] if n >= 2 else [])
    out = {}
    for name, j, g, backend in cases:
        rows: dict[str, list[dict]] = {"warm": [], "stock": []}
        for _ in range(2):
            if budget.left() < 60:
                break
            rows["warm"].append(time_ddp(env, "monarch_local", f"pool={POOL}", j, g, backend, work))
            rows["stock"].append(time_ddp(env, "local_cwd", "auto_set_cuda_visible_devices=True", j, g, backend, work))
        ok = all(r["state"] == "SUCCEEDED" for v in rows.values() for r in v) and rows["warm"]
        ratio = None
        if ok:
            w = min(r["first_step_s"] or 1e9 for r in rows["warm"])
            s = min(r["first_step_s"] or 1e9 for r in rows["stock"])
            ratio = round(s / w, 2) if w else None
        out[name] = {"ok": bool(ok), "runs": rows, "first_step_stock_over_warm": ratio}
    return {"ok": all(v["ok"] for v in out.values()), "cases": out}


def check_no_libcuda(env: dict[str, str]) -> dict:
    offenders = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "monarch_torchx.agent" not in cmd or "torchrun_node" in cmd:
                continue
            maps = (p / "maps").read_text()
        except OSError:
            continue
        if "libcuda.so" in maps:
            offenders.append({"pid": int(p.name), "cmd": cmd[:160]})
    return {"ok": not offenders, "offenders": offenders}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=230.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("device_check.json"))
    a = ap.parse_args()
    n, why = gpu_count()
    if not n:
        print(f"no GPU here ({why}): nothing to check")
        return 2
    budget = Budget(a.budget_s)
    work = Path(tempfile.mkdtemp(prefix="devcheck-"))
    home = work / "home"
    home.mkdir(mode=0o700)
    env = {**os.environ, "MONARCH_TORCHX_HOME": str(home)}
    report: dict = {"gpus": n}
    releases: list[Path] = []
    try:
        tx(env, "pool", "create", POOL, "-s", "monarch_local", "-cfg", "hosts=1,preload=torch", timeout=180)
        steps = [
            ("1 detection", lambda: check_detection(env, n)),
            ("2 forked CUDA twice", lambda: check_forked_cuda_twice(env)),
        ]
        for name, fn in steps:
            report[name] = fn() if budget.left() > 30 else {"ok": None, "skipped": "budget"}
        if budget.left() > 30:
            report["3 disjoint devices"], releases = check_disjoint(env, n, work)
            report["4 gpus table"] = check_gpus_table(env, n)
            for r in releases:
                r.touch()
        report["5 ddp warm vs stock"] = (
            check_ddp(env, n, work, budget) if budget.left() > 60 else {"ok": None, "skipped": "budget"}
        )
        report["6 no libcuda in pool processes"] = check_no_libcuda(env)
    finally:
        for r in releases:
            r.touch()
        tx(env, "pool", "stop", POOL, timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    for name, r in report.items():
        if isinstance(r, dict):
            verdict = "SKIPPED" if r.get("ok") is None else "PASS" if r["ok"] else "FAIL"
            print(f"{name}: {verdict} {json.dumps({k: v for k, v in r.items() if k != 'ok'})[:600]}")
    a.out.write_text(json.dumps(report, indent=1))
    return 0 if all(r.get("ok") is not False for r in report.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
