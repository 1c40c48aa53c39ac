"""Which roles run as a warm torchrun, and why: torchrun's command line read without importing torch.

A role whose command is torchrun (``torchrun ...``, ``python -m torch.distributed.run ...``, or
dist.ddp's ``bash -c "torchrun ..."``) is run on a pool by ``agent/torchrun_node.py``: torch's
own elastic agent, started from the host's warm fork server, with workers forked rather than
exec'd and the role's hosts meeting at a store the pool places. This module decides that on the
client (``--dryrun`` prints the decision), so it must not import torch: it carries torchrun's
option table (checked against torch's own parser in the tests) and a small POSIX-shell reader.
What it cannot honour runs the real torchrun, unchanged.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from typing import Sequence

from .errors import MonarchError

NODE_MODULE = "monarch_torchx.agent.torchrun_node"
PLAN_ENV = "MONARCH_TORCHX_TORCHRUN"  # the node's placement (json), set per replica at submit
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # a node's forked workers apply these themselves
WARM_BACKENDS = ("c10d",)  # rendezvous backends the pool stands in for
# what a node process imports beyond torch; the warm fork server imports them with torch
TORCH_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
)

# torchrun's options as (names, takes a value, default); `torch.distributed.run.get_args_parser()`
# is the source, and tests/test_torchrun.py fails when the two differ.
OPTIONS: tuple[tuple[tuple[str, ...], bool, object], ...] = (
    (("--nnodes",), True, "1:1"),
    (("--nproc-per-node", "--nproc_per_node"), True, "1"),
    (("--rdzv-backend", "--rdzv_backend"), True, "static"),
    (("--rdzv-endpoint", "--rdzv_endpoint"), True, ""),
    (("--rdzv-id", "--rdzv_id"), True, "none"),
    (("--rdzv-conf", "--rdzv_conf"), True, ""),
    (("--standalone",), False, False),
    (("--max-restarts", "--max_restarts"), True, "0"),
    (("--monitor-interval", "--monitor_interval"), True, "0.1"),
    (("--start-method", "--start_method"), True, "spawn"),
    (("--event-log-handler", "--event_log_handler"), True, "null"),
    (("--role",), True, "default"),
    (("-m", "--module"), False, False),
    (("--no-python", "--no_python"), False, False),
    (("--run-path", "--run_path"), False, False),
    (("--log-dir", "--log_dir"), True, None),
    (("-r", "--redirects"), True, "0"),
    (("-t", "--tee"), True, "0"),
    (("--local-ranks-filter", "--local_ranks_filter"), True, ""),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), True, None),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), True, None),
    (("--node-rank", "--node_rank"), True, "0"),
    (("--master-addr", "--master_addr"), True, "127.0.0.1"),
    (("--master-port", "--master_port"), True, None),
    (("--local-addr", "--local_addr"), True, None),
    (("--logs-specs", "--logs_specs"), True, None),
    (("--numa-binding", "--numa_binding"), True, None),
    (("--signals-to-handle", "--signals_to_handle"), True, "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
    (("--shutdown-timeout", "--shutdown_timeout"), True, None),
    (("--virtual-local-rank", "--virtual_local_rank"), False, False),
)


class ShellTooComplex(ValueError):
    """The shell command does more than run one program with words we can expand exactly."""


class _ArgError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgError(message)


def _parser() -> _Parser:
    p = _Parser(prog="torchrun", add_help=False)
    for names, takes_value, default in OPTIONS:
        dest = names[-1].lstrip("-").replace("-", "_")
        if takes_value:
            p.add_argument(*names, dest=dest, default=default)
        else:
            p.add_argument(*names, dest=dest, action="store_true")
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("training_script", nargs="?")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_args(args: Sequence[str], env: dict[str, str]) -> argparse.Namespace:
    """torchrun's arguments; ``PET_*`` variables stand in for absent options, as in torchrun."""
    ns = _parser().parse_args(list(args))
    for names, takes_value, default in OPTIONS:
        dest = names[-1].lstrip("-").replace("-", "_")
        pet = env.get("PET_" + dest.upper())
        if pet is not None and getattr(ns, dest) == default:
            setattr(ns, dest, pet if takes_value else pet.lower() in ("1", "true", "yes"))
    return ns


# ------------------------------------------------------------------ the shell subset

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNSUPPORTED = set(";&|<>()`*?[~\n")


