"""Launch a compiled plan's PyTorch program under torchrun and collect rank 0's JSON result.

Called by ``partita run DIR`` (``driver.run_plan``). ``DIR`` holds ``plan.json`` and the
emitted ``program_torch.py``; :func:`run` starts ``python -m torch.distributed.run`` with one
process per plan rank on this machine (or, with ``dry_run``, returns the exact command each node
of a multi-node launch would run), waits, and returns the program's result, plus the seeded
single-device reference losses when ``reference`` is set.

Before anything starts the launcher checks that the program was generated from this plan and that
the plan's device kind exists here (a GPU plan on a machine without CUDA is refused, not hung).
``max_restarts`` (or ``$PARTITA_MAX_RESTARTS``) is torchrun's ``--max-restarts``: when a rank dies
the whole group restarts and ``torch_train`` resumes from the run's latest published checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from partita.errors import PlanError, RunError
from partita.plan import Plan, read_plan

PROGRAM_FILE = "program_torch.py"
MAX_RESTARTS_ENV = "PARTITA_MAX_RESTARTS"


def load_program(plan_dir: str | Path) -> ModuleType:
    """Import ``DIR/program_torch.py`` as a module (its ``PROGRAM``, ``lr_lambda``...)."""
    path = Path(plan_dir) / PROGRAM_FILE
    if not path.exists():
        raise PlanError(f"no PyTorch program at {path}.", "run `partita compile MODEL --out DIR` first, then pass DIR.")
    # compiled from source, not imported: an import would leave DIR/__pycache__ behind, and a
    # refused launch must not write into the plan directory
    mod = ModuleType("partita_program")
    mod.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)  # noqa: S102 - our generated program
    return mod


def torchrun_command(
    program: str | Path,
    world_size: int,
    args: Sequence[str],
    *,
    nnodes: int = 1,
    multi_node: bool = False,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line; ``multi_node`` uses a c10d rendezvous at $MASTER_ADDR:$MASTER_PORT."""
    if nnodes < 1 or world_size % nnodes:
        raise PlanError(
            f"the plan's {world_size} ranks do not split over {nnodes} nodes.",
            f"use a node count that divides {world_size}.",
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size // nnodes)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
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
    max_restarts: int | None = None,
    hostfile: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps of the plan in ``plan_dir``; return (and with ``json_out`` print) the result.

    ``hostfile``: place every plan rank on a node of its device type (``hosts.py``); returns (and
    prints) one torchrun command per node and writes ``DIR/launch.sbatch``; it launches nothing here.
    """
    plan_dir = Path(plan_dir)
    plan_path = plan_dir / "plan.json"
    if not plan_path.exists():
        raise PlanError(f"no plan at {plan_path}.", "run `partita compile MODEL --out DIR` first, then pass DIR.")
    plan = read_plan(plan_path)
    program_path = (plan_dir / PROGRAM_FILE).resolve()
    if not program_path.exists():
        raise PlanError(f"no PyTorch program at {program_path}.", "recompile with `partita compile ... --out DIR`.")
    if steps < 1:
        raise PlanError(f"--steps {steps} must be >= 1.", "pass --steps N with N >= 1.")
    restarts = _max_restarts(max_restarts)
    program = load_program(plan_dir)
    _check_program(plan, program, program_path)
    extra_args = _check_data(plan, program, extra_args)
    args = ["--steps", str(steps), *extra_args]
    if hostfile:
        return _per_node(plan_dir, plan, program_path, args, hostfile, restarts, json_out)
    if dry_run or nnodes > 1:
        if not dry_run:
            raise PlanError(
                f"`partita run` launches on this machine only; {nnodes} nodes were asked.",
                "add --dry-run to print the torchrun command, then run it on every node with NODE_RANK set.",
            )
        if nnodes > 1:
            _check_uniform_nodes(plan, nnodes)
        cmd = torchrun_command(
            program_path, plan.world_size, args, nnodes=nnodes, multi_node=nnodes > 1, max_restarts=restarts
        )
        out: dict[str, Any] = {"command": cmd, "command_str": " ".join(_quote(c) for c in cmd)}
        if json_out:
            print(json.dumps(out, indent=1))
        else:
            print(out["command_str"])
        return out
    _check_devices(plan, program)
    with tempfile.TemporaryDirectory(prefix="partita-run-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        dumps = _parity().dump_args(tmp) if reference else []  # step-1 gradients, last parameters (parity.py)
        cmd = torchrun_command(
            program_path, plan.world_size, [*args, *dumps, "--json-out", result_path], max_restarts=restarts
        )
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = _run_streaming(cmd, env, plan_dir)
        if proc.returncode != 0 or not os.path.exists(result_path):
            _raise_failure(proc)
        result: dict[str, Any] = json.loads(Path(result_path).read_text())
        if reference:
            xs = list(extra_args)
            data = {
                k: xs[xs.index(f) + 1] if f in xs[:-1] else d for k, (f, d) in _DATA_FLAGS.items()
            }  # the run's data
            result.update(_parity().check_run(program, steps, data, result, tmp))
    if json_out:
        print(json.dumps(result, indent=1, sort_keys=True))
    return result


def _parity() -> ModuleType:
    from partita.backends.torch import parity  # imports torch: only for --reference

    return parity


def _per_node(
    plan_dir: Path, plan: Plan, program_path: Path, args: list[str], hostfile: str, restarts: int, json_out: bool
) -> dict[str, Any]:
    """One torchrun command per node of the hostfile (static rendezvous), and DIR/launch.sbatch."""
    from partita.backends.torch import hosts

    nodes = hosts.place(plan, hosts.parse_hostfile(hostfile))
    cmds = [hosts.node_command(n, nodes, "python", str(program_path), args, restarts) for n in nodes]
    sbatch = plan_dir / "launch.sbatch"
    sbatch.write_text(hosts.sbatch_script(nodes, cmds))
    out: dict[str, Any] = {
        "nodes": [
            {"node_rank": n.node_rank, "host": n.host, "device": n.device, "ranks": list(n.ranks), "command": c}
            for n, c in zip(nodes, cmds)
        ],
        "sbatch": str(sbatch),
    }
    out["command_str"] = "\n".join(
        f"# on {n.host} ({n.device}):\n" + " ".join(_quote(x) for x in c) for n, c in zip(nodes, cmds)
    )
    print(json.dumps(out, indent=1) if json_out else out["command_str"])
    return out


def _check_uniform_nodes(plan: Plan, nnodes: int) -> None:
    """One command for every node places ranks by arrival order: right only for one device type."""
    from partita.backends.torch import hosts

    types = sorted(set(hosts.rank_devices(plan)))
    if len(types) > 1:
        raise PlanError(
            f"the plan runs on {len(types)} device types ({', '.join(types)}); one torchrun command for all "
            f"{nnodes} nodes cannot say which node runs which ranks.",
            "pass --hostfile FILE (one `HOST device=TYPE` line per node) for one command per node.",
        )


def _check_data(plan: Plan, program: ModuleType, extra_args: Sequence[str]) -> list[str]:
    """A token file passed to the program is checked here, before any process starts (exit 2);
    returns the arguments with its path made absolute (the ranks run in DIR)."""
    from partita.backends.torch import data as tdata

    def flag(name: str, default: str) -> str:
        xs = list(extra_args)
        return xs[xs.index(name) + 1] if name in xs[:-1] else default

    path = flag("--data-file", "")
    if not path:
        return list(extra_args)
    vocab = None
    try:
        from partita.models.zoo import resolve_model

        vocab = int(resolve_model(program.PROGRAM["model"]).config.get("vocab") or 0) or None
    except Exception:  # noqa: BLE001 - a model spec that cannot be resolved here: the rank checks again
        vocab = None
    tr = plan.training
    tdata.check_token_file(
        path, flag("--data-dtype", "uint16"), int(tr.get("seq_len", 1)), int(tr["global_batch"]), vocab
    )
    xs = list(extra_args)
    xs[xs.index("--data-file") + 1] = os.path.abspath(path)
    return xs


_DATA_FLAGS = {"data_file": ("--data-file", ""), "data_dtype": ("--data-dtype", "uint16"), "data_fn": ("--data-fn", "")}


def _run_streaming(cmd: list[str], env: Mapping[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run torchrun, echoing rank 0's step lines (``partita: [###...] step k/N ...``) to stderr as they come."""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env), cwd=str(cwd)
    ) as proc:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("partita: [") and " step " in line:
                print(line, end="", file=sys.stderr, flush=True)
        rc = proc.wait()
    return subprocess.CompletedProcess(cmd, rc, stdout="".join(lines), stderr="")


