"""Plugins for the ``torchx`` CLI (entry-point group ``torchx.cli.cmds``).

``torchx pool ...`` is ours. ``run``, ``log``, ``status``, ``describe``, ``cancel`` and ``list``
are TorchX's own commands, subclassed only so that a refusal from one of our schedulers prints
one line instead of a traceback, and so that ``torchx log`` on an app that does not exist fails
at once instead of polling forever (TorchX 0.7.0 waits for such an app to start).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from datetime import datetime

from torchx.cli.cmd_base import SubCommand
from torchx.cli.cmd_cancel import CmdCancel as _Cancel
from torchx.cli.cmd_describe import CmdDescribe as _Describe
from torchx.cli.cmd_list import CmdList as _List
from torchx.cli.cmd_log import CmdLog as _Log
from torchx.cli.cmd_run import CmdRun as _Run
from torchx.cli.cmd_status import CmdStatus as _Status

from .errors import MonarchError


@contextlib.contextmanager
def _components_found_once() -> Iterator[None]:
    """TorchX's component finder validates every component of every registered module on each
    ``torchx run``, and for each one it scans every installed distribution's entry points again
    (``torchx.util.io.read_conf_file``) and parses its module's source again (``file_linter``):
    19 of each for ``torchx run utils.echo`` (the cost: RESULTS.md ``warm-iterations``). Neither
    the installed distributions nor a module's source change while one command runs, so for its
    length the full scan is made once and each source parsed once (a call that asks for a group
    or a name, or a parse with other options, still goes through as it is)."""
    import ast

    from torchx.util import entrypoints

    metadata = entrypoints.metadata  # importlib.metadata, or the importlib_metadata backport (torchx 0.7.0)
    real_scan, real_parse = metadata.entry_points, ast.parse
    scanned: list[Any] = []
    parsed: dict[str, Any] = {}

    def entry_points(**params: Any) -> Any:
        if params:
            return real_scan(**params)
        if not scanned:
            scanned.append(real_scan())
        return scanned[0]

    def parse(source: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(source, str):
            return real_parse(source, *args, **kwargs)
        if source not in parsed:  # (the linter only reads the tree)
            parsed[source] = real_parse(source)
        return parsed[source]

    metadata.entry_points, ast.parse = entry_points, parse
    try:
        yield
    finally:
        metadata.entry_points, ast.parse = real_scan, real_parse


class _OneLineErrors:
    """A refusal is one line on stderr (a JSON object on stdout under ``--json``), Ctrl-C too."""

    def run(self, args: argparse.Namespace) -> None:
        from .cli import error_kind, fail, interrupted_message

        as_json = bool(getattr(args, "json", False))
        try:
            super().run(args)  # type: ignore[misc]
        except MonarchError as e:
            fail(str(e), error_kind(e), 1, as_json, prog="torchx: error")
        except KeyboardInterrupt as e:  # (a pool being created says what it left: CreateInterrupted)
            fail(interrupted_message(e), error_kind(e), 130, as_json, prog="monarch-torchx")


def check_scheduler(scheduler: str) -> None:
    """A scheduler that is not registered (``-s monarch_locl``, or .torchxconfig's ``[cli:run]
    scheduler``) is one line naming the close one and the known ones, not a KeyError."""
    import difflib

    from torchx.schedulers import get_scheduler_factories

    known = list(get_scheduler_factories())
    if scheduler not in known:
        close = difflib.get_close_matches(scheduler, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise MonarchError(
            f"no scheduler {scheduler!r} (from -s, or .torchxconfig's [cli:run] scheduler): "
            f"{hint}known: {', '.join(known)}"
        )


def check_config_files(scheduler: str, cfg_str: str) -> None:
    """The .torchxconfig files TorchX will read for this run, checked first, because TorchX
    silently ignores a section it does not know (``[monarch_locl]``: the run falls back to
    defaults, e.g. a 1-host pool ``default``) and raises a traceback on a value of the wrong
    type (``hosts = abc``) or a malformed file. A misspelled section is a one-line warning that
    names it and the known ones; a bad value or file is refused in one line naming file, section
    and key. (Values ``-cfg`` sets are not read from the file, so they are not checked there.)"""
    import configparser
    import difflib

    from torchx.runner.config import find_configs
    from torchx.schedulers import get_scheduler_factories

    known = list(get_scheduler_factories())
    given = set(_cfg_keys(cfg_str))
    for path in find_configs():
        parser = configparser.ConfigParser()
        parser.optionxform = str  # type: ignore[assignment,method-assign]  # as TorchX's: case-sensitive options
        try:
            parser.read(path)
        except configparser.Error as e:
            raise MonarchError(f"{path} is not a valid .torchxconfig: {e.message.splitlines()[0]}") from None
        for section in parser.sections():
            if ":" not in section and section not in known:  # (cli:run, component:X, tracker:X: TorchX's own)
                close = difflib.get_close_matches(section, known, n=1)
                hint = f" (did you mean [{close[0]}]?)" if close else ""
                print(
                    f"torchx: warning: {path}: section [{section}] is not a scheduler, so it is ignored{hint}; "
                    f"schedulers: {', '.join(known)}",
                    file=sys.stderr,
                )
        if parser.has_section(scheduler):
            _check_config_values(path, parser, scheduler, given)


def _cfg_keys(cfg_str: str) -> list[str]:
    import re

    return re.findall(r"(?:^|[,;])\s*([A-Za-z_][\w.-]*)\s*=", cfg_str or "")


def _check_config_values(path: str, parser: Any, scheduler: str, given: set[str]) -> None:
    """Each value of the scheduler's section casts to its run option's type (as TorchX will cast it)."""
    from torchx.schedulers import get_scheduler_factories

    opts = get_scheduler_factories()[scheduler]("default").run_opts()
    for key, value in parser.items(scheduler):
        opt = opts.get(key)
        if opt is None or key in given or value == "None":
            continue
        kind = opt.opt_type
        try:
            if kind is bool:
                parser.getboolean(scheduler, key)
            elif kind in (int, float):
                kind(value)
        except ValueError:
            what = {bool: "true or false", int: "an integer", float: "a number"}[kind]
            raise MonarchError(
                f"{path}: [{scheduler}] {key} = {value} is not {what}; fix it there (or give -cfg {key}=...)"
            ) from None


def check_run_options(scheduler: str, cfg_str: str) -> None:
    """TorchX ignores unknown -cfg keys and raises a traceback on bad values; we refuse in one line."""
    import difflib

    from torchx.schedulers import get_scheduler_factories

    check_scheduler(scheduler)
    opts = get_scheduler_factories()[scheduler]("default").run_opts()
    known = [name for name, _ in opts]
    for key in _cfg_keys(cfg_str):
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; valid options: {', '.join(known)}"
            raise MonarchError(f"unknown run option {key!r} for {scheduler}{hint}")
    try:
        opts.cfg_from_str(cfg_str or "")
    except ValueError as e:
        raise MonarchError(f"invalid run option value in {cfg_str!r}: {e}") from None


class _PromptWaitRunner:
    """A TorchX Runner whose ``wait`` blocks on the pool's agents (they answer when the app ends).

    With ``--log``, it also waits for the thread that follows the replicas' output to print their
    last lines: TorchX logs "job finished" as soon as ``wait`` returns and only then joins that
    thread, so the replicas' last lines came after it."""

    def __init__(self, runner: Any, log_thread: Any = lambda: None):
        self._runner = runner
        self._log_thread = log_thread

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def wait(self, app_handle: str, wait_interval: float = 10) -> Any:
        scheduler, _, app_id = self._runner._scheduler_app_id(app_handle, check_session=False)
        while True:
            status = self._runner.status(app_handle)
            if not status or status.is_terminal():
                break
            scheduler.wait_until_done(app_id, timeout=max(wait_interval, 30.0))
        thread = self._log_thread()
        if thread is not None:
            thread.join()  # (it ends with the replicas' streams; TorchX joins it next anyway)
        return status


