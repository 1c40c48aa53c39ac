"""The Kubernetes API as monarch_kubernetes uses it: the official client for one context, every
failure as one line, and port-forward tunnels to agents.

The client is imported here only (its import is slow: benchmarks/RESULTS.md, "numbers behind
the code"), so a run on a pool reached by pod IP never pays for it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from ..errors import AccessError, MonarchError

API_TIMEOUT_S = 15
EXTRA = "kubernetes"  # the pyproject extra that brings the client (and PyYAML)
MISSING_CLIENT = f"monarch_kubernetes needs the kubernetes client: pip install 'monarch-torchx[{EXTRA}]'"


def kube_client() -> ModuleType:
    """The official client package, imported where it is first used: it is an optional extra, so
    a user without it gets the one line that installs it, not an import traceback."""
    try:
        import kubernetes.client
        import kubernetes.config
        import kubernetes.stream  # noqa: F401 - port-forward; part of the same package
    except ImportError:
        raise MonarchError(MISSING_CLIENT) from None
    return kubernetes


class KubeApi:
    """The official client for one kubeconfig context (or the pod's own service account)."""

    def __init__(self, context: str | None = None):
        k8s = kube_client()
        client, config = k8s.client, k8s.config
        self.context: str | None = context
        kubeconfig = os.environ.get("KUBECONFIG") or None  # the client reads $KUBECONFIG at import: read it now
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST") and not kubeconfig and context is None:
                conf = client.Configuration()
                config.load_incluster_config(client_configuration=conf)
                self.api = client.ApiClient(conf)
            else:
                if context is None:
                    _, active = config.list_kube_config_contexts(config_file=kubeconfig)
                    self.context = active["name"]
                self.api = config.new_client_from_config(config_file=kubeconfig, context=self.context)
        except config.ConfigException as e:
            where = kubeconfig or "~/.kube/config"
            raise MonarchError(
                f"no usable Kubernetes configuration ({where}): {str(e).rstrip('.')}; "
                "set KUBECONFIG or run `kubectl config use-context`"
            ) from None
        self.server = self.api.configuration.host
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)

    def call(
        self,
        verb: str,
        resource: str,
        namespace: str | None,
        fn: Callable[..., Any],
        *args: Any,
        ok: tuple[int, ...] = (),
        hints: dict[int, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs one API call; statuses in ``ok`` come back as ``None`` instead of an error, and a
        status in ``hints`` adds what the caller knows about that refusal to the one line."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        kwargs.setdefault("_request_timeout", API_TIMEOUT_S)
        try:
            return fn(*args, **kwargs)
        except ApiException as e:
            if e.status in ok:
                return None
            hint = (hints or {}).get(e.status)
            raise MonarchError(api_error(e, verb, resource, namespace) + (f" ({hint})" if hint else "")) from None
        except (HTTPError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise MonarchError(
                f"the Kubernetes API server at {self.server} is unreachable ({reason}); "
                "check KUBECONFIG, the cluster and your network"
            ) from None

    def one_off_core(self) -> Any:
        """The core API on a client of its own, with this one's configuration (nothing is read again)."""
        from kubernetes import client

        return client.CoreV1Api(client.ApiClient(self.api.configuration))

    def close(self) -> None:
        self.api.close()


def api_error(e: Any, verb: str, resource: str, namespace: str | None) -> str:
    try:
        message = json.loads(e.body).get("message", "") if e.body else ""
    except (ValueError, AttributeError):
        message = ""
    message = message or e.reason or f"HTTP {e.status}"
    where = f" in namespace {namespace!r}" if namespace else ""
    if e.status == 403:
        return (
            f"Kubernetes RBAC forbids {verb} {resource}{where}: {message} "
            f"(ask for the right to {verb} {resource}, or use another namespace)"
        )
    if e.status == 401:
        return f"Kubernetes rejected your credentials ({message}): refresh your kubeconfig"
    return f"Kubernetes refused to {verb} {resource}{where}: {message}"


# ---------------------------------------------------------------- port-forward


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
    """One line from a failed port-forward handshake ("Handshake status 403 ... -+-+- {Status}").

    Only a refusal of *us* (401/403, or a server that cannot upgrade) is an ``AccessError``;
    a pod that is gone (404) or not running (400) is an ordinary lost host, to be repaired.
    """
    m = re.search(r"Handshake status (\d+)", reason)
    status = int(m.group(1)) if m else 0
    try:
        message = json.loads(reason.rsplit("-+-+-", 1)[1]).get("message", "")
    except (IndexError, ValueError, AttributeError):
        message = ""
    if status in (401, 403):
        return AccessError(
            f"Kubernetes RBAC forbids create pods/portforward in namespace {namespace!r}: "
            f"{message or reason} (ask for that right, or use access=pod_ip inside the cluster)"
        )
    if status in (400, 404, 409, 500, 503):
        return MonarchError(f"port-forward to pod {namespace}/{pod}: {message or f'HTTP {status}'}")
    if status:
        return AccessError(
            f"the API server refused port-forward to pod {namespace}/{pod} (HTTP {status}"
            f"{': ' + message if message else ''}); use access=pod_ip from inside the cluster"
        )
    return AccessError(f"port-forward to pod {namespace}/{pod} failed: {reason}")


def open_portforward(api: KubeApi, namespace: str, pod: str, port: int, timeout: float) -> Tunnel:
    """``kubectl port-forward`` to one pod port, bounded by ``timeout`` (the client's own
    websocket connect has none, so it runs in a helper thread that is abandoned on timeout)."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.stream import portforward

    box: dict = {}

    def connect() -> None:
        try:
            # on a client of its own: ``portforward`` swaps the client's request method for the call's
            # length, and two at once on one client (a fan-out's threads) can leave the swap in place
            box["forward"] = portforward(
                api.one_off_core().connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port)
            )
        except Exception as e:  # the client wraps websocket failures in ApiException(0) (and then trips on it)
            box["error"] = e if isinstance(e, ApiException) else (e.__context__ or e)

    t = threading.Thread(target=connect, name=f"port-forward {pod}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AccessError(
            f"port-forward to pod {namespace}/{pod} did not open within {timeout:.0f} s (API server {api.server})"
        )
    if "error" in box:
        e = box["error"]
        raise tunnel_error(getattr(e, "reason", None) or str(e), namespace, pod)
    forward = box["forward"]
    return Tunnel(forward.socket(port), forward, port)
