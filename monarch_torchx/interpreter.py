"""How we start our own Python processes on a node: never importing from the directory we start in.

``python -m pkg`` puts the current directory first on ``sys.path``. An agent, fork server or
worker started from a directory another user can write (a group project directory, the client's
cwd on shared scratch) would import their planted ``monarch_torchx/__init__.py`` or ``torch.py``
and run it as the pool's owner. So every process of ours starts with that entry left out: ``-P``
(Python 3.11+), or on 3.10 a ``-c`` stub that drops it before anything is imported. ``-I`` would
do it too, but it also ignores ``PYTHONPATH``, which a user's install may rely on. The user's own
cwd is applied to replicas only, by the fork server, after start-up.
"""

from __future__ import annotations

import sys

# what a 3.10 interpreter runs instead of ``-P -m MODULE``: ``-c`` puts '' (the cwd) first on
# sys.path, and the stub removes it before the module (or anything it imports) is looked up. The
# module stays an argument of its own, so a command line is recognised the same on every version.
_STUB_310 = (
    "import sys, runpy; sys.path.pop(0); module = sys.argv.pop(1); "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def module_argv(module: str, *args: str, python: str | None = None) -> list[str]:
    """The command line that runs ``module`` as ``__main__`` with the cwd off ``sys.path``."""
    exe = python or sys.executable
    if sys.version_info >= (3, 11):
        return [exe, "-P", "-m", module, *args]
    return [exe, "-c", _STUB_310, module, *args]
