"""``torchx log --tail`` of N replicas as one stream through the relay tree, not N streams.

The client splits the hosts into ``FANOUT`` groups and streams ``app_logs_follow`` from each
group's first member. That agent follows its own replicas' logs, splits the rest of its group the
same way, streams from each subgroup's first member, and passes every event up as it comes: the
client holds a few connections whatever N is, and each agent passes on what its subtree prints.

Events are ``LogEvent``s: lines of one replica, that replica's end, a host's end (all of its
replicas ended), or a host that could not be followed (not reached, or lost with the relay that
led it), named with why. A group's first member that cannot be reached is passed over: the next
member leads the rest. A relay that dies mid-stream takes its subtree's stream with it (its lines
so far were printed; a follow started again would print them twice): the hosts of that subtree
that had not ended are reported as lost through it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

from .. import net
from ..errors import MonarchError
from ..net import aio
from ..net.fanout import DIAL_TIMEOUT_S, PATIENT_DIAL_S, Target, split

if TYPE_CHECKING:
    from .server import Agent

OP = "app_logs_follow"
QUEUE_EVENTS = 1024  # events an agent holds for a slow reader before its sources wait
BATCH_EVENTS = 256  # events sent up in one frame
# a refusal every member of the group would give too: an agent older than the client, bad arguments
GROUP_REFUSALS = frozenset({net.UnknownOperation.__name__, "ValueError", "TypeError"})


@dataclass
class LogEvent:
    """One thing a followed subtree reports (on the wire: its dict)."""

    host: int
    role: str = ""
    replica_id: int = -1
    lines: list[str] = field(default_factory=list)
    replica_ended: bool = False  # this replica's output is complete
    host_ended: bool = False  # every followed replica of this host has ended
    error: str = ""  # this host (or, with a role, this replica) is not followed: why
    kind: str = ""  # the error's type name (UnknownOperation: an agent older than the client)

    @staticmethod
    def from_wire(d: dict[str, Any]) -> LogEvent:
        """From its dict; fields a newer agent added are left out."""
        return LogEvent(**{k: v for k, v in d.items() if k in LogEvent.__dataclass_fields__})

    def raised(self, *types: type[BaseException]) -> bool:
        """Whether ``error`` came from one of ``types`` (``kind`` is its wire form: the type's name)."""
        return self.kind in {t.__name__ for t in types}


def check_filters(streams: str, regex: str | None) -> None:
    """Raises ValueError, naming the bad one, before anything is followed."""
    import re

    from .procs import STREAMS

    if streams != "combined" and streams not in STREAMS:
        raise ValueError(f"unknown stream {streams!r}: use stdout, stderr or combined")
    if regex:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"bad --regex {regex!r}: {e}") from None


def follow_group(
    targets: Sequence[Target],
    creds: Any,
    args: dict[str, Any],
    fanout: int,
    emit: Callable[[dict[str, Any]], None],
    stop: threading.Event,
    opened: Callable[[net.Client], None],
    sock_for: Any = None,
) -> None:
    """Blocking: follows one group through its first reachable member, passing each event (a
    dict) to ``emit``, until every host of the group ended or could not be followed; every host
    of the group ends with a ``host_ended`` or an ``error`` event. ``opened`` gets each client,
    so that another thread can ``abort()`` it once ``stop`` is set. A leader too slow to finish
    its handshake in the dial time (busy, or hung) is asked again alone, patiently, on a thread
    of its own, while the next member leads the rest; this returns once both have ended."""
    retries: list[threading.Thread] = []
    try:
        _follow_group(targets, creds, args, fanout, emit, stop, opened, sock_for, retries)
    finally:
        for t in retries:
            t.join()