def _max_restarts(value: int | None) -> int:
    raw = os.environ.get(MAX_RESTARTS_ENV, "0") if value is None else value
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise PlanError(f"max restarts {raw!r} is not a non-negative integer.", "pass --max-restarts N with N >= 0.")
    return n


def _check_program(plan: Plan, program: ModuleType, program_path: Path) -> None:
    """The program beside plan.json must have been generated from it (same ranks, layers, batch)."""
    prog = getattr(program, "PROGRAM", None)

    def layout(stages: Sequence[Any]) -> list[tuple[Any, ...]]:
        return [(list(s["ranks"]), s["dp"], s["tp"], list(s["layers"])) for s in stages]

    from partita.backends.torch.chunks import physical_plan

    mine = [dataclasses.asdict(s) for s in physical_plan(plan).stages]  # model chunks: per rank group
    same = (
        isinstance(prog, dict)
        and prog.get("world_size") == plan.world_size
        and layout(prog.get("stages", [])) == layout(mine)
        and prog.get("training", {}).get("global_batch") == plan.training.get("global_batch")
    )
    if not same:
        raise PlanError(
            f"{program_path} was not generated from the plan.json beside it (their ranks, layers or batch differ).",
            "recompile with `partita compile ... --out DIR` so both files come from one plan.",
        )


