"""Reading torchrun's command line without torch (``monarch_torchx/torchrun.py``): its options and
``PET_*`` variables, the POSIX-shell subset dist.ddp writes, and which roles run warm and why."""

from __future__ import annotations

import pytest

from monarch_torchx import torchrun
from monarch_torchx.errors import MonarchError


def test_options_take_either_spelling_and_the_script_keeps_its_own_arguments():
    ns = torchrun.parse_args(
        ["--nproc_per_node=4", "--rdzv-backend", "c10d", "--standalone", "train.py", "--lr", "0.1", "--nnodes", "9"], {}
    )
    assert (ns.nproc_per_node, ns.rdzv_backend, ns.standalone) == ("4", "c10d", True)
    assert ns.training_script == "train.py" and ns.training_script_args == ["--lr", "0.1", "--nnodes", "9"]
    assert ns.nnodes == "1:1" and ns.max_restarts == "0" and ns.module is False  # torchrun's defaults
    with pytest.raises(torchrun._ArgError, match="unrecognized arguments|--bogus"):
        torchrun.parse_args(["--bogus", "t.py"], {})


def test_pet_variables_stand_in_for_absent_options_only():
    env = {"PET_NNODES": "2", "PET_RDZV_BACKEND": "c10d", "PET_STANDALONE": "true", "PET_NPROC_PER_NODE": "8"}
    ns = torchrun.parse_args(["--nproc-per-node", "2", "t.py"], env)
    assert (ns.nnodes, ns.rdzv_backend, ns.standalone) == ("2", "c10d", True)
    assert ns.nproc_per_node == "2"  # given on the command line: the variable does not override it
    assert torchrun.parse_args(["t.py"], {"PET_STANDALONE": "0"}).standalone is False


@pytest.mark.parametrize(
    "cmd, env, words",
    [
        ("a  b\tc", {}, ["a", "b", "c"]),
        ("'a b' \"c d\" e\\ f", {}, ["a b", "c d", "e f"]),
        ('"$X" $X', {"X": "1 2"}, ["1 2", "1", "2"]),  # quoted: one word; unquoted: split
        ("a $UNSET b", {}, ["a", "b"]),  # an empty unquoted expansion is no word
        ('a "$UNSET" b', {}, ["a", "", "b"]),  # ... a quoted one is an empty word
        ("${H-x} ${H:-y}", {"H": ""}, ["y"]),  # without ':' only unset takes the default
        ("x${N}y ${N}z", {"N": "1"}, ["x1y", "1z"]),
        ('"\\$HOME \\"q\\""', {"HOME": "/h"}, ['$HOME "q"']),
        ("c a=b", {}, ["c", "a=b"]),  # "=" after the first word is a plain character (before it: an assignment)
        ("cost $ 5", {}, ["cost", "$", "5"]),
    ],
)
def test_shell_words_split_and_expand_as_bash_would(cmd, env, words):
    assert torchrun.shell_words(cmd, env) == words


def test_without_an_environment_expansions_keep_their_text_and_assign_nothing():
    assert torchrun.shell_words("torchrun --rdzv_endpoint ${H:=localhost}:29500 $X") == [
        "torchrun",
        "--rdzv_endpoint",
        "${H:=localhost}:29500",
        "$X",
    ]
    env: dict = {}
    assert torchrun.shell_words("${H:=localhost}", env) == ["localhost"] and env == {"H": "localhost"}


@pytest.mark.parametrize(
    "cmd",
    [
        "a=b c",
        "a; b",
        "a & b",
        "a `b`",
        "echo ~",
        "ls [ab]",
        "$1",
        "$@",
        "${H/x/y}",
        "${H:-$X}",
        "'open",
        '"open',
        "${H",
        "# c",
    ],
)
def test_anything_beyond_the_subset_is_too_complex(cmd):
    with pytest.raises(torchrun.ShellTooComplex):
        torchrun.shell_words(cmd, {})


@pytest.mark.parametrize(
    "argv, args",
    [
        (["torchrun", "--nnodes", "2", "t.py"], ["--nnodes", "2", "t.py"]),
        (["/opt/venv/bin/torchrun", "t.py"], ["t.py"]),
        (["python3.12", "-m", "torch.distributed.run", "t.py"], ["t.py"]),
        (["sh", "-c", "torchrun --standalone t.py"], ["--standalone", "t.py"]),
        (["bash", "-c", "python -m torch.distributed.run t.py"], ["t.py"]),
        (["python", "-m", "torch.distributed.launch", "t.py"], None),  # another launcher
        (["bash", "-c", "python t.py"], None),
        (["bash", "-c", "cd x && python t.py"], None),  # too complex, and not torchrun either
        (["bash", "-lc", "torchrun t.py"], None),  # only plain `-c`
        ([], None),
    ],
)
def test_a_torchrun_role_is_recognised_however_it_is_started(argv, args):
    assert torchrun.torchrun_args(argv) == args


def test_a_warm_plan_runs_the_node_module_with_the_roles_own_command():
    plan = torchrun.plan_role(["torchrun", "--rdzv_backend", "c10d", "--nnodes", "1:3", "t.py"], {}, 2, "r")
    assert plan.warm and plan.nnodes == 2 and "2 node(s)" in plan.reason
    assert plan.argv == [
        "python",
        "-m",
        torchrun.NODE_MODULE,
        "--",
        "--rdzv_backend",
        "c10d",
        "--nnodes",
        "1:3",
        "t.py",
    ]
    shell = "torchrun --standalone t.py --x $X"
    plan = torchrun.plan_role(["bash", "-c", shell], {"X": "1"}, 1, "r")
    assert plan.warm and plan.argv == ["python", "-m", torchrun.NODE_MODULE, "-c", shell]  # expanded on the host


@pytest.mark.parametrize(
    "argv, why",
    [
        (["torchrun"], "no training script"),
        (["torchrun", "--help"], "no training script"),
        (["bash", "-c", "torchrun $(cat args) t.py"], "does more than run torchrun"),
        (["torchrun", "--rdzv_backend", "etcd-v2", "t.py"], "--rdzv_backend etcd-v2 is served by the real torchrun"),
    ],
)
def test_what_the_pool_cannot_honour_runs_the_real_torchrun_unchanged(argv, why):
    plan = torchrun.plan_role(argv, {}, 1, "r")
    assert not plan.warm and why in plan.reason and plan.argv == argv


def test_node_counts_the_replicas_can_never_meet_are_refused():
    with pytest.raises(MonarchError, match=r"--nnodes 1 asks for 1 node\(s\) but the role has 2"):
        torchrun.plan_role(["torchrun", "--standalone", "t.py"], {"PET_NNODES": "1"}, 2, "train")
    with pytest.raises(MonarchError, match="is not N or MIN:MAX"):
        torchrun.plan_role(["torchrun", "--nnodes", "two", "t.py"], {}, 2, "r")
    assert torchrun.plan_role(["python", "t.py"], {}, 3, "r") is None  # not torchrun: nothing to check
