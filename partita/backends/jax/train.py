"""Training loop of the generated JAX programs: SPMD stages on sub-meshes, pipelined or not.

The generated ``program_jax.py`` (``backends/jax/emit.py``) is the plan as data -- meshes, one
PartitionSpec per parameter, activation pins, schedule -- in a :class:`Program`, and calls
:func:`main`; ``backends/jax/run.py`` launches it. How a plan becomes JAX:

* a stage runs on a ``("dp", "tp")`` mesh (``AxisType.Auto``). Parameters, optimizer states,
  batches and per-sample weights are placed with ``NamedSharding`` through ``jax.jit``'s
  in/out shardings. Tensor parallelism is XLA's SPMD partitioner applied to the parameter specs,
  with the plan's activation layouts pinned by ``with_sharding_constraint`` at every layer
  boundary and at the outputs of the modules the plan shards (``Program.activation_pins``).
* data parallelism is a ``jax.vmap`` over the dp replicas (``spmd_axis_name="dp"``): each
  replica differentiates its own share, so its gradients stay local over the micro-batches and
  one reduction per step does the sync -- ``psum`` of all gradients flattened into one buffer per
  dtype (one all-reduce, :func:`_flat_psum`), or ``psum_scatter`` of each tensor into the ZeRO
  layout, in a ``shard_map``. ZeRO-2/3 reduce-scatter every micro-batch; ZeRO-3 all-gathers
  each parameter per micro-batch (its transpose is the reduce-scatter). XLA's CPU all-reduce
  combiner is off (``NO_COMBINE``): every collective the program asks for stays one HLO op, one
  record of the plan (``search/program/jax_records.py``). The loss is weighted per
  replica (``share / samples``), which also makes uneven shares exact: each replica's share is
  padded to the largest one and the model runs per sample with weight 0 on the padding.
* per stage a jitted forward (returns its ``jax.vjp`` residuals, so the backward recomputes
  nothing unless the plan says so), backward, fused forward+backward of the loss stage and
  update, called per micro-batch in the plan's schedule order (the per-stage action lists of
  ``search/schedule.pipeline_actions``, the ones the cost model simulates, merged by
  ``parallel.pipeline_schedule``; the loss stage's F and B are two calls, as listed; one stage:
  its fused step per micro-batch, then the update); activations and cotangents move between the stage meshes with
  ``jax.device_put``. A chunked plan (interleaved 1F1B, ``Plan.chunked``) lists one stage per model
  chunk: the chunks of a rank group share its mesh, and a value passes between them in place. Per-micro-batch calls keep micro-batches apart (:func:`train` says why).

Every compiled function's HLO is read for its collectives (``backends/jax/fidelity.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from partita.backends.jax import fidelity as fid
from partita.backends.jax import parallel as jp
from partita.errors import PlanError

# XLA's CPU all-reduce combiner merges neighbouring all-reduces of a compiled function by adjacency, which
# neither the plan nor its cost model (one latency per collective) knows: the programs keep every all-reduce
# they ask for as its own op, so each plan record is one HLO op (search/program/jax_records.py). Set before the
# backend starts (the program, the run and the rehearsal import this module first).
NO_COMBINE = "cpu-all-reduce-combiner"


def _no_combiner(flags: str) -> str:
    parts = flags.split()
    for k, f in enumerate(parts):
        if f.startswith("--xla_disable_hlo_passes="):
            if NO_COMBINE not in f.split("=", 1)[1].split(","):
                parts[k] = f"{f},{NO_COMBINE}"
            return " ".join(parts)
    return " ".join([*parts, f"--xla_disable_hlo_passes={NO_COMBINE}"])


os.environ["XLA_FLAGS"] = _no_combiner(os.environ.get("XLA_FLAGS", ""))


@dataclasses.dataclass(frozen=True)
class Program:
    """What a generated program declares (its module-level constants)."""

    model: str
    seq_len: int
    global_batch: int
    num_micro_batches: int
    layers: Sequence[str]
    stages: Sequence[Mapping[str, Any]]  # index, ranks, dp, tp, zero_stage, recompute, layers, shares, specs
    param_specs: Mapping[str, P]
    opt_state_specs: Mapping[str, P]  # where they differ from param_specs
    make_optimizer: Callable[[], Any]
    activation_pins: Mapping[str, Sequence[Sequence[P]]] = dataclasses.field(default_factory=dict)
    schedule: Sequence[tuple[str, int, int]] = ()
    notes: Sequence[str] = ()
    predicted_collectives: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0


def _axis_dim(spec: P, axis: str) -> int | None:
    for d, e in enumerate(spec):
        if e == axis or (isinstance(e, tuple) and axis in e):
            return d
    return None


def _without(spec: P, axis: str) -> P:
    """``spec`` with ``axis`` removed (a replica's view of a dp-sharded layout)."""
    out = []
    for e in spec:
        rest = tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if a != axis)
        out.append(None if not rest else rest[0] if len(rest) == 1 else rest)
    return P(*out)


