"""The Kubernetes objects of one pool, built as plain JSON-able dicts.

Kept apart from the API calls so that `--dryrun`, the tests and the provisioner all see the same
objects, and so that every object is checked against the Kubernetes schema (the official
client's generated models) before anything is sent: a bad ``pod_template`` overlay fails here,
with the field named, instead of half-creating a pool. (The tests check what reaches their API
server independently: built-in kinds with kubernetes-validate, the MonarchMesh against its CRD.)
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..agent.logstore import POOL_MAX_MB, REPLICA_MAX_MB
from ..errors import MonarchError
from .k8s_api import kube_client

MESH_GROUP = "monarch.pytorch.org"
MESH_VERSION = "v1alpha1"
MESH_PLURAL = "monarchmeshes"
MESH_KIND = "MonarchMesh"
MESH_LABEL = "monarch.pytorch.org/mesh-name"  # what the monarch-kubernetes operator puts on a mesh's pods
MESH_OPERATOR = "0.2"  # monarch-operator line whose CRD we write (for Monarch >= 0.5; 0.1.x took a bare PodSpec)
MESH_SPEC_FIELDS = ("replicas", "port", "podTemplate")  # the 0.2 CRD's spec; anything else is pruned
MESH_TEMPLATE_META = ("annotations", "finalizers", "labels", "name", "namespace")  # its podTemplate.metadata
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
POOL_LABEL = "monarch-torchx.pytorch.org/pool"
MANAGED_BY = {"app.kubernetes.io/name": "monarch-torchx", "app.kubernetes.io/managed-by": "monarch-torchx"}
STATE_VOLUME = "/var/lib/monarch-torchx"  # an emptyDir: 0777, not ours to chmod
STATE_DIR = f"{STATE_VOLUME}/pool"  # made 0700 by the agent inside it, and checked
TOKEN_DIR = "/etc/monarch-torchx"
IDLE_MODULE = "monarch_torchx.schedulers.k8s_idle:setup"
DEFAULT_PORT = 29600
_DNS_LABEL = re.compile(r"[^a-z0-9-]+")


def object_name(pool: str) -> str:
    """A DNS-1123 name for the pool's objects; pool names that need changes get a short hash."""
    base = _DNS_LABEL.sub("-", pool.lower()).strip("-") or "pool"
    name = f"monarch-{base}"
    if base != pool or len(name) > 40:  # keep it unique and short enough for pod names + hostnames
        name = f"{name[:33].rstrip('-')}-{hashlib.sha256(pool.encode()).hexdigest()[:6]}"
    return name


def mesh_name(pool: str) -> str:
    """The MonarchMesh CRD wants ``^[a-z][a-z0-9]*$`` (no hyphens) and at most 63 characters."""
    base = re.sub(r"[^a-z0-9]+", "", pool.lower())
    name = f"monarch{base}"
    if base != pool or len(name) > 40:
        name = f"{name[:33]}{hashlib.sha256(pool.encode()).hexdigest()[:6]}"
    return name


def label_value(pool: str) -> str:
    """Pool names may hold characters a label value may not: same rule as object_name."""
    return object_name(pool)[len("monarch-") :]


