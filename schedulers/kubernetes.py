"""``monarch_kubernetes``: a warm pool of pods, one agent each, kept by Kubernetes.

A pool is one owner object: a ``MonarchMesh`` where the cluster has that CRD
(meta-pytorch/monarch-kubernetes), else a StatefulSet (Parallel pod management); a headless
Service, the pool secret and the agents' service account hang off it by owner reference, so
deleting the owner deletes the pool. Kueue admits the owner object through its
``kueue.x-k8s.io/queue-name`` label. Pods share no file system with the client, so the client
writes the pool's host files itself from pod status: pod IP, the fixed agent port, and the pod
UID, which is also the agent's handshake incarnation.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import AccessError, MonarchError
from ..pool import parse_duration
from ..registry import HostAddr, PoolRecord, Registry
from . import k8s_manifests as mf
from .base import MonarchScheduler

SPEC_OPTS = ("namespace", "image", "cpu", "memMB", "gpu", "queue", "priority_class", "service_account",
             "node_selector", "tolerations", "pod_template", "port")
PLAIN_OPTS = ("access", "idle_action", "context", "start_timeout", "image_repo")
# container states that will not get better by waiting: the pool fails at once, with the reason
FATAL_WAITING = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                 "CreateContainerConfigError", "CreateContainerError", "CrashLoopBackOff")
KUEUE_GATE = "kueue.x-k8s.io/admission"
API_TIMEOUT_S = 15


# ---------------------------------------------------------------- API access


class KubeApi:
    """The official client for one kubeconfig context (or the pod's own service account), with
    every failure turned into one line that says what to do."""

    def __init__(self, context: Optional[str] = None):
        try:
            from kubernetes import client, config
        except ImportError:
            raise MonarchError("monarch_kubernetes needs the kubernetes client: "
                               "pip install 'monarch-torchx[kubernetes]'") from None
        self.client = client
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG") and context is None:
                conf = client.Configuration()
                config.load_incluster_config(client_configuration=conf)
                self.api = client.ApiClient(conf)
            else:
                # the client reads $KUBECONFIG once, at import: read it now
                self.api = config.new_client_from_config(config_file=os.environ.get("KUBECONFIG") or None,
                                                         context=context)
        except config.ConfigException as e:
            where = os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise MonarchError(f"no usable Kubernetes configuration ({where}): {str(e).rstrip('.')}; "
                               "set KUBECONFIG or run `kubectl config use-context`") from None
        self.server = self.api.configuration.host
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)

    def call(self, verb: str, resource: str, namespace: Optional[str], fn: Callable[..., Any], *args: Any,
             ok: Tuple[int, ...] = (), **kwargs: Any) -> Any:
        """Runs one API call; statuses in ``ok`` come back as ``None`` instead of an error."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        kwargs.setdefault("_request_timeout", API_TIMEOUT_S)
        try:
            return fn(*args, **kwargs)
        except ApiException as e:
            if e.status in ok:
                return None
            raise MonarchError(api_error(e, verb, resource, namespace)) from None
        except (HTTPError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise MonarchError(f"the Kubernetes API server at {self.server} is unreachable ({reason}); "
                               "check KUBECONFIG, the cluster and your network") from None

    def close(self) -> None:
        self.api.close()


def api_error(e: Any, verb: str, resource: str, namespace: Optional[str]) -> str:
    try:
        message = json.loads(e.body).get("message", "") if e.body else ""
    except (ValueError, AttributeError):
        message = ""
    message = message or e.reason or f"HTTP {e.status}"
    where = f" in namespace {namespace!r}" if namespace else ""
    if e.status == 403:
        return (f"Kubernetes RBAC forbids {verb} {resource}{where}: {message} "
                f"(ask for the right to {verb} {resource}, or use another namespace)")
    if e.status == 401:
        return f"Kubernetes rejected your credentials ({message}): refresh your kubeconfig"
    return f"Kubernetes refused to {verb} {resource}{where}: {message}"


# ---------------------------------------------------------------- run options


def _config_defaults() -> Dict[str, str]:
    """Values of a ``[kubernetes]`` section of .torchxconfig, so TorchX users' configs carry over."""
    out: Dict[str, str] = {}
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


def _items(value: Optional[str]) -> List[str]:
    return [p.strip() for p in re.split(r"[,;]", value or "") if p.strip()]


def parse_node_selector(value: Optional[str]) -> Dict[str, str]:
    """``label:value,label2:value2``: TorchX's syntax for a dict run option."""
    out: Dict[str, str] = {}
    for part in _items(value):
        k, sep, v = part.partition(":")
        if not sep or not k.strip():
            raise MonarchError(f"node_selector={value!r}: use label:value,label2:value2")
        out[k.strip()] = v.strip()
    return out


def parse_tolerations(value: Optional[str]) -> List[Dict[str, Any]]:
    """``key:value:Effect``, ``key::Effect`` (any value) or ``key``, comma-separated ('=' cannot
    appear inside a TorchX run option)."""
    out: List[Dict[str, Any]] = []
    for part in _items(value):
        key, _, rest = part.partition(":")
        val, _, effect = rest.partition(":")
        if not key:
            raise MonarchError(f"tolerations={value!r}: use key:value:Effect,key::Effect")
        if effect and effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise MonarchError(f"tolerations={value!r}: effect {effect!r} is not NoSchedule, PreferNoSchedule or NoExecute")
        t: Dict[str, Any] = {"key": key, "operator": "Equal" if val else "Exists"}
        if val:
            t["value"] = val
        if effect:
            t["effect"] = effect
        out.append(t)
    return out


def load_pod_template(path: Optional[str]) -> Dict[str, Any]:
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
        pool=rec.name, replicas=rec.num_hosts, namespace=s.get("namespace") or "default",
        image=image or mf.KubePoolSpec.image, port=int(s.get("port") or mf.DEFAULT_PORT),
        cpu=s.get("cpu"), mem_mb=s.get("memMB"), gpu=s.get("gpu"), queue=s.get("queue"),
        priority_class=s.get("priority_class"), service_account=s.get("service_account"),
        node_selector=s.get("node_selector") or {}, tolerations=s.get("tolerations") or [],
        pod_template=s.get("pod_template") or {}, preload=s.get("preload") or "",
        idle_timeout=float(o.get("idle_timeout", 1800)), idle_action=o.get("idle_action", "delete"))


# ---------------------------------------------------------------- pods


def pod_index(pod: Any) -> Optional[int]:
    labels = pod.metadata.labels or {}
    raw = labels.get(mf.POD_INDEX_LABEL) or pod.metadata.name.rsplit("-", 1)[-1]
    return int(raw) if str(raw).isdigit() else None


def pod_ready(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp or pod.status is None or pod.status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def pod_problem(pod: Any) -> Tuple[str, bool]:
    """(what is wrong with a pod that is not ready, whether waiting cannot fix it)."""
    st = pod.status
    name = pod.metadata.name
    if st is None:
        return f"pod {name}: no status yet", False
    if st.phase == "Failed":
        return f"pod {name} {st.reason or 'failed'}: {st.message or 'no message'}", True
    for cs in st.container_statuses or []:
        w = cs.state.waiting if cs.state else None
        if w and w.reason in FATAL_WAITING:
            if w.reason == "CrashLoopBackOff":
                t = cs.last_state.terminated if cs.last_state else None
                detail = f"exit code {t.exit_code}{f' ({t.reason})' if t and t.reason else ''}" if t else w.message
                return f"pod {name}: agent keeps crashing: {detail}", True
            return f"pod {name}: {w.reason}: {w.message or 'no message'}", True
        t = cs.state.terminated if cs.state else None
        if t:
            return f"pod {name}: agent exited with code {t.exit_code}{f' ({t.reason})' if t.reason else ''}", False
        if w and w.reason:
            return f"pod {name}: {w.reason}", False
    if pod.spec and any(g.name == KUEUE_GATE for g in pod.spec.scheduling_gates or []):
        return f"pod {name}: waiting for Kueue admission", False
    for c in st.conditions or []:
        if c.type == "PodScheduled" and c.status == "False":
            return f"pod {name}: {c.reason or 'unschedulable'}: {c.message or ''}".rstrip(": "), False
    return f"pod {name}: {st.phase or 'Pending'}", False


@dataclass
class Tunnel:
    """A stream to one agent through the API server's port-forward (a socket-like object)."""

    sock: Any
    forward: Any
    port: int

    def error(self) -> str:
        err = self.forward.error(self.port)
        return f"port-forward: {err.strip()}" if err else ""


def tunnel_error(reason: str, namespace: str, pod: str) -> MonarchError:
    """One line from a failed port-forward handshake ("Handshake status 403 ... -+-+- {Status})."""
    m = re.search(r"Handshake status (\d+)", reason)
    status = int(m.group(1)) if m else 0
    try:
        message = json.loads(reason.rsplit("-+-+-", 1)[1]).get("message", "")
    except (IndexError, ValueError, AttributeError):
        message = ""
    if status in (401, 403):
        return AccessError(f"Kubernetes RBAC forbids create pods/portforward in namespace {namespace!r}: "
                           f"{message or reason} (ask for that right, or use access=pod_ip inside the cluster)")
    if status:
        return AccessError(f"the API server refused port-forward to pod {namespace}/{pod} (HTTP {status}"
                           f"{': ' + message if message else ''}); use access=pod_ip from inside the cluster")
    return AccessError(f"port-forward to pod {namespace}/{pod} failed: {reason}")


def access_mode(rec: PoolRecord) -> str:
    """pod_ip inside the cluster, port_forward outside it, unless the pool says which."""
    mode = rec.options.get("access", "auto")
    if mode == "auto":
        return "pod_ip" if os.environ.get("KUBERNETES_SERVICE_HOST") else "port_forward"
    return mode


class KubernetesProvisioner:
    scheduler = "monarch_kubernetes"
    hosts_option = "replicas"
    client_cwd_on_hosts = False  # replicas start in the client's cwd (else the agent's)
    fingerprint = ("hosts", *SPEC_OPTS, "preload")

    def add_run_opts(self, opts: Any) -> None:
        d = _config_defaults()
        opts.add("namespace", type_=str, default=d.get("namespace"),
                 help="Kubernetes namespace of the pool (default: the existing pool's, else default)")
        opts.add("image", type_=str, default=d.get("image"),
                 help="agent image: python, torch and monarch-torchx (see Dockerfile); default IMAGE_REPO/monarch-torchx:latest")
        opts.add("image_repo", type_=str, default=d.get("image_repo"),
                 help="repository of the agent image when image is not given (TorchX's kubernetes option)")
        opts.add("queue", type_=str, default=d.get("queue"),
                 help="Kueue LocalQueue: sets kueue.x-k8s.io/queue-name on the pool and its pods")
        opts.add("priority_class", type_=str, default=d.get("priority_class"), help="PriorityClass of the pods")
        opts.add("service_account", type_=str, default=d.get("service_account"),
                 help="service account of the pods (default: one made for the pool, allowed to end it when idle)")
        opts.add("cpu", type_=str, default=d.get("cpu"), help="CPUs per pod (request and limit), e.g. 8 or 0.5")
        opts.add("memMB", type_=int, default=int(d["memmb"]) if d.get("memmb") else None, help="memory per pod in MiB")
        opts.add("gpu", type_=int, default=int(d["gpu"]) if d.get("gpu") else None, help="nvidia.com/gpu per pod")
        opts.add("node_selector", type_=str, default=d.get("node_selector"),
                 help="node labels the pods need: pool:a100,zone:us-east-1a")
        opts.add("tolerations", type_=str, default=d.get("tolerations"),
                 help="taints to tolerate, key:value:Effect or key::Effect (any value): gpu:true:NoSchedule,spot::NoExecute")
        opts.add("pod_template", type_=str, default=d.get("pod_template"),
                 help="YAML file overlaid on the pod template (volumes, env, sidecars, affinity, ...)")
        opts.add("port", type_=int, default=int(d["port"]) if d.get("port") else None,
                 help=f"agent port in each pod (default: the existing pool's, else {mf.DEFAULT_PORT})")
        opts.add("access", type_=str, default=d.get("access", "auto"),
                 help="how clients reach agents: pod_ip (in the cluster, or a routed pod network), port_forward "
                      "(through the API server), auto = pod_ip inside a cluster, else port_forward")
        opts.add("idle_action", type_=str, default=d.get("idle_action", "delete"),
                 help="when the pool idles out: delete its objects, or scale_to_zero (the next run scales it back)")
        opts.add("context", type_=str, default=d.get("context"), help="kubeconfig context (default: the current one)")
        opts.add("start_timeout", type_=str, default=d.get("start_timeout", "10m"),
                 help="give up when pods are not ready after this long, Kueue admission included (e.g. 5m)")

    def pool_spec(self, cfg: Dict[str, Any], spec: Dict[str, Any], options: Dict[str, Any]) -> None:
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

    # ------------------------------------------------------------ objects

    def _api(self, rec: PoolRecord) -> KubeApi:
        return KubeApi(rec.options.get("context"))

    @staticmethod
    def has_monarch_mesh(api: KubeApi) -> bool:
        """Whether the cluster serves the MonarchMesh CRD (discovery, which every user may read)."""
        res = api.call("discover", f"{mf.MESH_GROUP}/{mf.MESH_VERSION}", None, api.custom.get_api_resources,
                       mf.MESH_GROUP, mf.MESH_VERSION, ok=(404,))
        return bool(res and any(r.name == mf.MESH_PLURAL for r in res.resources or []))

    def _owner_calls(self, api: KubeApi, kind: str) -> Dict[str, Any]:
        """create/get/patch/delete of the owner object, whichever kind it is (as plain dicts)."""
        plain = api.api.sanitize_for_serialization
        if kind == mf.MESH_KIND:
            g, v, p = mf.MESH_GROUP, mf.MESH_VERSION, mf.MESH_PLURAL
            return {
                "resource": f"{p}.{g}",
                "create": lambda ns, body, **kw: api.custom.create_namespaced_custom_object(g, v, ns, p, body, **kw),
                "get": lambda ns, name, **kw: api.custom.get_namespaced_custom_object(g, v, ns, p, name, **kw),
                "patch": lambda ns, name, body, **kw: api.custom.patch_namespaced_custom_object(g, v, ns, p, name, body, **kw),
                "delete": lambda ns, name, **kw: api.custom.delete_namespaced_custom_object(
                    g, v, ns, p, name, propagation_policy="Background", **kw),
            }
        return {
            "resource": "statefulsets.apps",
            "create": lambda ns, body, **kw: plain(api.apps.create_namespaced_stateful_set(ns, body, **kw)),
            "get": lambda ns, name, **kw: plain(api.apps.read_namespaced_stateful_set(name, ns, **kw)),
            "patch": lambda ns, name, body, **kw: api.apps.patch_namespaced_stateful_set(name, ns, body, **kw),
            "delete": lambda ns, name, **kw: api.apps.delete_namespaced_stateful_set(
                name, ns, propagation_policy="Background", **kw),
        }

    def create(self, rec: PoolRecord) -> None:
        for i in range(rec.num_hosts):
            Registry.clear_host(rec, i)
        spec = kube_spec(rec)
        api = self._api(rec)
        try:
            kind = mf.MESH_KIND if self.has_monarch_mesh(api) else "StatefulSet"
            owner_body = mf.monarch_mesh(spec) if kind == mf.MESH_KIND else mf.statefulset(spec)
            mf.check(owner_body)
            calls = self._owner_calls(api, kind)
            ns = spec.namespace
            owner = api.call("create", calls["resource"], ns, calls["create"], ns, owner_body, ok=(409,))
            if owner is None:
                raise MonarchError(
                    f"a {kind} named {spec.name!r} already exists in namespace {ns!r} (left from an earlier pool "
                    f"{rec.name!r}?): delete it (kubectl -n {ns} delete {calls['resource']} {spec.name}) or use another pool name")
            rec.allocation = {"kind": kind, "name": spec.name, "namespace": ns, "uid": owner["metadata"]["uid"],
                              "server": api.server, "created": time.time()}
            deps = [mf.token_secret(spec, owner, rec.token), mf.headless_service(spec, owner)]
            if not spec.service_account:
                resource = mf.MESH_PLURAL if kind == mf.MESH_KIND else "statefulsets"
                group = mf.MESH_GROUP if kind == mf.MESH_KIND else "apps"
                deps += mf.agent_rbac(spec, owner, resource, group)
            makers = {"Secret": (api.core.create_namespaced_secret, "secrets"),
                      "Service": (api.core.create_namespaced_service, "services"),
                      "ServiceAccount": (api.core.create_namespaced_service_account, "serviceaccounts"),
                      "Role": (api.rbac.create_namespaced_role, "roles.rbac.authorization.k8s.io"),
                      "RoleBinding": (api.rbac.create_namespaced_role_binding, "rolebindings.rbac.authorization.k8s.io")}
            for body in deps:
                mf.check(body)
                fn, resource = makers[body["kind"]]
                api.call("create", resource, ns, fn, ns, body)
        finally:
            api.close()

    def _pods(self, api: KubeApi, rec: PoolRecord) -> Dict[int, Any]:
        """The pool's live pods by index (the newest, where a replacement overlaps its predecessor)."""
        spec = kube_spec(rec)
        pods = api.call("list", "pods", spec.namespace, api.core.list_namespaced_pod, spec.namespace,
                        label_selector=spec.selector)
        out: Dict[int, Any] = {}
        for pod in pods.items:
            i = pod_index(pod)
            if i is None or (pod.metadata.labels or {}).get(mf.POOL_LABEL) != mf.label_value(rec.name):
                continue
            if i not in out or (pod.metadata.creation_timestamp or 0) >= (out[i].metadata.creation_timestamp or 0):
                out[i] = pod
        return out

    def _owner(self, api: KubeApi, rec: PoolRecord) -> Optional[Dict[str, Any]]:
        a = rec.allocation
        if not a.get("name"):
            return None
        calls = self._owner_calls(api, a["kind"])
        obj = api.call("get", calls["resource"], a["namespace"], calls["get"], a["namespace"], a["name"], ok=(404,))
        if obj is not None and a.get("uid") and obj["metadata"].get("uid") != a["uid"]:
            return None  # same name, another pool's object
        return obj

    def _kueue_reason(self, api: KubeApi, rec: PoolRecord, pods: Dict[int, Any]) -> str:
        """Kueue's own message for a pool it has not admitted (its Workload's conditions)."""
        ns = rec.allocation["namespace"]
        res = api.call("list", "workloads.kueue.x-k8s.io", ns, api.custom.list_namespaced_custom_object,
                       "kueue.x-k8s.io", "v1beta1", ns, "workloads", ok=(403, 404))
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

    def _state(self, api: KubeApi, rec: PoolRecord) -> Dict[str, Any]:
        owner = self._owner(api, rec)
        if owner is None:
            return {"state": "GONE", "reason": f"{rec.allocation.get('kind', 'owner object')} "
                                               f"{rec.allocation.get('namespace')}/{rec.allocation.get('name')} was deleted"}
        pods = self._pods(api, rec)
        want = owner["spec"].get("replicas", 0)
        ready = sorted(i for i, p in pods.items() if pod_ready(p) and i < want)
        if want == 0:
            return {"state": "SCALED_TO_ZERO", "reason": "scaled to zero (idle)", "owner": owner, "pods": pods,
                    "ready": ready, "replicas": want}
        problems = {i: pod_problem(p) for i, p in pods.items() if i not in ready and i < want}
        gated = [i for i, p in pods.items() if any(g.name == KUEUE_GATE for g in (p.spec.scheduling_gates or []))]
        suspended = bool(owner["spec"].get("suspend"))
        state = "RUNNING" if len(ready) == want else "PENDING"
        reason = ""
        if state == "PENDING" and (gated or suspended or (rec.spec.get("queue") and not pods)):
            reason = "Kueue: " + (self._kueue_reason(api, rec, pods) or "not admitted yet")
        elif problems:
            reason = "; ".join(p for p, _ in problems.values())
        return {"state": state, "reason": reason, "owner": owner, "pods": pods, "ready": ready,
                "replicas": want, "problems": problems}

    def _publish_ready(self, rec: PoolRecord, pods: Dict[int, Any], indices: List[int], old: Dict[int, str]) -> List[int]:
        """Writes host files for ready pods that are new incarnations; returns the indices written."""
        port = int(rec.spec.get("port") or mf.DEFAULT_PORT)
        forward = access_mode(rec) == "port_forward"
        done = []
        for i in indices:
            pod = pods.get(i)
            if pod is None or not pod_ready(pod) or not pod.status.pod_ip or pod.metadata.uid == old.get(i):
                continue
            started = pod.status.start_time.timestamp() if pod.status.start_time else time.time()
            Registry.publish_host(Path(rec.state_dir), HostAddr(
                index=i, host=pod.status.pod_ip, port=port, hostname=pod.metadata.name, pid=0,
                incarnation=pod.metadata.uid, started=started, heartbeat=time.time(), last_work=time.time(),
                via=f"k8s-portforward:{pod.metadata.namespace}/{pod.metadata.name}" if forward else ""))
            done.append(i)
        return done

    def wait_ready(self, rec: PoolRecord, indices: List[int], old: Dict[int, str], timeout: float,
                   progress: Callable[[str], None]) -> None:
        deadline = time.time() + timeout
        pending = set(indices)
        said = ""
        api = self._api(rec)
        try:
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
                line = f"{rec.allocation['kind']} {rec.allocation['namespace']}/{rec.allocation['name']}: " \
                       f"{len(st['ready'])}/{st['replicas']} ready" + (f" ({st['reason']})" if st["reason"] else "")
                if line != said:
                    progress(line)
                    said = line
                if time.time() > deadline:
                    why = f" ({st['reason']})" if st["reason"] else ""
                    raise MonarchError(f"pool {rec.name!r}: {len(pending)} pod(s) not ready after {timeout:.0f} s{why}; "
                                       "deleted the pool's objects (raise start_timeout to wait longer)")
                time.sleep(0.2)
        finally:
            api.close()

    def repair(self, rec: PoolRecord, indices: List[int]) -> List[int]:
        """Lost pods are deleted so the StatefulSet brings them back; a pool that idled out
        (deleted or scaled to zero) comes back whole."""
        api = self._api(rec)
        try:
            st = self._state(api, rec)
            if st["state"] == "GONE":
                self.create(rec)
                return list(range(rec.num_hosts))
            a = rec.allocation
            calls = self._owner_calls(api, a["kind"])
            if st["replicas"] != rec.num_hosts:
                body = {"spec": {"replicas": rec.num_hosts}}
                api.call("patch", calls["resource"], a["namespace"], calls["patch"], a["namespace"], a["name"], body)
                return list(range(rec.num_hosts)) if st["replicas"] == 0 else indices
            for i in indices:
                Registry.clear_host(rec, i)
                pod = st["pods"].get(i)
                if pod is not None and not pod.metadata.deletion_timestamp:
                    api.call("delete", "pods", a["namespace"], api.core.delete_namespaced_pod,
                             pod.metadata.name, a["namespace"], grace_period_seconds=5, ok=(404,))
            return indices
        finally:
            api.close()

    def resize(self, rec: PoolRecord, replicas: int) -> Tuple[List[int], Dict[int, str]]:
        """Scales the owner object, leaving running pods alone; returns the new indices to wait
        for and the pod UIDs they must not be (a pod being deleted may still hold the name)."""
        api = self._api(rec)
        try:
            st = self._state(api, rec)
            if st["state"] == "GONE":
                raise MonarchError(f"pool {rec.name!r} has no objects any more ({st['reason']}): the next run recreates it")
            a = rec.allocation
            calls = self._owner_calls(api, a["kind"])
            api.call("patch", calls["resource"], a["namespace"], calls["patch"], a["namespace"], a["name"],
                     {"spec": {"replicas": replicas}})
        finally:
            api.close()
        old_n = rec.num_hosts
        rec.spec["hosts"] = replicas
        for i in range(replicas, old_n):
            Registry.clear_host(rec, i)
        grow = list(range(0 if st["replicas"] == 0 else old_n, replicas))  # scaled to zero: all come back
        return grow, {i: st["pods"][i].metadata.uid for i in grow if i in st["pods"]}

    def open_tunnel(self, rec: PoolRecord, addr: HostAddr, timeout: float) -> Tunnel:
        """A stream to one agent through the API server (``kubectl port-forward``, for clients
        outside the cluster); the pool handshake then runs over it as over TCP."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.stream import portforward

        namespace, _, pod = addr.via.partition(":")[2].partition("/")
        api = self._api(rec)
        try:
            forward = portforward(api.core.connect_get_namespaced_pod_portforward, pod, namespace,
                                  ports=str(addr.port), _request_timeout=timeout)
        except Exception as e:  # the client wraps websocket failures in ApiException(0) (and then trips on it)
            inner = e if isinstance(e, ApiException) else (e.__context__ or e)
            raise tunnel_error(getattr(inner, "reason", None) or str(inner), namespace, pod) from None
        finally:
            api.close()
        return Tunnel(forward.socket(addr.port), forward, addr.port)

    def release(self, rec: PoolRecord) -> None:
        a = rec.allocation
        if not a.get("name"):
            return
        api = self._api(rec)
        try:
            calls = self._owner_calls(api, a["kind"])
            owner = self._owner(api, rec)
            if owner is not None:  # dependents go with it (owner references)
                api.call("delete", calls["resource"], a["namespace"], calls["delete"], a["namespace"], a["name"], ok=(404,))
        finally:
            api.close()

    def loss_reason(self, rec: PoolRecord) -> Optional[str]:
        """Why hosts are gone: the pool's objects deleted, or each lost pod's own story (its
        status while it lasts, then the Warning events Kubernetes kept about it: Evicted, OOM...)."""
        try:
            api = self._api(rec)
        except MonarchError as e:
            return str(e)
        try:
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
                lost.append(f"pod {h.hostname} {why or 'was deleted'}"
                            + (f" (replaced by a new pod: {pod_problem(pod)[0] if not pod_ready(pod) else 'ready'})"
                               if pod is not None else ""))
            return "; ".join(lost) or None
        except MonarchError as e:
            return str(e)
        finally:
            api.close()

    def _events(self, api: KubeApi, rec: PoolRecord, uid: str) -> str:
        ns = rec.allocation["namespace"]
        res = api.call("list", "events", ns, api.core.list_namespaced_event, ns,
                       field_selector=f"involvedObject.uid={uid}", ok=(403,))
        warnings = [e for e in (res.items if res else []) if e.type == "Warning"]
        return "; ".join(f"{e.reason}: {e.message}" for e in warnings[-2:])

    def describe(self, rec: PoolRecord) -> Dict[str, Any]:
        a = rec.allocation
        out: Dict[str, Any] = {"kind": a.get("kind"), "object": f"{a.get('namespace')}/{a.get('name')}"}
        try:
            api = self._api(rec)
            try:
                st = self._state(api, rec)
            finally:
                api.close()
        except MonarchError as e:
            return {**out, "state": "UNKNOWN", "reason": str(e)}
        return {**out, "state": st["state"], "reason": st["reason"], "ready": f"{len(st.get('ready', []))}/{st.get('replicas', 0)}",
                "queue": rec.spec.get("queue")}


def create_scheduler(session_name: str, **kwargs: Any) -> MonarchScheduler:
    return MonarchScheduler(session_name, "monarch_kubernetes")
