"""`torchx run --dryrun` shows what a pool's creation would submit, and submits nothing.

The outputs are parsed and handed to the real peer: the sbatch command and script to SLURM's
``sbatch --test-only`` on the lab, the Kubernetes objects to the official client's models and to
the emulated API server.
"""

from __future__ import annotations

import base64
import json
import subprocess

import pytest

from monarch_torchx.registry import Registry
from monarch_torchx.schedulers import k8s_manifests as mf
from monarch_torchx.submission import SECRET_PLACEHOLDER

from .conftest import squeue_ids, torchx
from .test_kubernetes import cluster  # noqa: F401  (the emulated cluster, as a fixture)

pytestmark = pytest.mark.integration


def _dryrun_json(home, cwd, scheduler: str, cfg: str) -> dict:
    res = torchx(home, "run", "--dryrun", "--json", "-s", scheduler, "-cfg", cfg, "utils.echo", "--msg", "hi", cwd=cwd)
    return json.loads(res.stdout)


def test_a_local_dryrun_shows_the_agents_it_would_start_and_then_that_it_reuses_the_pool(home, pool_name, tmp_path):
    out = torchx(
        home,
        "run",
        "--dryrun",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},hosts=2,preload=none",
        "utils.echo",
        "--msg",
        "hi",
        cwd=tmp_path,
    ).stdout
    assert "pool: create" in out and "would submit (processes):" in out
    assert out.count("-m monarch_torchx.agent") == 2
    assert Registry(home).get(pool_name) is None and not (home / "pools" / pool_name).exists()  # nothing made

    torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},hosts=2,preload=none",
        "utils.echo",
        "--msg",
        "hi",
        cwd=tmp_path,
    )
    plan = _dryrun_json(home, tmp_path, "monarch_local", f"pool={pool_name}")["request"]["pool_plan"]
    assert plan["action"] == "reuse" and plan["submission"] is None
    plan = _dryrun_json(home, tmp_path, "monarch_local", f"pool={pool_name},hosts=3")["request"]["pool_plan"]
    assert plan["action"] == "refused" and "replace=True" in plan["reason"]
    plan = _dryrun_json(home, tmp_path, "monarch_local", f"pool={pool_name},hosts=3,replace=True")["request"]
    assert plan["pool_plan"]["action"] == "replace" and len(plan["pool_plan"]["submission"]["commands"]) == 3
    assert len(Registry.hosts(Registry(home).require(pool_name))) == 2  # the dry-run replaced nothing


@pytest.mark.usefixtures("slurm_lab")
def test_the_sbatch_command_and_script_of_a_dryrun_pass_sbatch_test_only(home, pool_name, tmp_path):
    out = torchx(
        home,
        "run",
        "--dryrun",
        "-s",
        "monarch_slurm",
        "-cfg",
        f"pool={pool_name},nodes=2,partition=debug,time=00:10:00",
        "utils.echo",
        "--msg",
        "hi",
        cwd=tmp_path,
    ).stdout
    assert "would submit (sbatch):" in out and "exec srun --ntasks-per-node=1" in out
    sub = _dryrun_json(home, tmp_path, "monarch_slurm", f"pool={pool_name},nodes=2,partition=debug,time=00:10:00")[
        "request"
    ]["pool_plan"]["submission"]
    (argv,) = sub["commands"]
    assert argv[0] == "sbatch" and ["-N", "2"] == argv[argv.index("-N") : argv.index("-N") + 2]
    assert sub["script"].startswith("#!/bin/bash") and "monarch_torchx.agent" in sub["script"]
    script = tmp_path / "pool.sbatch"
    script.write_text(sub["script"])
    res = subprocess.run(
        [a for a in argv[:-1] if a != "--parsable"] + ["--test-only", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and "to start at" in res.stderr, res.stderr
    assert "node[1-2]" in res.stderr or res.stderr.count("node") >= 2
    assert not squeue_ids(f"monarch-{pool_name}") and Registry(home).get(pool_name) is None


def test_the_kubernetes_objects_of_a_dryrun_load_and_the_api_server_accepts_them(cluster, home, pool_name, tmp_path):  # noqa: F811
    cfg = f"pool={pool_name},replicas=2,namespace=default,queue=team-a,image=reg/monarch-torchx:latest"
    out = torchx(
        home, "run", "--dryrun", "-s", "monarch_kubernetes", "-cfg", cfg, "utils.echo", "--msg", "hi", cwd=tmp_path
    ).stdout
    assert "would submit (kubernetes):" in out and "kind: StatefulSet" in out and SECRET_PLACEHOLDER in out
    sub = _dryrun_json(home, tmp_path, "monarch_kubernetes", cfg)["request"]["pool_plan"]["submission"]
    objects = sub["objects"]
    kinds = [o["kind"] for o in objects]
    assert kinds == ["Secret", "Service", "ServiceAccount", "Role", "RoleBinding", "StatefulSet"]
    owner = objects[-1]
    assert owner["metadata"]["labels"][mf.KUEUE_QUEUE_LABEL] == "team-a"
    assert all(o["metadata"]["ownerReferences"][0]["name"] == owner["metadata"]["name"] for o in objects[:-1])
    role = objects[kinds.index("Role")]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]} in role["rules"]
    secret = objects[0]
    assert set(secret["data"].values()) == {SECRET_PLACEHOLDER}  # no secret in a dry-run
    for o in objects:
        assert mf.schema_errors(o) == [], o["kind"]  # the official client's models load it

    # the API server takes them as they are, owner first (its uid fills the references)
    made = cluster.create("StatefulSet", "default", {**owner, "spec": {**owner["spec"], "replicas": 0}})
    try:
        for o in objects[:-1]:
            o["metadata"]["ownerReferences"][0]["uid"] = made["metadata"]["uid"]
            if o["kind"] == "Secret":
                o["data"] = {k: base64.b64encode(b"x").decode() for k in o["data"]}
            cluster.create(o["kind"], "default", o)
        assert not cluster.server.invalid
    finally:
        cluster.delete("StatefulSet", "default", owner["metadata"]["name"])
    assert Registry(home).get(pool_name) is None
