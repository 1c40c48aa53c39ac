"""monarch_local through TorchX's own Runner (``torchx.runner.get_runner``): the full contract."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from torchx.runner import get_runner
from torchx.schedulers import get_scheduler_factories
from torchx.specs import AppDef, AppState, Role

from monarch_torchx.registry import Registry

from .conftest import wait_for

pytestmark = pytest.mark.integration


def _app(name: str, entrypoint: str, *args: str, replicas: int = 1, env=None, max_retries: int = 0) -> AppDef:
    return AppDef(
        name=name,
        roles=[
            Role(
                name=name,
                image=".",
                entrypoint=entrypoint,
                args=list(args),
                num_replicas=replicas,
                env=env or {},
                max_retries=max_retries,
            )
        ],
    )


def _wait_done(runner, handle: str, timeout: float = 60):
    return wait_for(lambda: (s := runner.status(handle)) and s.is_terminal() and s, timeout, what=f"{handle} to finish")


def _logs(runner, handle, role, k=0, **kw) -> str:
    return "".join(runner.log_lines(handle, role, k, **kw))


@pytest.fixture
def runner(home):
    with get_runner() as r:
        yield r


def test_the_schedulers_are_ours_and_exactly_the_installed_torchxs_builtins():
    from torchx.schedulers import DEFAULT_SCHEDULER_MODULES

    names = list(get_scheduler_factories())
    if "aws_batch" not in DEFAULT_SCHEDULER_MODULES:  # torchx-nightly: plugins first, ours in our order
        assert names[0] == "monarch_local"  # TorchX's default scheduler (0.7.0 sorts; `torchx run` says ours)
    assert set(names) == {"monarch_local", "monarch_slurm", "monarch_kubernetes", *DEFAULT_SCHEDULER_MODULES}
    from torchx.specs.finder import get_components

    comps = get_components()
    assert {"utils.echo", "utils.python", "dist.ddp", "monarch.hostinfo"} <= set(comps)


def test_torchx_runopts_prints_every_scheduler_and_no_error():
    from torchx.schedulers import DEFAULT_SCHEDULER_MODULES

    res = subprocess.run(
        [str(Path(sys.executable).with_name("torchx")), "runopts"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    headers = [line for line in res.stdout.splitlines() if line and not line[0].isspace()]
    names = [h.split(":")[0].split(" (")[0] for h in headers]
    assert sorted(names) == sorted(get_scheduler_factories()), res.stdout
    unavailable = {h.split(" (")[0] for h in headers if "(not available here:" in h}
    # only torchx 0.7.0's built-ins whose own optional dependency (boto3, ray) is not installed
    assert unavailable <= {"aws_sagemaker", "ray", "aws_batch", "gcp_batch", "kubernetes_mcad", "lsf"}, headers
    if "aws_batch" not in DEFAULT_SCHEDULER_MODULES:  # torchx-nightly: every scheduler it has is listed whole
        assert not unavailable, headers


def test_one_distribution_provides_the_torchx_package():
    from importlib.metadata import packages_distributions

    assert len(packages_distributions()["torchx"]) == 1, packages_distributions()["torchx"]


def test_first_run_creates_the_pool_and_later_runs_reuse_it(runner, home, pool_name):
    cfg = {"pool": pool_name, "hosts": 2, "preload": ""}
    h1 = runner.run(_app("hello", "echo", "hi"), "monarch_local", cfg)
    assert h1.startswith(f"monarch_local://torchx/{pool_name}:hello-")
    st = _wait_done(runner, h1)
    assert st.state == AppState.SUCCEEDED
    assert _logs(runner, h1, "hello") == "hi\n"
    rec = Registry(home).get(pool_name)
    assert (home / "pools" / f"{pool_name}.json").stat().st_mode & 0o777 == 0o600
    before = [(h.pid, h.incarnation) for h in Registry.hosts(rec)]

    h2 = runner.run(_app("again", "python", "-c", "print('again')", replicas=2), "monarch_local", {"pool": pool_name})
    st = _wait_done(runner, h2)
    assert st.state == AppState.SUCCEEDED, st
    assert [(h.pid, h.incarnation) for h in Registry.hosts(Registry(home).get(pool_name))] == before  # no new hosts
    desc = runner.describe(h2)
    assert [r.name for r in desc.roles] == ["again"] and desc.roles[0].num_replicas == 2
    sched = get_scheduler_factories()["monarch_local"]("torchx")
    resp = sched.describe(h2.split("/")[-1])
    assert {r.hostname for r in resp.roles_statuses[0].replicas} == {h.hostname for h in Registry.hosts(rec)}
    assert [r.state for r in resp.roles_statuses[0].replicas] == [AppState.SUCCEEDED] * 2
    listed = {a.app_handle: a.state for a in runner.list("monarch_local")}
    assert listed[h1] == AppState.SUCCEEDED and listed[h2] == AppState.SUCCEEDED


def test_log_iter_options(runner, pool_name):
    code = (
        "import sys, time\n"
        "for i in range(3): print(f'out {i}', flush=True); time.sleep(0.05)\n"
        "time.sleep(0.4)\n"
        "print('late line', flush=True); print('an error', file=sys.stderr, flush=True)\n"
    )
    h = runner.run(_app("logs", "python", "-c", code), "monarch_local", {"pool": pool_name, "preload": ""})
    # should_tail follows the live replica to its end
    tailed = _logs(runner, h, "logs", should_tail=True)
    assert tailed.splitlines() == ["out 0", "out 1", "out 2", "late line", "an error"]
    from torchx.schedulers.api import Stream

    assert _logs(runner, h, "logs", streams=Stream.STDERR) == "an error\n"
    assert _logs(runner, h, "logs", streams=Stream.STDOUT).splitlines() == ["out 0", "out 1", "out 2", "late line"]
    assert _logs(runner, h, "logs", regex=r"out [12]").splitlines() == ["out 1", "out 2"]
    # since/until cut by the time each line arrived
    sched = get_scheduler_factories()["monarch_local"]("torchx")
    app_id = h.split("/")[-1]
    log_dir = Registry().get(pool_name).path / "logs" / "host0" / app_id.split(":")[1] / "logs" / "0"
    stamps = [float(line.split(" ", 1)[0]) for line in (log_dir / "stdout.log").read_text().splitlines()]
    cut = datetime.fromtimestamp((stamps[2] + stamps[3]) / 2)
    assert list(sched.log_iter(app_id, "logs", since=cut, streams=Stream.STDOUT)) == ["late line\n"]
    assert list(sched.log_iter(app_id, "logs", until=cut, streams=Stream.STDOUT)) == ["out 0\n", "out 1\n", "out 2\n"]
    assert list(sched.log_iter(app_id, "logs", since=cut + timedelta(hours=1))) == []


def _replica_log_bytes(pool_name: str, app_id: str = "") -> int:
    """Bytes of replica logs host 0 keeps (of one app, or of all)."""
    root = Registry().get(pool_name).path / "logs" / "host0" / app_id
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _dropped(first_line: str) -> int:
    """How many earlier lines ``torchx log`` says were dropped, from its notice line."""
    m = re.fullmatch(
        r"\[monarch-torchx: ([\d,]+) earlier lines \(.+\) of this replica's output were dropped: "
        r"over the .*\]\n?",
        first_line,
    )
    assert m, first_line
    return int(m.group(1).replace(",", ""))


def test_a_chatty_replica_keeps_its_latest_lines_within_log_max_mb_and_torchx_log_says_what_went(runner, pool_name):
    """Issue 37: replica logs were unbounded, and one chatty job filled the state dir (on SLURM,
    the shared file system)."""
    n = 100_000  # ~2.8 MiB as stored
    h = runner.run(
        _app("chatty", "python", "-c", f"for i in range({n}): print('line', i)"),
        "monarch_local",
        {"pool": pool_name, "preload": "", "log_max_mb": 0.25},
    )
    # followed as it is written: every line, or a notice of how many went before they were read
    tailed = _logs(runner, h, "chatty", should_tail=True).splitlines()
    notices = [
        int(m.group(1).replace(",", "")) for m in map(re.compile(r"\[monarch-torchx: ([\d,]+) ").match, tailed) if m
    ]
    shown = [int(line.split()[1]) for line in tailed if line.startswith("line ")]
    assert len(shown) + sum(notices) == n and shown == sorted(shown) and shown[-1] == n - 1
    assert runner.status(h).state == AppState.SUCCEEDED
    lines = _logs(runner, h, "chatty").splitlines(keepends=True)
    app_id = h.split("/")[-1]
    assert _replica_log_bytes(pool_name, app_id.split(":")[1]) <= 256 << 10
    dropped = _dropped(lines[0])
    assert "log limit 256 KiB per replica (-cfg log_max_mb)" in lines[0]
    assert lines[1:] == [f"line {i}\n" for i in range(dropped, n)]  # the latest lines, none missing
    sched = get_scheduler_factories()["monarch_local"]("torchx")
    ((_, _, printed),) = sched.app_logs(app_id, [("chatty", 0)])  # what `torchx log APP` prints
    assert list(printed) == lines


def test_the_pools_log_limit_drops_the_oldest_output_of_ended_apps_first(runner, pool_name):
    cfg = {"pool": pool_name, "preload": "", "log_max_mb": 0.25, "log_pool_max_mb": 0.6}
    handles = []
    for k in range(3):  # each keeps up to 0.25 MiB: three are over the pool's 0.6 MiB
        h = runner.run(
            _app(f"app{k}", "python", "-c", f"for i in range(30000): print('app{k}', i)"), "monarch_local", cfg
        )
        assert _wait_done(runner, h).state == AppState.SUCCEEDED
        handles.append(h)
    last = _logs(runner, handles[2], "app2", should_tail=True).splitlines(keepends=True)  # (to the end of its output)
    assert last[-1] == "app2 29999\n"
    assert _replica_log_bytes(pool_name) <= 0.6 * (1 << 20)
    first = _logs(runner, handles[0], "app0").splitlines(keepends=True)
    assert "log_pool_max_mb" in first[0] and first[-1] == "app0 29999\n"
    assert _dropped(first[0]) > _dropped(last[0])  # the oldest ended app lost the most


def test_cancel_kills_the_app_and_the_pool_stays_warm(runner, home, pool_name):
    h = runner.run(
        _app("sleeper", "sh", "-c", "echo started; sleep 600", replicas=2),
        "monarch_local",
        {"pool": pool_name, "preload": ""},
    )
    wait_for(lambda: runner.status(h).state == AppState.RUNNING, what="running")
    wait_for(lambda: "started" in _logs(runner, h, "sleeper"), what="first output")
    runner.cancel(h)
    st = _wait_done(runner, h, timeout=20)
    assert st.state == AppState.CANCELLED
    rec = Registry(home).get(pool_name)
    pids = [h.pid for h in Registry.hosts(rec)]
    h2 = runner.run(_app("after", "echo", "still warm"), "monarch_local", {"pool": pool_name})
    assert _wait_done(runner, h2).state == AppState.SUCCEEDED
    assert [h.pid for h in Registry.hosts(rec)] == pids


def test_max_retries_restarts_a_failed_replica(runner, tmp_path, pool_name):
    counter = tmp_path / "attempts"
    code = (
        f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0; "
        "p.write_text(str(n + 1)); print('attempt', n + 1); sys.exit(0 if n >= 2 else 3)"
    )
    h = runner.run(
        _app("flaky", "python", "-c", code, max_retries=2), "monarch_local", {"pool": pool_name, "preload": ""}
    )
    st = _wait_done(runner, h)
    assert st.state == AppState.SUCCEEDED and st.num_restarts == 2
    assert _logs(runner, h, "flaky").splitlines() == ["attempt 1", "attempt 2", "attempt 3"]
    h = runner.run(_app("doomed", "sh", "-c", "exit 7", max_retries=1), "monarch_local", {"pool": pool_name})
    st = _wait_done(runner, h)
    assert st.state == AppState.FAILED and "exited with code 7 after 2 attempts" in st.msg


def test_macros_and_env_reach_every_replica(runner, pool_name):
    from torchx.specs import macros

    role = Role(
        name="m",
        image=".",
        entrypoint="sh",
        num_replicas=2,
        args=["-c", f"echo app={macros.app_id} rep={macros.replica_id} rank0=${{{macros.rank0_env}}} x=$X"],
        env={"X": "from-role"},
    )
    h = runner.run(AppDef("macros", roles=[role]), "monarch_local", {"pool": pool_name, "preload": ""})
    _wait_done(runner, h)
    app = h.split("/")[-1]
    for k in range(2):
        assert _logs(runner, h, "m", k) == f"app={app} rep={k} rank0=127.0.0.1 x=from-role\n"


def test_missing_entrypoint_fails_with_the_os_error_and_the_pool_stays_healthy(runner, pool_name):
    h = runner.run(_app("missing", "/nonexistent/bin/prog"), "monarch_local", {"pool": pool_name, "preload": ""})
    st = _wait_done(runner, h)
    assert st.state == AppState.FAILED
    assert "No such file or directory" in st.msg and "/nonexistent/bin/prog" in st.msg
    h = runner.run(_app("notonpath", "no-such-program-xyz"), "monarch_local", {"pool": pool_name})
    st = _wait_done(runner, h)
    assert st.state == AppState.FAILED and "no-such-program-xyz" in st.msg
    h = runner.run(_app("ok", "true"), "monarch_local", {"pool": pool_name})
    assert _wait_done(runner, h).state == AppState.SUCCEEDED


def test_pool_that_cannot_serve_the_request_is_refused_or_replaced(runner, home, pool_name):
    from monarch_torchx.errors import MonarchError

    h = runner.run(_app("one", "true"), "monarch_local", {"pool": pool_name, "hosts": 1, "preload": ""})
    _wait_done(runner, h)
    with pytest.raises(MonarchError, match=r"hosts=1 \(you asked hosts=2\).*replace=True"):
        runner.run(_app("two", "true"), "monarch_local", {"pool": pool_name, "hosts": 2, "preload": ""})
    with pytest.raises(MonarchError, match="needs 2 hosts .* has 1"):
        runner.run(_app("two", "true", replicas=2), "monarch_local", {"pool": pool_name})
    with pytest.raises(MonarchError, match="at least 1 host"):
        runner.run(_app("zero", "true"), "monarch_local", {"pool": pool_name, "hosts": 0})
    old = [a.pid for a in Registry.hosts(Registry(home).get(pool_name))]
    h = runner.run(
        _app("two", "true", replicas=2),
        "monarch_local",
        {"pool": pool_name, "hosts": 2, "preload": "", "replace": True},
    )
    assert _wait_done(runner, h).state == AppState.SUCCEEDED
    new = Registry.hosts(Registry(home).get(pool_name))
    assert len(new) == 2 and not set(old) & {a.pid for a in new}


def test_describe_returns_the_app_as_submitted(runner, home, pool_name, tmp_path):
    from torchx.specs import Resource, RetryPolicy

    role = Role(
        name="trainer",
        image=str(tmp_path),
        entrypoint="python",
        args=["-c", "print('ok')"],
        num_replicas=2,
        env={"LR": "0.1", "MODE": "warm"},
        max_retries=2,
        retry_policy=RetryPolicy.REPLICA,
        port_map={"tensorboard": 6006},
        resource=Resource(cpu=2, gpu=0, memMB=1024, capabilities={"arch": "x86"}),
    )
    h = runner.run(AppDef(name="described", roles=[role]), "monarch_local", {"pool": pool_name, "preload": ""})
    _wait_done(runner, h)
    (got,) = runner.describe(h).roles
    assert (got.name, got.image, got.entrypoint, got.args, got.num_replicas) == (
        "trainer",
        str(tmp_path),
        "python",
        ["-c", "print('ok')"],
        2,
    )
    assert {"LR": "0.1", "MODE": "warm"}.items() <= got.env.items()
    assert (got.max_retries, got.retry_policy, got.port_map) == (2, RetryPolicy.REPLICA, {"tensorboard": 6006})
    assert (got.resource.cpu, got.resource.gpu, got.resource.memMB, got.resource.capabilities) == (
        2,
        0,
        1024,
        {"arch": "x86"},
    )
    # and the CLI, from another process
    from .conftest import torchx

    out = torchx(home, "describe", h).stdout
    assert "'LR': '0.1'" in out and "'max_retries': 2" in out and "'tensorboard': 6006" in out, out


def test_torchx_delete_cancels_the_app_and_forgets_it(home, pool_name, tmp_path):
    from .conftest import torchx

    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},hosts=1,preload=none",
        "utils.sh",
        "sleep",
        "600",
        cwd=tmp_path,
    )
    h = res.stdout.strip().splitlines()[-1]
    app = h.rsplit(":", 1)[1]
    assert app in torchx(home, "list", "-s", "monarch_local").stdout
    rec = Registry(home).require(pool_name)
    (arec,) = Registry.list_apps(rec)
    from monarch_torchx import apps, procfs
    from monarch_torchx.pool import attach

    (pid,) = [s.pid for s in apps.replica_states(attach(pool_name, Registry(home)), arec).values()]
    torchx(home, "delete", h)
    assert app not in torchx(home, "list", "-s", "monarch_local").stdout
    assert Registry.list_apps(Registry(home).require(pool_name)) == []
    wait_for(lambda: not procfs.alive(pid), timeout=15, what="the deleted app's process to end")
    assert get_scheduler_factories()["monarch_local"]("torchx").describe(h.rsplit("/", 1)[1]) is None
