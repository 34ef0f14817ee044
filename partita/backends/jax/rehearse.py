"""Rehearsal of a generated JAX program: its step lowered and compiled at full device count, on abstract inputs.

``driver.rehearse`` (``partita rehearse DIR`` on a JAX plan) runs ``python -m
partita.backends.jax.rehearse DIR/program_jax.py OUT`` through ``run.rehearse``, in a subprocess
owning the plan's world size of JAX CPU devices (``run.device_env``): the generated program is
loaded as a module (its ``PROGRAM``, the plan as data; its ``__main__`` block does not run). Nothing is allocated: every parameter, optimizer state,
gradient accumulator, micro-batch and activation is a ``jax.ShapeDtypeStruct`` carrying the
``NamedSharding`` the program gives it, and each stage's jitted functions (``train.StageRun``:
forward / backward / fused loss step / update, the ones :func:`train.train` calls) are lowered and
compiled by XLA exactly as the program compiles them. Per stage and training step it reads

* collectives: every HLO collective of every compiled function (``fidelity.count_collectives``),
  times the number of calls per step (micro-batches; the update once), plus the stage-to-stage
  sends the schedule makes (one per micro-batch and boundary, bytes per device);
* memory per device (XLA's ``memory_analysis``): the arguments that live across the step
  (parameters, optimizer state, gradient accumulator: their shard shapes), the forward residuals
  held between a micro-batch's F and its B (the schedule's most in flight on this stage, times the
  residual bytes the compiled forward returns) with the largest temporary buffer of the forward and
  backward functions, or, if larger, the update's temporary buffer alone (it runs after the schedule,
  when no residual is held);
* FLOPs per device (XLA's ``cost_analysis``), times the calls.

``driver._rehearse_jax`` sets them beside the plan's records (``Stage.collectives``, which
``search/program/jax_records.py`` builds one per HLO op; ``Stage.predicted`` memory and FLOPs) with the torch
rehearsal's rule (``backends/torch/rehearse.compare_stage``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from partita.backends.jax import fidelity as fid
from partita.backends.jax import parallel as jp
from partita.backends.jax import train as jt

KINDS = {v: k for k, v in fid.PLAN_KINDS.items()}  # HLO kind -> plan kind


def _struct(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _device_bytes(tree: Any) -> int:
    """Bytes per device of abstract values with shardings (shard shape x item size)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def _in_flight(schedule: Sequence[tuple[str, int, int]], stage: int) -> int:
    """Most micro-batches between their F and their B on ``stage`` in the program's dispatch order."""
    live = peak = 0
    for action, s, _ in schedule:
        if s != stage:
            continue
        live += 1 if action == "F" else -1 if action == "B" else 0
        peak = max(peak, live)
    return max(peak, 1)


class _Compiled:
    def __init__(self, compiled: Any, calls: int, mesh_shape: tuple[int, int]) -> None:
        self.calls, self.compiled = calls, compiled
        self.hlo = fid.count_collectives(compiled.as_text(), mesh_shape)
        mem = compiled.memory_analysis()
        self.temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        self.flops = float((cost or {}).get("flops", 0.0))


