"""Ping-pong: two actors in two procs hold references to each other and volley a ball.

    .venv/bin/python examples/actors_pingpong.py [--pool NAME] [--volleys 1000]

Without --pool it uses this_host() (the warm local pool ``local``, created on first use).
"""

from __future__ import annotations

import argparse
import time

from monarch_torchx import Actor, attach, current_rank, endpoint, this_host


class Player(Actor):
    def __init__(self) -> None:
        self.hits = 0

    @endpoint
    def hit(self, other, n: int) -> int:
        """Returns the ball n times to ``other`` (a mesh reference that travelled in the message)."""
        for _ in range(n):
            other.receive.call_one().get()
            self.hits += 1
        return self.hits

    @endpoint
    def receive(self) -> int:
        return current_rank().rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", help="a warm pool to run on (default: this_host())")
    ap.add_argument("--volleys", type=int, default=1000)
    args = ap.parse_args()
    hosts = attach(args.pool).slice(hosts=0) if args.pool else this_host()  # one host, no dims
    procs = hosts.spawn_procs(per_host={"procs": 2})
    players = procs.spawn("players", Player)
    ping = players.slice(procs=0)
    pong = players.slice(procs=1)
    t0 = time.perf_counter()
    hits = ping.hit.call_one(pong, args.volleys).get()
    dt = time.perf_counter() - t0
    print(f"{hits} volleys between two procs in {dt:.2f} s ({dt / hits * 1e6:.0f} us per actor-to-actor round trip)")
    procs.stop().get()


if __name__ == "__main__":
    main()
