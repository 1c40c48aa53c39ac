"""Multi-node DDP training that snapshots and resumes, in the style of pytorch/examples' DDP tutorial
(``distributed/ddp-tutorial-series/multinode.py``), on CPU with gloo and a random dataset.

    torchx run -s monarch_local -cfg pool=dev,workspace_mount=ws dist.ddp -j 2x2 --script ddp_snapshot.py -- 6 2

As in the tutorial, global rank 0 alone writes ``snapshot.pt`` to its working directory every
SAVE_EVERY epochs, and every rank resumes from it when it is there: with ``workspace_mount`` that
directory is the writable working directory over the synced code that all the pool's hosts share
(docs/syncfs.md), so the next run (after an edit, on the warm pool) resumes on every rank.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomData(Dataset):
    def __init__(self, size: int):
        g = torch.Generator().manual_seed(1234)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i]


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, save_every: int, snapshot_path: str):
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.data = data
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path, weights_only=True)
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
            print(f"[rank {self.rank}] resuming from snapshot at epoch {self.epochs_run}", flush=True)
        self.model = DDP(self.model)

    def _run_epoch(self, epoch: int) -> float:
        self.data.sampler.set_epoch(epoch)
        total = 0.0
        for x, y in self.data:
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
        return total

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"[rank {self.rank}] epoch {epoch} | snapshot saved at {os.path.abspath(self.snapshot_path)}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            print(f"[rank {self.rank}] epoch {epoch} | loss {loss:.4f}", flush=True)
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:  # global rank 0 alone, as the tutorial
                self._save_snapshot(epoch + 1)


def main(total_epochs: int, save_every: int, snapshot_path: str = "snapshot.pt") -> None:
    dist.init_process_group("gloo")
    data = RandomData(256)
    loader = DataLoader(data, batch_size=32, shuffle=False, sampler=DistributedSampler(data))
    torch.manual_seed(0)
    Trainer(torch.nn.Linear(20, 1), loader, save_every, snapshot_path).train(total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6, int(sys.argv[2]) if len(sys.argv) > 2 else 2)
