"""syncfs against rsync (daemon mode) and a raw `tar | socket` stream, over shaped links.

Needs root. It builds its own network: a bridge (10.78.0.0/24, never routed out), a client
namespace and 4 host namespaces, each plugged in by a veth pair with a TBF rate limit in both
directions, so every machine, the client included, has a link of the given rate. One agent runs
in each host namespace (a pool of 4), an rsync daemon and a tar receiver next to it; the
clients run in the client namespace. Everything is removed at the end.

Scenarios, each method taking its turn in one run:
  (a) cold sync of a real virtualenv with torch (this checkout's .venv) to 1, 2 and 4 hosts;
  (b) no-op resync of it to 4 hosts, and of a tree of exactly 10,000 small files;
  (c) resync after changing 4 KiB in the middle of a 1 GiB file (1 host).

    sudo .venv/bin/python benchmarks/sync.py [--rates 1gbit,4gbit] [--src .venv] [--hosts 1,2,4]

With --tls-cost, only what TLS costs: cold syncs of the tree to 1 and 4 hosts on a pool without
TLS and on one with it (the default of pools that span machines), side by side, at each rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
NET = "10.78.0"
BR = "mtxsbr0"
NS_CLIENT = "mtxs-client"
N_HOSTS = 4
RSYNC_PORT = 8730
TAR_PORT = 9730


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def ns_host(i: int) -> str:
    return f"mtxs-h{i}"


def ip_host(i: int) -> str:
    return f"{NET}.{20 + i}"


def setup_network(rate: str) -> None:
    teardown_network()
    sh("ip", "link", "add", BR, "type", "bridge")
    sh("ip", "addr", "add", f"{NET}.1/24", "dev", BR)
    sh("ip", "link", "set", BR, "up")
    nodes = [(NS_CLIENT, f"{NET}.10")] + [(ns_host(i), ip_host(i)) for i in range(N_HOSTS)]
    for k, (ns, addr) in enumerate(nodes):
        outer = f"mtxsv{k}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", outer, "master", BR, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        burst = "4mb"
        sh("tc", "qdisc", "add", "dev", outer, "root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst,
            "latency",
            "50ms",
        )


def teardown_network() -> None:
    for ns in [NS_CLIENT] + [ns_host(i) for i in range(N_HOSTS)]:
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", BR, check=False)


def in_client(*cmd: str, timeout: float = 3600, env: dict[str, str] = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", NS_CLIENT, *cmd], capture_output=True, text=True, timeout=timeout, env=env
    )


class Bench:
    def __init__(self, work: Path, src: Path, tls: bool = False):
        self.work, self.src, self.tls = work, src, tls
        self.home = work / "home"
        self.env = dict(
            os.environ,
            MONARCH_TORCHX_HOME=str(self.home),
            MONARCH_TORCHX_SYNC_STORE=str(work / "stores"),
            PYTHONPATH=str(ROOT),
        )
        self.procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------ servers in the host namespaces

    def start(self) -> None:
        self.start_agents()
        for i in range(N_HOSTS):
            d = self.work / "rsync" / f"h{i}"
            d.mkdir(parents=True)
            conf = self.work / f"rsyncd{i}.conf"
            conf.write_text(f"use chroot = no\nuid = root\ngid = root\n[bench]\npath = {d}\nread only = no\n")
            self.procs.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns_host(i),
                        "rsync",
                        "--daemon",
                        "--no-detach",
                        f"--config={conf}",
                        f"--port={RSYNC_PORT}",
                        f"--address={ip_host(i)}",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )

    def start_agents(self) -> None:
        """A pool of 4 agents, one per host namespace (fresh: empty chunk stores)."""
        from monarch_torchx.agent import agent_argv
        from monarch_torchx.pool import wait_for_hosts
        from monarch_torchx.registry import Registry

        os.environ["MONARCH_TORCHX_HOME"] = str(self.home)
        reg = Registry(self.home)
        rec = reg.new_record(
            "syncbench", "monarch_local", {"hosts": N_HOSTS, "preload": "", "tls": self.tls}, {"idle_timeout": 0}
        )
        reg.save(rec)
        pids = {}
        for i in range(N_HOSTS):
            argv = agent_argv(rec, i, ip_host(i))
            p = subprocess.Popen(
                ["ip", "netns", "exec", ns_host(i), *argv],
                env=self.env,
                stdout=open(self.work / f"agent{i}.log", "ab"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            pids[str(i)] = p.pid
        rec.allocation["pids"] = pids
        reg.save(rec)
        wait_for_hosts(rec, list(range(N_HOSTS)), {}, 60)

    def stop_agents(self) -> None:
        from monarch_torchx.pool import stop_pool

        try:
            stop_pool("syncbench")  # agents unmount and delete their stores
        except Exception as e:  # noqa: BLE001
            print(f"stop_pool: {e}", file=sys.stderr)

    def stop(self) -> None:
        self.stop_agents()
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wipe(self) -> None:
        """Cold hosts: new agents (empty chunk stores), empty rsync and tar destinations, no
        client hash cache, no page cache."""
        self.stop_agents()
        self.start_agents()
        for d in (self.work / "rsync").glob("h*"):
            shutil.rmtree(d)
            d.mkdir()
        for d in (self.work / "tar").glob("h*"):
            shutil.rmtree(d)
        shutil.rmtree(self.home / "syncfs-cache", ignore_errors=True)
        sh("sync")
        sh("sh", "-c", "echo 1 > /proc/sys/vm/drop_caches", check=False)

    # ------------------------------------------------------------ the three methods

    def ours(self, src: Path, n: int, target: str = "bench") -> dict[str, float]:
        hosts = ",".join(str(i) for i in range(n))
        t = time.perf_counter()
        res = in_client(
            str(ROOT / ".venv/bin/monarch-torchx"),
            "sync",
            str(src),
            "--pool",
            "syncbench",
            "--to",
            target,
            "--hosts",
            hosts,
            "--json",
            env=self.env,
        )
        dt = time.perf_counter() - t
        if res.returncode != 0:
            raise SystemExit(f"sync failed: {res.stdout[-2000:]} {res.stderr[-2000:]}")
        rep = json.loads(res.stdout)
        return {"s": dt, "sent": rep["bytes_sent"]}

    def rsync(self, src: Path, n: int) -> dict[str, float]:
        t = time.perf_counter()
        procs = [
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    NS_CLIENT,
                    "rsync",
                    "-aH",
                    "--delete",
                    "--stats",
                    f"{src}/",
                    f"rsync://{ip_host(i)}:{RSYNC_PORT}/bench/",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(n)
        ]
        sent = 0
        for p in procs:
            out, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise SystemExit(f"rsync failed: {err[-2000:]}")
            for line in out.splitlines():
                if line.startswith("Total bytes sent:"):
                    sent += int(line.split(":")[1].replace(",", "").split()[0])
        return {"s": time.perf_counter() - t, "sent": sent}

    def tar(self, src: Path, n: int) -> dict[str, float]:
        receivers = []
        for i in range(n):
            d = self.work / "tar" / f"h{i}"
            d.mkdir(parents=True, exist_ok=True)
            code = (
                f"import socket,subprocess\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                f"s.bind(('{ip_host(i)}',{TAR_PORT}));s.listen(1);c,_=s.accept()\n"
                f"p=subprocess.Popen(['tar','-x','-C','{d}'],stdin=c.fileno());p.wait()"
            )
            receivers.append(subprocess.Popen(["ip", "netns", "exec", ns_host(i), sys.executable, "-c", code]))
        time.sleep(0.5)
        t = time.perf_counter()
        send = (
            "import socket,subprocess,sys\nfor _ in range(50):\n    try:\n"
            "        c=socket.create_connection((sys.argv[1],int(sys.argv[2])));break\n"
            "    except OSError:\n        import time;time.sleep(0.1)\n"
            "p=subprocess.Popen(['tar','-c','-C',sys.argv[3],'.'],stdout=c.fileno());p.wait();c.close()"
        )
        senders = [
            subprocess.Popen(
                ["ip", "netns", "exec", NS_CLIENT, sys.executable, "-c", send, ip_host(i), str(TAR_PORT), str(src)]
            )
            for i in range(n)
        ]
        for p in senders + receivers:
            p.wait(timeout=3600)
        size = int(sh("du", "-sb", str(src)).stdout.split()[0])
        return {"s": time.perf_counter() - t, "sent": size * n}


def rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for u, m in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * m
    raise SystemExit(f"rate {rate!r}: use e.g. 1gbit")


def tls_cost(args: argparse.Namespace) -> None:
    """Cold syncs with TLS off and on, in one run: what encryption costs on each link rate."""
    from _results import record

    work = Path(tempfile.mkdtemp(prefix="mtx-syncbench-tls-"))
    src = Path(args.src).resolve()
    size = int(sh("du", "-sb", str(src)).stdout.split()[0])
    hosts = [int(x) for x in args.hosts.split(",")]
    lines = [
        f"Tree: `{src.name}` ({size / 1e9:.2f} GB). Cold syncs (fresh agents, empty stores), TLS off and on.",
        "",
        "| link | hosts | TLS | seconds | rate vs link |",
        "|---|---:|---|---:|---:|",
    ]
    notes = []
    try:
        for rate in args.rates.split(","):
            setup_network(rate)
            link = rate_bytes(rate)
            t: dict[tuple, float] = {}
            for tls in (False, True):
                b = Bench(work / f"{rate}-{tls}", src, tls=tls)
                (work / f"{rate}-{tls}").mkdir()
                b.start_agents()
                for n in hosts:
                    b.wipe()
                    t[(n, tls)] = b.ours(src, n, target=f"cold{n}")["s"]
                    print(f"{rate} {n} host(s) tls={tls}: {t[(n, tls)]:.2f} s", file=sys.stderr)
                b.stop()
            for n in hosts:
                for tls in (False, True):
                    lines.append(
                        f"| {rate} | {n} | {'on' if tls else 'off'} | {t[(n, tls)]:.2f} | "
                        f"{size / t[(n, tls)] / link * 100:.0f}% |"
                    )
            notes.append(
                f"- {rate}: with TLS, 1 host at **{size / t[(1, True)] / link * 100:.0f}%** of the link "
                f"(target >= 90% at 1 Gbit/s); TLS takes {t[(1, True)] / t[(1, False)]:.2f}x the time to 1 host, "
                f"{t[(hosts[-1], True)] / t[(hosts[-1], False)]:.2f}x to {hosts[-1]}"
            )
    finally:
        teardown_network()
        shutil.rmtree(work, ignore_errors=True)
    body = "\n".join(lines + [""] + notes)
    print(body)
    record(
        "sync-tls",
        f"sudo .venv/bin/python benchmarks/sync.py --tls-cost --rates {args.rates} --hosts {args.hosts}",
        body,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1gbit,4gbit")
    ap.add_argument("--src", default=str(ROOT / ".venv"), help="the tree of scenarios (a) and (b)")
    ap.add_argument("--hosts", default="1,2,4")
    ap.add_argument("--tls-cost", action="store_true", help="only cold syncs with TLS off and on (see above)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, tc)")
    if args.tls_cost:
        tls_cost(args)
        return
    from _results import record

    work = Path(tempfile.mkdtemp(prefix="mtx-syncbench-"))
    src = Path(args.src).resolve()
    size = int(sh("du", "-sb", str(src)).stdout.split()[0])
    files = int(sh("sh", "-c", f"find {src} | wc -l").stdout)
    big = work / "bigsrc"
    big.mkdir()
    with open(big / "weights.bin", "wb") as f:
        for _ in range(1024):
            f.write(os.urandom(1 << 20))
    tenk = work / "tenk"  # the no-op target is stated for 10k files
    for d in range(100):
        (tenk / f"pkg{d:02d}").mkdir(parents=True)
        for k in range(100):
            (tenk / f"pkg{d:02d}" / f"mod{k:02d}.py").write_bytes(os.urandom(1024 + 37 * k))
    lines = [
        f"Tree (a), (b): `{src.name}` ({size / 1e9:.2f} GB, {files} paths; a virtualenv with torch). "
        f"Tree (c): one 1 GiB file. Every machine's link is shaped by TBF, both ways.",
        "",
    ]
    try:
        for rate in args.rates.split(","):
            setup_network(rate)
            b = Bench(work / rate, src)
            (work / rate).mkdir()
            b.start()
            link = rate_bytes(rate)
            rows = []
            one = {}
            for n in [int(x) for x in args.hosts.split(",")]:
                for name, fn in (
                    ("syncfs", lambda s_, n_: b.ours(s_, n_, target=f"cold{n_}")),  # noqa: B023
                    ("rsync", b.rsync),
                    ("tar over socket", b.tar),
                ):
                    b.wipe()
                    r = fn(src, n)
                    one.setdefault(name, r["s"]) if n == 1 else None
                    rows.append((n, name, r["s"], r["sent"]))
                    print(f"{rate} cold {n} host(s) {name}: {r['s']:.2f} s", file=sys.stderr)
            noop = {}
            b.ours(src, N_HOSTS, target="noop")
            noop["syncfs"] = b.ours(src, N_HOSTS, target="noop")["s"]
            b.rsync(src, N_HOSTS)
            noop["rsync"] = b.rsync(src, N_HOSTS)["s"]
            b.wipe()
            b.ours(tenk, N_HOSTS, target="tenk")
            noop["syncfs 10k"] = b.ours(tenk, N_HOSTS, target="tenk")["s"]
            b.rsync(tenk, N_HOSTS)
            noop["rsync 10k"] = b.rsync(tenk, N_HOSTS)["s"]
            b.wipe()
            b.ours(big, 1, target="big")
            b.rsync(big, 1)
            with open(big / "weights.bin", "r+b") as f:
                f.seek(512 << 20)
                f.write(os.urandom(4096))
            edit = {"syncfs": b.ours(big, 1, target="big"), "rsync": b.rsync(big, 1), "tar over socket": b.tar(big, 1)}
            b.stop()
            lines += [
                f"### {rate} links",
                "",
                "| hosts | method | seconds | bytes sent by the client | rate vs link (1 host) |",
                "|---:|---|---:|---:|---:|",
            ]
            for n, name, s, sent in rows:
                eff = f"{size / s / link * 100:.0f}%" if n == 1 else ""
                lines.append(f"| {n} | {name} | {s:.2f} | {sent / 1e9:.2f} GB | {eff} |")
            t = {(n, name): s for n, name, s, _ in rows}
            nmax = max(n for n, _, _, _ in rows)
            lines += [
                "",
                f"- syncfs to {nmax} hosts takes **{t[(nmax, 'syncfs')] / t[(1, 'syncfs')]:.2f}x** its 1-host time "
                f"(target <= 1.25x); **{t[(nmax, 'rsync')] / t[(nmax, 'syncfs')]:.1f}x** faster than rsync and "
                f"**{t[(nmax, 'tar over socket')] / t[(nmax, 'syncfs')]:.1f}x** faster than tar to {nmax} hosts "
                "(target >= 3x vs rsync)",
                f"- 1 host: syncfs moves the tree at **{size / t[(1, 'syncfs')] / link * 100:.0f}%** of the link rate "
                "(target >= 90%; includes chunking and hashing the tree, commit on the host)",
                f"- no-op resync to {N_HOSTS} hosts: syncfs **{noop['syncfs']:.2f} s**, rsync {noop['rsync']:.2f} s "
                f"({files} paths); of 10,000 files: syncfs **{noop['syncfs 10k']:.2f} s**, rsync "
                f"{noop['rsync 10k']:.2f} s (target < 0.5 s; both include process start)",
                "- 4 KiB changed in a 1 GiB file: syncfs sent "
                f"**{edit['syncfs']['sent'] / (1 << 30) * 100:.2f}%** of the "
                f"file in {edit['syncfs']['s']:.2f} s (target < 1%); "
                f"rsync {edit['rsync']['sent'] / (1 << 30) * 100:.2f}% in "
                f"{edit['rsync']['s']:.2f} s; tar 100% in {edit['tar over socket']['s']:.2f} s",
                "",
            ]
            print("\n".join(lines[-12:]), file=sys.stderr)
    finally:
        teardown_network()
        shutil.rmtree(work, ignore_errors=True)
    body = "\n".join(lines)
    print(body)
    record("sync", f"sudo .venv/bin/python benchmarks/sync.py --rates {args.rates} --hosts {args.hosts}", body)


if __name__ == "__main__":
    main()