def dryrun_json(info: Any, scheduler: str) -> dict[str, Any]:
    """``torchx run --dryrun --json``'s object on torchx 0.7.0 (whose AppDryRunInfo keeps ``_app``
    and ``_cfg``), in torchx-nightly's schema: scheduler, cfg, app, request."""
    from dataclasses import asdict, is_dataclass

    request = info.request
    return {
        "scheduler": scheduler,
        "cfg": dict(info._cfg or {}),
        "app": asdict(info._app) if info._app else None,
        "request": asdict(request) if is_dataclass(request) and not isinstance(request, type) else str(info),
    }


class _CaptureDryrun:
    """A Runner that keeps the dry-run it computes (torchx 0.7.0 prints it only as text)."""

    def __init__(self, runner: Any):
        self._runner, self.info = runner, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def dryrun_component(self, *args: Any, **kwargs: Any) -> Any:
        self.info = self._runner.dryrun_component(*args, **kwargs)
        return self.info


class CmdRun(_OneLineErrors, _Run):
    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        """As TorchX's, but ``monarch_local`` is the default scheduler unless .torchxconfig names one.

        (TorchX takes the first registered entry point as default, and entry points are sorted.)
        torchx 0.7.0 also gets torchx-nightly's ``--json`` for dry-runs.
        """
        from torchx.schedulers import get_default_scheduler_name

        super().add_arguments(subparser)
        for action in subparser._actions:
            if action.dest == "scheduler" and action.default == get_default_scheduler_name():
                action.default = "monarch_local"
        self._own_json = not any("--json" in a.option_strings for a in subparser._actions)
        if self._own_json:
            subparser.add_argument(
                "--json", action="store_true", default=False, help="with --dryrun: print the dry-run as one JSON object"
            )

    def _run(self, runner: Any, args: argparse.Namespace) -> None:
        if not (getattr(self, "_own_json", False) and args.json):
            return super()._run(runner, args)
        if not args.dryrun:
            print("torchx: error: --json goes with --dryrun on this torchx (0.7.0)", file=sys.stderr)
            sys.exit(1)
        import contextlib
        import io
        import json

        capture = _CaptureDryrun(runner)
        with contextlib.redirect_stdout(io.StringIO()):
            super()._run(capture, args)
        print(json.dumps(dryrun_json(capture.info, args.scheduler), default=str))

    def _start_log_thread(self, runner: Any, app_handle: str, *args: Any, **kwargs: Any) -> Any:
        """TorchX's, kept so that the prompt wait can let it print the replicas' last lines."""
        self._log_thread = super()._start_log_thread(runner, app_handle, *args, **kwargs)
        return self._log_thread

    def _wait_and_exit(self, runner: Any, app_handle: str, log: bool) -> None:
        """TorchX's, with a wait that returns when the app ends rather than at the next 1 s poll."""
        if app_handle.startswith("monarch_"):
            runner = _PromptWaitRunner(runner, lambda: getattr(self, "_log_thread", None))
        with _still_running_on_interrupt(app_handle):
            super()._wait_and_exit(runner, app_handle, log)

    def _wait(self, runner: Any, app_handle: str, log: bool, tee_logs: bool = False) -> Any:
        """torchx-nightly's wait (it has no ``_wait_and_exit``): the same prompt wait."""
        if app_handle.startswith("monarch_"):
            runner = _PromptWaitRunner(runner, lambda: getattr(self, "_log_thread", None))
        with _still_running_on_interrupt(app_handle):
            return super()._wait(runner, app_handle, log, tee_logs)

    def run(self, args: argparse.Namespace) -> None:
        from torchx.specs import InvalidRunConfigException

        from .cli import error_kind, fail

        try:
            check_scheduler(args.scheduler)
            check_config_files(args.scheduler, args.scheduler_args)
            if str(args.scheduler).startswith("monarch_"):
                check_run_options(args.scheduler, args.scheduler_args)
        except MonarchError as e:
            fail(str(e), error_kind(e), 1, bool(getattr(args, "json", False)), prog="torchx: error")
        try:
            with _components_found_once():
                super().run(args)
        except InvalidRunConfigException as e:  # TorchX's own refusal of -cfg (torchx-nightly raises it as a traceback)
            print(
                f"torchx: error: {str(e).splitlines()[0]} (`torchx runopts {args.scheduler}` lists them)",
                file=sys.stderr,
            )
            sys.exit(1)


