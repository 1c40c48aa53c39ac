"""The README's generated parts match the code."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_run_options_table_is_current():
    res = subprocess.run(
        [sys.executable, "-m", "monarch_torchx.docs", "--check", str(ROOT / "README.md")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
