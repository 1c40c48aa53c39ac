"""Our stand-in for Monarch's helper: the procs a test spawned are stopped after it."""

from __future__ import annotations

import pytest

from monarch_torchx.actor import HostMesh


@pytest.fixture(autouse=True)
def stop_all_proc_meshes(monkeypatch):
    spawned = []
    real = HostMesh.spawn_procs

    def recording(self, *a, **kw):
        pm = real(self, *a, **kw)
        spawned.append(pm)
        return pm

    monkeypatch.setattr(HostMesh, "spawn_procs", recording)
    yield
    for pm in spawned:
        try:
            pm.stop().get(timeout=15)
        except Exception:
            pass
