"""The main demo: a warm pool on ``monarch_local``, driven by the real torchx CLI.

    make demo        (or: .venv/bin/python examples/demo.py)

Creates pool "demo" with 2 hosts, runs utils.echo (cold: creates the pool), a torch script
(warm: no new hosts, torch already imported), a 2-host dist.ddp all-reduce, shows status, logs
and the pool, trains a small model with actors on the same pool, then stops the pool. Every
command is printed so you can type it yourself.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
POOL = os.environ.get("DEMO_POOL", "demo")
TRAIN = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: all_reduce sum = {t.item()}")
dist.destroy_process_group()
"""


def sh(*args: str, cwd: str | None = None) -> str:
    print(f"\n$ {' '.join(shlex.quote(a) for a in args)}", flush=True)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    t0 = time.time()
    res = subprocess.run([str(BIN / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True)
    out = res.stdout.strip()
    if out:
        print(out)
    if res.returncode != 0:
        print(res.stderr.strip(), file=sys.stderr)
        raise SystemExit(f"demo failed at: {' '.join(args)}")
    print(f"  ({time.time() - t0:.2f} s)")
    return out


def wait(handle: str, timeout: float = 180) -> str:
    from torchx.runner import get_runner

    with get_runner() as runner:
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = runner.status(handle)
            if st and st.is_terminal():
                return st.state.name
            time.sleep(0.1)
    raise SystemExit(f"{handle} did not finish within {timeout:.0f} s")


def main() -> None:
    work = tempfile.mkdtemp(prefix="monarch-demo-")
    Path(work, "train.py").write_text(TRAIN)
    print(
        f"monarch-torchx demo: pool {POOL!r} on monarch_local (registry: "
        f"{os.environ.get('MONARCH_TORCHX_HOME', '~/.monarch_torchx')})"
    )
    try:
        print("\n# 1. the first run creates the pool (2 local hosts) and returns as soon as the app is submitted")
        h = sh(
            "torchx",
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={POOL},hosts=2",
            "utils.echo",
            "--msg",
            "hello from a warm pool",
            cwd=work,
        ).splitlines()[-1]
        print(f"  -> {wait(h)}")
        sh("torchx", "log", h)

        print("\n# 2. the next run reuses the warm hosts; Python starts from a fork server with torch imported")
        h = sh(
            "torchx",
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={POOL}",
            "utils.python",
            "-c",
            "import sys, torch; print('torch was already imported:', 'torch' in sys.modules or 'no', "
            "torch.ones(3).sum())",
            cwd=work,
        ).splitlines()[-1]
        print(f"  -> {wait(h)}")
        sh("torchx", "log", h)

        print("\n# 3. torchrun across the pool's 2 hosts: a real gloo all_reduce")
        h = sh(
            "torchx",
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={POOL}",
            "dist.ddp",
            "-j",
            "2x1",
            "--rdzv_port",
            "29531",
            "--script",
            "train.py",
            cwd=work,
        ).splitlines()[-1]
        print(f"  -> {wait(h)}")
        sh("torchx", "log", "--regex", "all_reduce", h)

        print("\n# 4. from any shell, any time later")
        sh("torchx", "status", h)
        sh("torchx", "list", "-s", "monarch_local")
        sh("torchx", "pool", "status", POOL)

        print("\n# 5. the same warm pool from a Python controller: actors (Monarch's API), data-parallel training")
        sh("python", str(Path(__file__).with_name("actors_ddp.py")), "--pool", POOL, "--procs", "2", "--steps", "5")
    finally:
        print("\n# 6. release the pool")
        sh("torchx", "pool", "stop", POOL)
    print("\ndemo done")


if __name__ == "__main__":
    main()
