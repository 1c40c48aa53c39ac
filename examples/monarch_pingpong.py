"""Monarch's ping-pong, written for Monarch's own runtime; only the job object is ours.

    python examples/monarch_pingpong.py --trust-local-users                  # a monarch_local pool of 2 hosts
    python examples/monarch_pingpong.py --trust-local-users --scheduler monarch_slurm --pool dev

``--trust-local-users``: nobody else can log into these machines. Monarch's runtime serves every
host and client on a local socket that nothing authenticates (docs/security.md); without it the
job is refused in one line.

Run it twice: the second run finds the job Monarch cached (.monarch/job_state.pkl) and attaches
to the warm workers; nothing is allocated or started again.
"""

import argparse
import os
import time

from monarch.actor import Actor, current_rank, endpoint

from monarch_torchx.monarch_backend import WarmPoolJob  # was: from monarch.job import SlurmJob


class PingPong(Actor):
    def __init__(self) -> None:
        self.name = "Ping" if current_rank().rank == 0 else "Pong"
        self.count = 0

    @endpoint
    def ping(self, message: str) -> str:
        self.count += 1
        return f"{self.name} (pid {os.getpid()}, host {os.uname().nodename}) got {message!r}: {self.count} pings"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", default="monarch_local")
    p.add_argument("--pool", default="monarch-pingpong")
    p.add_argument("--cfg", default="", help="run options for a new pool, e.g. partition=debug")
    p.add_argument("--kill", action="store_true", help="end the workers after the run (the pool stays warm)")
    p.add_argument(
        "--trust-local-users",
        action="store_true",
        help="nobody else can log into the client's or the pool's machines (required: docs/security.md)",
    )
    a = p.parse_args()
    cfg = dict(kv.split("=", 1) for kv in a.cfg.split(",") if kv)

    t0 = time.perf_counter()
    job = WarmPoolJob({"hosts": 2}, scheduler=a.scheduler, pool=a.pool, cfg=cfg, trust_local_users=a.trust_local_users)
    hosts = job.state().hosts
    procs = hosts.spawn_procs(per_host={"procs": 1})
    actors = procs.spawn("pingpong", PingPong)
    for line in actors.ping.call("hello").get().values():
        print(line)
    ping = actors.slice(hosts=0, procs=0)
    pong = actors.slice(hosts=1, procs=0)
    print(ping.ping.call_one("ball from the client").get())
    print(pong.ping.call_one("ball from the client").get())
    print(f"ready and answered in {time.perf_counter() - t0:.2f} s")
    procs.stop().get()  # the procs end; the workers stay warm for the next run
    if a.kill:
        job.kill()


if __name__ == "__main__":
    main()
