"""The agent's ``relay`` op: runs a request here and passes it on to its subtree of the pool
(the tree, its groups and the client's half are ``net.fanout``)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..net import aio
from ..net.fanout import FANOUT, LOCAL_LAST, ConnectionCache, Outcome, RelayRefused, Target, call_group, failure, split
from ..net.frames import RemoteError, UnknownOperation

if TYPE_CHECKING:
    from .server import Agent


class Relay:
    """The agent's ``relay`` op (see the module's docstring)."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self._threads: ThreadPoolExecutor | None = None
        self.relayed = 0  # requests this agent passed on to a subtree (shown in its info)
        self.connections = ConnectionCache()

    def _pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=4 * FANOUT, thread_name_prefix="relay")
        return self._threads

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        self.connections.close()

    async def op_relay(
        self,
        peer: aio.Peer,
        relayed: str,
        targets: list[dict],
        args: dict | None = None,
        calls: dict[int, list] | None = None,
        fanout: int = FANOUT,
        timeout: float = 10.0,
    ) -> dict[int, dict]:
        """Runs operation ``relayed`` here (with ``args``, or each of ``calls[my index]`` in
        turn) and on every other target through the tree; returns each target's outcome by host
        index."""
        op = relayed
        if self.agent.stopping.is_set():
            raise RelayRefused(f"agent {self.agent.index} is shutting down ({self.agent.stop_reason})")
        if op == "relay":
            raise RemoteError(f"operation {op!r} cannot be relayed")
        tree = [Target(**t) for t in targets]
        if not tree or tree[0].index != self.agent.index:
            raise ValueError("a relayed request's first target must be the agent it is sent to")
        fanout = max(2, min(int(fanout), 64))
        loop = asyncio.get_running_loop()
        groups = split(tree[1:], fanout)
        self.relayed += len(groups)
        subtrees = [
            loop.run_in_executor(
                self._pool(), call_group, g, self.agent.creds, op, args, calls, fanout, timeout, None, self.connections
            )
            for g in groups
        ]
        out: dict[int, dict] = {}
        if op not in LOCAL_LAST:
            out[self.agent.index] = (await self._local(peer, op, args, (calls or {}).get(self.agent.index))).as_dict()
        for done in await asyncio.gather(*subtrees, return_exceptions=True):
            if isinstance(done, BaseException):  # (call_group reports every failure it knows of)
                continue
            out.update(done)
        for t in tree[1:]:
            out.setdefault(
                t.index,
                Outcome(
                    False, error=f"not reached through host {self.agent.index}", kind="PeerClosed", via=self.agent.index
                ).as_dict(),
            )
        if op in LOCAL_LAST:
            out[self.agent.index] = (await self._local(peer, op, args, (calls or {}).get(self.agent.index))).as_dict()
        combine = self.agent.combiners.get(op)
        if combine is not None:
            out = await loop.run_in_executor(self._pool(), combined, out, combine, args or {})
        return out

    async def _local(self, peer: aio.Peer, op: str, args: dict | None, calls: list | None) -> Outcome:
        handler = self.agent.handlers.get(op)
        if handler is None:  # (e.g. its module is not loaded here): the subtree is asked all the same
            return failure(UnknownOperation(op))
        self.agent.touch(op, work=calls is None or bool(calls))  # (no calls: a host only asked to answer)
        try:
            if calls is not None:
                values = []
                for one in calls:
                    values.append(await _run(handler, peer, one))
                return Outcome(True, values)
            return Outcome(True, await _run(handler, peer, args or {}))
        except TypeError as e:
            return Outcome(False, error=f"bad arguments for {op!r}: {e}", kind="TypeError")
        except Exception as e:  # the host's answer, as a direct call would carry it
            return failure(e)


def combined(out: dict[int, dict], combine: Any, args: dict) -> dict[int, dict]:
    """A subtree's outcomes with every answered value combined into one, carried by the lowest
    host that answered; the others say ``merged_into`` it. Failures stay as they are, so the
    answer still names every host it lacks. If combining fails, the values travel as they came
    (the client combines them): a bad merge loses nothing."""
    answered = sorted(i for i, o in out.items() if o["ok"] and o.get("merged_into") is None and o["value"] is not None)
    if len(answered) < 2:
        return out
    try:
        value = combine(args, [out[i]["value"] for i in answered])
    except Exception:  # noqa: BLE001 (the module's combiner: whatever it raises, the values survive)
        import logging

        logging.getLogger("monarch_torchx.agent").exception("combining %d answers failed", len(answered))
        return out
    carrier = answered[0]
    out = dict(out)
    out[carrier] = Outcome(True, value).as_dict()
    for i in answered[1:]:
        out[i] = Outcome(True, None, merged_into=carrier).as_dict()
    for i, o in out.items():  # those merged into a host of ours are in the carrier's value now
        if o["ok"] and o.get("merged_into") is not None and i not in answered:
            out[i] = Outcome(True, None, merged_into=carrier).as_dict()
    return out


async def _run(handler: Any, peer: aio.Peer, args: dict) -> Any:
    result = handler(peer, **args)
    if asyncio.iscoroutine(result):
        result = await result
    if isinstance(result, aio.Stream):
        raise RemoteError("a streaming operation cannot be relayed")
    return result
