"""Fan-out through the pool, the client's half (the agent's ``relay`` op is ``agent.relay.Relay``):
one request to a few agents, who pass it on along a tree.

A client that asks every host of a big pool (health, describe, kill, shutdown, launch) would
otherwise open one connection per host. With ``relay`` it sends ``FANOUT`` requests; each agent
that gets one runs the operation itself, splits the rest of its targets into ``FANOUT`` groups
and sends each group to its first member, and answers with every outcome of its subtree. A group
whose first member cannot be reached is led by the next one (that host's own outcome says why),
as is the rest of a group whose first member died while relaying an operation that may run twice
(``REPEATABLE``). A subtree that does not answer within the request's deadline is reported, host
by host, as not answered through the agent that led it: a dead or hung host costs its subtree a
bounded wait.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import MonarchError
from .blocking import Client
from .frames import ConnectFailed, PeerClosed, PeerTimeout, RemoteError, WireError

FANOUT = int(os.environ.get("MONARCH_TORCHX_TREE_FANOUT", "8"))  # requests each level sends on
LEVEL_MARGIN_S = 0.5  # each level answers this much before its parent's deadline
DIAL_TIMEOUT_S = 3.0  # a group's first member that does not complete a handshake in this is passed over
PATIENT_DIAL_S = 10.0  # ... and asked again alone, once the rest answered, with at most this long to connect
LOCAL_LAST = frozenset({"shutdown"})  # ops that end this agent: run after the subtrees were told
# ops a host may run twice without harm: when a relay dies holding one, the rest of its group is
# asked again through the next member, and a kept connection that closes under one is dialled
# afresh and the request sent again (others, e.g. launch, report the group as not answered)
REPEATABLE = frozenset(
    {
        "info",
        "describe",
        "list",
        "app_logs",
        "wait",
        "kill",
        "shutdown",
        "telemetry.partial",
        "telemetry.rows",
        "syncfs.missing",
        "syncfs.prepare",
    }
)


class RelayRefused(RemoteError):
    """This agent takes no relayed request (it is stopping): nothing of the request ran here, so
    the next member of the group may lead it. Its peers branch on this kind, not on the text."""


@dataclass(frozen=True)
class Target:
    """One host a relayed request is for, with what it takes to dial it."""

    index: int
    host: str
    port: int
    identity: str

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class Outcome:
    """What one host's operation gave: its value, or the error and its type's name."""

    ok: bool
    value: Any = None
    error: str = ""
    kind: str = ""  # the exception's class name (a wire error: the host was not reached)
    refused: bool = False  # a ConnectFailed whose connection was refused (nothing listens there)
    via: int | None = None  # the agent that reported it, when not the host itself
    merged_into: int | None = None  # for a combined op: its value is part of that host's value

    def as_dict(self) -> dict[str, Any]:
        """Its wire form, shallow: ``dataclasses.asdict`` would deep-copy the value (a host's
        whole answer) again at every level of the tree."""
        return dict(vars(self))


def tree_min_hosts() -> int:
    """From how many hosts on a client asks through the agents' relay tree rather than each host
    itself (``Pool.ask``, ``HostMesh.spawn_procs``): one decision, here."""
    return int(os.environ.get("MONARCH_TORCHX_TREE_MIN_HOSTS", "32"))


def split(targets: Sequence[Target], fanout: int) -> list[list[Target]]:
    """``targets`` in at most ``fanout`` contiguous groups of near-equal size."""
    n = len(targets)
    k = min(fanout, n)
    if k <= 0:
        return []
    size, extra = divmod(n, k)
    out, start = [], 0
    for g in range(k):
        end = start + size + (1 if g < extra else 0)
        out.append(list(targets[start:end]))
        start = end
    return out


def failure(e: BaseException, via: int | None = None) -> Outcome:
    return Outcome(
        False,
        error=str(e) or type(e).__name__,
        kind=getattr(e, "kind", "") or type(e).__name__,
        refused=isinstance(e, ConnectFailed) and e.refused,
        via=via,
    )


class ConnectionCache:
    """An agent's open connections to other agents, kept between relayed requests: a relay asked
    again and again (launches, a sync's steps, health checks, describes) does not pay a handshake
    each time. A kept connection is pinged before it carries a request, which tells what a fresh
    dial's handshake would have: the peer is there and answering (a hung one is passed over as
    a slow dial is), or it has closed this connection since or is stopping, and then it is dialled
    afresh, the request not sent yet. (A restarted agent is a new ``Target``: no kept connection
    is taken for it.) Only once a request was sent does its kind matter: one that may run twice
    (``REPEATABLE``) is sent again on a fresh connection if the kept one closed under it; any
    other is reported as not answered, as on a fresh connection that closed."""

    IDLE_S = 30.0
    PER_PEER = 4

    def __init__(self) -> None:
        import threading

        self._idle: dict[Target, list[tuple[float, Client]]] = {}
        self._lock = threading.Lock()

    def take(self, peer: Target) -> Client | None:
        now = time.monotonic()
        with self._lock:
            kept = self._idle.get(peer, [])
            while kept:
                since, c = kept.pop()
                if now - since < self.IDLE_S:
                    return c
                c.close()
        return None

    def give(self, peer: Target, c: Client) -> None:
        with self._lock:
            if len(self._idle) > 4 * FANOUT:  # peers that moved (a restarted agent is a new Target)
                now = time.monotonic()
                for gone in [p for p, kept in self._idle.items() if all(now - t >= self.IDLE_S for t, _ in kept)]:
                    for _, old in self._idle.pop(gone):
                        old.close()
            kept = self._idle.setdefault(peer, [])
            kept.append((time.monotonic(), c))
            while len(kept) > self.PER_PEER:
                kept.pop(0)[1].close()

    def close(self) -> None:
        with self._lock:
            for kept in self._idle.values():
                for _, c in kept:
                    c.close()
            self._idle.clear()


def call_group(
    targets: list[Target],
    creds: Any,
    op: str,
    args: dict | None,
    calls: dict[int, list] | None,
    fanout: int,
    timeout: float,
    sock_for: Any = None,
    cache: ConnectionCache | None = None,
) -> dict[int, dict]:
    """Blocking: sends one group to its first reachable member; returns its subtree's outcomes
    (as dicts). Used by agents and by the client alike. A member passed over because it did not
    finish its handshake in the dial time (busy, or hung) never got the request: once the rest
    has answered, it is asked once more, alone and patiently, with the time that is left."""
    deadline = time.monotonic() + timeout
    slow: list[Target] = []
    out = _lead_group(targets, creds, op, args, calls, fanout, deadline, sock_for, cache, slow)
    for head in slow:
        left = deadline - time.monotonic()
        if left > 0.5:
            out.update(_lead_group([head], creds, op, args, calls, fanout, deadline, sock_for, cache, []))
    return out


def _lead_group(
    targets: list[Target],
    creds: Any,
    op: str,
    args: dict | None,
    calls: dict[int, list] | None,
    fanout: int,
    deadline: float,
    sock_for: Any,
    cache: ConnectionCache | None,
    slow: list[Target],
) -> dict[int, dict]:
    """``call_group``'s one pass over the group; members passed over for a slow handshake are
    added to ``slow``."""
    out: dict[int, dict] = {}
    for pos, head in enumerate(targets):
        left = deadline - time.monotonic()
        if left <= 0:
            for t in targets[pos:]:
                out.setdefault(
                    t.index, Outcome(False, error="no time was left to reach it", kind="PeerTimeout").as_dict()
                )
            return out
        group = targets[pos:]
        # a hung first member leaves time for the next; a member alone in its group waits patiently
        dial = min(DIAL_TIMEOUT_S, left / 3) if len(group) > 1 else min(PATIENT_DIAL_S, left / 2)
        reused = cache.take(head) if cache is not None else None
        while True:
            if reused is not None:  # alive and answering? (a fresh dial's handshake would have told)
                c, tunnelled = reused, False
                try:
                    c.settimeout(dial)
                    c.call("ping")
                except RemoteError:  # it answered, and refused (stopping): nothing was sent yet
                    c.close()
                    reused = None
                    continue  # a fresh dial finds it gone, or tells why
                except (WireError, OSError) as e:
                    c.close()
                    reused = None
                    if _closed(e):  # it had closed this connection since (restarted?): dial it afresh
                        continue
                    out[head.index] = failure(e).as_dict()  # hung: the next member leads the rest
                    if isinstance(e, PeerTimeout) and len(group) > 1:
                        slow.append(head)
                    break
            else:
                try:
                    sock = sock_for(head, dial) if sock_for else None
                    c = Client(head.host, head.port, creds, timeout=dial, identity=head.identity.encode(), sock=sock)
                    tunnelled = sock is not None
                except (WireError, OSError, MonarchError) as e:  # (MonarchError: a tunnel that did not open)
                    out[head.index] = failure(e).as_dict()  # the next member leads the rest of the group
                    if isinstance(e, PeerTimeout) and len(group) > 1:
                        slow.append(head)
                    break
            try:
                c.settimeout(max(0.1, deadline - time.monotonic()))
                sub_calls = {t.index: calls[t.index] for t in group if t.index in calls} if calls else None
                reply = c.call(
                    "relay",
                    relayed=op,
                    targets=[t.as_dict() for t in group],
                    args=args,
                    calls=sub_calls,
                    fanout=fanout,
                    timeout=max(0.1, deadline - time.monotonic() - LEVEL_MARGIN_S),
                )
            except RemoteError as e:
                c.close()
                if isinstance(e, RelayRefused) or op in REPEATABLE:
                    # it refused the relay itself (stopping), or the rest may be asked again: the next member leads
                    out[head.index] = failure(e).as_dict()
                    break
                # it took the request and failed it as a whole (cancelled while stopping, say): part of
                # its subtree may have run it, so the rest is not asked again
                for t in group:
                    out.setdefault(
                        t.index,
                        Outcome(
                            False,
                            error=f"no answer through host {head.index} ({e})",
                            kind=e.kind or "RemoteError",
                            via=head.index,
                        ).as_dict(),
                    )
                return out
            except (WireError, OSError) as e:  # it took the request and did not answer: its subtree waited
                c.close()
                if reused is not None and op in REPEATABLE and _closed(e):  # closed under a kept one: once more, fresh
                    reused = None
                    continue
                if op in REPEATABLE and len(group) > 1 and _closed(e):
                    # it died mid-operation (a hung one times out instead): the rest is led by the next member
                    out[head.index] = Outcome(
                        False, kind="PeerClosed", error=f"closed the connection while relaying ({e})"
                    ).as_dict()
                    break
                for t in group:
                    out.setdefault(
                        t.index,
                        Outcome(
                            False,
                            kind=type(e).__name__,
                            via=head.index,
                            error=f"no answer through host {head.index} ({e})",
                        ).as_dict(),
                    )
                return out
            if cache is not None and not tunnelled:
                cache.give(head, c)
            else:
                c.close()
            out.update({int(i): o for i, o in reply.items()})
            return out
    return out


def _closed(e: BaseException) -> bool:
    """The peer's end went away (it died): not a timeout, whose wait has used the time up.
    (Every wire error is a ConnectionError; a raw one is a reset socket.)"""
    return isinstance(e, PeerClosed) or (isinstance(e, ConnectionError) and not isinstance(e, WireError))


def ask_tree(
    targets: list[Target],
    creds: Any,
    op: str,
    args: dict | None = None,
    calls: dict[int, list] | None = None,
    timeout: float = 10.0,
    sock_for: Any = None,
    fanout: int | None = None,
) -> dict[int, dict]:
    """Blocking, for a client: ``op`` on every target through the tree (the client sends one
    request per group, ``fanout`` groups); returns each target's outcome (as a dict) by index."""
    from concurrent.futures import ThreadPoolExecutor as Threads

    k = fanout or FANOUT
    groups = split(targets, k)
    out: dict[int, dict] = {}
    if groups:
        with Threads(max_workers=len(groups)) as ex:
            for part in ex.map(lambda g: call_group(g, creds, op, args, calls, k, timeout, sock_for), groups):
                out.update(part)
    return out