def rehearse(program: jt.Program, handle: Any) -> dict[str, Any]:
    """Per stage: ``collectives`` (``kind@axis`` -> count, bytes per step), ``peak_memory_bytes``,
    ``memory_by_category``, ``flops``. Needs ``jax.device_count() >= `` the plan's world size."""
    meshes = jt._meshes(program)
    split = jt._split(program, handle, *jt._pins(meshes, program))
    runs = [jt.StageRun(program, s, meshes[s], prog, split) for s, prog in enumerate(split.stages)]
    flat = jp.flatten(handle.abstract_params())
    host_batch = [np.zeros(s.shape, s.dtype) for s in handle.example_batch(program.global_batch, program.seq_len)]
    batch_np, w_np = jt.replica_batch(program, host_batch)
    m, last = program.num_micro_batches, len(runs) - 1
    schedule = program.schedule or [("B", 0, mb) for mb in range(m)]
    acts: dict[int, Any] = {}  # value id -> abstract activation (one micro-batch)
    out: dict[str, Any] = {}
    for run in runs:
        params = {f: _struct(flat[f], run.param_sh[f]) for f in run.prog.param_fqns}
        opt_sh = run.opt_shardings(flat)
        opt = jax.tree.map(_struct, jax.eval_shape(run.tx.init, params), opt_sh)
        acc = jax.eval_shape(run.zero_acc, params)
        acc = {f: _struct(acc[f], run.acc_sh[f]) for f in acc}
        rep = run.sh(P("dp"))
        xs = []
        for i in run.prog.inputs:
            if split.producer[i] < 0:
                b = batch_np[split.batch_ids.index(i)]
                xs.append(jax.ShapeDtypeStruct(b.shape[1:], b.dtype, sharding=rep))
            else:
                xs.append(_struct(acts[i], rep))
        weights = jax.ShapeDtypeStruct(w_np.shape[1:], w_np.dtype, sharding=rep)
        mesh_shape = (run.dp, run.tp)
        fns: dict[str, _Compiled] = {}
        update = jax.jit(
            run.update,
            in_shardings=(run.param_sh, opt_sh, run.acc_sh),
            out_shardings=(run.param_sh, opt_sh, run.grad_sh),
            donate_argnums=(0, 1),
        )
        fns["update"] = _Compiled(update.lower(params, opt, acc).compile(), 1, mesh_shape)
        held = 0
        if len(runs) == 1:
            fused = jax.jit(
                run.last, in_shardings=(run.param_sh, [rep] * len(xs), rep, run.acc_sh), donate_argnums=(3,)
            )
            fns["last"] = _Compiled(fused.lower(params, xs, weights, acc).compile(), m, mesh_shape)
        else:
            fwd = jax.jit(run.forward, in_shardings=(run.param_sh, [rep] * len(xs))).lower(params, xs).compile()
            fns["forward"] = _Compiled(fwd, m, mesh_shape)
            outs, aux, vjp = fwd.out_info
            held = _device_bytes(vjp) * _in_flight(schedule, run.index)
            if run.index == last:
                cots = [jax.ShapeDtypeStruct(weights.shape, outs[0].dtype, sharding=rep)]
            else:
                cots = [_struct(o, rep) for o in outs]
                floats = [run.prog.outputs[k] for k in run.fout]
                others = [i for k, i in enumerate(run.prog.outputs) if k not in run.fout]
                acts.update(zip(floats, outs))
                acts.update(zip(others, aux))
            bwd = jax.jit(run.backward, donate_argnums=(2,)).lower(vjp, cots, acc).compile()
            fns["backward"] = _Compiled(bwd, m, mesh_shape)
        per_fn = {k: c.hlo for k, c in fns.items()}
        counts = fid.weighted_collectives(per_fn, {k: c.calls for k, c in fns.items()})
        collectives = {}
        for key, ops in counts["by_axis"].items():
            kind, axis = key.split("@")
            collectives[f"{KINDS.get(kind, kind)}@{axis}"] = {"count": int(ops), "bytes": float(counts["bytes"][key])}
        sends = _sends(run, split, acts, m, meshes)
        if sends["count"]:
            collectives["p2p@pp"] = sends
        persistent = {
            "parameters": _device_bytes(params),
            "optimizer": _device_bytes(opt),
            "gradients": _device_bytes(acc),
        }
        # two moments: a micro-batch's F / B with the residuals in flight and its own temporaries, or the
        # update (after the schedule: no residuals left) with its temporaries; the peak is the larger
        step_temp = max((c.temp for k, c in fns.items() if k != "update"), default=0)
        if held + step_temp >= fns["update"].temp:
            cats = {**persistent, "activations": held, "temporary": step_temp}
        else:
            cats = {**persistent, "activations": 0, "temporary": fns["update"].temp}
        out[f"stage{run.index}"] = {
            "collectives": dict(sorted(collectives.items())),
            "peak_memory_bytes": sum(cats.values()),
            "memory_by_category": cats,
            "flops": sum(c.flops * c.calls for c in fns.values()),
        }
    return out


def _sends(run: Any, split: Any, acts: Mapping[int, Any], m: int, meshes: Sequence[Any]) -> dict[str, float]:
    """This stage's forward sends per step, as the program counts them: one per micro-batch and consumer
    stage on another mesh (its ``jax.device_put`` of every value that stage reads; a chunk of the same
    rank group reads in place), bytes per device (the array over dp replicas)."""
    consumers: set[int] = set()
    nbytes = 0.0
    for i in run.prog.outputs:
        readers = {s for s, prog in enumerate(split.stages) if meshes[s] is not meshes[run.index] and i in prog.inputs}
        if i not in acts or not readers:
            continue
        consumers |= readers
        x = acts[i]
        nbytes += m * len(readers) * float(np.prod(x.shape) * np.dtype(x.dtype).itemsize) / x.shape[0]
    return {"count": m * len(consumers), "bytes": nbytes}


def main(program_file: str, out_file: str) -> None:
    """Load the generated program (not as ``__main__``), rehearse its ``PROGRAM``, write JSON to ``out_file``."""
    spec = importlib.util.spec_from_file_location("partita_program_jax", program_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    program = module.PROGRAM
    with open(out_file, "w") as f:
        json.dump({"rehearsal": rehearse(program, jp.load_model(program.model))}, f, sort_keys=True)


if __name__ == "__main__":  # PROGRAM OUT [PROGRAM OUT ...]: several programs in one process (tests)
    for k in range(1, len(sys.argv) - 1, 2):
        main(sys.argv[k], sys.argv[k + 1])
