"""Agent module for Kubernetes pools: end an idle pool when no client is around to do it.

On SLURM an idle agent exits and the allocation ends with it. A pod that exits is restarted by
its StatefulSet, so on Kubernetes agents run with no idle exit of their own and agent 0 does
this instead: once it has been idle for the pool's ``idle_timeout``, it asks every peer (found
through the API, reached with the pool secret) how long it has been idle, and when all of them
have been idle that long it deletes the pool's owner object (dependents follow by owner
reference) or scales it to zero, as ``idle_action`` says.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

log = logging.getLogger("monarch_torchx.agent.k8s_idle")

CHECK_EVERY_S = float(os.environ.get("MONARCH_TORCHX_K8S_IDLE_CHECK_S", "5"))


class IdleWatch:
    """Agent 0's watch of a Kubernetes pool's idle time (``AgentModule``: one background task)."""

    def __init__(self, agent: Any, owner: str, limit: float, action: str):
        self.agent, self.owner, self.limit, self.action = agent, owner, limit, action

    def operations(self) -> dict[str, Any]:
        return {}

    def background_tasks(self) -> list[Any]:
        return [_watch(self.agent, self.owner, self.limit, self.action)]

    def stop(self) -> None:
        pass


def setup(agent: Any) -> None:
    owner = os.environ.get("MONARCH_TORCHX_K8S_OWNER", "")
    limit = float(os.environ.get("MONARCH_TORCHX_K8S_IDLE_TIMEOUT", "0") or 0)
    if not owner or limit <= 0 or agent.index != 0:
        return  # only agent 0 of a Kubernetes pool with an idle timeout acts
    agent.install(IdleWatch(agent, owner, limit, os.environ.get("MONARCH_TORCHX_K8S_IDLE_ACTION", "delete")))


async def _watch(agent: Any, owner: str, limit: float, action: str) -> None:
    loop = asyncio.get_running_loop()
    while not agent.stopping.is_set():
        await asyncio.sleep(min(CHECK_EVERY_S, max(limit / 4, 0.2)))
        if agent.idle_seconds() < limit:
            continue
        try:
            idle = await loop.run_in_executor(None, _pool_idle_seconds, agent)
            if idle is None or idle < limit or agent.idle_seconds() < limit:  # a run may have started meanwhile
                continue
            log.info(
                "pool idle for %.0f s: %s %s",
                idle,
                "scaling to zero" if action == "scale_to_zero" else "deleting",
                owner,
            )
            await loop.run_in_executor(None, _end_pool, owner, action)
            return
        except Exception as e:  # the API or a peer may be briefly unavailable: try again later
            log.warning("idle check failed: %s", e)


def _pool_idle_seconds(agent: Any) -> float | None:
    """The least idle time over the pool's ready pods; None when a ready peer does not answer
    (a network problem is not idleness: ask again next round)."""
    from .. import net
    from .k8s_api import KubeApi
    from .k8s_pods import pod_index, pod_ready

    namespace = os.environ["MONARCH_TORCHX_POD_NAMESPACE"]
    api = KubeApi()
    try:
        pods = api.call(
            "list",
            "pods",
            namespace,
            api.core.list_namespaced_pod,
            namespace,
            label_selector=os.environ["MONARCH_TORCHX_K8S_SELECTOR"],
        ).items
    finally:
        api.close()
    least = agent.idle_seconds()
    for pod in pods:
        i = pod_index(pod)
        if i is None or i == agent.index or not pod_ready(pod):
            continue
        try:
            with net.Client(
                pod.status.pod_ip,
                agent.addr.port,
                agent.creds,
                timeout=3.0,
                identity=f"{agent.pool}/{i}/{pod.metadata.uid}".encode(),
            ) as c:
                c.settimeout(5.0)
                least = min(least, float(c.call("info")["idle_s"]))
        except (net.WireError, net.RemoteError, OSError, KeyError, ValueError) as e:
            log.info("peer %s did not answer the idle check (%s): not ending the pool this round", pod.metadata.name, e)
            return None
    return least


def _end_pool(owner: str, action: str) -> None:
    """Deletes the owner object, or scales a StatefulSet to zero through its ``scale``
    subresource: the only rights the pool's Role grants (see ``k8s_manifests.agent_rbac``)."""
    from .k8s_api import KubeApi
    from .kubernetes import KubernetesProvisioner

    namespace = os.environ["MONARCH_TORCHX_POD_NAMESPACE"]
    kind = "MonarchMesh" if owner.startswith("monarch.pytorch.org/") else "StatefulSet"
    name = owner.rsplit("/", 1)[-1]
    api = KubeApi()
    try:
        if action == "scale_to_zero" and kind == "StatefulSet":
            api.call(
                "patch",
                "statefulsets.apps/scale",
                namespace,
                api.apps.patch_namespaced_stateful_set_scale,
                name,
                namespace,
                {"spec": {"replicas": 0}},
                _preload_content=False,
            )
        else:
            calls = KubernetesProvisioner()._owner_calls(api, kind)
            api.call("delete", calls["resource"], namespace, calls["delete"], namespace, name, ok=(404,))
    finally:
        api.close()
