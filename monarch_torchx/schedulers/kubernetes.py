"""``monarch_kubernetes``: a warm pool of pods, one agent each, kept by Kubernetes.

A pool is one owner object: a ``MonarchMesh`` where the cluster has that CRD
(meta-pytorch/monarch-kubernetes; its operator makes the StatefulSet), else a StatefulSet
(Parallel pod management) and a headless Service. The pool secret and the agents' service
account hang off the owner by owner reference, so deleting the owner deletes the pool. Kueue
admits the owner through its ``kueue.x-k8s.io/queue-name`` label. Pods share no file system with
the client, so the client writes the pool's host files itself from pod status: pod IP, the
agent port, and the pod UID, which is also the agent's handshake incarnation.
"""

from __future__ import annotations

import configparser
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

from ..agent import declared_capacity
from ..errors import MonarchError
from ..pool import parse_duration
from ..registry import HostAddr, PoolRecord, Registry
from ..submission import Submission, redact_secrets
from . import k8s_manifests as mf
from .base import MonarchScheduler
from .k8s_api import KubeApi, Tunnel, open_portforward
from .k8s_pods import gated, pod_index, pod_problem, pod_ready

SPEC_OPTS = (
    "namespace",
    "image",
    "cpu",
    "memMB",
    "gpu",
    "queue",
    "priority_class",
    "service_account",
    "node_selector",
    "tolerations",
    "pod_template",
    "port",
)
PLAIN_OPTS = ("access", "idle_action", "context", "start_timeout", "image_repo")
# events that say why a pod went away (with every Warning)
LOSS_EVENTS = ("Preempted", "Killing", "Evicted", "TaintManagerEviction", "NodeNotReady", "OOMKilling")
RELEASE_WAIT_S = 60.0
# a MonarchMesh refused as malformed (400: unknown fields under Strict; 422: schema) most likely
# meets an operator of another line, whose CRD has another shape
_OPERATOR_HINTS = {
    status: f"this client writes the MonarchMesh of monarch-operator {mf.MESH_OPERATOR}.x, the "
    "line for Monarch >= 0.5; upgrade the cluster's operator (helm upgrade) to that line"
    for status in (400, 422)
}


# ---------------------------------------------------------------- run options


def _config_defaults() -> dict[str, str]:
    """Values of a ``[kubernetes]`` section of .torchxconfig, so TorchX users' configs carry over."""
    out: dict[str, str] = {}
    try:
        from torchx.runner.config import find_configs

        files = find_configs()
    except Exception:
        return out
    for path in files:
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        if parser.has_section("kubernetes"):
            for k, v in parser.items("kubernetes"):
                out.setdefault(k, v)
    return out


def _items(value: str | None) -> list[str]:
    return [p.strip() for p in re.split(r"[,;]", value or "") if p.strip()]


def parse_node_selector(value: str | None) -> dict[str, str]:
    """``label:value,label2:value2``: TorchX's syntax for a dict run option."""
    out: dict[str, str] = {}
    for part in _items(value):
        k, sep, v = part.partition(":")
        if not sep or not k.strip():
            raise MonarchError(f"node_selector={value!r}: use label:value,label2:value2")
        out[k.strip()] = v.strip()
    return out


def parse_tolerations(value: str | None) -> list[dict[str, Any]]:
    """``key:value:Effect``, ``key::Effect`` (any value) or ``key``, comma-separated ('=' cannot
    appear inside a TorchX run option)."""
    out: list[dict[str, Any]] = []
    for part in _items(value):
        key, _, rest = part.partition(":")
        val, _, effect = rest.partition(":")
        if not key:
            raise MonarchError(f"tolerations={value!r}: use key:value:Effect,key::Effect")
        if effect and effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise MonarchError(
                f"tolerations={value!r}: effect {effect!r} is not NoSchedule, PreferNoSchedule or NoExecute"
            )
        t: dict[str, Any] = {"key": key, "operator": "Equal" if val else "Exists"}
        if val:
            t["value"] = val
        if effect:
            t["effect"] = effect
        out.append(t)
    return out


