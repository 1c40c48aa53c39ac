"""What creating a pool would send to its cluster, for ``torchx run --dryrun`` to show before anything is made.

Each engine builds its submission with the same code its ``create`` uses (the sbatch command and
batch script, the Kubernetes objects, the agent command lines), from a draft record that is
never saved: no state dir, no secret, no allocation. Secrets appear as a placeholder.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .registry import PoolRecord, Registry

SECRET_PLACEHOLDER = "<made when the pool is created>"


@dataclass
class Submission:
    """One engine's submission, as it would be sent."""

    engine: str  # "processes" (monarch_local), "sbatch" (monarch_slurm), "kubernetes"
    commands: list[list[str]] = field(default_factory=list)  # argv of each command that would run
    script: str = ""  # the sbatch batch script
    objects: list[dict[str, Any]] = field(default_factory=list)  # Kubernetes objects, in creation order
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        import shlex

        out = [f"would submit ({self.engine}):"]
        out += [f"  $ {shlex.join(argv)}" for argv in self.commands]
        if self.script:
            out.append("  batch script:")
            out += [f"    {line}" for line in self.script.rstrip("\n").splitlines()]
        if self.objects:
            import yaml

            out.append("  objects:")
            text = yaml.safe_dump_all(self.objects, sort_keys=False, default_flow_style=False)
            out += [f"    {line}" for line in text.rstrip("\n").splitlines()]
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)


@dataclass
class PoolPlan:
    """What a run would do to its pool: ``reuse``, ``create`` or ``replace`` it (with ``submission``),
    ``grow`` it in place (``grow=True``), or be ``refused`` (``reason`` says why, as the run itself would)."""

    action: str
    reason: str = ""
    submission: Submission | None = None

    def render(self) -> str:
        head = f"pool: {self.action}" + (f" ({self.reason})" if self.reason else "")
        return head + ("\n" + self.submission.render() if self.submission else "")


def draft_record(
    name: str, scheduler: str, spec: dict[str, Any], options: dict[str, Any], registry: Registry
) -> PoolRecord:
    """The record a new pool would get, made in memory only (its state dir is not created)."""
    state = (
        Path(options["job_dir"]).expanduser().absolute() / name if options.get("job_dir") else registry.state_dir(name)
    )
    return PoolRecord(
        name=name,
        scheduler=scheduler,
        spec=spec,
        token=secrets.token_hex(32),
        state_dir=str(state),
        options=options,
        tls_pem=SECRET_PLACEHOLDER if spec.get("tls") else "",
    )


def redact_secrets(obj: dict[str, Any]) -> dict[str, Any]:
    """A Kubernetes object with each Secret value replaced by the placeholder."""
    if obj.get("kind") != "Secret":
        return obj
    out = json.loads(json.dumps(obj))
    for key in ("data", "stringData"):
        if key in out:
            out[key] = {k: SECRET_PLACEHOLDER for k in out[key]}
    return out
