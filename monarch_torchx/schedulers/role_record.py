"""A TorchX ``Role`` as submitted, kept in the app's record so ``torchx describe`` returns it whole.

The record is JSON in the registry (0600), so a later process (``torchx describe`` from another
shell) rebuilds the same Role: env, resources, retries, ports. Fields the installed TorchX does
not have (the two lines differ: torchx-nightly added ``Resource.tags``, ``Role.workspace``)
are kept and skipped on the way back.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from torchx.specs import Resource, RetryPolicy, Role

_KEPT = (
    "name",
    "image",
    "entrypoint",
    "args",
    "num_replicas",
    "min_replicas",
    "env",
    "max_retries",
    "port_map",
    "metadata",
)


def role_to_record(role: Role) -> dict[str, Any]:
    rec: dict[str, Any] = {k: getattr(role, k) for k in _KEPT if hasattr(role, k)}
    rec["args"], rec["env"], rec["port_map"] = list(role.args), dict(role.env), dict(role.port_map)
    rec["retry_policy"] = role.retry_policy.name
    rec["resource"] = {f.name: getattr(role.resource, f.name) for f in dataclasses.fields(role.resource)}
    rec["resource"]["devices"] = dict(rec["resource"].get("devices") or {})
    rec["metadata"] = _jsonable(rec.get("metadata") or {})
    return rec


def role_from_record(rec: dict[str, Any]) -> Role:
    known = {f.name for f in dataclasses.fields(Role)}
    kwargs = {k: rec[k] for k in _KEPT if k in rec and k in known}
    if "retry_policy" in rec:
        kwargs["retry_policy"] = RetryPolicy[rec["retry_policy"]]
    if "resource" in rec:
        res_fields = {f.name for f in dataclasses.fields(Resource)}
        kwargs["resource"] = Resource(**{k: v for k, v in rec["resource"].items() if k in res_fields})
    return Role(**kwargs)


def _jsonable(meta: dict[str, Any]) -> dict[str, Any]:
    """The metadata entries that survive JSON (others are the submitting process's own objects)."""
    out = {}
    for k, v in meta.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[str(k)] = v
    return out
