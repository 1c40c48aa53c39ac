"""Runs Monarch's own public actor tests against monarch_torchx, with only the imports rewritten.

    python compat/monarch_suite/run.py --monarch PATH_TO_A_MONARCH_CHECKOUT [--files test_cookbook ...]

Nothing of Monarch's is committed here: the tests are read from the checkout given, rewritten
(``rewrite.py``) into a scratch directory next to our stand-ins for Monarch's test helpers, and run
with pytest. The report counts, per file, what passed, what failed (with the first line of why), what
failed only on reaching Monarch's internals through a public object ("reached": a private attribute
of ours, a patched stand-in; see ``stand_ins/monarch_internal.py``), and what was left out: tests
that need Monarch's runtime internals (``Monarch-internal: NAME``) or a device this host lacks
(CUDA, ibverbs). As Monarch's own OSS CI does, tests marked ``oss_skip``
are not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rewrite import load_public, private_names, rewrite  # noqa: E402

# Monarch's tests of its public actor API (python/tests), as the issue that asked for this names them
DEFAULT_FILES = [
    "test_python_actors",
    "test_actor_error",
    "test_supervision_hierarchy",
    "test_proc_mesh",
    "test_host_mesh",
    "test_concurrent_endpoints",
    "test_cookbook",
    "test_actor_logging",
    "test_client_shutdown",
    "test_inter_mesh_ping_pong",
    "test_rdma",
    "test_rdma_unit",
    "test_rdma_cpu_no_torch",
    "test_rdma_initialization",
    "test_rdma_action",
    "test_cuda",  # its items that need no GPU run here; DEVICE_ONLY names the one that does
    "test_examples",  # Monarch's examples (EXAMPLES), each run as a program: made here, not in the checkout
]
# Monarch's examples (docs/source/examples/NAME.py) that use its actor API, each run whole as one
# test of the made-up file test_examples.py (rewritten as the tests are; in a fresh interpreter)
EXAMPLES = ["ping_pong", "getting_started", "grpo_actor"]
# items that need a device this host lacks, whatever their markers say: left out before running,
# counted as "device" (test_cuda.py has no skip markers: Monarch runs it on CPU-only Linux too)
DEVICE_ONLY = {
    "test_cuda::TestEnvBeforeCuda::test_cleanup_torch_distributed": "CUDA: backend='nccl' needs a GPU",
    "test_examples::test_example_grpo_actor": "CUDA: the example moves its tensors to 'cuda'",
}
# items that pass here only against the stand-ins they walk, checking nothing of ours: left out
# before running and counted as Monarch-internal (the harness cannot see a walk of a stand-in's
# own attributes: cloudpickle walks them too, when a test sends a function that names one)
STAND_INS_ONLY = {
    "test_python_actors::test_rust_binding_modules_correct": "walks monarch._rust_bindings (a stand-in here)",
}
PLUGINS = ["pytest-asyncio==1.5.0", "pytest-timeout==2.4.0"]  # what Monarch's suite runs under


def _plugins(cache: Path) -> Path:
    if not (cache / "pytest_asyncio").exists():
        print(f"installing {' '.join(PLUGINS)} into {cache}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(cache), *PLUGINS], check=True
        )
    return cache


def prepare(monarch: Path, files: list[str], work: Path) -> None:
    tests = monarch / "python" / "tests"
    if not tests.is_dir():
        raise SystemExit(f"error: {tests} is not there: --monarch takes a checkout of meta-pytorch/monarch")
    load_public(monarch)
    for f in files:
        if f == "test_examples":
            _write_examples(monarch, work)
            continue
        src = tests / f"{f}.py"
        if not src.exists():
            raise SystemExit(f"error: {src} is not there (is the checkout recent?)")
        (work / src.name).write_text(rewrite(src.read_text()))
    for f in (HERE / "stand_ins").glob("*.py"):
        shutil.copy(f, work / f.name)
    (work / "monarch_private.json").write_text(json.dumps(private_names(monarch)))
    # Monarch's own pytest settings, and the marker its OSS CI deselects (-m "not oss_skip")
    (work / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    oss_skip: marks tests to skip in OSS CI\n"
    )


def _write_examples(monarch: Path, work: Path) -> None:
    """Each example, rewritten, as ``example_NAME.py``, and ``test_examples.py`` that runs each one
    as a program (``__main__``) in a fresh interpreter: a pass is the example run to its end."""
    tests = [
        "import runpy",
        "from pathlib import Path",
        "",
        "import pytest",
        "from isolate_in_subprocess import isolate_in_subprocess",
        "",
    ]
    for name in EXAMPLES:
        src = monarch / "docs" / "source" / "examples" / f"{name}.py"
        if not src.exists():
            raise SystemExit(f"error: {src} is not there (is the checkout recent?)")
        (work / f"example_{name}.py").write_text(rewrite(src.read_text()))
        tests += [
            "",
            "@pytest.mark.timeout(300)",
            "@isolate_in_subprocess",
            f"def test_example_{name}():",
            f"    runpy.run_path(str(Path.cwd() / 'example_{name}.py'), run_name='__main__')",
            "",
        ]
    (work / "test_examples.py").write_text("\n".join(tests))


def _why(fail: ET.Element) -> str:
    """The exception that failed a test, in one line (a traceback's last line, not its first)."""
    lines = [ln for ln in (fail.text or fail.get("message") or "").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("E   "):
            return ln[1:].strip()[:200]
    return (lines[-1].strip() if lines else "")[:200]


def classify(junit: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("classname", "").split(".")[0]
        name = case.get("name", "")
        rec = out.setdefault(
            file, {"counts": Counter(), "failures": [], "left_out": Counter(), "reached": [], "stand_ins": []}
        )
        fail = case.find("failure")
        if fail is None:
            fail = case.find("error")
        skip = case.find("skipped")
        props = {p.get("name"): p.get("value", "") for p in case.iter("property")}
        reached = props.get("reached_internals")
        if fail is not None and "monarch_internal" in props:  # a stand-in used inside an actor
            rec["counts"]["internal"] += 1
            rec["left_out"][props["monarch_internal"]] += 1
        elif fail is not None and "Monarch-internal" in _why(fail):  # skipped from a fixture or a helper thread
            rec["counts"]["internal"] += 1
            rec["left_out"][_why(fail).split(":")[1].strip()] += 1
        elif fail is not None and reached:  # ran on our public API, then reached Monarch's internals
            rec["counts"]["reached"] += 1
            rec["reached"].append((name, reached))
        elif fail is not None:
            rec["counts"]["failed"] += 1
            rec["failures"].append((name, _why(fail)))
        elif skip is not None:
            why = skip.get("message", "")
            kind = (
                "internal"
                if "Monarch-internal" in why
                else "device"
                if any(k in why.lower() for k in ("cuda", "gpu", "ibverbs"))
                else "skipped"
            )
            rec["counts"][kind] += 1
            rec["left_out"][why.split(":")[0] if kind == "internal" else why[:80]] += 1
        elif "stand_ins_only" in props:  # passed, but against the stand-ins it touched: not counted as a pass
            rec["counts"]["stand-ins"] += 1
            rec["stand_ins"].append((name, props["stand_ins_only"]))
        else:
            rec["counts"]["passed"] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--monarch", required=True, type=Path, help="a checkout of github.com/meta-pytorch/monarch")
    ap.add_argument("--files", nargs="*", default=DEFAULT_FILES, help="test files (without .py) of python/tests")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a new temp dir)")
    ap.add_argument("--json", type=Path, help="write the report here too")
    ap.add_argument("-k", default="", help="pytest -k expression")
    ap.add_argument("--plugins", type=Path, default=Path.home() / ".cache" / "monarch-torchx-suite-plugins")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="monarch-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    prepare(args.monarch, args.files, work)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(_plugins(args.plugins)), str(work), os.environ.get("PYTHONPATH", "")]),
    )
    junit = work / "report.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "--tb=no",  # the plugins load by their entry points
        f"--timeout={args.timeout}",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
        "-m",
        "not oss_skip",  # as Monarch's OSS CI runs its suite (scripts/common-setup.sh)
        *(["-k", args.k] if args.k else []),
        *[
            f"--deselect={t.replace('::', '.py::', 1)}"
            for t in (*DEVICE_ONLY, *STAND_INS_ONLY)
            if t.split("::")[0] in args.files
        ],
        *[f"{f}.py" for f in args.files],
    ]
    print(f"running in {work}: {' '.join(cmd[2:])}", file=sys.stderr)
    subprocess.run(cmd, cwd=work, env=env)
    if not junit.exists():
        print("error: pytest wrote no report", file=sys.stderr)
        return 1
    report = classify(junit)
    for kind, items in (("device", DEVICE_ONLY), ("internal", STAND_INS_ONLY)):
        for test, why in items.items():
            file = test.split("::")[0]
            if file in args.files and file in report and (not args.k or args.k in test):
                report[file]["counts"][kind] += 1
                report[file]["left_out"][why] += 1
    total = Counter()
    print(f"\n{'file':34} {'passed':>7} {'failed':>7} {'reached':>8} {'internal':>9} {'device':>7} {'other skip':>10}")
    for file, rec in sorted(report.items()):
        c = rec["counts"]
        total.update(c)
        print(
            f"{file:34} {c['passed']:7} {c['failed']:7} {c['reached']:8} {c['internal']:9} {c['device']:7} "
            f"{c['skipped']:10}"
        )
    print(
        f"{'total':34} {total['passed']:7} {total['failed']:7} {total['reached']:8} {total['internal']:9} "
        f"{total['device']:7} {total['skipped']:10}"
    )
    ran = total["passed"] + total["failed"] + total["reached"]
    runnable = total["passed"] + total["failed"]
    print(
        f"\n{total['passed']} of {ran} items that ran pass ({100 * total['passed'] / max(1, ran):.0f}%); "
        f"{total['reached']} of them failed on reaching Monarch's internals through a public object "
        f'("reached"); without those, {total["passed"]} of {runnable} pass '
        f"({100 * total['passed'] / max(1, runnable):.0f}%).\nLeft out before running: {total['internal']} "
        f"Monarch-internal, {total['device']} for a device this host lacks, {total['skipped']} skipped by the "
        f"tests themselves; {total['stand-ins']} passed only against stand-ins they touched (not counted)"
    )
    for file, rec in sorted(report.items()):
        for name, why in rec["stand_ins"]:
            print(f"STAND-INS ONLY {file}::{name}: {why}")
    for file, rec in sorted(report.items()):
        for name, why in rec["reached"]:
            print(f"REACHED {file}::{name}: {why}")
    for file, rec in sorted(report.items()):
        for name, why in rec["failures"]:
            print(f"FAILED {file}::{name}: {why}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    f: {
                        "counts": r["counts"],
                        "failures": r["failures"],
                        "reached": r["reached"],
                        "left_out": r["left_out"],
                        "stand_ins": r["stand_ins"],
                    }
                    for f, r in report.items()
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