def shell_words(cmd: str, env: dict[str, str] | None = None) -> list[str]:
    """Splits and expands ``cmd`` as bash would, for the subset dist.ddp produces.

    Quotes, backslashes, ``$NAME``, ``${NAME}``, ``${NAME:=word}``, ``${NAME:-word}`` (and the
    forms without ``:``). With ``env=None`` expansions are kept verbatim (the client only needs
    the words' shape). Anything else (pipes, lists, redirections, globs, command substitution,
    assignments, ``~``) raises ShellTooComplex.
    """
    words: list[str] = []
    cur: list[str] = []
    in_word = False
    i, n = 0, len(cmd)

    def expand(j: int) -> tuple[str, int]:
        if j + 1 < n and cmd[j + 1] == "{":
            end = cmd.find("}", j + 2)
            if end < 0:
                raise ShellTooComplex("unterminated ${")
            body = cmd[j + 2 : end]
            m = _NAME.match(body)
            if not m:
                raise ShellTooComplex(f"${{{body}}}")
            name, rest = m.group(0), body[m.end() :]
            if rest and not re.match(r"^:?[-=]", rest):
                raise ShellTooComplex(f"${{{body}}}")
            raw = cmd[j : end + 1]
            if env is None:
                return raw, end + 1
            colon = rest.startswith(":")
            op, word = (rest[1:2], rest[2:]) if colon else (rest[:1], rest[1:])
            if any(c in word for c in "$`\\'\""):
                raise ShellTooComplex(f"${{{body}}}")
            value = env.get(name)
            unset = value is None or (colon and value == "")
            if op and unset:
                value = word
                if op == "=":
                    env[name] = word
            return value or "", end + 1
        m = _NAME.match(cmd, j + 1)
        if not m:
            if j + 1 < n and cmd[j + 1] in "(":
                raise ShellTooComplex("$( )")
            if j + 1 < n and (cmd[j + 1].isdigit() or cmd[j + 1] in "@*#?$!-"):
                raise ShellTooComplex(f"${cmd[j + 1]}")
            return "$", j + 1
        raw = cmd[j : m.end()]
        return (raw if env is None else env.get(m.group(0), "")), m.end()

    while i < n:
        c = cmd[i]
        if c in " \t":
            if in_word:
                words.append("".join(cur))
                cur, in_word = [], False
            i += 1
        elif c == "'":
            end = cmd.find("'", i + 1)
            if end < 0:
                raise ShellTooComplex("unterminated '")
            cur.append(cmd[i + 1 : end])
            in_word, i = True, end + 1
        elif c == '"':
            i += 1
            in_word = True
            while True:
                if i >= n:
                    raise ShellTooComplex('unterminated "')
                c = cmd[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n and cmd[i + 1] in '$`"\\\n':
                    cur.append(cmd[i + 1])
                    i += 2
                elif c == "$":
                    text, i = expand(i)
                    cur.append(text)
                elif c == "`":
                    raise ShellTooComplex("`")
                else:
                    cur.append(c)
                    i += 1
        elif c == "\\":
            if i + 1 < n:
                cur.append(cmd[i + 1])
            in_word, i = True, i + 2
        elif c == "$":
            text, i = expand(i)
            if env is not None and not in_word and text == "" and (i >= n or cmd[i] in " \t"):
                continue  # an empty unquoted expansion is no word at all
            if env is not None and any(ch in text for ch in " \t\n"):
                parts = text.split()
                if parts:
                    cur.append(parts[0])
                    for p in parts[1:]:
                        words.append("".join(cur))
                        cur = [p]
                in_word = True
            else:
                cur.append(text)
                in_word = True
        elif c in _UNSUPPORTED or (c == "#" and not in_word):
            raise ShellTooComplex(repr(c))
        elif c == "=" and in_word and not words and _NAME.fullmatch("".join(cur)):
            raise ShellTooComplex("a variable assignment")
        else:
            cur.append(c)
            in_word = True
            i += 1
    if in_word:
        words.append("".join(cur))
    return words


# ------------------------------------------------------------------ the decision

_SHELLS = ("bash", "sh", "dash")
_PYTHONS = re.compile(r"^python(\d+(\.\d+)?)?$")


@dataclass
class TorchrunPlan:
    """How one role's torchrun command runs on a pool."""

    warm: bool
    reason: str
    # warm: the node process's argv; not warm: the role's argv unchanged
    argv: list[str] = field(default_factory=list)
    nnodes: int = 1
    restarts: int = 0  # warm: the role's scheduler retries, as torchrun restarts of all its nodes


def _torchrun_args(argv: Sequence[str]) -> tuple[list[str] | None, str | None, str]:
    """(torchrun args, shell command or None, how it was found) for a torchrun role, else (None, None, why not)."""
    if not argv:
        return None, None, ""
    prog = os.path.basename(argv[0])
    if prog == "torchrun":
        return list(argv[1:]), None, "torchrun"
    if _PYTHONS.match(prog) and len(argv) >= 3 and argv[1] == "-m" and argv[2] == "torch.distributed.run":
        return list(argv[3:]), None, "python -m torch.distributed.run"
    if prog in _SHELLS and len(argv) == 3 and argv[1] == "-c":
        try:
            words = shell_words(argv[2])
        except ShellTooComplex as e:
            if "torchrun" in argv[2]:
                return None, None, f"the shell command does more than run torchrun ({e})"
            return None, None, ""
        inner, _, how = _torchrun_args(words)
        if inner is None:
            return None, None, ""
        return inner, argv[2], f'{prog} -c "{how} ..."'
    return None, None, ""


def torchrun_args(argv: Sequence[str]) -> list[str] | None:
    """torchrun's own arguments when ``argv`` runs torchrun (directly or in ``sh -c``), else None."""
    return _torchrun_args(argv)[0]


def plan_role(argv: Sequence[str], env: dict[str, str], num_replicas: int, role: str) -> TorchrunPlan | None:
    """None when the role is not torchrun; else whether (and how) it runs warm, or why not.

    Raises MonarchError for a command that cannot work on the pool at all (``--nnodes`` that
    the role's replicas can never meet).
    """
    args, shell, how = _torchrun_args(argv)
    if args is None:
        return TorchrunPlan(False, how, list(argv)) if how else None
    real = lambda why: TorchrunPlan(False, why, list(argv))  # noqa: E731
    try:
        expanded = shell_words(shell, dict(env)) if shell else list(args)
        if shell:
            expanded = _torchrun_args(expanded)[0] or []
        ns = parse_args(expanded, env)
    except ShellTooComplex as e:
        return real(f"the command uses shell features the pool does not reproduce ({e})")
    except _ArgError as e:
        return real(f"torchrun would not accept the command ({e}); the real torchrun reports it")
    if ns.help or not ns.training_script:
        return real("no training script (torchrun prints its usage)")
    backend = ns.rdzv_backend
    lo, hi = (1, 1) if ns.standalone else _nnodes(ns.nnodes)
    if num_replicas < lo:  # the real torchrun too: its rendezvous would wait for nodes that never come
        raise MonarchError(_nodes_mismatch(role, ns, lo, hi, num_replicas))
    if backend == "static" and not ns.rdzv_endpoint and ns.master_port is None and hi == 1:
        backend = "c10d"  # torchrun's own rewrite of a single-node static run
    if not ns.standalone and backend not in WARM_BACKENDS:
        return real(
            f"--rdzv_backend {backend} is served by the real torchrun only "
            f"(the warm path stands in for {', '.join(WARM_BACKENDS)}, --standalone and single-node runs)"
        )
    if not lo <= num_replicas <= hi:
        raise MonarchError(_nodes_mismatch(role, ns, lo, hi, num_replicas))
    node_argv = ["python", "-m", NODE_MODULE]
    node_argv += ["-c", shell] if shell else ["--", *args]
    why = (
        f"{how}: torch's elastic agent starts from the warm fork server, workers are forked "
        f"(torch imported), the pool is the rendezvous ({num_replicas} node(s))"
    )
    return TorchrunPlan(True, why, node_argv, nnodes=num_replicas)


def _nodes_mismatch(role: str, ns: argparse.Namespace, lo: int, hi: int, replicas: int) -> str:
    """One line for a role whose replicas torchrun's --nnodes can never accept, with the options
    that fix it: each replica is one node, so too few would hang at the rendezvous."""
    want = f"{lo}" if lo == hi else f"{lo} to {hi}"
    nodes = lo if replicas < lo else hi
    procs = ns.nproc_per_node if str(ns.nproc_per_node).isdigit() else "PROCS"
    why = "torchrun would wait for nodes that never come" if replicas < lo else "torchrun admits no more"
    return (
        f"role {role!r}: torchrun --nnodes {ns.nnodes} asks for {want} node(s) but the role has {replicas} "
        f"replica(s) ({why}); pass -j {nodes}x{procs} (dist.ddp, dist.torchrun) or --num_replicas {nodes} "
        f"(utils.sh)"
    )


def _nnodes(value: str) -> tuple[int, int]:
    try:
        if ":" in value:
            lo, hi = value.split(":", 1)
            return int(lo), int(hi)
        return int(value), int(value)
    except ValueError:
        raise MonarchError(f"torchrun --nnodes {value!r} is not N or MIN:MAX") from None
