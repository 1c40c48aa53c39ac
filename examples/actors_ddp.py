"""Data-parallel training with actors (torch CPU): one model replica per proc, gradients
averaged by the controller and applied everywhere, all on a warm pool.

    .venv/bin/python examples/actors_ddp.py [--pool NAME] [--procs 4] [--steps 30]

Each step: ``step.call()`` returns every replica's gradients (tensors travel out of band),
the controller averages them, ``apply.broadcast(avg)`` sends them back (fire and forget: each
replica applies them before its next step, because messages from one sender arrive in order).
"""

from __future__ import annotations

import argparse
import time

import torch

from monarch_torchx import Actor, attach, current_rank, endpoint, this_host


class Replica(Actor):
    def __init__(self, seed: int, lr: float) -> None:
        torch.manual_seed(seed)  # the same initial weights everywhere
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.lr = lr  # plain SGD by hand: torch.optim's first use imports torch._dynamo (~1.5 s per proc)
        g = torch.Generator().manual_seed(1000 + current_rank().rank)  # this replica's data shard
        self.x = torch.randn(256, 16, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    @endpoint
    def step(self) -> tuple:
        self.model.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        return loss.item(), [p.grad for p in self.model.parameters()]

    @endpoint
    def apply(self, grads: list) -> None:
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), grads):
                p -= self.lr * g

    @endpoint
    def checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.model.parameters()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", help="a warm pool to run on (default: this_host())")
    ap.add_argument("--procs", type=int, default=4, help="replicas per host")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    hosts = attach(args.pool) if args.pool else this_host()
    t0 = time.perf_counter()
    procs = hosts.spawn_procs(per_host={"procs": args.procs})
    replicas = procs.spawn("replicas", Replica, seed=0, lr=0.05)
    print(f"{len(replicas)} replicas on {procs.extent} ready in {time.perf_counter() - t0:.2f} s")
    for step in range(args.steps):
        answers = list(replicas.step.call().get().values())
        losses = [a[0] for a in answers]
        avg = [torch.stack(gs).mean(dim=0) for gs in zip(*(a[1] for a in answers))]
        replicas.apply.broadcast(avg)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  mean loss {sum(losses) / len(losses):.4f}")
    sums = set(round(v, 6) for v in replicas.checksum.call().get().values())
    print("replicas in sync:", len(sums) == 1)
    procs.stop().get()


if __name__ == "__main__":
    main()