@contextlib.contextmanager
def _still_running_on_interrupt(app_handle: str) -> Iterator[None]:
    """Ctrl-C while ``torchx run --wait`` waits: the app runs on (it is the pool's, not this
    shell's); say so with the command that ends it, exit 130, no traceback."""
    try:
        yield
    except KeyboardInterrupt:
        if not app_handle.startswith("monarch_"):
            raise
        print(f"monarch-torchx: app still running: torchx cancel {app_handle}", file=sys.stderr, flush=True)
        sys.exit(130)


class CmdStatus(_OneLineErrors, _Status):
    pass


class CmdDelete(_OneLineErrors, SubCommand):
    """``torchx delete APP_HANDLE``: cancels the app if it runs, then forgets it. torchx-nightly
    has this command; on torchx 0.7.0 it is ours, for our schedulers (0.7.0's have no delete)."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        subparser.add_argument("app_handle", type=str, help="torchx app handle (e.g. monarch_local://torchx/dev:app)")

    def run(self, args: argparse.Namespace) -> None:
        from torchx.runner import get_runner
        from torchx.specs import parse_app_handle

        with get_runner() as runner:
            if hasattr(runner, "delete"):
                return runner.delete(args.app_handle)
            handle = parse_app_handle(args.app_handle)
            sched = runner._scheduler(handle.scheduler_backend)
            if not hasattr(sched, "delete"):
                print(
                    f"torchx: error: {handle.scheduler_backend} cannot delete apps on torchx 0.7.0; use "
                    "`torchx cancel`",
                    file=sys.stderr,
                )
                sys.exit(1)
            sched.delete(handle.app_id)


class CmdDescribe(_OneLineErrors, _Describe):
    pass


class CmdCancel(_OneLineErrors, _Cancel):
    """TorchX's, but an app our schedulers do not know is one line and exit status 1 (TorchX
    cancels nothing and exits 0 without a word, so a typo in a handle looked like success)."""

    def run(self, args: argparse.Namespace) -> None:
        scheduler, sep, _ = args.app_handle.partition("://")
        if sep and scheduler.startswith("monarch_"):
            from torchx.runner import get_runner
            from torchx.specs import parse_app_handle

            with get_runner() as runner:
                if runner.status(args.app_handle) is None:
                    _no_such_app(parse_app_handle(args.app_handle).app_id, scheduler)
        super().run(args)


class CmdList(_OneLineErrors, _List):
    pass


def log_time(text: str) -> datetime:
    """A ``--since``/``--until`` value: a duration ago (90s, 10m, 2h, 1d) or an ISO 8601 time."""
    from datetime import datetime, timedelta

    from .pool import parse_duration

    try:
        return datetime.now() - timedelta(seconds=parse_duration(text, "time"))
    except MonarchError:
        pass
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: use a duration ago (90s, 10m, 2h) or an ISO time (2026-12-02T10:30)"
        ) from None


class _TimeWindow:
    """A Runner whose ``log_lines`` keeps only the lines logged between ``since`` and ``until``
    (TorchX's ``torchx log`` passes neither; its Runner and our schedulers take both)."""

    def __init__(self, runner: Any, since: Any, until: Any):
        self._runner, self._since, self._until = runner, since, until

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def log_lines(
        self,
        app_handle: str,
        role_name: str,
        k: int = 0,
        regex: Any = None,
        since: Any = None,
        until: Any = None,
        should_tail: bool = False,
        streams: Any = None,
    ) -> Any:
        return self._runner.log_lines(
            app_handle,
            role_name,
            k,
            regex,
            since=since or self._since,
            until=until or self._until,
            should_tail=should_tail,
            streams=streams,
        )


class CmdLog(_OneLineErrors, _Log):
    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        super().add_arguments(subparser)
        subparser.add_argument(
            "--since",
            type=log_time,
            default=None,
            metavar="WHEN",
            help="only lines logged at or after WHEN: a duration ago (10m) or an ISO time",
        )
        subparser.add_argument(
            "--until",
            type=log_time,
            default=None,
            metavar="WHEN",
            help="only lines logged before WHEN: a duration ago (10m) or an ISO time",
        )

    def run(self, args: argparse.Namespace) -> None:
        import threading

        default_hook = threading.excepthook

        def quiet(hook_args: threading.ExceptHookArgs) -> None:  # TorchX re-raises it in the main thread
            if not isinstance(hook_args.exc_value, MonarchError):
                default_hook(hook_args)

        threading.excepthook = quiet
        scheduler, sep, path = args.identifier.partition("://")
        if sep and scheduler.startswith("monarch_"):
            parts = path.split("/")
            if len(parts) >= 2 and parts[1]:
                from torchx.cli.cmd_log import validate
                from torchx.schedulers import get_scheduler_factories

                validate(args.identifier)
                sched = get_scheduler_factories()[scheduler](parts[0] or "default")
                show = _follow_app_logs if args.tail else _print_app_logs
                try:
                    show(sched, scheduler, parts, args)
                except MonarchError as e:
                    print(f"torchx: error: {e}", file=sys.stderr)
                    sys.exit(1)
                except KeyboardInterrupt:  # Ctrl-C ends a follow: no traceback
                    sys.exit(130)
                except BrokenPipeError:  # `torchx log ... | head`: the reader has what it wanted (as TorchX: quietly)
                    import os

                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                    sys.exit(0)
                return
        if args.since is None and args.until is None:
            return super().run(args)
        from torchx.cli.cmd_log import get_logs
        from torchx.runner import get_runner

        try:
            with get_runner() as runner:
                get_logs(
                    sys.stdout,
                    args.identifier,
                    args.regex,
                    args.tail,
                    runner=_TimeWindow(runner, args.since, args.until),
                    streams=args.streams,
                )
        except MonarchError as e:
            print(f"torchx: error: {e}", file=sys.stderr)
            sys.exit(1)


def _no_such_app(app_id: str, scheduler: str) -> None:
    print(f"torchx: error: no app {app_id!r} on {scheduler}; see `torchx list -s {scheduler}`", file=sys.stderr)
    sys.exit(1)


def _print_app_logs(sched: Any, scheduler: str, parts: list[str], args: argparse.Namespace) -> None:
    """``torchx log`` of an app on a pool, without ``--tail``: TorchX's output (each line prefixed
    with its ``role/replica``, in TorchX's colours), but asked of the pool once per host through its
    relay tree (``MonarchScheduler.app_logs``), not by one thread and one stream per replica, so
    the client's cost grows with the bytes, not with the replicas. Replica by replica, in order."""
    from torchx.cli import cmd_log

    app_id, replicas = _replicas_to_show(sched, scheduler, parts)
    failures = []
    for name, k, lines in sched.app_logs(app_id, replicas, args.regex, args.since, args.until, args.streams):
        prefix = f"{cmd_log.GREEN}{name}/{k}{cmd_log.ENDC} "
        try:
            sys.stdout.writelines(cmd_log._prefix_line(prefix, line) for line in lines)
        except MonarchError as e:  # that replica's host: the others are still printed
            failures.append(str(e))
        sys.stdout.flush()
    for why in failures:
        print(f"torchx: error: {why}", file=sys.stderr)
    if failures:
        sys.exit(1)


def _follow_app_logs(sched: Any, scheduler: str, parts: list[str], args: argparse.Namespace) -> None:
    """``torchx log --tail`` of an app on a pool: TorchX's output (lines as they are written, each
    prefixed with its ``role/replica``), through the relay tree (``MonarchScheduler.follow_logs``):
    the client holds a few streams, not one thread and one stream per replica. A host that cannot
    be followed is named on stderr as soon as that is known, the others go on, and the exit
    status is 1 at the end."""
    from torchx.cli import cmd_log

    app_id, replicas = _replicas_to_show(sched, scheduler, parts)
    failed = 0
    for ev in sched.follow_logs(app_id, replicas, args.regex, args.since, args.until, args.streams):
        if ev.lines:
            prefix = f"{cmd_log.GREEN}{ev.role}/{ev.replica_id}{cmd_log.ENDC} "
            sys.stdout.writelines(cmd_log._prefix_line(prefix, line) for line in ev.lines)
            sys.stdout.flush()
        elif ev.error:
            failed += 1
            where = f"{ev.role}/{ev.replica_id}" if ev.role else f"host {ev.host}"
            print(f"torchx: error: logs of {where} not followed: {ev.error}", file=sys.stderr, flush=True)
    if failed:
        sys.exit(1)


def _replicas_to_show(sched: Any, scheduler: str, parts: list[str]) -> tuple[str, list[tuple[str | None, int]]]:
    """The app id and the (role, replica) pairs a ``torchx log`` identifier names, once the app
    has started (as TorchX: it waits for a submitted app, saying so)."""
    import time

    from torchx.specs import AppState

    app_id, role = parts[1], (parts[2] if len(parts) > 2 and parts[2] else None)
    resp = sched.describe(app_id)
    waiting = True
    # not yet started; an app whose state is UNKNOWN (a host did not answer) has its other logs printed now
    while resp is not None and resp.state in (AppState.UNSUBMITTED, AppState.SUBMITTED, AppState.PENDING):
        if waiting:
            print("Waiting for app state response before fetching logs...", file=sys.stderr)
            waiting = False
        time.sleep(1)
        resp = sched.describe(app_id)
    if resp is None:
        _no_such_app(app_id, scheduler)
    if len(parts) == 4:
        replicas = [(role, int(i)) for i in parts[3].split(",") if i]
    else:
        replicas = [(r.name, i) for r in resp.roles if role is None or r.name == role for i in range(r.num_replicas)]
    if not replicas:
        names = ", ".join(r.name for r in resp.roles)
        raise MonarchError(f"app {app_id!r} has no role {role!r}; its roles: {names}")
    return app_id, replicas


class CmdRunopts(SubCommand):
    """``torchx runopts [SCHEDULER]``: as TorchX's, but a built-in scheduler whose own dependency is
    not installed (torchx 0.7.0's ``aws_sagemaker`` needs boto3, ``ray`` needs ray) is one line
    saying so, instead of an error line or a traceback that ends the listing."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        subparser.add_argument(
            "scheduler", type=str, nargs="?", help="scheduler to print the run options of (default: every scheduler)"
        )

    def run(self, args: argparse.Namespace) -> None:
        from torchx.schedulers import get_scheduler_factories

        factories = get_scheduler_factories()
        if args.scheduler and args.scheduler not in factories:
            print(f"torchx: error: no scheduler {args.scheduler!r}: use one of {', '.join(factories)}", file=sys.stderr)
            sys.exit(1)
        for name, factory in factories.items():
            if args.scheduler and name != args.scheduler:
                continue
            try:
                opts = factory("default").run_opts()
            except Exception as e:  # noqa: BLE001 (another package's scheduler: any failure is its own)
                missing = getattr(e, "name", None) if isinstance(e, ImportError) else None
                why = f"needs {missing} (pip install {missing})" if missing else f"{type(e).__name__}: {e}"
                print(f"{name} (not available here: {why})\n")
                continue
            print(f"{name}:\n{opts!r}\n")


class CmdPool(SubCommand):
    """``torchx pool create|list|status|stop``: same as ``monarch-torchx pool ...``."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        from .cli import add_pool_arguments

        add_pool_arguments(subparser)

    def run(self, args: argparse.Namespace) -> None:
        from .cli import run_pool

        run_pool(args)
