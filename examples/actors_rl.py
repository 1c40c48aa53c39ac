"""RL-style generator/trainer pair: generators roll out with the current policy and push
trajectories to the trainer through a port; the trainer learns and publishes new weights.

    .venv/bin/python examples/actors_rl.py [--pool NAME] [--generators 3] [--rounds 5]

Shows Channel/Port (actor -> actor messages), mesh references travelling in messages,
async endpoints, and versioned weight broadcast. The "environment" is a toy bandit.
"""

from __future__ import annotations

import argparse

import torch

from monarch_torchx import Actor, Channel, attach, current_rank, endpoint, this_host

ARMS = 4
BEST = 2  # the arm that pays


class Generator(Actor):
    def __init__(self) -> None:
        self.logits = torch.zeros(ARMS)
        self.version = 0
        self.gen = torch.Generator().manual_seed(current_rank().rank)

    @endpoint
    def set_weights(self, logits: torch.Tensor, version: int) -> None:
        self.logits, self.version = logits, version

    @endpoint
    def rollout(self, port, n: int) -> None:
        """Samples n actions with the current policy and sends (version, actions, rewards) to port."""
        probs = torch.softmax(self.logits, dim=0)
        actions = torch.multinomial(probs, n, replacement=True, generator=self.gen)
        rewards = (actions == BEST).float() + 0.1 * torch.randn(n, generator=self.gen)
        port.send((self.version, actions, rewards))


class Trainer(Actor):
    def __init__(self, lr: float) -> None:
        self.logits = torch.zeros(ARMS, requires_grad=True)
        self.opt = torch.optim.Adam([self.logits], lr=lr)
        self.version = 0

    @endpoint
    async def train_round(self, generators, batches: int, n: int) -> dict:
        """Opens an inbox, asks every generator for rollouts, learns from them, publishes weights."""
        port, inbox = Channel.open()
        for _ in range(batches):
            generators.rollout.broadcast(port, n)
        rewards = []
        for _ in range(batches * len(generators)):
            version, actions, r = await inbox.recv()
            logp = torch.log_softmax(self.logits, dim=0)[actions]
            loss = -((r - r.mean()) * logp).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            rewards.append(r.mean().item())
        self.version += 1
        await generators.set_weights.call(self.logits.detach().clone(), self.version)
        probs = torch.softmax(self.logits.detach(), dim=0)
        return {"version": self.version, "mean_reward": sum(rewards) / len(rewards), "p_best": probs[BEST].item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", help="a warm pool to run on (default: this_host())")
    ap.add_argument("--generators", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    hosts = attach(args.pool) if args.pool else this_host()
    gen_procs = hosts.spawn_procs(per_host={"procs": args.generators})
    first_host = hosts.slice(hosts=0) if "hosts" in hosts.sizes else hosts  # (this_host() has no dims)
    trainer_procs = first_host.spawn_procs(per_host={"procs": 1})
    generators = gen_procs.spawn("generators", Generator)
    trainer = trainer_procs.spawn("trainer", Trainer, lr=0.1)
    for _ in range(args.rounds):
        stats = trainer.slice(procs=0).train_round.call_one(generators, batches=4, n=64).get()
        print(f"policy v{stats['version']}: mean reward {stats['mean_reward']:.3f}, P(best arm) {stats['p_best']:.2f}")
    gen_procs.stop().get()
    trainer_procs.stop().get()


if __name__ == "__main__":
    main()