@dataclass
class KubePoolSpec:
    """Everything that shapes a pool's objects, from run options (see ``KubernetesProvisioner``)."""

    pool: str
    replicas: int
    namespace: str = "default"
    image: str = "ghcr.io/meta-pytorch/monarch-torchx:latest"
    port: int = DEFAULT_PORT
    cpu: float | None = None
    mem_mb: int | None = None
    gpu: int | None = None
    queue: str | None = None
    priority_class: str | None = None
    service_account: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    pod_template: dict[str, Any] = field(default_factory=dict)
    preload: str = "torch"
    idle_timeout: float = 1800.0
    idle_action: str = "delete"
    log_max_mb: float = REPLICA_MAX_MB  # replica logs kept in a pod: per replica, and in all (its share of the pool's)
    log_host_max_mb: float = POOL_MAX_MB
    declare: str = ""  # capacity the pool declares per host (the agent's --declare)
    python: str = "python"
    kind: str = "StatefulSet"  # or MESH_KIND: the owner object, decided by what the cluster serves

    @property
    def name(self) -> str:
        return mesh_name(self.pool) if self.kind == MESH_KIND else object_name(self.pool)

    @property
    def labels(self) -> dict[str, str]:
        return {**MANAGED_BY, POOL_LABEL: label_value(self.pool)}

    @property
    def selector(self) -> str:
        """Finds the pool's pods: our label, or the operator's (it replaces a mesh's pod labels)."""
        if self.kind == MESH_KIND:
            return f"{MESH_LABEL}={self.name}"
        return f"{POOL_LABEL}={label_value(self.pool)}"

    @property
    def account(self) -> str:
        return self.service_account or self.name


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """Makes an object die with the pool's owner object (Kubernetes' garbage collector)."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": False,
        "blockOwnerDeletion": True,
    }


def _meta(spec: KubePoolSpec, name: str, kueue: bool = False) -> dict[str, Any]:
    labels = dict(spec.labels)
    if kueue and spec.queue:
        labels[KUEUE_QUEUE_LABEL] = spec.queue
    return {"name": name, "namespace": spec.namespace, "labels": labels}


def agent_args(spec: KubePoolSpec) -> list[str]:
    """The agent's command line in each pod; $(VAR) is expanded by the kubelet from the pod's env."""
    return [
        "-m",
        "monarch_torchx.agent",
        "--state-dir",
        STATE_DIR,
        "--pool",
        spec.pool,
        "--bind",
        "0.0.0.0",
        "--port",
        str(spec.port),
        "--advertise",
        "$(MONARCH_TORCHX_POD_IP)",
        "--incarnation",
        "$(MONARCH_TORCHX_POD_UID)",
        "--token-file",
        f"{TOKEN_DIR}/token",
        "--idle-timeout",
        "0",
        "--preload",
        spec.preload,
        "--module",
        IDLE_MODULE,
        "--log-max-mb",
        str(spec.log_max_mb),
        "--log-host-max-mb",
        str(spec.log_host_max_mb),
        *(["--declare", spec.declare] if spec.declare else []),
    ]


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def pod_template(spec: KubePoolSpec) -> dict[str, Any]:
    """The pod every host of the pool runs: one agent, the pool secret, a node-local state dir."""
    resources: dict[str, dict[str, Any]] = {}
    if spec.cpu:
        resources.setdefault("requests", {})["cpu"] = f"{int(spec.cpu * 1000)}m"
        resources.setdefault("limits", {})["cpu"] = f"{int(spec.cpu * 1000)}m"
    if spec.mem_mb:
        resources.setdefault("requests", {})["memory"] = f"{spec.mem_mb}Mi"
        resources.setdefault("limits", {})["memory"] = f"{spec.mem_mb}Mi"
    if spec.gpu:
        resources.setdefault("requests", {})["nvidia.com/gpu"] = str(spec.gpu)
        resources.setdefault("limits", {})["nvidia.com/gpu"] = str(spec.gpu)
    env = [
        _field_env("MONARCH_TORCHX_POD_IP", "status.podIP"),
        _field_env("MONARCH_TORCHX_POD_UID", "metadata.uid"),
        _field_env("MONARCH_TORCHX_POD_NAMESPACE", "metadata.namespace"),
        _field_env("MONARCH_TORCHX_HOST_INDEX", f"metadata.labels['{POD_INDEX_LABEL}']"),
        {"name": "MONARCH_TORCHX_K8S_OWNER", "value": "{owner}"},  # filled in by the provisioner
        {"name": "MONARCH_TORCHX_K8S_SELECTOR", "value": spec.selector},
        {"name": "MONARCH_TORCHX_K8S_IDLE_TIMEOUT", "value": str(spec.idle_timeout)},
        {"name": "MONARCH_TORCHX_K8S_IDLE_ACTION", "value": spec.idle_action},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    container: dict[str, Any] = {
        "name": "agent",
        "image": spec.image,
        "command": [spec.python],
        "args": agent_args(spec),
        "ports": [{"name": "agent", "containerPort": spec.port, "protocol": "TCP"}],
        "env": env,
        "readinessProbe": {"tcpSocket": {"port": spec.port}, "periodSeconds": 2, "failureThreshold": 3},
        "volumeMounts": [
            {"name": "pool-token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "state", "mountPath": STATE_VOLUME},
        ],
    }
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Always",
        "serviceAccountName": spec.account,
        # group-readable through fsGroup: the image runs as UID 1000, Secret files belong to root
        # (Kubernetes gives no other owner); the agent copies them to 0600 files in its 0700 state dir
        "volumes": [
            {"name": "pool-token", "secret": {"secretName": f"{spec.name}-token", "defaultMode": 0o440}},
            {"name": "state", "emptyDir": {}},
        ],
        "securityContext": {"fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch"},
    }
    if spec.priority_class:
        pod_spec["priorityClassName"] = spec.priority_class
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(spec.tolerations)
    labels = dict(spec.labels)
    if spec.queue:
        labels[KUEUE_QUEUE_LABEL] = spec.queue
    template = {"metadata": {"labels": labels}, "spec": pod_spec}
    if spec.pod_template:
        template = overlay(template, spec.pod_template)
        template["metadata"].setdefault("labels", {}).update(labels)  # the selector must keep matching
    return template


def overlay(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A ``pod_template`` overlay: dicts merge, lists of named items (containers, volumes, env)
    merge by name, other lists and values replace."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        have = out.get(key)
        if isinstance(have, dict) and isinstance(value, dict):
            out[key] = overlay(have, value)
        elif (
            isinstance(have, list)
            and isinstance(value, list)
            and all(isinstance(v, dict) and "name" in v for v in have + value)
        ):
            merged = {v["name"]: v for v in have}
            for v in value:
                merged[v["name"]] = overlay(merged[v["name"]], v) if v["name"] in merged else copy.deepcopy(v)
            out[key] = list(merged.values())
        else:
            out[key] = copy.deepcopy(value)
    return out


def with_owner_env(template: dict[str, Any], owner: str) -> dict[str, Any]:
    out = copy.deepcopy(template)
    for c in out["spec"]["containers"]:
        for e in c.get("env", []):
            if e.get("value") == "{owner}":
                e["value"] = owner
    return out


def statefulset(spec: KubePoolSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(spec, spec.name, kueue=True),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": spec.name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": spec.labels},
            "template": with_owner_env(pod_template(spec), f"apps/v1/statefulsets/{spec.name}"),
        },
    }


def monarch_mesh(spec: KubePoolSpec) -> dict[str, Any]:
    """The monarch-operator 0.2 CRD: ``podTemplate`` is a pod *template* (metadata + spec), as
    Monarch's own ``KubernetesJob`` sends it. The operator merges its selector labels into the
    template's labels and keeps ours, so the pods carry both. The CRD's metadata knows only labels,
    annotations, finalizers, name and namespace: anything else would be pruned, so it is refused."""
    template = with_owner_env(pod_template(spec), f"{MESH_GROUP}/{MESH_VERSION}/{MESH_PLURAL}/{spec.name}")
    return {
        "apiVersion": f"{MESH_GROUP}/{MESH_VERSION}",
        "kind": MESH_KIND,
        "metadata": _meta(spec, spec.name, kueue=True),
        "spec": {"replicas": spec.replicas, "port": spec.port, "podTemplate": template},
    }


def headless_service(spec: KubePoolSpec) -> dict[str, Any]:
    """Stable DNS names for a StatefulSet's pods (the mesh operator makes its own, NAME-svc)."""
    meta = _meta(spec, spec.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": spec.labels,
            "ports": [{"name": "agent", "port": spec.port, "targetPort": spec.port, "protocol": "TCP"}],
        },
    }