def _follow_group(
    targets: Sequence[Target],
    creds: Any,
    args: dict[str, Any],
    fanout: int,
    emit: Callable[[dict[str, Any]], None],
    stop: threading.Event,
    opened: Callable[[net.Client], None],
    sock_for: Any,
    retries: list[threading.Thread],
) -> None:
    for pos, head in enumerate(targets):
        group = list(targets[pos:])
        if stop.is_set():
            return
        dial = DIAL_TIMEOUT_S if len(group) > 1 else PATIENT_DIAL_S
        try:
            sock = sock_for(head, dial) if sock_for else None
            c = net.Client(head.host, head.port, creds, timeout=dial, identity=head.identity.encode(), sock=sock)
        except (net.WireError, OSError, MonarchError) as e:  # (MonarchError: a tunnel that did not open)
            if isinstance(e, net.PeerTimeout) and len(group) > 1:
                retry = threading.Thread(
                    target=follow_group,
                    args=([head], creds, args, fanout, emit, stop, opened, sock_for),
                    name="log-follow",
                    daemon=True,
                )
                retry.start()
                retries.append(retry)
            else:
                emit(asdict(LogEvent(head.index, error=f"not reached: {e}", kind=type(e).__name__)))
            continue  # the next member leads the rest
        opened(c)
        ended: set = set()
        streamed = False  # once a line came, following the group again would print it twice
        why = ""
        try:
            with c:
                if stop.is_set():
                    return
                c.settimeout(None)  # a follow lasts as long as the replicas
                for batch in c.stream(OP, targets=[t.as_dict() for t in group], fanout=fanout, **args):
                    streamed = True
                    for ev in batch:
                        if ev.get("host_ended") or (ev.get("error") and not ev.get("role")):
                            ended.add(ev.get("host"))
                        emit(ev)
        except net.RemoteError as e:  # it refused the follow, or failed while following
            if not streamed:
                emit(asdict(LogEvent(head.index, error=str(e), kind=e.kind or type(e).__name__)))
                if e.kind in GROUP_REFUSALS:  # the others would refuse it alike: said for each, asked of none
                    for t in group[1:]:
                        emit(asdict(LogEvent(t.index, error=str(e), kind=e.kind)))
                    return
                continue  # (e.g. it is shutting down): the next member leads the rest
            why = f"the follow failed on host {head.index} ({e})"
        except (net.WireError, OSError) as e:
            if stop.is_set():
                return
            why = f"lost through host {head.index} ({e})"
        for t in group:  # (after a normal end too: a host that never said it ended is not complete)
            if t.index not in ended and not stop.is_set():
                emit(
                    asdict(
                        LogEvent(
                            t.index, error=why or f"its follow through host {head.index} ended early", kind="PeerClosed"
                        )
                    )
                )
        return


