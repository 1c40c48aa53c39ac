"""Our stand-in for Monarch's helper: a job's state for one test, the job killed after it."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def scoped_state(job, cached_path=".monarch/job_state.pkl"):
    state = job.state(cached_path=cached_path)
    try:
        yield state
    finally:
        try:
            job.kill()
        except Exception:
            pass
