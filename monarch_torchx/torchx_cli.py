"""Plugins for the ``torchx`` CLI (entry-point group ``torchx.cli.cmds``).

``torchx pool ...`` is ours. ``run``, ``log``, ``status``, ``describe``, ``cancel`` and ``list``
are TorchX's own commands, subclassed only so that a refusal from one of our schedulers prints
one line instead of a traceback, and so that ``torchx log`` on an app that does not exist fails
at once instead of polling forever (TorchX 0.7.0 waits for such an app to start).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from torchx.cli.cmd_base import SubCommand
from torchx.cli.cmd_cancel import CmdCancel as _Cancel
from torchx.cli.cmd_describe import CmdDescribe as _Describe
from torchx.cli.cmd_list import CmdList as _List
from torchx.cli.cmd_log import CmdLog as _Log
from torchx.cli.cmd_run import CmdRun as _Run
from torchx.cli.cmd_status import CmdStatus as _Status

from .errors import MonarchError


class _OneLineErrors:
    def run(self, args: argparse.Namespace) -> None:
        try:
            super().run(args)  # type: ignore[misc]
        except MonarchError as e:
            print(f"torchx: error: {e}", file=sys.stderr)
            sys.exit(1)


def check_run_options(scheduler: str, cfg_str: str) -> None:
    """TorchX ignores unknown -cfg keys and raises a traceback on bad values; we refuse in one line."""
    import difflib
    import re

    from torchx.schedulers import get_scheduler_factories

    opts = get_scheduler_factories()[scheduler]("default").run_opts()
    known = [name for name, _ in opts]
    for key in re.findall(r"(?:^|[,;])\s*([A-Za-z_][\w.-]*)\s*=", cfg_str or ""):
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; valid options: {', '.join(known)}"
            raise MonarchError(f"unknown run option {key!r} for {scheduler}{hint}")
    try:
        opts.cfg_from_str(cfg_str or "")
    except ValueError as e:
        raise MonarchError(f"invalid run option value in {cfg_str!r}: {e}") from None


class _PromptWaitRunner:
    """A TorchX Runner whose ``wait`` blocks on the pool's agents (they answer when the app ends)."""

    def __init__(self, runner: Any):
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def wait(self, app_handle: str, wait_interval: float = 10) -> Any:
        scheduler, _, app_id = self._runner._scheduler_app_id(app_handle, check_session=False)
        while True:
            status = self._runner.status(app_handle)
            if not status or status.is_terminal():
                return status
            scheduler.wait_until_done(app_id, timeout=max(wait_interval, 30.0))


class CmdRun(_OneLineErrors, _Run):
    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        """As TorchX's, but ``monarch_local`` is the default scheduler unless .torchxconfig names one.

        (TorchX takes the first registered entry point as default, and entry points are sorted.)
        """
        from torchx.schedulers import get_default_scheduler_name

        super().add_arguments(subparser)
        for action in subparser._actions:
            if action.dest == "scheduler" and action.default == get_default_scheduler_name():
                action.default = "monarch_local"

    def _wait_and_exit(self, runner: Any, app_handle: str, log: bool) -> None:
        """TorchX's, with a wait that returns when the app ends rather than at the next 1 s poll."""
        if app_handle.startswith("monarch_"):
            runner = _PromptWaitRunner(runner)
        super()._wait_and_exit(runner, app_handle, log)

    def run(self, args: argparse.Namespace) -> None:
        if str(getattr(args, "scheduler", "")).startswith("monarch_"):
            try:
                check_run_options(args.scheduler, args.scheduler_args)
            except MonarchError as e:
                print(f"torchx: error: {e}", file=sys.stderr)
                sys.exit(1)
        super().run(args)


class CmdStatus(_OneLineErrors, _Status):
    pass


class CmdDescribe(_OneLineErrors, _Describe):
    pass


class CmdCancel(_OneLineErrors, _Cancel):
    pass


class CmdList(_OneLineErrors, _List):
    pass


class CmdLog(_OneLineErrors, _Log):
    def run(self, args: argparse.Namespace) -> None:
        import threading

        default_hook = threading.excepthook

        def quiet(hook_args: "threading.ExceptHookArgs") -> None:  # TorchX re-raises it in the main thread
            if not isinstance(hook_args.exc_value, MonarchError):
                default_hook(hook_args)

        threading.excepthook = quiet
        scheduler, sep, path = args.identifier.partition("://")
        if sep and scheduler.startswith("monarch_"):
            parts = path.split("/")
            if len(parts) >= 2 and parts[1]:
                from torchx.schedulers import get_scheduler_factories

                sched = get_scheduler_factories()[scheduler](parts[0] or "default")
                if sched.describe(parts[1]) is None:
                    print(f"torchx: error: no app {parts[1]!r} on {scheduler}; see `torchx list -s {scheduler}`",
                          file=sys.stderr)
                    sys.exit(1)
        super().run(args)


class CmdPool(SubCommand):
    """``torchx pool create|list|status|stop``: same as ``monarch-torchx pool ...``."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        from .cli import add_pool_arguments

        add_pool_arguments(subparser)

    def run(self, args: argparse.Namespace) -> None:
        from .cli import run_pool

        run_pool(args)