def token_secret(spec: KubePoolSpec, token: str, tls_pem: str = "") -> dict[str, Any]:
    """The pool's secret and, for a TLS pool, its certificate and key (tls.pem)."""
    meta = _meta(spec, f"{spec.name}-token")
    data = {"token": base64.b64encode(token.encode()).decode()}
    if tls_pem:
        data["tls.pem"] = base64.b64encode(tls_pem.encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": data}


def agent_rbac(spec: KubePoolSpec) -> list[dict[str, Any]]:
    """A service account that may list its pool's pods and delete (or scale) its own owner object,
    nothing more: what agent 0 needs to end an idle pool when no client is around. Scaling goes
    through the ``scale`` subresource, so code in a pod cannot rewrite the pod template."""
    if spec.kind == MESH_KIND:
        owner_rules = [
            {
                "apiGroups": [MESH_GROUP],
                "resources": [MESH_PLURAL],
                "resourceNames": [spec.name],
                "verbs": ["get", "delete"],
            }
        ]
    elif spec.idle_action == "scale_to_zero":
        owner_rules = [
            {
                "apiGroups": ["apps"],
                "resources": ["statefulsets/scale"],
                "resourceNames": [spec.name],
                "verbs": ["get", "patch"],
            }
        ]
    else:
        owner_rules = [
            {
                "apiGroups": ["apps"],
                "resources": ["statefulsets"],
                "resourceNames": [spec.name],
                "verbs": ["get", "delete"],
            }
        ]
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(spec, spec.name)}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(spec, spec.name),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}, *owner_rules],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(spec, spec.name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": spec.name},
        "subjects": [{"kind": "ServiceAccount", "name": spec.name, "namespace": spec.namespace}],
    }
    return [sa, role, binding]