def load_pod_template(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    import yaml

    p = Path(path).expanduser()
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise MonarchError(f"pod_template={path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise MonarchError(f"pod_template={path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise MonarchError(f"pod_template={path!r} must hold a pod template (metadata/spec), not {type(data).__name__}")
    if data.get("kind") == "Pod" or "apiVersion" in data:
        data = {k: v for k, v in data.items() if k in ("metadata", "spec")}
    errs = mf.schema_errors(data, "V1PodTemplateSpec")
    if errs:
        raise MonarchError(f"pod_template={path!r}: {'; '.join(errs[:3])}")
    return data


def kube_spec(rec: PoolRecord) -> mf.KubePoolSpec:
    s, o = rec.spec, rec.options
    image = s.get("image") or (f"{o['image_repo'].rstrip('/')}/monarch-torchx:latest" if o.get("image_repo") else None)
    return mf.KubePoolSpec(
        pool=rec.name,
        replicas=rec.num_hosts,
        namespace=s.get("namespace") or "default",
        image=image or mf.KubePoolSpec.image,
        port=int(s.get("port") or mf.DEFAULT_PORT),
        cpu=s.get("cpu"),
        mem_mb=s.get("memMB"),
        gpu=s.get("gpu"),
        queue=s.get("queue"),
        priority_class=s.get("priority_class"),
        service_account=s.get("service_account"),
        node_selector=s.get("node_selector") or {},
        tolerations=s.get("tolerations") or [],
        pod_template=s.get("pod_template") or {},
        preload=s.get("preload") or "",
        idle_timeout=float(o.get("idle_timeout", 1800)),
        idle_action=o.get("idle_action", "delete"),
        log_max_mb=float(o.get("log_max_mb", mf.KubePoolSpec.log_max_mb)),
        log_host_max_mb=float(o.get("log_pool_max_mb", mf.POOL_MAX_MB)) / max(1, rec.num_hosts),
        kind=rec.allocation.get("kind", "StatefulSet"),
        declare=declared_capacity(s),
    )


# ---------------------------------------------------------------- pods


def access_mode(rec: PoolRecord) -> str:
    """pod_ip inside the cluster, port_forward outside it, unless the pool says which."""
    mode = rec.options.get("access", "auto")
    if mode == "auto":
        return "pod_ip" if os.environ.get("KUBERNETES_SERVICE_HOST") else "port_forward"
    return mode


class KubernetesProvisioner:
    """Creates, watches, repairs, resizes and releases a pool's Kubernetes objects.

    Holds one API client per kubeconfig context for its life (a ``Pool`` keeps one provisioner),
    so a health check of N hosts through port-forward reads the kubeconfig once, not N times.
    """

    scheduler = "monarch_kubernetes"
    hosts_option = "replicas"
    client_cwd_on_hosts = False  # replicas start in the client's cwd (else the agent's)
    fingerprint = ("hosts", *SPEC_OPTS, "preload", "tls")
    tls_default = True  # pods on other nodes: the network is shared

    def add_run_opts(self, opts: Any) -> None:
        d = _config_defaults()
        opts.add(
            "namespace",
            type_=str,
            default=d.get("namespace"),
            help="Kubernetes namespace of the pool (default: the existing pool's, else default)",
        )
        opts.add(
            "image",
            type_=str,
            default=d.get("image"),
            help=(
                "agent image: python, torch and monarch-torchx (see Dockerfile); "
                "default IMAGE_REPO/monarch-torchx:latest"
            ),
        )
        opts.add(
            "image_repo",
            type_=str,
            default=d.get("image_repo"),
            help="repository of the agent image when image is not given (TorchX's kubernetes option)",
        )
        # not from [kubernetes]: there TorchX's queue is a Volcano queue, here a Kueue LocalQueue
        opts.add(
            "queue",
            type_=str,
            default=None,
            help="Kueue LocalQueue: sets kueue.x-k8s.io/queue-name on the pool and its pods",
        )
        opts.add("priority_class", type_=str, default=d.get("priority_class"), help="PriorityClass of the pods")
        opts.add(
            "service_account",
            type_=str,
            default=d.get("service_account"),
            help="service account of the pods (default: one made for the pool, allowed to end it when idle)",
        )
        opts.add("cpu", type_=str, default=d.get("cpu"), help="CPUs per pod (request and limit), e.g. 8 or 0.5")
        opts.add("memMB", type_=int, default=int(d["memmb"]) if d.get("memmb") else None, help="memory per pod in MiB")
        opts.add("gpu", type_=int, default=int(d["gpu"]) if d.get("gpu") else None, help="nvidia.com/gpu per pod")
        opts.add(
            "node_selector",
            type_=str,
            default=d.get("node_selector"),
            help="node labels the pods need: pool:a100,zone:us-east-1a",
        )
        opts.add(
            "tolerations",
            type_=str,
            default=d.get("tolerations"),
            help="taints to tolerate, key:value:Effect or key::Effect (any value): gpu:true:NoSchedule,spot::NoExecute",
        )
        opts.add(
            "pod_template",
            type_=str,
            default=d.get("pod_template"),
            help="YAML file overlaid on the pod template (volumes, env, sidecars, affinity, ...)",
        )
        opts.add(
            "port",
            type_=int,
            default=int(d["port"]) if d.get("port") else None,
            help=f"agent port in each pod (default: the existing pool's, else {mf.DEFAULT_PORT})",
        )
        opts.add(
            "access",
            type_=str,
            default=d.get("access", "auto"),
            help="how clients reach agents: pod_ip (in the cluster, or a routed pod network), port_forward "
            "(through the API server), auto = pod_ip inside a cluster, else port_forward",
        )
        opts.add(
            "idle_action",
            type_=str,
            default=d.get("idle_action", "delete"),
            help="when the pool idles out: delete its objects, or scale_to_zero (the next run scales it back)",
        )
        opts.add("context", type_=str, default=d.get("context"), help="kubeconfig context (default: the current one)")
        opts.add(
            "start_timeout",
            type_=str,
            default=d.get("start_timeout", "10m"),
            help="give up when pods are not ready after this long, Kueue admission included (e.g. 5m)",
        )

    def pool_spec(self, cfg: dict[str, Any], spec: dict[str, Any], options: dict[str, Any]) -> None:
        for k in PLAIN_OPTS:
            if cfg.get(k) not in (None, ""):
                options[k] = cfg[k]
        options["start_timeout"] = parse_duration(options.get("start_timeout", "10m"), "start_timeout")
        if options.get("idle_action", "delete") not in ("delete", "scale_to_zero"):
            raise MonarchError(f"idle_action={options['idle_action']!r}: use delete or scale_to_zero")
        if options.get("access", "auto") not in ("auto", "pod_ip", "port_forward"):
            raise MonarchError(f"access={options['access']!r}: use pod_ip, port_forward or auto")
        spec["namespace"] = cfg.get("namespace") or None
        spec["image"] = cfg.get("image") or None
        for k in ("queue", "priority_class", "service_account"):
            spec[k] = cfg.get(k) or None
        cpu = cfg.get("cpu")
        if cpu not in (None, ""):
            try:
                spec["cpu"] = float(str(cpu).rstrip("m")) / (1000 if str(cpu).endswith("m") else 1)
            except ValueError:
                raise MonarchError(f"cpu={cpu!r} is not a number of CPUs (e.g. 8, 0.5 or 500m)") from None
        else:
            spec["cpu"] = None
        for k in ("memMB", "gpu"):
            v = cfg.get(k)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise MonarchError(f"{k}={v!r} must be a non-negative integer")
            spec[k] = v or None
        port = cfg.get("port")
        if port is not None and not (0 < int(port) < 65536):
            raise MonarchError(f"port={port!r} is not a TCP port")
        spec["port"] = port
        spec["node_selector"] = parse_node_selector(cfg.get("node_selector")) or None
        spec["tolerations"] = parse_tolerations(cfg.get("tolerations")) or None
        spec["pod_template"] = load_pod_template(cfg.get("pod_template")) or None

    def __init__(self) -> None:
        self._apis: dict[str | None, KubeApi] = {}

    # ------------------------------------------------------------ API and objects

    def _api(self, rec: PoolRecord) -> KubeApi:
        """The client for the pool's context; refuses when that context now points at another
        cluster than the one the pool was created on (it would look gone, and be recreated there)."""
        context = rec.options.get("context")
        api = self._apis.get(context)
        if api is None:
            api = self._apis[context] = KubeApi(context)
        made_on = rec.allocation.get("server")
        if made_on and api.server != made_on:
            raise MonarchError(
                f"pool {rec.name!r} lives on the API server {made_on}, but kubeconfig context "
                f"{api.context!r} points at {api.server}: switch back, or -cfg context=... "
            )
        return api

    @staticmethod
    def has_monarch_mesh(api: KubeApi) -> bool:
        """Whether the cluster serves the MonarchMesh CRD (discovery, which every user may read)."""
        res = api.call(
            "discover",
            f"{mf.MESH_GROUP}/{mf.MESH_VERSION}",
            None,
            api.custom.get_api_resources,
            mf.MESH_GROUP,
            mf.MESH_VERSION,
            ok=(404,),
        )
        return bool(res and any(r.name == mf.MESH_PLURAL for r in res.resources or []))

    def _owner_calls(self, api: KubeApi, kind: str) -> dict[str, Any]:
        """create/get/patch/delete of the owner object, whichever kind it is (as plain dicts)."""
        plain = api.api.sanitize_for_serialization
        if kind == mf.MESH_KIND:
            g, v, p = mf.MESH_GROUP, mf.MESH_VERSION, mf.MESH_PLURAL
            return {
                "resource": f"{p}.{g}",
                # Strict: a field the cluster's CRD does not know is refused, not pruned in silence
                "create": lambda ns, body, **kw: api.custom.create_namespaced_custom_object(
                    g, v, ns, p, body, field_validation="Strict", **kw
                ),
                "get": lambda ns, name, **kw: api.custom.get_namespaced_custom_object(g, v, ns, p, name, **kw),
                "patch": lambda ns, name, body, **kw: api.custom.patch_namespaced_custom_object(
                    g, v, ns, p, name, body, **kw
                ),
                "delete": lambda ns, name, **kw: api.custom.delete_namespaced_custom_object(
                    g, v, ns, p, name, propagation_policy="Foreground", **kw
                ),
            }
        return {
            "resource": "statefulsets.apps",
            "create": lambda ns, body, **kw: plain(
                api.apps.create_namespaced_stateful_set(ns, body, field_validation="Strict", **kw)
            ),
            "get": lambda ns, name, **kw: plain(api.apps.read_namespaced_stateful_set(name, ns, **kw)),
            "patch": lambda ns, name, body, **kw: api.apps.patch_namespaced_stateful_set(name, ns, body, **kw),
            "delete": lambda ns, name, **kw: api.apps.delete_namespaced_stateful_set(
                name, ns, propagation_policy="Foreground", **kw
            ),
        }

    @staticmethod
    def _dependent_calls(api: KubeApi, kind: str) -> dict[str, Any]:
        """resource name and create/read/patch/delete for the objects that hang off the owner."""
        core, rbac = api.core, api.rbac
        resource, client, suffix = {
            "Secret": ("secrets", core, "secret"),
            "Service": ("services", core, "service"),
            "ServiceAccount": ("serviceaccounts", core, "service_account"),
            "Role": ("roles.rbac.authorization.k8s.io", rbac, "role"),
            "RoleBinding": ("rolebindings.rbac.authorization.k8s.io", rbac, "role_binding"),
        }[kind]
        return {
            "resource": resource,
            **{verb: getattr(client, f"{verb}_namespaced_{suffix}") for verb in ("create", "read", "patch", "delete")},
        }

    @staticmethod
    def _manifests(rec: PoolRecord, spec: mf.KubePoolSpec) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The owner object and its dependents, checked against the official client's models."""
        owner_body = mf.monarch_mesh(spec) if spec.kind == mf.MESH_KIND else mf.statefulset(spec)
        deps = [mf.token_secret(spec, rec.token, rec.tls_pem)]
        if spec.kind != mf.MESH_KIND:  # the operator makes a mesh's Service
            deps.append(mf.headless_service(spec))
        if not spec.service_account:
            deps += mf.agent_rbac(spec)
        for body in [owner_body, *deps]:
            mf.check(body)
        return owner_body, deps

    def submission(self, rec: PoolRecord) -> Submission:
        """The objects ``create`` makes, in its order, with the owner references it patches in."""
        spec = kube_spec(rec)
        try:
            api = self._api(rec)
            spec.kind = mf.MESH_KIND if self.has_monarch_mesh(api) else "StatefulSet"
            notes = [f"on the API server {api.server} (kubeconfig context {api.context!r})"]
        except MonarchError as e:
            spec.kind = "StatefulSet"
            notes = [
                f"the cluster was not reached ({e}); shown as on a cluster without the MonarchMesh CRD "
                "(one that has it gets a MonarchMesh instead of the StatefulSet and Service)"
            ]
        owner_body, deps = self._manifests(rec, spec)
        owner = {**owner_body, "metadata": {**owner_body["metadata"], "uid": "<set by the API server>"}}
        ref = [mf.owner_reference(owner)]
        objects = [redact_secrets({**d, "metadata": {**d["metadata"], "ownerReferences": ref}}) for d in deps]
        return Submission(
            "kubernetes",
            objects=[*objects, owner_body],
            notes=notes + ["created in this order; the owner references are patched in once the owner exists"],
        )

    def create(self, rec: PoolRecord) -> None:
        """Dependents first (the secret and service account must exist before any pod), then the
        owner, then owner references on the dependents. Nothing is left behind on failure."""
        for i in range(rec.num_hosts):
            Registry.clear_host(rec, i)
        api = self._api(rec)
        rec.options["context"] = api.context  # this pool stays on this cluster
        spec = kube_spec(rec)
        spec.kind = mf.MESH_KIND if self.has_monarch_mesh(api) else "StatefulSet"
        if spec.kind == mf.MESH_KIND and spec.idle_action == "scale_to_zero":
            raise MonarchError(
                "idle_action=scale_to_zero: this cluster has the MonarchMesh CRD, whose replicas "
                "cannot be 0; use idle_action=delete"
            )
        ns = spec.namespace
        owner_body, deps = self._manifests(rec, spec)
        rec.allocation = {
            "kind": spec.kind,
            "name": spec.name,
            "namespace": ns,
            "server": api.server,
            "created": time.time(),
        }
        made: list[dict[str, Any]] = []
        try:
            for body in deps:
                self._create_dependent(api, rec, body)
                made.append(body)
            calls = self._owner_calls(api, spec.kind)
            owner = api.call(
                "create",
                calls["resource"],
                ns,
                calls["create"],
                ns,
                owner_body,
                ok=(409,),
                hints=_OPERATOR_HINTS if spec.kind == mf.MESH_KIND else None,
            )
            if owner is None:
                raise MonarchError(
                    f"a {spec.kind} named {spec.name!r} already exists in namespace {ns!r} (left from an earlier pool "
                    f"{rec.name!r}?): delete it (kubectl -n {ns} delete {calls['resource']} {spec.name}) or use "
                    "another pool name"
                )
            rec.allocation["uid"] = owner["metadata"]["uid"]
            ref = {"metadata": {"ownerReferences": [mf.owner_reference(owner)]}}
            for body in deps:
                c = self._dependent_calls(api, body["kind"])
                api.call("patch", c["resource"], ns, c["patch"], body["metadata"]["name"], ns, ref)
        except BaseException:
            for body in made:  # the owner (if any) is deleted by the caller's release
                c = self._dependent_calls(api, body["kind"])
                try:
                    api.call("delete", c["resource"], ns, c["delete"], body["metadata"]["name"], ns, ok=(404,))
                except MonarchError:
                    pass
            raise

    def _create_dependent(self, api: KubeApi, rec: PoolRecord, body: dict[str, Any]) -> None:
        """Creates one dependent; one left by an earlier pool of this name that is still being
        garbage-collected is waited for, anything else of that name is refused in one line."""
        ns, name = rec.allocation["namespace"], body["metadata"]["name"]
        c = self._dependent_calls(api, body["kind"])
        resource = c["resource"]
        deadline = time.time() + RELEASE_WAIT_S
        while api.call("create", resource, ns, c["create"], ns, body, ok=(409,)) is None:
            old = api.call("get", resource, ns, c["read"], name, ns, ok=(404,))
            ours = old is not None and (old.metadata.labels or {}).get(mf.POOL_LABEL) == mf.label_value(rec.name)
            if old is not None and (not ours or time.time() > deadline):
                raise MonarchError(
                    f"a {body['kind']} named {name!r} already exists in namespace {ns!r}: delete it "
                    f"(kubectl -n {ns} delete {resource} {name}) or use another pool name"
                )
            time.sleep(0.5)  # an earlier pool's object, on its way out

    def _owner(self, api: KubeApi, rec: PoolRecord) -> dict[str, Any] | None:
        a = rec.allocation
        if not a.get("name"):
            return None
        calls = self._owner_calls(api, a["kind"])
        obj = api.call("get", calls["resource"], a["namespace"], calls["get"], a["namespace"], a["name"], ok=(404,))
        if obj is not None and a.get("uid") and obj["metadata"].get("uid") != a["uid"]:
            return None  # same name, another pool's object
        return obj

    def _pods_owner_uid(self, api: KubeApi, rec: PoolRecord) -> str | None:
        """The UID the pool's pods name as their owner: ours, or the operator's StatefulSet's."""
        a = rec.allocation
        if a["kind"] != mf.MESH_KIND:
            return a.get("uid")
        sts = api.call(
            "get",
            "statefulsets.apps",
            a["namespace"],
            api.apps.read_namespaced_stateful_set,
            a["name"],
            a["namespace"],
            ok=(404,),
        )
        if sts is None or not any(r.uid == a.get("uid") for r in sts.metadata.owner_references or []):
            return None
        return sts.metadata.uid

    def _pods(self, api: KubeApi, rec: PoolRecord) -> dict[int, Any]:
        """The pool's pods by index: only those of this pool's owner (not a predecessor's, still
        being collected), the newest where a replacement overlaps its predecessor."""
        spec = kube_spec(rec)
        owner_uid = self._pods_owner_uid(api, rec)
        if owner_uid is None:
            return {}
        pods = api.call(
            "list", "pods", spec.namespace, api.core.list_namespaced_pod, spec.namespace, label_selector=spec.selector
        )
        out: dict[int, Any] = {}
        for pod in pods.items:
            i = pod_index(pod)
            if i is None or not any(r.uid == owner_uid for r in pod.metadata.owner_references or []):
                continue
            if i not in out or (pod.metadata.creation_timestamp or 0) >= (out[i].metadata.creation_timestamp or 0):
                out[i] = pod
        return out

    def _kueue_reason(self, api: KubeApi, rec: PoolRecord, pods: dict[int, Any]) -> str:
        """Kueue's own message for a pool it has not admitted (its Workload's conditions)."""
        ns = rec.allocation["namespace"]
        res = api.call(
            "list",
            "workloads.kueue.x-k8s.io",
            ns,
            api.custom.list_namespaced_custom_object,
            "kueue.x-k8s.io",
            "v1beta1",
            ns,
            "workloads",
            ok=(403, 404),
        )
        uids = {rec.allocation.get("uid")} | {p.metadata.uid for p in pods.values()}
        for wl in (res or {}).get("items", []):
            owners = {o.get("uid") for o in wl.get("metadata", {}).get("ownerReferences", [])}
            if not owners & uids:
                continue
            conds = {c.get("type"): c for c in wl.get("status", {}).get("conditions", [])}
            for t in ("Admitted", "QuotaReserved"):
                c = conds.get(t)
                if c and c.get("status") == "False" and c.get("message"):
                    return c["message"]
        return ""

    def _state(self, api: KubeApi, rec: PoolRecord) -> dict[str, Any]:
        owner = self._owner(api, rec)
        if owner is None:
            return {
                "state": "GONE",
                "reason": f"{rec.allocation.get('kind', 'owner object')} "
                f"{rec.allocation.get('namespace')}/{rec.allocation.get('name')} was deleted",
                "pods": {},
                "ready": [],
                "replicas": 0,
            }
        pods = self._pods(api, rec)
        want = owner["spec"].get("replicas", 0)
        ready = sorted(i for i, p in pods.items() if pod_ready(p) and i < want)
        if want == 0:
            return {
                "state": "SCALED_TO_ZERO",
                "reason": "scaled to zero (idle)",
                "owner": owner,
                "pods": pods,
                "ready": ready,
                "replicas": want,
            }
        problems = {i: pod_problem(p) for i, p in pods.items() if i not in ready and i < want}
        waiting = [i for i, p in pods.items() if gated(p)]
        suspended = bool(owner["spec"].get("suspend"))
        state = "RUNNING" if len(ready) == want else "PENDING"
        reason = ""
        if state == "PENDING" and (waiting or suspended or (rec.spec.get("queue") and not pods)):
            reason = "Kueue: " + (self._kueue_reason(api, rec, pods) or "not admitted yet")
        elif problems:
            reason = "; ".join(p for p, _ in problems.values())
        return {
            "state": state,
            "reason": reason,
            "owner": owner,
            "pods": pods,
            "ready": ready,
            "replicas": want,
            "problems": problems,
        }

    def _publish_ready(
        self, rec: PoolRecord, pods: dict[int, Any], indices: list[int], old: dict[int, str]
    ) -> list[int]:
        """Writes host files for ready pods that are new incarnations; returns the indices written."""
        port = int(rec.spec.get("port") or mf.DEFAULT_PORT)
        forward = access_mode(rec) == "port_forward"
        done = []
        for i in indices:
            pod = pods.get(i)
            if pod is None or not pod_ready(pod) or not pod.status.pod_ip or pod.metadata.uid == old.get(i):
                continue
            started = pod.status.start_time.timestamp() if pod.status.start_time else time.time()
            Registry.publish_host(
                Path(rec.state_dir),
                HostAddr(
                    index=i,
                    host=pod.status.pod_ip,
                    port=port,
                    hostname=pod.metadata.name,
                    pid=0,
                    incarnation=pod.metadata.uid,
                    started=started,
                    heartbeat=time.time(),
                    last_work=time.time(),
                    via=f"k8s-portforward:{pod.metadata.namespace}/{pod.metadata.name}" if forward else "",
                ),
            )
            done.append(i)
        return done

    # ------------------------------------------------------------ the Provisioner protocol

    def wait_ready(
        self, rec: PoolRecord, indices: list[int], old: dict[int, str], timeout: float, progress: Callable[[str], None]
    ) -> None:
        deadline = time.time() + timeout
        pending = set(indices)
        said = ""
        api = self._api(rec)
        while True:
            st = self._state(api, rec)
            if st["state"] == "GONE":
                raise MonarchError(f"pool {rec.name!r} did not start: {st['reason']}")
            pending -= set(self._publish_ready(rec, st["pods"], sorted(pending), old))
            if not pending:
                return
            for i, (problem, fatal) in st.get("problems", {}).items():
                if fatal and i in pending:
                    raise MonarchError(f"pool {rec.name!r} did not start: {problem}")
            line = (
                f"{rec.allocation['kind']} {rec.allocation['namespace']}/{rec.allocation['name']}: "
                f"{len(st['ready'])}/{st['replicas']} ready" + (f" ({st['reason']})" if st["reason"] else "")
            )
            if line != said:
                progress(line)
                said = line
            if time.time() > deadline:
                why = f" ({st['reason']})" if st["reason"] else ""
                raise MonarchError(
                    f"pool {rec.name!r}: {len(pending)} pod(s) not ready after {timeout:.0f} s{why} "
                    "(raise start_timeout to wait longer)"
                )
            time.sleep(0.2)

    def repair(self, rec: PoolRecord, indices: list[int]) -> list[int]:
        """Lost pods are deleted so the StatefulSet brings them back; a pool that idled out
        (deleted or scaled to zero) comes back whole."""
        api = self._api(rec)
        st = self._state(api, rec)
        if st["state"] == "GONE":
            self.create(rec)
            return list(range(rec.num_hosts))
        a = rec.allocation
        calls = self._owner_calls(api, a["kind"])
        if st["replicas"] != rec.num_hosts:
            api.call(
                "patch",
                calls["resource"],
                a["namespace"],
                calls["patch"],
                a["namespace"],
                a["name"],
                {"spec": {"replicas": rec.num_hosts}},
            )
            if st["replicas"] == 0:
                return list(range(rec.num_hosts))
        for i in indices:
            Registry.clear_host(rec, i)
            pod = st["pods"].get(i)
            if pod is not None and not pod.metadata.deletion_timestamp:
                api.call(
                    "delete",
                    "pods",
                    a["namespace"],
                    api.core.delete_namespaced_pod,
                    pod.metadata.name,
                    a["namespace"],
                    grace_period_seconds=5,
                    ok=(404,),
                )
        return indices

    def resize(self, rec: PoolRecord, replicas: int) -> tuple[list[int], dict[int, str]]:
        """Scales the owner object, leaving running pods alone; returns the new indices to wait
        for and the pod UIDs they must not be (a pod being deleted may still hold the name)."""
        api = self._api(rec)
        st = self._state(api, rec)
        if st["state"] == "GONE":
            raise MonarchError(f"pool {rec.name!r} has no objects any more ({st['reason']}): the next run recreates it")
        a = rec.allocation
        calls = self._owner_calls(api, a["kind"])
        api.call(
            "patch",
            calls["resource"],
            a["namespace"],
            calls["patch"],
            a["namespace"],
            a["name"],
            {"spec": {"replicas": replicas}},
        )
        old_n = rec.num_hosts
        rec.spec["hosts"] = replicas
        for i in range(replicas, old_n):
            Registry.clear_host(rec, i)
        grow = list(range(0 if st["replicas"] == 0 else old_n, replicas))  # scaled to zero: all come back
        return grow, {i: st["pods"][i].metadata.uid for i in grow if i in st["pods"]}

    def open_tunnel(self, rec: PoolRecord, addr: HostAddr, timeout: float) -> Tunnel:
        """A stream to one agent through the API server (``kubectl port-forward``, for clients
        outside the cluster); the pool handshake then runs over it as over TCP."""
        namespace, _, pod = addr.via.partition(":")[2].partition("/")
        return open_portforward(self._api(rec), namespace, pod, addr.port, timeout)

    def end_leftovers(self, rec: PoolRecord, lost: list[int]) -> list[str]:
        """Nothing to do: a pod's sync store and temp dirs are in its emptyDir, gone with the pod."""
        return []

    def release(self, rec: PoolRecord) -> None:
        """Deletes the owner in the foreground (dependents first) and waits, a bounded while, until
        it is gone, so that a pool created right after under the same name finds a clean slate."""
        a = rec.allocation
        if not a.get("name"):
            return
        api = self._api(rec)
        calls = self._owner_calls(api, a["kind"])
        if self._owner(api, rec) is None:
            return
        api.call("delete", calls["resource"], a["namespace"], calls["delete"], a["namespace"], a["name"], ok=(404,))
        deadline = time.time() + RELEASE_WAIT_S
        while time.time() < deadline and self._owner(api, rec) is not None:
            time.sleep(0.5)

    def loss_reason(self, rec: PoolRecord) -> str | None:
        """Why hosts are gone: the pool's objects deleted, or each lost pod's own story (its
        status while it lasts, then the events Kubernetes kept about it: Evicted, Preempted...)."""
        try:
            api = self._api(rec)
            st = self._state(api, rec)
            if st["state"] in ("GONE", "SCALED_TO_ZERO"):
                return f"pool objects {st['reason']}"
            lost = []
            for i, h in enumerate(Registry.hosts(rec)):
                if h is None:
                    continue
                pod = st["pods"].get(i)
                if pod is not None and pod.metadata.uid == h.incarnation and pod_ready(pod):
                    continue
                if pod is not None and pod.metadata.uid == h.incarnation:
                    lost.append(pod_problem(pod)[0])
                    continue
                why = self._events(api, rec, h.incarnation)
                lost.append(
                    f"pod {h.hostname} {why or 'was deleted'}"
                    + (
                        f" (replaced by a new pod: {pod_problem(pod)[0] if not pod_ready(pod) else 'ready'})"
                        if pod is not None
                        else ""
                    )
                )
            return "; ".join(lost) or None
        except MonarchError as e:
            return str(e)

    def _events(self, api: KubeApi, rec: PoolRecord, uid: str) -> str:
        ns = rec.allocation["namespace"]
        res = api.call(
            "list",
            "events",
            ns,
            api.core.list_namespaced_event,
            ns,
            field_selector=f"involvedObject.uid={uid}",
            ok=(403,),
        )
        told = [e for e in (res.items if res else []) if e.type == "Warning" or e.reason in LOSS_EVENTS]
        return "; ".join(f"{e.reason}: {e.message}" for e in told[-2:])

    def describe(self, rec: PoolRecord) -> dict[str, Any]:
        a = rec.allocation
        out: dict[str, Any] = {"kind": a.get("kind"), "object": f"{a.get('namespace')}/{a.get('name')}"}
        try:
            st = self._state(self._api(rec), rec)
        except MonarchError as e:
            return {**out, "state": "UNKNOWN", "reason": str(e)}
        return {
            **out,
            "state": st["state"],
            "reason": st["reason"],
            "ready": f"{len(st.get('ready', []))}/{st.get('replicas', 0)}",
            "queue": rec.spec.get("queue"),
        }


def create_scheduler(session_name: str, **kwargs: Any) -> MonarchScheduler:
    return MonarchScheduler(session_name, "monarch_kubernetes")
