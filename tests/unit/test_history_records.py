"""How replicas ended, kept on disk (``monarch_torchx/history.py``), and stopped pools' state dirs,
remembered and pruned: all in temporary directories."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from monarch_torchx import history
from monarch_torchx.history import ReplicaEnd


def end(app="app-1", role="trainer", rid=0, state="SUCCEEDED", **kw) -> ReplicaEnd:
    return ReplicaEnd(app, role, rid, state, **kw)


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


def test_a_recorded_end_is_read_back_as_it_was_written_in_a_private_file(state_dir):
    e = end(exit_code=0, msg="", attempts=2, started=10.0, ended=20.5, hostname="node3")
    history.record_end(state_dir, e)
    path = history.end_path(state_dir, "app-1", "trainer", 0)
    assert path == state_dir / "ended" / "app-1" / "trainer.0.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "age_s" not in json.loads(path.read_text())
    assert history.read_ends(state_dir, "app-1") == {("trainer", 0): e}


def test_names_that_are_not_plain_file_names_stay_inside_the_app_dir(state_dir):
    e = end(app="../../etc", role="a/b", rid=3)
    history.record_end(state_dir, e)
    path = history.end_path(state_dir, "../../etc", "a/b", 3)
    assert path.parent.parent == state_dir / "ended" and path.exists()
    assert history.read_ends(state_dir, "../../etc") == {("a/b", 3): e}


def test_every_replica_of_an_app_is_kept_apart_and_a_new_launch_forgets_its_old_end(state_dir):
    checked: set = set()
    for rid, state in enumerate(["SUCCEEDED", "FAILED", "CANCELLED"]):
        history.record_end(state_dir, end(rid=rid, state=state, exit_code=rid), checked)
    history.record_end(state_dir, end(app="app-2"), checked)
    assert len(checked) == 2  # each app's dir checked once by this writer
    ends = history.read_ends(state_dir, "app-1")
    assert {k: e.state for k, e in ends.items()} == {
        ("trainer", 0): "SUCCEEDED",
        ("trainer", 1): "FAILED",
        ("trainer", 2): "CANCELLED",
    }
    history.forget_end(state_dir, "app-1", "trainer", 1)
    history.forget_end(state_dir, "app-1", "trainer", 9)  # never ended: nothing to forget, no error
    assert sorted(history.read_ends(state_dir, "app-1")) == [("trainer", 0), ("trainer", 2)]
    history.forget_app(state_dir, "app-1")
    assert history.read_ends(state_dir, "app-1") == {} and len(history.read_ends(state_dir, "app-2")) == 1


def test_damaged_or_foreign_files_are_skipped_not_a_traceback(state_dir):
    history.record_end(state_dir, end(rid=0))
    d = state_dir / "ended" / "app-1"
    (d / "trainer.1.json").write_text('{"app_id": "app-1", "role": "trainer", "replica_id": 1, "state": "RUNNING"}')
    (d / "trainer.2.json").write_text("{not json")
    (d / "trainer.3.json").write_text('["a", "list"]')
    (d / "trainer.4.json").write_text(json.dumps(vars(end(app="other", rid=4))))  # another app's end
    (d / "notes.txt").write_text("ignored")
    assert list(history.read_ends(state_dir, "app-1")) == [("trainer", 0)]
    assert history.read_ends(state_dir, "never-ran") == {}


@pytest.mark.parametrize(
    "data, why",
    [
        ({"app_id": "a", "role": "r", "replica_id": True, "state": "FAILED"}, "not an end"),  # a bool is not an id
        ({"app_id": "a", "role": "r", "replica_id": "0", "state": "FAILED"}, "not an end"),
        ({"app_id": "a", "role": "r", "replica_id": 0, "state": "RUNNING"}, "not an end"),  # not final
        ({"app_id": "a", "role": "r"}, "missing"),
    ],
)
def test_a_record_that_is_not_an_end_is_refused(data, why):
    with pytest.raises(ValueError, match=why):
        ReplicaEnd.from_json(data)


def test_an_end_read_as_a_replica_status_is_the_same_end_again_and_a_live_status_is_no_end():
    from monarch_torchx.specs import ReplicaState, ReplicaStatus

    e = end(state="FAILED", exit_code=3, msg="exited with code 3", attempts=2, started=1.0, ended=2.0, hostname="n1")
    st = e.status()
    assert st.recorded and st.state == ReplicaState.FAILED and (st.exit_code, st.attempts) == (3, 2)
    assert ReplicaEnd.from_status("app-1", "trainer", 0, st) == e
    assert ReplicaEnd.from_status("a", "r", 0, ReplicaStatus(ReplicaState.SUCCEEDED)).attempts == 1
    with pytest.raises(ValueError, match="not an end"):
        ReplicaEnd.from_status("a", "r", 0, ReplicaStatus(ReplicaState.RUNNING))


def test_ages_are_read_on_the_file_systems_clock_only_when_asked(state_dir):
    history.record_end(state_dir, end())
    path = history.end_path(state_dir, "app-1", "trainer", 0)
    old = time.time() - 3600
    os.utime(path, (old, old))
    assert history.read_ends(state_dir, "app-1")[("trainer", 0)].age_s is None
    assert not (path.parent / ".clock").exists()  # a plain read touches nothing
    age = history.read_ends(state_dir, "app-1", ages=True)[("trainer", 0)].age_s
    assert 3590 < age < 3700


# ------------------------------------------------------------ stopped pools


@pytest.fixture
def stopped(tmp_path):
    d = tmp_path / "home" / "stopped"
    d.parent.mkdir(mode=0o700)
    return d


def pool_dir(tmp_path, name: str):
    d = tmp_path / "pools" / name
    d.mkdir(parents=True)
    (d / "apps").mkdir()
    return d


def test_stopped_pools_of_a_name_are_remembered_newest_first_and_once_per_state_dir(stopped, tmp_path):
    a, b = pool_dir(tmp_path, "a"), pool_dir(tmp_path, "b")
    history.remember_stopped(stopped, "p", "monarch_local", a)
    history.remember_stopped(stopped, "p", "monarch_slurm", b)
    history.remember_stopped(stopped, "p", "monarch_local", a)  # the same dir stopped again: moves to the front
    assert [(p.state_dir, p.scheduler) for p in history.stopped_pools(stopped, "p")] == [
        (str(a), "monarch_local"),
        (str(b), "monarch_slurm"),
    ]
    assert history.stopped_names(stopped) == ["p"] and history.stopped_pools(stopped, "q") == []
    (stopped / "q.json").write_text("{damaged")
    assert history.stopped_pools(stopped, "q") == []  # unreadable: none, not a traceback


def test_pruning_removes_only_dirs_past_the_retention_that_nothing_still_uses(stopped, tmp_path, monkeypatch):
    monkeypatch.setenv(history.HISTORY_DAYS_ENV, "1")
    dirs = {name: pool_dir(tmp_path, name) for name in ("old", "recent", "live", "skip", "secret")}
    (dirs["secret"] / "token").write_text("00")  # holds a pool's secret again: a pool uses it
    for name, d in dirs.items():
        history.remember_stopped(stopped, name, "monarch_local", d)
    later = time.time() + 2 * 86400
    history.remember_stopped(stopped, "recent", "monarch_local", dirs["recent"])
    removed = history.prune_stopped(stopped, [dirs["live"]], now=later, skip=dirs["skip"])
    assert sorted(removed) == sorted([dirs["old"], dirs["recent"]])
    assert not dirs["old"].exists() and all(dirs[n].exists() for n in ("live", "skip", "secret"))
    assert history.stopped_pools(stopped, "old") == [] and not (stopped / "old.json").exists()
    assert len(history.stopped_pools(stopped, "live")) == 1


def test_the_retention_comes_from_the_environment_and_a_bad_value_is_the_default(monkeypatch):
    monkeypatch.setenv(history.HISTORY_DAYS_ENV, "0.5")
    assert history.retention_s() == 43200
    monkeypatch.setenv(history.HISTORY_DAYS_ENV, "-3")
    assert history.retention_s() == 0
    monkeypatch.setenv(history.HISTORY_DAYS_ENV, "a month")
    assert history.retention_s() == history.DEFAULT_HISTORY_DAYS * 86400


def test_apps_older_than_the_retention_are_forgotten_with_their_ends(state_dir, monkeypatch):
    monkeypatch.setenv(history.HISTORY_DAYS_ENV, "1")
    (state_dir / "apps").mkdir()
    for app, age_days in (("old-app", 3), ("new-app", 0)):
        rec = state_dir / "apps" / f"{app}.json"
        rec.write_text("{}")
        t = time.time() - age_days * 86400
        os.utime(rec, (t, t))
        history.record_end(state_dir, end(app=app))
    assert history.prune_old_apps(state_dir) == 1
    assert [p.name for p in (state_dir / "apps").iterdir()] == ["new-app.json"]
    assert history.read_ends(state_dir, "old-app") == {} and len(history.read_ends(state_dir, "new-app")) == 1
