"""Shared writes in a TorchX workspace (issue 38): what any rank writes to its cwd is seen by every
rank of the run and by the next run, as on a shared file system.

The shape is pytorch/examples' DDP tutorial (``distributed/ddp-tutorial-series/multinode.py``):
global rank 0 alone saves ``snapshot.pt`` in the cwd, and on start every rank loads it if it is
there. With a working directory per host, only host 0 had the snapshot, the ranks resumed from
different epochs, and the resume hung. ``TUTORIAL`` fails fast instead: the ranks compare their
starting epoch before training.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from .conftest import torchx

pytestmark = pytest.mark.integration

TUTORIAL = """
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

total, save_every, snapshot_path = int(sys.argv[1]), int(sys.argv[2]), "snapshot.pt"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, epochs_run = torch.nn.Linear(4, 1), 0
if os.path.exists(snapshot_path):  # the tutorial's _load_snapshot, on every rank
    snapshot = torch.load(snapshot_path, weights_only=True)
    model.load_state_dict(snapshot["MODEL_STATE"])
    epochs_run = snapshot["EPOCHS_RUN"]
    print(f"rank {rank} resuming from snapshot at epoch {epochs_run}", flush=True)
starts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
dist.all_gather(starts, torch.tensor([epochs_run]))
assert len({int(s) for s in starts}) == 1, f"rank {rank}: the ranks start at epochs {[int(s) for s in starts]}"
# every rank writes a file of its own in the cwd, and sees the others' (two hosts, different files)
with open(f"rank{rank}.txt", "w") as f:
    f.write(str(epochs_run))
dist.barrier()
assert all(os.path.exists(f"rank{r}.txt") for r in range(world)), (rank, os.getcwd(), sorted(os.listdir(".")))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for epoch in range(epochs_run, total):
    opt.zero_grad()
    ddp(torch.ones(8, 4)).sum().backward()
    opt.step()
    print(f"rank {rank} epoch {epoch}", flush=True)
    if rank == 0 and epoch % save_every == 0:  # the tutorial's _save_snapshot: global rank 0 alone
        torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": epoch}, snapshot_path)
print(f"rank {rank} done in {os.getcwd()}", flush=True)
dist.destroy_process_group()
"""


def write_tutorial(tmp_path: Path) -> Path:
    ws = tmp_path / "proj"
    ws.mkdir()
    (ws / "tutorial.py").write_text(TUTORIAL)
    return ws


def run_tutorial_twice(run) -> list[str]:
    """Runs the tutorial to epoch 3 and then to 5 with ``run(total_epochs)`` (which returns its
    output); asserts the second run resumed, on every rank, from the snapshot rank 0 saved."""
    first = run(3)
    assert "resuming" not in first and "SUCCEEDED" in first, first
    assert sorted(re.findall(r"rank (\d) epoch 2", first)) == ["0", "1"], first
    second = run(5)
    assert "SUCCEEDED" in second, second
    assert sorted(re.findall(r"rank (\d) resuming from snapshot at epoch 2", second)) == ["0", "1"], second
    assert sorted(re.findall(r"rank (\d) epoch 4", second)) == ["0", "1"] and "epoch 1" not in second, second
    return re.findall(r"rank \d done in (\S+)", second)


def test_the_ddp_tutorials_snapshot_by_rank_0_resumes_every_rank_on_monarch_local(home, pool_name, tmp_path):
    ws = write_tutorial(tmp_path)

    def run(epochs: int) -> str:
        res = torchx(
            home,
            "run",
            "--wait",
            "--log",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name},hosts=2,idle_timeout=120s,workspace_mount=tut",
            "dist.ddp",
            "-j",
            "2x1",
            "--script",
            "tutorial.py",
            "--",
            str(epochs),
            "1",
            cwd=ws,
            timeout=240,
        )
        return res.stdout + res.stderr

    cwds = run_tutorial_twice(run)
    shared = home / "workspaces" / pool_name / "tut" / "shared"
    assert cwds == [str(shared)] * 2  # one directory, whichever host the rank is on
    assert (shared / "snapshot.pt").is_file() and not (shared / "snapshot.pt").is_symlink()
    assert os.stat(shared).st_mode & 0o777 == 0o700 and os.stat(shared).st_uid == os.getuid()
    assert (shared / "tutorial.py").is_symlink()  # the code itself is read through the synced copy
    assert not (home / "workspaces" / pool_name / "tut" / "host0").exists()

    # a shared directory others can open is refused before anything starts, in one line
    os.chmod(shared, 0o755)
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},workspace_mount=tut",
        "dist.ddp",
        "-j",
        "2x1",
        "--script",
        "tutorial.py",
        "--",
        "5",
        "1",
        cwd=ws,
        check=False,
    )
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert (
        f"{shared} is open to other users (mode 755): chmod 700 it" in res.stderr
        and "nothing was started" in res.stderr
    )