class LogFollow:
    """The agent's ``app_logs_follow`` op (see the module's docstring)."""

    def __init__(self, agent: Agent):
        self.agent = agent

    async def op_app_logs_follow(
        self,
        peer: aio.Peer,
        targets: list[dict],
        fanout: int,
        app_id: str,
        role: str | None = None,
        replica_ids: list[int] | None = None,
        streams: str = "combined",
        since: float | None = None,
        until: float | None = None,
        regex: str | None = None,
    ) -> aio.Stream:
        """Follows the logs of ``app_id``'s replicas (of ``role``, of ``replica_ids``) on this
        host and, through the tree, on every other host of ``targets``; streams LogEvents in
        batches until all of them ended."""
        tree = [Target(**t) for t in targets]
        if not tree or tree[0].index != self.agent.index:
            raise ValueError("a followed group's first target must be the agent it is sent to")
        check_filters(streams, regex)
        fanout = max(2, min(int(fanout), 64))
        args = {
            "app_id": app_id,
            "role": role,
            "replica_ids": replica_ids,
            "streams": streams,
            "since": since,
            "until": until,
            "regex": regex,
        }
        wanted = None if replica_ids is None else {int(i) for i in replica_ids}
        reps = [r for r in self.agent.procs.select(app_id, role) if wanted is None or r.spec.replica_id in wanted]
        groups = split(tree[1:], fanout)
        self.agent.relay.relayed += len(groups)
        return aio.Stream(self._events(reps, groups, args, fanout))

    async def _events(
        self, reps: list[Any], groups: list[list[Target]], args: dict[str, Any], fanout: int
    ) -> AsyncIterator[list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        # one bounded queue for every source: a subtree's thread waits on it (never twice for one
        # event), this host's own replicas poll it; `ready` wakes the loop below
        items: queue.Queue[dict[str, Any]] = queue.Queue(QUEUE_EVENTS)
        ready = asyncio.Event()
        stop = threading.Event()
        clients: list[net.Client] = []
        lock = threading.Lock()

        def opened(c: net.Client) -> None:
            with lock:
                clients.append(c)
            if stop.is_set():
                c.abort()

        def emit(ev: dict[str, Any]) -> None:  # from a subtree's thread
            while not stop.is_set():
                try:
                    items.put(ev, timeout=0.5)
                except queue.Full:
                    continue
                try:
                    loop.call_soon_threadsafe(ready.set)
                except RuntimeError:  # the loop has closed: the agent is stopping
                    pass
                return

        async def put(ev: dict[str, Any]) -> None:  # from this host's own replicas
            while True:
                try:
                    items.put_nowait(ev)
                    ready.set()
                    return
                except queue.Full:
                    await asyncio.sleep(0.01)

        local = asyncio.ensure_future(self._local(reps, args, put))
        sources: list[asyncio.Future[Any]] = [local]
        for g in groups:
            done: asyncio.Future[None] = loop.create_future()
            sources.append(done)
            threading.Thread(
                target=_run_group,
                name="log-follow",
                daemon=True,
                args=(loop, done, g, self.agent.creds, args, fanout, emit, stop, opened),
            ).start()
        pending = set(sources)
        waiter: asyncio.Future[Any] | None = None
        try:
            while True:
                batch: list[dict[str, Any]] = []
                while len(batch) < BATCH_EVENTS:
                    try:
                        batch.append(items.get_nowait())
                    except queue.Empty:
                        break
                if batch:
                    yield batch
                    continue
                if not pending:
                    return
                ready.clear()
                if not items.empty():
                    continue
                waiter = asyncio.ensure_future(ready.wait())
                finished, _ = await asyncio.wait(pending | {waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                pending -= finished
                if local in finished and not local.cancelled() and local.exception() is not None:
                    e = local.exception()
                    await put(
                        asdict(
                            LogEvent(
                                self.agent.index, error=f"following its replicas failed: {e}", kind=type(e).__name__
                            )
                        )
                    )
        finally:
            stop.set()
            if waiter is not None:
                waiter.cancel()
            for s in sources:
                s.cancel()
            with lock:
                for c in clients:
                    c.abort()

    async def _local(
        self, reps: list[Any], args: dict[str, Any], put: Callable[[dict[str, Any]], Awaitable[None]]
    ) -> None:
        index = self.agent.index
        if not reps:  # the client saw a replica here: this agent was restarted or replaced since
            await put(
                asdict(
                    LogEvent(
                        index,
                        error=f"host {index} has no replica of app {args['app_id']} "
                        "(its agent was restarted since the launch?)",
                        kind="LookupError",
                    )
                )
            )
            return

        async def one(rep: Any) -> None:
            role, k = rep.spec.role, rep.spec.replica_id
            try:
                async for lines in self.agent.procs.logs(
                    rep, args["streams"], args["since"], args["until"], args["regex"], follow=True
                ):
                    await put(asdict(LogEvent(index, role, k, lines)))
            except (OSError, ValueError) as e:  # its log is unreadable, or a bad filter: said once, per replica
                await put(asdict(LogEvent(index, role, k, error=f"logs of {role}/{k}: {e}", kind=type(e).__name__)))
            await put(asdict(LogEvent(index, role, k, replica_ended=True)))

        tasks = [asyncio.ensure_future(one(r)) for r in reps]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # one failed (or the follow ended): the others stop too
                t.cancel()
        await put(asdict(LogEvent(index, host_ended=True)))


def _run_group(loop: asyncio.AbstractEventLoop, done: asyncio.Future[None], *args: Any) -> None:
    def finish() -> None:
        if not done.done():
            done.set_result(None)

    try:
        follow_group(*args)
    finally:
        loop.call_soon_threadsafe(finish)
