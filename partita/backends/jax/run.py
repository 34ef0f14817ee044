"""Launch a compiled JAX plan: run ``DIR/program_jax.py`` on JAX CPU devices in fresh processes.

Called by ``driver.run_plan`` (``partita run DIR --steps N --reference --json``) when
``plan.model["framework"] == "jax"``. The program runs in a subprocess whose environment sets the
device count (``JAX_NUM_CPU_DEVICES`` and the equivalent XLA flag), so the caller's JAX state does
not matter. With ``num_processes=2`` it starts two processes joined by ``jax.distributed``
(coordinator on 127.0.0.1 at a free port, gloo CPU collectives), each owning
``world_size / num_processes`` devices. Imports no JAX itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.errors import PlanError
from partita.plan import Plan

PROGRAM_FILE = "program_jax.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device_env(num_devices: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a JAX CPU process that owns ``num_devices`` devices."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(num_devices),
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={num_devices}"]),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
    )
    return env


def _plan(plan_dir: Path) -> Plan:
    path = plan_dir / "plan.json"
    if not path.exists():
        raise PlanError(f"no plan at {path}.", "run `partita compile MODEL --out DIR` first, then pass DIR.")
    return Plan.from_json(path.read_text(), str(path))


def run(
    plan_dir: str | Path,
    *,
    steps: int,
    reference: bool = False,
    num_processes: int = 1,
    dump_dir: str | Path | None = None,
    timeout_s: float = 600.0,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Train ``steps`` steps of the plan in ``plan_dir``; return the program's result dict.

    Keys (``backends/jax/train.main``): ``losses``, ``reference_losses`` (with ``reference``),
    ``collectives`` (stage -> ``kind@axis`` -> ops and bytes per step, read from the compiled HLO
    plus the program's stage-to-stage sends), ``predicted_collectives`` (the plan's, as the JAX
    program issues them), ``collective_mismatches`` (stage -> list of differences), ``hlo_collectives``
    (per-function detail), ``notes`` (where the program departs from the plan; also printed to
    stderr), ``max_param_diff`` / ``max_grad_diff`` against the reference.
    """
    plan_dir = Path(plan_dir)
    plan = _plan(plan_dir)
    program = plan_dir / PROGRAM_FILE
    if not program.exists():
        raise PlanError(f"{program} does not exist.", "recompile the plan with the JAX emitter (`partita compile`).")
    if steps < 1:
        raise PlanError(f"--steps {steps} must be >= 1.", "pass --steps 1 or more.")
    world = plan.world_size
    if num_processes < 1 or world % num_processes:
        raise PlanError(
            f"{num_processes} processes cannot split the plan's {world} devices evenly.",
            f"use a divisor of {world}.",
        )
    with tempfile.TemporaryDirectory(prefix="partita-jax-") as tmp:
        out = Path(tmp) / "result.json"
        base = [sys.executable, str(program), "--steps", str(steps), "--json-out", str(out), *extra_args]
        if reference:
            base.append("--reference")
        if dump_dir is not None:
            Path(dump_dir).mkdir(parents=True, exist_ok=True)
            base += ["--dump", str(dump_dir)]
        env = device_env(world // num_processes)
        if num_processes == 1:
            procs = [subprocess.Popen(base, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
        else:
            coord = f"127.0.0.1:{free_port()}"
            procs = [
                subprocess.Popen(
                    [*base, "--coordinator", coord, "--num-processes", str(num_processes), "--process-id", str(i)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for i in range(num_processes)
            ]
        logs, codes = [], []
        try:
            for p in procs:
                text, _ = p.communicate(timeout=timeout_s)
                logs.append(text)
                codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            raise PlanError(
                f"the JAX program did not finish within {timeout_s:.0f} s.", "run fewer --steps or a smaller model."
            ) from None
        if any(codes) or not out.exists():
            tail = "\n".join(t.strip().splitlines()[-1] if t.strip() else "" for t in logs)
            detail = "\n".join(t[-4000:] for t in logs)
            raise ProgramFailed(
                f"{program} exited with codes {codes}: {tail}",
                "see the log above; rerun with the same command to reproduce.",
                detail,
            )
        result = json.loads(out.read_text())
    for note in result.get("notes", []):
        print(f"partita: {note}", file=sys.stderr)
    return result


def rehearse(plan_dir: str | Path, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Stage -> rehearsed collectives, memory and FLOPs of the JAX program in ``plan_dir``, compiled
    for the plan's world size on abstract inputs (``backends/jax/rehearse.py``) in a fresh process."""
    plan_dir = Path(plan_dir)
    plan = _plan(plan_dir)
    program = plan_dir / PROGRAM_FILE
    if not program.exists():
        raise PlanError(f"{program} does not exist.", "recompile the plan with the JAX emitter (`partita compile`).")
    with tempfile.TemporaryDirectory(prefix="partita-jax-") as tmp:
        out = Path(tmp) / "rehearsal.json"
        cmd = [sys.executable, "-m", "partita.backends.jax.rehearse", str(program), str(out)]
        try:
            proc = subprocess.run(
                cmd, env=device_env(plan.world_size), capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise PlanError(
                f"compiling the JAX step for {plan.world_size} devices took over {timeout_s:.0f} s.",
                "rehearse a smaller plan, or raise the timeout.",
            ) from None
        if proc.returncode or not out.exists():
            text = proc.stdout + proc.stderr
            last = text.strip().splitlines()[-1] if text.strip() else ""
            raise ProgramFailed(
                f"rehearsing {program} failed (exit code {proc.returncode}): {last}",
                "see the log above; rerun with the same command to reproduce.",
                text[-4000:],
            )
        result: dict[str, Any] = json.loads(out.read_text())["rehearsal"]
    return result


class ProgramFailed(PlanError):
    """The generated program crashed; ``log`` holds the tail of its output."""

    exit_code = 1

    def __init__(self, problem: str, fix: str, log: str) -> None:
        super().__init__(problem, fix)
        self.log = log
