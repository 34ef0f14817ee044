"""Launch a compiled plan's PyTorch program under torchrun and collect rank 0's JSON result.

Called by ``partita run DIR`` (``compiler/driver.run_plan``). ``DIR`` holds ``plan.json`` and the
emitted ``program_torch.py``; :func:`run` starts ``python -m torch.distributed.run`` with one
process per plan rank on this machine (or, with ``dry_run``, returns the exact command each node
of a multi-node launch would run), waits, and returns the program's result, plus the seeded
single-device reference losses when ``reference`` is set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from partita.errors import PlanError
from partita.plan import Plan

PROGRAM_FILE = "program_torch.py"


def load_program(plan_dir: str | Path) -> ModuleType:
    """Import ``DIR/program_torch.py`` as a module (its ``PROGRAM``, ``lr_lambda``...)."""
    path = Path(plan_dir) / PROGRAM_FILE
    if not path.exists():
        raise PlanError(f"no PyTorch program at {path}.", "run `partita compile MODEL --out DIR` first, then pass DIR.")
    spec = importlib.util.spec_from_file_location("partita_program", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def torchrun_command(
    program: str | Path, world_size: int, args: Sequence[str], *, nnodes: int = 1, multi_node: bool = False
) -> list[str]:
    """The torchrun command line; ``multi_node`` uses a c10d rendezvous at $MASTER_ADDR:$MASTER_PORT."""
    if world_size % nnodes:
        raise PlanError(
            f"the plan's {world_size} ranks do not split over {nnodes} nodes.",
            f"use a node count that divides {world_size}.",
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size // nnodes)]
    if multi_node:
        cmd += [
            "--nnodes", str(nnodes), "--node-rank", "${NODE_RANK}", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "${MASTER_ADDR}:${MASTER_PORT:-29500}", "--rdzv-id", "partita",
        ]  # fmt: skip
    else:
        cmd += ["--standalone", "--nnodes", "1"]
    return [*cmd, str(program), *args]


def run(
    plan_dir: str | Path,
    *,
    steps: int,
    reference: bool = False,
    json_out: bool = False,
    dry_run: bool = False,
    nnodes: int = 1,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Train ``steps`` steps of the plan in ``plan_dir``; return (and with ``json_out`` print) the result."""
    plan_dir = Path(plan_dir)
    plan_path = plan_dir / "plan.json"
    if not plan_path.exists():
        raise PlanError(f"no plan at {plan_path}.", "run `partita compile MODEL --out DIR` first, then pass DIR.")
    plan = Plan.from_json(plan_path.read_text(), str(plan_path))
    program_path = (plan_dir / PROGRAM_FILE).resolve()
    if not program_path.exists():
        raise PlanError(f"no PyTorch program at {program_path}.", "recompile with `partita compile ... --out DIR`.")
    if steps < 1:
        raise PlanError(f"--steps {steps} must be >= 1.", "pass --steps N with N >= 1.")
    args = ["--steps", str(steps), *extra_args]
    if dry_run or nnodes > 1:
        if not dry_run:
            raise PlanError(
                f"`partita run` launches on this machine only; {nnodes} nodes were asked.",
                "add --dry-run to print the torchrun command, then run it on every node with NODE_RANK set.",
            )
        cmd = torchrun_command(program_path, plan.world_size, args, nnodes=nnodes, multi_node=nnodes > 1)
        out: dict[str, Any] = {"command": cmd, "command_str": " ".join(_quote(c) for c in cmd)}
        if json_out:
            print(json.dumps(out, indent=1))
        else:
            print(out["command_str"])
        return out
    with tempfile.TemporaryDirectory(prefix="partita-run-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = torchrun_command(program_path, plan.world_size, [*args, "--json-out", result_path])
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(plan_dir))
        if proc.returncode != 0 or not os.path.exists(result_path):
            _raise_failure(proc)
        result: dict[str, Any] = json.loads(Path(result_path).read_text())
    if reference:
        from partita.runtime.torch_train import reference_run

        prog = load_program(plan_dir)
        ref = reference_run(prog.PROGRAM["model"], prog.PROGRAM["training"], steps, lr_lambda=prog.lr_lambda)
        result["reference_losses"] = ref["losses"]
    if json_out:
        print(json.dumps(result, indent=1, sort_keys=True))
    return result


def _quote(part: str) -> str:
    return part if part.startswith("${") else shlex.quote(part)


def _raise_failure(proc: subprocess.CompletedProcess[str]) -> None:
    text = (proc.stderr or "") + (proc.stdout or "")
    for line in text.splitlines():
        if "PlanError:" in line:  # the program refused the launch before any work
            raise PlanError(line.split("PlanError:", 1)[1].strip(), "")
    lines = [ln for ln in text.splitlines() if ln.startswith("[rank")] or text.strip().splitlines()
    errors = [i for i, ln in enumerate(lines) if "Error:" in ln and "Connection closed" not in ln]
    end = errors[0] + 1 if errors else len(lines)
    tail = "\n".join(lines[max(0, end - 30) : end])
    raise RuntimeError(f"the generated program failed (exit {proc.returncode}):\n{tail}")
