"""How a long-lived server of ours ends once its own cleanup is done.

An agent or a FUSE server that has ended and cleaned up everything it owns has nothing left for
CPython's finalization to do but collect its whole heap; on a node whose cores host many of them
(a big pool on one machine, or a pool stop on a busy node) that collection was most of their CPU
at stop. Logs and stdio are flushed first, since ``os._exit`` skips that.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_without_finalizing(code: int = 0) -> None:
    """Flushes logging and stdio, then ends the process with ``code`` at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    os._exit(code)
