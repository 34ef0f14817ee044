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


# ---- launch files beside a multi-node program ----------------------------------------------------
SBATCH_FILE = "launch.sbatch"


def group_script_name(device: str) -> str:
    """``launch_<device type>.sh`` (lower case, characters a file name keeps)."""
    return "launch_" + "".join(c if c.isalnum() or c in "-_." else "_" for c in device.lower()) + ".sh"


def node_groups(plan: Plan) -> list[tuple[str, list[int], list[tuple[int, ...]]]]:
    """``(device type, node ranks, plan ranks per node)`` per device type, in order of its first node
    (the group holding node rank 0 first): the plan's nodes (``hosts.plan_nodes``) grouped by type."""
    from partita.backends.torch import hosts

    out: dict[str, tuple[list[int], list[tuple[int, ...]]]] = {}
    for k, (dev, ranks) in enumerate(hosts.plan_nodes(plan)):
        got = out.setdefault(dev, ([], []))
        got[0].append(k)
        got[1].append(ranks)
    return [(d, ks, rs) for d, (ks, rs) in out.items()]


def launch_files(plan: Plan, program: str = PROGRAM_FILE) -> dict[str, str]:
    """The files written beside the program of a plan on several nodes (none for one node): one
    launch script per node group by device type (``launch_<type>.sh``: the static-rendezvous torchrun
    command of the group's i-th node, with its node rank and process count) and ``launch.sbatch``, a
    SLURM heterogeneous job with one component per device type, each running its group's script."""
    groups = node_groups(plan)
    total = sum(len(ks) for _, ks, _ in groups)
    if total < 2:
        return {}
    files: dict[str, str] = {}
    for dev, ks, ranks in groups:
        name = group_script_name(dev)
        lines = [
            "#!/usr/bin/env bash",
            f"# Partita launch of the {dev} nodes of this plan: {len(ks)} of its {total} nodes. Node i of this group",
            "# (0-based; $SLURM_NODEID under launch.sbatch, else $PARTITA_NODE_INDEX) is node rank NODE_RANKS[i] of",
            "# the static rendezvous at $MASTER_ADDR (the host of node rank 0) and runs these plan ranks:",
            *(f"#   node {i}: node rank {k}, plan ranks {r[0]}..{r[-1]} ({len(r)} processes)" for i, (k, r) in
              enumerate(zip(ks, ranks))),
            "# Usage on each node: MASTER_ADDR=HOST PARTITA_NODE_INDEX=i bash " + name + " --steps N",
            "set -euo pipefail",
            'cd "$(dirname "${BASH_SOURCE[0]}")"',
            "NODE_RANKS=(" + " ".join(str(k) for k in ks) + ")",
            "NPROCS=(" + " ".join(str(len(r)) for r in ranks) + ")",
            'i="${PARTITA_NODE_INDEX:-${SLURM_NODEID:-}}"',
            'if [ -z "$i" ] || [ "$i" -ge ${#NODE_RANKS[@]} ]; then',
            f'  echo "{name}: set PARTITA_NODE_INDEX to this node\'s index in the {dev} group (0..{len(ks) - 1})" >&2',
            "  exit 2",
            "fi",
            ': "${MASTER_ADDR:?set MASTER_ADDR to the host of node rank 0}"',
            f'exec "${{PYTHON:-python}}" -m torch.distributed.run --nnodes {total} --node-rank "${{NODE_RANKS[$i]}}" \\',
            '  --nproc-per-node "${NPROCS[$i]}" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \\',
            f'  {program} "$@"',
            "",
        ]  # fmt: skip
        files[name] = "\n".join(lines)
    head = ["#!/bin/bash", "# Partita: a SLURM heterogeneous job, one component per device type of the plan."]
    head.append("# Submit from the plan directory: cd DIR && sbatch launch.sbatch --steps N")
    head.append("#SBATCH --job-name=partita")
    for c, (dev, ks, ranks) in enumerate(groups):
        if c:
            head.append("#SBATCH hetjob")
        gpus = f" --gpus-per-node={max(len(r) for r in ranks)}" if _is_gpu(plan, dev) else ""
        head.append(f"# component {c}: {len(ks)} {dev} node(s) (add the --partition / --constraint that selects them)")
        head.append(f"#SBATCH --nodes={len(ks)} --ntasks-per-node=1 --exclusive{gpus}")
    body = [
        "set -euo pipefail",
        'cd "${SLURM_SUBMIT_DIR:-.}"',
        'export MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}" | head -n 1)"',
        'export MASTER_PORT="${MASTER_PORT:-29500}"',
        *(f'srun --het-group={c} bash {group_script_name(dev)} "$@" &' for c, (dev, _, _) in enumerate(groups)),
        "wait",
        "",
    ]
    files[SBATCH_FILE] = "\n".join(head + body)
    return files


def _is_gpu(plan: Plan, device: str) -> bool:
    from partita.backends.torch import hosts

    return str(hosts.device_spec(plan, device).get("kind", "gpu")) != "cpu"


def run_line(plan: Plan) -> str:
    """The program header's launch line: torchrun on one node, the launch files for several."""
    groups = node_groups(plan)
    if sum(len(ks) for _, ks, _ in groups) < 2:
        return f"torchrun --nproc-per-node {plan.world_size} program_torch.py --steps N"
    parts = ", ".join(f"{group_script_name(d)} on the {len(ks)} {d} node(s)" for d, ks, _ in groups)
    return f"cd DIR && sbatch {SBATCH_FILE} --steps N  (SLURM heterogeneous job), or {parts}"


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
