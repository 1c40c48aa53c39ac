"""Reading a pool's pods: which host each one is, whether it is ready, and if not, why."""

from __future__ import annotations

from typing import Any

from . import k8s_manifests as mf

# container states that will not get better by waiting: the pool fails at once, with the reason.
# (ErrImagePull is not one: a registry hiccup or a slow large image often clears on the next try;
# Kubernetes moves it to ImagePullBackOff when it does not.)
FATAL_WAITING = (
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "CrashLoopBackOff",
)
KUEUE_GATE = "kueue.x-k8s.io/admission"


def pod_index(pod: Any) -> int | None:
    labels = pod.metadata.labels or {}
    raw = labels.get(mf.POD_INDEX_LABEL) or pod.metadata.name.rsplit("-", 1)[-1]
    return int(raw) if str(raw).isdigit() else None


def pod_ready(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp or pod.status is None or pod.status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def gated(pod: Any) -> bool:
    return bool(pod.spec and any(g.name == KUEUE_GATE for g in pod.spec.scheduling_gates or []))


def pod_problem(pod: Any) -> tuple[str, bool]:
    """(what is wrong with a pod that is not ready, whether waiting cannot fix it)."""
    st = pod.status
    name = pod.metadata.name
    for c in (st.conditions if st else None) or []:
        if c.type == "DisruptionTarget" and c.status == "True":  # eviction, preemption, node drain
            return f"pod {name} {c.reason or 'disrupted'}: {c.message or 'no message'}", False
    if pod.metadata.deletion_timestamp:
        return f"pod {name} is being deleted", False
    if st is None:
        return f"pod {name}: no status yet", False
    if st.phase == "Failed":
        return f"pod {name} {st.reason or 'failed'}: {st.message or 'no message'}", True
    for cs in st.container_statuses or []:
        w = cs.state.waiting if cs.state else None
        if w and w.reason in FATAL_WAITING:
            if w.reason == "CrashLoopBackOff":
                t = cs.last_state.terminated if cs.last_state else None
                detail = f"exit code {t.exit_code}{f' ({t.reason})' if t.reason else ''}" if t else w.message
                return f"pod {name}: agent keeps crashing: {detail}", True
            return f"pod {name}: {w.reason}: {w.message or 'no message'}", True
        t = cs.state.terminated if cs.state else None
        if t:
            return f"pod {name}: agent exited with code {t.exit_code}{f' ({t.reason})' if t.reason else ''}", False
        if w and w.reason:
            return f"pod {name}: {w.reason}{f': {w.message}' if w.message else ''}", False
    if gated(pod):
        return f"pod {name}: waiting for Kueue admission", False
    for c in st.conditions or []:
        if c.type == "PodScheduled" and c.status == "False":
            return f"pod {name}: {c.reason or 'unschedulable'}: {c.message or ''}".rstrip(": "), False
    return f"pod {name}: {st.phase or 'Pending'}", False