def _flat_psum(local: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """One all-reduce over dp per dtype of every local gradient (``(1, *shape)`` per replica), flattened
    into one buffer and split back: a ``psum`` of several arrays lowers to one HLO all-reduce each, so
    the program buckets them itself, as the plan records (``search/program/jax_records.py``) and prices them."""
    out: dict[str, jax.Array] = {}
    by_dtype: dict[Any, list[str]] = {}
    for f, g in local.items():
        by_dtype.setdefault(g.dtype, []).append(f)
    for names in by_dtype.values():
        flat = jax.lax.psum(jnp.concatenate([local[f][0].ravel() for f in names]), "dp")
        start = 0
        for f in names:
            shape = local[f].shape[1:]
            size = int(np.prod(shape))
            out[f] = flat[start : start + size].reshape(shape)
            start += size
    return out


def check_tp_shards_nothing(index: int, specs: Mapping[str, P]) -> None:
    """The program's side of ``Stage.tp_shards_nothing`` (plan.json), as the torch program checks it: the
    plan says tp shards nothing in stage ``index``, so no parameter's layout names the ``tp`` axis.
    PlanError if one does (plan and program disagree)."""
    on_tp = [f for f, spec in specs.items() if _axis_dim(spec, "tp") is not None]
    if on_tp:
        raise PlanError(
            f"the plan says tp shards nothing in stage {index} (tp_shards_nothing), yet the program lays out "
            f"{', '.join(on_tp[:3])} on tp: plan and program disagree.",
            "recompile the plan with this Partita version; do not edit plan.json or the program by hand.",
        )


class StageRun:
    """One stage's mesh, layouts and the pieces of its step (module docstring)."""

    def __init__(self, program: Program, index: int, mesh: Any, prog: jp.StageProgram, split: jp.ModelSplit) -> None:
        self.cfg = program.stages[index]
        self.index, self.prog, self.mesh = index, prog, mesh
        self.dp, self.tp, self.zero = int(self.cfg["dp"]), int(self.cfg["tp"]), int(self.cfg["zero_stage"])
        self.tx = program.make_optimizer()
        self.per_sample = len(set(self.cfg["shares"])) > 1
        fq = prog.param_fqns
        self.spec = {f: _without(program.param_specs[f], "dp") for f in fq}  # compute layout (no dp)
        self.zspec = {f: program.opt_state_specs.get(f, program.param_specs[f]) for f in fq}
        if self.cfg.get("tp_shards_nothing"):
            check_tp_shards_nothing(index, {f: program.param_specs[f] for f in fq})
        self.param_sh = {f: self.sh(program.param_specs[f]) for f in fq}
        self.opt_param_sh = {f: self.sh(self.zspec[f]) for f in fq}
        self.grad_sh = self.opt_param_sh if self.zero >= 1 else self.param_sh
        self.acc_sh = self.grad_sh if self.zero >= 2 else {f: self.sh(P("dp", *self.spec[f])) for f in fq}
        self.diff = [k for k, i in enumerate(prog.inputs) if split.producer[i] >= 0 and split.is_float(i)]
        self.fout = [k for k, i in enumerate(prog.outputs) if split.is_float(i)]

    def sh(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # ---- parameters per replica and the dp reductions -------------------------------------
    def _gather(self, f: str, x: jax.Array) -> jax.Array:
        d = _axis_dim(self.zspec[f], "dp")

        def body(xl: jax.Array) -> jax.Array:
            return jax.lax.all_gather(xl, "dp", axis=d, tiled=True)[None]

        out = P("dp", *self.spec[f])
        return jax.shard_map(body, mesh=self.mesh, in_specs=self.zspec[f], out_specs=out)(x)

    def replicas(self, params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """(dp, *shape) per-replica parameters: a local broadcast, or ZeRO-3's all-gather over dp."""
        out = {}
        for f, x in params.items():
            if self.zero >= 3 and _axis_dim(self.zspec[f], "dp") is not None:
                out[f] = self._gather(f, x)
            else:
                b = jnp.broadcast_to(x, (self.dp, *x.shape))
                out[f] = jax.lax.with_sharding_constraint(b, self.sh(P("dp", *self.spec[f])))
        return out

    def sum_replicas(self, grads: Mapping[str, jax.Array], scatter: bool) -> dict[str, jax.Array]:
        """Sum per-replica gradients over dp: all-reduce, or reduce-scatter into the ZeRO layout."""
        if self.dp == 1:  # one replica: nothing to reduce (a psum over 1 device is still an HLO op)
            return {f: jax.lax.with_sharding_constraint(g[0], self.sh(self.zspec[f])) for f, g in grads.items()}
        out = {}
        whole = {}  # the gradients no dp layout divides: one psum of them all, one (tuple) all-reduce
        for f, g in grads.items():
            d = _axis_dim(self.zspec[f], "dp") if scatter else None
            if d is None:
                whole[f] = g
                continue

            def body(gl: jax.Array, d: int = d) -> jax.Array:
                return jax.lax.psum_scatter(gl[0], "dp", scatter_dimension=d, tiled=True)

            spec_in = P("dp", *self.spec[f])
            out[f] = jax.shard_map(body, mesh=self.mesh, in_specs=spec_in, out_specs=self.zspec[f])(g)
        if whole:
            specs_in = {f: P("dp", *self.spec[f]) for f in whole}
            # one buffer holds tp-sharded and tp-replicated gradients, so JAX cannot infer that the
            # replicated ones stay equal over tp: they do (each tp rank holds the same copy), hence no check
            summed = jax.shard_map(
                _flat_psum,
                mesh=self.mesh,
                in_specs=(specs_in,),
                out_specs={f: self.spec[f] for f in whole},
                check_vma=False,
            )(whole)
            out.update(summed)
        return {f: out[f] for f in grads}

    def accumulate(self, acc: Mapping[str, jax.Array], grads: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        if self.zero == 2:  # reduce-scatter every micro-batch (ZeRO-3: the gather's transpose already did)
            grads = self.sum_replicas(grads, scatter=True)
        return {f: jax.lax.with_sharding_constraint(acc[f] + grads[f], self.acc_sh[f]) for f in acc}

    def zero_acc(self, params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        lead = () if self.zero >= 2 else (self.dp,)
        return {
            f: jax.lax.with_sharding_constraint(jnp.zeros(lead + x.shape, x.dtype), self.acc_sh[f])
            for f, x in params.items()
        }

    # ---- the step's pieces -------------------------------------------------------------------
    def _replica_fn(self) -> Callable[..., Any]:
        def one(p: Mapping[str, jax.Array], xs: Sequence[jax.Array]) -> Any:
            outs = self.prog.apply(p, list(xs))
            return [outs[k] for k in self.fout], [y for k, y in enumerate(outs) if k not in self.fout]

        f = jax.vmap(one, in_axes=(None, 0)) if self.per_sample else one
        return jax.vmap(f, in_axes=(0, 0), spmd_axis_name="dp")

    def linearize(self, params: Mapping[str, jax.Array], xs: Sequence[jax.Array]) -> tuple[Any, Any, Any]:
        """(float outputs, other outputs, vjp) of the stage on every replica."""
        fn = self._replica_fn()
        primal = params if self.zero >= 3 else self.replicas(params)

        def run(p: Any, dxs: Sequence[jax.Array]) -> Any:
            full = list(xs)
            for k, x in zip(self.diff, dxs):
                full[k] = x
            outs, aux = fn(self.replicas(p) if self.zero >= 3 else p, full)
            return [jax.lax.with_sharding_constraint(y, self.sh(P("dp"))) for y in outs], aux

        outs, vjp, aux = jax.vjp(run, primal, [xs[k] for k in self.diff], has_aux=True)
        return outs, aux, vjp

    def forward(self, params: Any, xs: Sequence[jax.Array]) -> tuple[Any, Any, Any]:
        return self.linearize(params, xs)

    def backward(self, vjp: Any, cots: Sequence[jax.Array], acc: Any) -> tuple[Any, Any]:
        gp, gx = vjp(list(cots))
        return self.accumulate(acc, gp), gx

    def last(self, params: Any, xs: Sequence[jax.Array], weights: jax.Array, acc: Any) -> tuple[Any, Any, Any]:
        """Fused forward+backward of the loss stage; ``weights`` is the loss cotangent per replica/sample."""
        outs, _, vjp = self.linearize(params, xs)
        gp, gx = vjp([weights.astype(outs[0].dtype)])
        return outs[0], self.accumulate(acc, gp), gx

    def update(self, params: Any, opt_state: Any, acc: Any) -> tuple[Any, Any, Any]:
        if self.zero <= 1:
            grads = self.sum_replicas(acc, scatter=self.zero == 1)  # the one gradient sync of the step
        else:
            grads = acc
        grads = {f: jax.lax.with_sharding_constraint(g, self.grad_sh[f]) for f, g in grads.items()}
        view = params
        if self.zero in (1, 2):  # update the local dp shard, then all-gather the new parameters
            view = {f: jax.lax.with_sharding_constraint(x, self.opt_param_sh[f]) for f, x in params.items()}
        updates, opt_state = self.tx.update(grads, opt_state, view)
        new = optax.apply_updates(view, updates)
        new = {f: jax.lax.with_sharding_constraint(x, self.param_sh[f]) for f, x in new.items()}
        return new, opt_state, grads

    def opt_shardings(self, host_params: Mapping[str, np.ndarray]) -> Any:
        return optax.tree_map_params(
            self.tx,
            lambda _, s: s,
            jax.eval_shape(self.tx.init, {f: host_params[f] for f in self.prog.param_fqns}),
            self.opt_param_sh,
            transform_non_params=lambda _: self.sh(P()),
        )

    def place(self, host_params: Mapping[str, np.ndarray]) -> tuple[dict[str, jax.Array], Any]:
        params = {f: jp.global_array(host_params[f], self.param_sh[f]) for f in self.prog.param_fqns}
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings(host_params))(params)
        return params, opt_state


# ---- data ------------------------------------------------------------------------------------
def replica_batch(program: Program, host_batch: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """Host batch -> per micro-batch, per replica arrays ``(M, dp, share[, 1], ...)`` and loss weights.

    Replica ``r`` takes the next ``shares[r]`` samples of each micro-batch; shares are padded to
    the largest with zeros of weight 0. Weights sum to 1 over the step: the reference's mean.
    """
    shares = [int(x) for x in program.stages[0]["shares"]]
    m, dp, top = program.num_micro_batches, len(shares), max(shares)
    per_mb = sum(shares)
    per_sample = len(set(shares)) > 1
    starts = np.cumsum([0, *shares[:-1]])
    out = []
    for b in host_batch:
        arr = np.zeros((m, dp, top, *b.shape[1:]), b.dtype)
        for i in range(m):
            for r, (s0, n) in enumerate(zip(starts, shares)):
                arr[i, r, :n] = b[i * per_mb + s0 : i * per_mb + s0 + n]
        out.append(arr[:, :, :, None] if per_sample else arr)
    if per_sample:
        weights = np.zeros((m, dp, top), np.float32)
        for r, n in enumerate(shares):
            weights[:, r, :n] = 1.0 / (per_mb * m)
    else:
        weights = np.full((m, dp), top / (per_mb * m), np.float32)
    return out, weights


def _split(program: Program, handle: Any, pin_boundary: Any, pin_module: Any) -> jp.ModelSplit:
    shares = program.stages[0]["shares"]
    rows = 1 if len(set(shares)) > 1 else int(shares[0])
    remat = [int(s["index"]) for s in program.stages if s.get("recompute", "none") != "none"]
    return jp.split_model(
        handle.loss_fn,
        handle.abstract_params(),
        handle.example_batch(rows, program.seq_len),
        program.layers,
        [s["layers"] for s in program.stages],
        pin_boundary,
        module_pins=program.activation_pins,
        pin=pin_module,
        remat_stages=remat,
    )


def _pins(meshes: Sequence[Any], program: Program) -> tuple[Any, Any]:
    def boundary(s: int, _vid: int, x: Any) -> Any:
        # Layer boundaries: the plan's activation layout on tp (replicated unless it says S(d)).
        st = program.stages[s]
        if st["tp"] == 1 or not st.get("pin_layer_boundaries") or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        spec = jp.fit_spec(_without(program.stages[s]["input_spec"], "dp"), x.ndim)
        return jax.lax.with_sharding_constraint(x, NamedSharding(meshes[s], spec))

    return boundary, jp.module_pin(meshes, [int(st["tp"]) for st in program.stages])


def _meshes(program: Program) -> list[Any]:
    """One mesh per rank group: the model chunks of a group (same ranks) share it."""
    by_group: dict[tuple, Any] = {}
    for s in program.stages:
        key = (tuple(s["ranks"]), int(s["dp"]), int(s["tp"]))
        if key not in by_group:
            by_group[key] = jp.stage_mesh(s["ranks"], int(s["dp"]), int(s["tp"]))
    return [by_group[(tuple(s["ranks"]), int(s["dp"]), int(s["tp"]))] for s in program.stages]


# ---- the step ----------------------------------------------------------------------------------
class LazyJit:
    """``jax.jit(fn)`` compiled ahead of time on its first call's arguments; keeps the HLO text."""

    def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any) -> None:
        self.jitted = jax.jit(fn, **jit_kwargs)
        self.compiled: Any = None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = self.jitted.lower(*args).compile()
        return self.compiled(*args)

    def hlo(self) -> str:
        return self.compiled.as_text()


def train(
    program: Program,
    handle: Any,
    host_params: Any,
    host_batch: Sequence[np.ndarray],
    steps: int,
    step_times: list[float] | None = None,
) -> Any:
    """Train ``steps`` optimizer steps; returns (losses, params, last gradients, fidelity per stage).

    ``step_times`` (if given) receives each step's wall time, synchronised on the updated
    parameters; the first includes the jit compilations.

    Per stage jitted forward / backward / last / update functions, dispatched in
    ``program.schedule`` order (one stage: its fused forward+backward per micro-batch, then the
    update). One jitted call per micro-batch keeps micro-batches apart: inside one XLA program
    the CPU pipeline drops optimization barriers, so XLA would merge ZeRO-3's per-micro-batch
    parameter gathers into one (holding every gathered parameter for the whole step) and combine
    collectives across micro-batches.
    """
    meshes = _meshes(program)
    split = _split(program, handle, *_pins(meshes, program))
    runs = [StageRun(program, s, meshes[s], prog, split) for s, prog in enumerate(split.stages)]
    flat = jp.flatten(host_params)
    batch_np, w_np = replica_batch(program, host_batch)
    last = len(runs) - 1
    params, opt_states, fns = [], [], []
    for run in runs:
        p, o = run.place(flat)
        params.append(p)
        opt_states.append(o)
        opt_sh = run.opt_shardings(flat)
        rep = run.sh(P("dp"))  # stage inputs and loss weights: (dp replicas[, samples], ...)
        ins = [rep] * len(run.prog.inputs)
        fns.append(
            {
                "forward": LazyJit(run.forward, in_shardings=(run.param_sh, ins)),
                "backward": LazyJit(run.backward, donate_argnums=(2,)),
                "last": LazyJit(run.last, in_shardings=(run.param_sh, ins, rep, run.acc_sh), donate_argnums=(3,)),
                "update": LazyJit(
                    run.update,
                    in_shardings=(run.param_sh, opt_sh, run.acc_sh),
                    out_shardings=(run.param_sh, opt_sh, run.grad_sh),
                    donate_argnums=(0, 1),
                ),
                "zeros": jax.jit(run.zero_acc, out_shardings=run.acc_sh),
            }
        )
    batch = [jp.global_array(b, runs[0].sh(P(None, "dp"))) for b in batch_np]
    weights = jp.global_array(w_np, runs[last].sh(P(None, "dp")))
    sent: dict[str, Any] = {}  # stage -> its p2p sends of the first step
    back: dict[str, Any] = {}

    def inputs_of(s: int, mb: int, acts: Mapping[tuple[int, int], Any], count: bool) -> list[Any]:
        xs = []
        for i in runs[s].prog.inputs:
            if split.producer[i] < 0:
                x = batch[split.batch_ids.index(i)][mb]
            else:  # stage-to-stage transfer onto this stage's mesh (none between chunks of one rank group)
                x = acts[(mb, i)]
                if count and meshes[split.producer[i]] is not meshes[s]:
                    _count(sent, f"stage{split.producer[i]}", (mb, s), x)
            xs.append(jax.device_put(x, runs[s].sh(P("dp"))))
        return xs

    schedule = program.schedule or [("B", 0, mb) for mb in range(program.num_micro_batches)]
    losses, grads = [], {}
    for step in range(steps):
        t0 = time.perf_counter()
        acts, cots, saved, mb_losses = {}, {}, {}, []
        accs = [fns[s]["zeros"](params[s]) for s in range(len(runs))]
        for action, s, mb in schedule:
            fn, run = fns[s], runs[s]
            if action == "F":
                outs, aux, vjp = fn["forward"](params[s], inputs_of(s, mb, acts, step == 0))
                saved[(s, mb)] = vjp
                if s == last:  # the loss stage's forward: its loss now, its backward at its "B"
                    mb_losses.append((mb, outs[0]))
                    continue
                floats = [run.prog.outputs[k] for k in run.fout]
                others = [i for k, i in enumerate(run.prog.outputs) if k not in run.fout]
                acts.update(zip([(mb, i) for i in floats], outs))
                acts.update(zip([(mb, i) for i in others], aux))
                continue
            if s == last and (s, mb) in saved:  # a pipeline's loss stage: backward from the loss weights
                loss_dtype = dict(mb_losses)[mb].dtype
                accs[s], gx = fn["backward"](saved.pop((s, mb)), [weights[mb].astype(loss_dtype)], accs[s])
            elif s == last:  # one stage: its fused forward + backward
                xs = inputs_of(s, mb, acts, step == 0)
                mb_loss, accs[s], gx = fn["last"](params[s], xs, weights[mb], accs[s])
                mb_losses.append((mb, mb_loss))
            else:
                out_cots = [cots.pop((mb, run.prog.outputs[k])) for k in run.fout]
                accs[s], gx = fn["backward"](saved.pop((s, mb)), out_cots, accs[s])
            for k, g in zip(run.diff, gx):  # cotangents go back to the producing stage's mesh
                i = run.prog.inputs[k]
                src = split.producer[i]
                if step == 0 and meshes[src] is not meshes[s]:
                    _count(back, f"stage{s}", (mb, src), g)
                g = jax.device_put(g, runs[src].sh(P("dp")))
                cots[(mb, i)] = cots[(mb, i)] + g if (mb, i) in cots else g
        for s in range(len(runs)):
            params[s], opt_states[s], g = fns[s]["update"](params[s], opt_states[s], accs[s])
            grads.update(g)
        losses.append(sum(float(np.sum(jp.to_host(x) * w_np[mb])) for mb, x in mb_losses))
        jax.block_until_ready(params)
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)
    fidelity = {}
    m = program.num_micro_batches
    for run, fn in zip(runs, fns):
        names = ["last", "update"] if len(runs) == 1 else ["forward", "backward", "update"]
        per_fn = {k: fid.count_collectives(fn[k].hlo(), (run.dp, run.tp)) for k in names}
        calls = {k: 1 if k == "update" else m for k in names}
        key = f"stage{run.index}"
        fidelity[key] = {
            "hlo": {"functions": per_fn, **fid.weighted_collectives(per_fn, calls)},
            "calls": calls,
            "transfers": sent.get(key, {}),
            "transfers_backward": back.get(key, {}),
        }
    all_params = {f: x for p in params for f, x in p.items()}
    return losses, all_params, grads, fidelity


def _count(table: dict[str, Any], key: str, event: tuple[int, int], x: jax.Array) -> None:
    """One send per (micro-batch, destination stage); bytes per device (the array over dp replicas)."""
    e = table.setdefault(key, {"ops": 0, "bytes": 0.0, "events": []})
    if list(event) not in e["events"]:
        e["events"].append(list(event))
        e["ops"] += 1
    e["bytes"] += float(x.size * x.dtype.itemsize) / x.shape[0]


# ---- reference and entry point ---------------------------------------------------------------
def reference(program: Program, handle: Any, host_params: Any, host_batch: Sequence[np.ndarray], steps: int) -> Any:
    """The same model, data and optimizer on one device, the whole batch at once."""
    device = jax.devices()[0]
    tx = program.make_optimizer()

    @jax.jit
    def step(params: Any, opt_state: Any, batch: Sequence[jax.Array]) -> Any:
        loss, grads = jax.value_and_grad(handle.loss_fn)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    params = jax.device_put(host_params, device)
    opt_state = tx.init(params)
    batch = [jax.device_put(b, device) for b in host_batch]
    losses, grads = [], None
    for _ in range(steps):
        params, opt_state, loss, grads = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, jp.flatten(params), jp.flatten(grads)


def fidelity_report(program: Program, fidelity: Mapping[str, Any]) -> dict[str, Any]:
    """``collectives`` (measured), ``predicted_collectives`` and ``collective_mismatches`` per stage."""
    measured = {k: fid.measured_summary(v["hlo"], v.get("transfers")) for k, v in fidelity.items()}
    predicted = {
        k: {kk: {"ops": e["ops"], "bytes": e["bytes"]} for kk, e in v.items()}
        for k, v in program.predicted_collectives.items()
    }
    return {
        "collectives": measured,
        "predicted_collectives": dict(program.predicted_collectives),
        "collective_mismatches": {k: fid.compare(measured[k], predicted.get(k, {})) for k in measured},
    }


def main(program: Program, argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=f"Partita-generated JAX program for {program.model}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also train on one device and report its losses")
    ap.add_argument("--json-out", default="", help="write the result dict here (process 0)")
    ap.add_argument("--dump", default="", help="write final params and last gradients (.npz) to this folder")
    ap.add_argument("--coordinator", default="", help="HOST:PORT for jax.distributed (multi-process)")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    args = ap.parse_args(argv)
    if args.num_processes > 1:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    for note in program.notes:
        print(f"partita: {note}", file=sys.stderr, flush=True)
    handle = jp.load_model(program.model)
    host_params = jax.tree.map(np.asarray, handle.init_params(program.seed))
    host_batch = jp.make_batch(handle, program.global_batch, program.seq_len, program.seed)
    times: list[float] = []
    losses, params, grads, fidelity = train(program, handle, host_params, host_batch, args.steps, times)
    params = {f: jp.to_host(x) for f, x in params.items()}  # collective in multi-process runs
    grads = {f: jp.to_host(x) for f, x in grads.items()}
    result = {
        "losses": losses,
        "step_time_s": times,  # the first includes the jit compilations
        "notes": list(program.notes),
        "hlo_collectives": hlo_detail(fidelity),
        **fidelity_report(program, fidelity),
        "num_devices": jax.device_count(),
        "num_processes": jax.process_count(),
    }
    if args.reference and jax.process_index() == 0:
        ref_losses, ref_params, ref_grads = reference(program, handle, host_params, host_batch, args.steps)
        result["reference_losses"] = ref_losses
        result["max_param_diff"] = max(float(np.max(np.abs(params[f] - ref_params[f]))) for f in params)
        result["max_grad_diff"] = max(float(np.max(np.abs(grads[f] - ref_grads[f]))) for f in grads)
        if args.dump:
            np.savez(os.path.join(args.dump, "reference_params.npz"), **ref_params)
            np.savez(os.path.join(args.dump, "reference_grads.npz"), **ref_grads)
    if jax.process_index() == 0:
        if args.dump:
            np.savez(os.path.join(args.dump, "params.npz"), **params)
            np.savez(os.path.join(args.dump, "grads.npz"), **grads)
        text = json.dumps(result, indent=1, sort_keys=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(text + "\n")
        else:
            print(text)


def hlo_detail(fidelity: Mapping[str, Any]) -> dict[str, Any]:
    """Stage index -> weighted HLO counts (kind -> ops, ``by_axis``, ``bytes``...), calls and sends."""
    out = {}
    for key, v in fidelity.items():
        extra = {k: _jsonable(x) for k, x in v.items() if k != "hlo"}
        out[key.removeprefix("stage")] = {**_jsonable(v["hlo"]), **extra}
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items() if k != "events"}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