# ---------------------------------------------------------------- schema checks

MODEL_OF = {
    "StatefulSet": "V1StatefulSet",
    "Service": "V1Service",
    "Secret": "V1Secret",
    "ServiceAccount": "V1ServiceAccount",
    "Role": "V1Role",
    "RoleBinding": "V1RoleBinding",
    "Pod": "V1Pod",
    "PodTemplateSpec": "V1PodTemplateSpec",
    "Scale": "V1Scale",
}


@dataclass
class _Body:
    """What the client's public ``ApiClient.deserialize`` reads: a response's JSON text."""

    data: str


def schema_errors(obj: dict[str, Any], model: str | None = None) -> list[str]:
    """Checks ``obj`` against the Kubernetes schema of the official client's models: wrong types
    and missing required fields raise in the models, unknown fields are dropped by them (found by
    comparing the round trip). A MonarchMesh is checked by its CRD's rules, its pod template by
    the models."""
    if obj.get("kind") == MESH_KIND and model is None:
        return _mesh_errors(obj)
    model = model or MODEL_OF.get(obj.get("kind", ""))
    if model is None:
        return [f"no schema for kind {obj.get('kind')!r}"]
    api = kube_client().client.ApiClient()
    try:
        parsed = api.deserialize(_Body(json.dumps(obj)), model)
    except (ValueError, TypeError, AttributeError) as e:
        return [str(e).splitlines()[0]]
    back = api.sanitize_for_serialization(parsed)
    return [f"unknown or invalid field {p}" for p in _unknown(obj, back, "")]


def _mesh_errors(obj: dict[str, Any]) -> list[str]:
    """The rules of the monarch-operator 0.2 CRD (``operator/api/v1alpha1/monarchmesh_types.go``
    in meta-pytorch/monarch-kubernetes): its CEL rule on the name, ``replicas`` >= 1, an integer
    ``port``, and ``podTemplate`` a PodTemplateSpec whose metadata has only the fields the CRD
    declares. Unknown fields are reported, as a strict API server would, not silently pruned."""
    errs: list[str] = []
    name = obj.get("metadata", {}).get("name", "")
    if not re.match(r"^[a-z][a-z0-9]*$", name) or len(name) > 63:
        errs.append(f"metadata.name {name!r} must be lowercase alphanumeric, starting with a letter")
    s = obj.get("spec", {})
    errs += [f"unknown field spec.{k}" for k in s if k not in MESH_SPEC_FIELDS]
    if not isinstance(s.get("replicas"), int) or s["replicas"] < 1:
        errs.append("spec.replicas must be an integer of at least 1")
    if "port" in s and not isinstance(s.get("port"), int):
        errs.append("spec.port must be an integer")
    template = s.get("podTemplate")
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        return errs + [
            f"spec.podTemplate must be a pod template with metadata and spec (monarch-operator "
            f"{MESH_OPERATOR}), not {sorted(template) if isinstance(template, dict) else template!r}"
        ]
    errs += [f"unknown field spec.podTemplate.{k}" for k in template if k not in ("metadata", "spec")]
    errs += [
        f"unknown field spec.podTemplate.metadata.{k}"
        for k in template.get("metadata") or {}
        if k not in MESH_TEMPLATE_META
    ]
    return errs + [f"spec.podTemplate: {e}" for e in schema_errors(template, "V1PodTemplateSpec")]


def _unknown(sent: Any, kept: Any, path: str) -> list[str]:
    if isinstance(sent, dict):
        out = []
        for k, v in sent.items():
            if not isinstance(kept, dict) or k not in kept:
                out.append(f"{path}.{k}".lstrip("."))
            else:
                out += _unknown(v, kept[k], f"{path}.{k}")
        return out
    if isinstance(sent, list) and isinstance(kept, list):
        return [p for i, (a, b) in enumerate(zip(sent, kept)) for p in _unknown(a, b, f"{path}[{i}]")]
    return []


def check(obj: dict[str, Any]) -> None:
    errs = schema_errors(obj)
    if errs:
        raise MonarchError(
            f"the {obj.get('kind')} for pool objects {obj['metadata'].get('name')!r} is invalid: "
            f"{'; '.join(errs[:3])} (check pod_template and the other run options)"
        )