def _check_devices(plan: Plan, program: ModuleType) -> None:
    """A plan for GPUs needs CUDA here (torch_train makes the same check inside every rank)."""
    import torch

    from partita.backends.torch.parallel import check_launch

    kinds = [s.get("kind", "gpu") for s in program.PROGRAM["stages"]]
    check_launch(plan.world_size, kinds, plan.world_size, torch.cuda.is_available())


def _quote(part: str) -> str:
    return part if part.startswith("${") else shlex.quote(part)


def _root_cause(text: str) -> str:
    """``; first failure: rank 1, exit code -9 (SIGKILL)`` from torchrun's failure summary, or ""."""
    import re

    part = text.split("Root Cause (first observed failure):", 1)
    rank, code = re.search(r"rank\s*:\s*(\d+)", part[-1]), re.search(r"exitcode\s*:\s*(-?\d+)", part[-1])
    if len(part) < 2 or not rank or not code:
        return ""
    sig = re.search(r"\((SIG[A-Z]+)\)", part[1])
    return f"; first failure: rank {rank.group(1)}, exit code {code.group(1)}" + (f" ({sig.group(1)})" if sig else "")


def _raise_failure(proc: subprocess.CompletedProcess[str]) -> None:
    text = (proc.stderr or "") + (proc.stdout or "")
    for line in text.splitlines():
        for mark in ("partita: error:", "PlanError:"):  # the program refused the launch before any work
            if mark in line:
                raise PlanError(line.split(mark, 1)[1].strip(), "")
    lines = [ln for ln in text.splitlines() if ln.startswith("[rank")] or text.strip().splitlines()
    errors = [i for i, ln in enumerate(lines) if "Error:" in ln and "Connection closed" not in ln]
    end = errors[0] + 1 if errors else len(lines)
    tail = "\n".join(lines[max(0, end - 30) : end])
    raise RunError(
        f"the generated program failed (exit {proc.returncode}{_root_cause(text)}):\n{tail}\n",
        "fix the error above; to survive a lost rank, add --checkpoint-every N --max-restarts R "
        "(a restart resumes from the last checkpoint).",
    )
