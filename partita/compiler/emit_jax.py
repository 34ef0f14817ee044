"""JAX emitter: a :class:`~partita.plan.Plan` -> the readable program ``program_jax.py``.

Last compile stage for JAX models (the PyTorch twin is ``emit_torch.py``); ``compiler/driver.py``
writes its output next to ``plan.json`` and ``runtime/jax_run.py`` launches it. Everything the
plan decided is literal data at the top of the generated file: the stages (ranks, mesh shape,
layers, ZeRO stage, boundary PartitionSpecs), one PartitionSpec per parameter (ZeRO's dp sharding
folded in), the optimizer, and for pipelines the dispatch order of every (forward / backward,
stage, micro-batch) action. The code below the data is fixed (``_PROGRAM_*`` templates):

* one stage: a single ``jax.jit`` train step with NamedSharding ``in_shardings`` /
  ``out_shardings`` on the stage mesh; micro-batches are unrolled inside it (gradient
  accumulation), then the optax update. XLA's SPMD partitioner inserts the collectives that the
  layouts imply (gradient all-reduce for dp, activation all-reduce for Megatron tp, parameter
  all-gather for ZeRO-3), and the compiled HLO shows them;
* several stages: per stage a jitted forward, a jitted backward (recomputes the stage forward
  under ``jax.vjp``, accumulates gradients) and a jitted optimizer update, each on the stage's
  sub-mesh; activations and cotangents move between meshes with ``jax.device_put``.

The emitter loads the model only for parameter shapes (``abstract_params``, nothing allocated).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from partita.errors import PlanError
from partita.plan import Plan, placements_to_str, shares
from partita.runtime import jax_parallel as jp

DEFAULT_LR = 1e-3


def _q(text: str) -> str:
    return json.dumps(text)


def _spec_src(spec: Any) -> str:
    parts = []
    for e in spec:
        parts.append("None" if e is None else _q(e) if isinstance(e, str) else "(" + ", ".join(map(_q, e)) + ")")
    while parts and parts[-1] == "None":
        parts.pop()
    return "P(" + ", ".join(parts) + ")"


def _optimizer_src(training: Mapping[str, Any]) -> str:
    opt = training.get("optimizer", "adam")
    name = str(opt.get("name", "adam") if isinstance(opt, Mapping) else opt)
    lr = float(training.get("lr", DEFAULT_LR))
    if name == "adamw":
        wd = float(training.get("weight_decay", 0.01))
        return f"optax.adamw(learning_rate={lr!r}, b1=0.9, b2=0.999, eps=1e-8, weight_decay={wd!r})"
    if name == "adam":
        return f"optax.adam(learning_rate={lr!r}, b1=0.9, b2=0.999, eps=1e-8)"
    if name == "sgd":
        return f"optax.sgd(learning_rate={lr!r})"
    raise PlanError(f"optimizer {name!r} has no JAX lowering.", "use adam, adamw or sgd.")


def _check(plan: Plan) -> None:
    for s in plan.stages:
        if len(set(shares(s, plan.micro_batch_size))) > 1:
            raise PlanError(
                f"stage {s.index} splits micro-batches unevenly ({list(s.batch_shares)}); "
                "JAX NamedSharding needs equal shards.",
                "compile without uneven shares for the JAX backend, or use the torch backend.",
            )
        if s.dp * plan.micro_batch_size != plan.stages[0].dp * plan.micro_batch_size:
            raise PlanError("stages see different micro-batch sizes.", "recompile the plan.")


def param_specs(plan: Plan, shapes: Mapping[str, Sequence[int]], stage_of: Mapping[str, int]) -> dict[str, Any]:
    """fqn -> (parameter PartitionSpec, optimizer-state PartitionSpec, plan placement text)."""
    out: dict[str, Any] = {}
    for fqn, shape in shapes.items():
        st = plan.stages[stage_of[fqn]]
        placement = tuple(st.param_placements.get(fqn, ("R",) * 2))
        spec = jp.partition_spec(placement, shape, st.mesh_shape, f"stage {st.index} parameter {fqn}")
        spec0 = spec
        opt_spec = jp.zero_spec(spec, shape, st.mesh_shape) if st.zero_stage >= 1 else spec
        if st.zero_stage >= 3:
            spec = opt_spec
        note = placements_to_str(placement) if fqn in st.param_placements else "not in plan: (R, R)"
        if st.zero_stage >= 1 and opt_spec != spec0:
            note += f"; ZeRO-{st.zero_stage} over dp"
        out[fqn] = (spec, opt_spec, note)
    return out


def emit_jax(plan: Plan, model_spec: str) -> str:
    """The generated program's source for ``plan`` (``model_spec`` names the zoo entry or module:factory)."""
    _check(plan)
    handle = jp.load_model(model_spec)
    abstract = handle.abstract_params()
    shapes = {k: tuple(v.shape) for k, v in jp.flatten(abstract).items()}
    layers = list(plan.model.get("layers") or [lay for s in plan.stages for lay in s.layers])
    micro = plan.micro_batch_size * plan.stages[0].dp
    seq = int(plan.training.get("seq_len", 0))
    batch_shapes = handle.example_batch(micro, seq)
    split = jp.split_model(handle.loss_fn, abstract, batch_shapes, layers, [s.layers for s in plan.stages])
    stage_of = {f: st.index for st in split.stages for f in st.param_fqns}
    specs = param_specs(plan, shapes, stage_of)

    lines = [
        f'"""Partita-generated JAX program: {plan.model.get("name", model_spec)} on {plan.cluster.get("name", "?")}.',
        "",
    ]
    lines += [
        f"{plan.num_stages} stage(s), schedule {plan.schedule}, {plan.num_micro_batches} micro-batches of {micro} samples "
        f"(global batch {micro * plan.num_micro_batches}), optimizer {plan.training.get('optimizer', 'adam')}.",
        "Run:  JAX_NUM_CPU_DEVICES="
        + str(plan.world_size)
        + " python program_jax.py --steps 3 [--reference] [--json-out F]",
        "      (or `partita run DIR --steps 3 --reference --json`). The data section is the plan; the code",
        "      below it is the same for every plan with this many stages.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import argparse",
        "import json",
        "import os",
        "",
        "import jax",
        "import jax.numpy as jnp",
        "import numpy as np",
        "import optax",
        "from jax.sharding import NamedSharding",
        "from jax.sharding import PartitionSpec as P",
        "",
        "from partita.runtime import jax_parallel as jp",
        "",
        "# ---- the plan ------------------------------------------------------------------------",
        f"MODEL = {_q(model_spec)}",
        "SEED = 0",
        f"SEQ_LEN = {seq}",
        f"NUM_MICRO_BATCHES = {plan.num_micro_batches}",
        f"MICRO_BATCH = {micro}  # samples per micro-batch, all dp replicas together",
        f"GLOBAL_BATCH = {micro * plan.num_micro_batches}",
        f"LAYERS = {json.dumps(layers)}",
        "",
        "",
        "def make_optimizer() -> optax.GradientTransformation:",
        f"    return {_optimizer_src(plan.training)}",
        "",
        "",
        "# One mesh per stage, axes (dp, tp): mesh coordinate (i, j) holds rank ranks[i * tp + j].",
        "# input_spec / output_spec: the boundary activation layout (batch dim first).",
        "STAGES = [",
    ]
    for st in plan.stages:
        in_spec = jp.partition_spec(st.input_placement, (micro * st.dp * st.tp,) * 4, st.mesh_shape, "input")
        out_spec = jp.partition_spec(st.output_placement, (micro * st.dp * st.tp,) * 4, st.mesh_shape, "output")
        lines += [
            "    dict(",
            f"        index={st.index},",
            f"        ranks={list(st.ranks)},",
            f"        dp={st.dp},",
            f"        tp={st.tp},",
            f"        zero_stage={st.zero_stage},",
            f"        layers={json.dumps(list(st.layers))},",
            f"        input_spec={_spec_src(in_spec)},  # plan: {placements_to_str(st.input_placement)}",
            f"        output_spec={_spec_src(out_spec)},  # plan: {placements_to_str(st.output_placement)}",
            "    ),",
        ]
    lines += [
        "]",
        "",
        "# Parameter layouts on their stage's mesh (ZeRO-3 adds dp here), and optimizer-state",
        "# layouts (ZeRO-1/2/3 shard them over dp; ZeRO-2 also reduces gradients to that layout).",
        "PARAM_STAGE = {",
    ]
    lines += [f"    {_q(f)}: {stage_of[f]}," for f in shapes]
    lines += ["}", "PARAM_SPECS = {"]
    lines += [f"    {_q(f)}: {_spec_src(specs[f][0])},  # {specs[f][2]}" for f in shapes]
    lines += ["}", "OPT_STATE_SPECS = {"]
    lines += [f"    {_q(f)}: {_spec_src(specs[f][1])}," for f in shapes]
    lines += [
        "}",
        "",
        "# What the plan predicts each stage issues per step (kind -> count; by_axis kind@axis -> count).",
    ]
    pred = {str(st.index): jp.predicted_collectives(st.collectives) for st in plan.stages}
    lines += [f"PREDICTED_COLLECTIVES = {json.dumps(pred, sort_keys=True)}", ""]
    if plan.num_stages > 1:
        kind = "gpipe" if plan.schedule == "gpipe" else "1f1b"
        actions = jp.pipeline_schedule(kind, plan.num_stages, plan.num_micro_batches)
        note = {
            "gpipe": "GPipe: every stage runs all forwards, then all backwards.",
            "1f1b": "1F1B: stage s runs num_stages-1-s warm-up forwards, then alternates one forward / one backward.",
            "interleaved_1f1b": "interleaved 1F1B is run as plain 1F1B over the plan's stages (one model chunk per stage).",
        }[plan.schedule]
        lines += [
            f"# {note}",
            "# (action, stage, micro-batch) in dispatch order; each device runs its work in dispatch order, so",
            "# this is the order the stages execute. 'B' of the last stage is its fused forward+backward.",
            f"SCHEDULE_KIND = {_q(plan.schedule)}",
            "# fmt: off",
            "SCHEDULE = [",
        ]
        for i in range(0, len(actions), 6):
            lines.append("    " + " ".join(f"({_q(a)}, {st}, {mb})," for a, st, mb in actions[i : i + 6]))
        lines += ["]", "# fmt: on", ""]
        lines.append(_PROGRAM_PIPELINE)
    else:
        lines.append(_PROGRAM_SPMD)
    lines.append(_PROGRAM_COMMON)
    return "\n".join(lines).rstrip() + "\n"


_PROGRAM_SPMD = """
# ---- one stage: a single SPMD train step ---------------------------------------------------
def train(handle, host_params, host_batch, steps):
    stage = STAGES[0]
    mesh = jp.stage_mesh(stage["ranks"], stage["dp"], stage["tp"])
    layout = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    replicated = layout(P())

    def pin_layer_boundary(_stage, _value, x):
        # Between layers only the batch dim is pinned (to dp); the partitioner picks the rest.
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1 and x.shape[0] == MICRO_BATCH:
            spec = P(*jp.fit_spec(stage["input_spec"], 1), *[P.UNCONSTRAINED] * (x.ndim - 1))
            return jax.lax.with_sharding_constraint(x, layout(spec))
        return x

    micro = [b[:MICRO_BATCH] for b in host_batch]
    split = jp.split_model(
        handle.loss_fn, handle.abstract_params(), micro, LAYERS, [stage["layers"]], pin_layer_boundary
    )
    loss_of = split.stages[0]
    tx = make_optimizer()
    param_sh = {f: layout(s) for f, s in PARAM_SPECS.items()}
    grad_sh = {f: layout(OPT_STATE_SPECS[f] if stage["zero_stage"] >= 2 else s) for f, s in PARAM_SPECS.items()}
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, s: s,
        jax.eval_shape(tx.init, jp.flatten(host_params)),
        {f: layout(s) for f, s in OPT_STATE_SPECS.items()},
        transform_non_params=lambda _: replicated,
    )
    # Micro-batches stacked on a leading dim: (NUM_MICRO_BATCHES, MICRO_BATCH, ...), batch dim over dp.
    batch_sh = [layout(P(None, *jp.fit_spec(stage["input_spec"], b.ndim))) for b in host_batch]

    def train_step(params, opt_state, batch):
        grads = {f: jnp.zeros_like(p) for f, p in params.items()}
        loss = jnp.zeros((), jnp.float32)
        for i in range(NUM_MICRO_BATCHES):  # unrolled: the HLO shows every collective a step issues
            inputs = [
                jax.lax.with_sharding_constraint(b[i], layout(jp.fit_spec(stage["input_spec"], b.ndim - 1)))
                for b in batch
            ]
            mb_loss, mb_grads = jax.value_and_grad(lambda p, xs=inputs: loss_of.apply(p, xs)[0])(params)
            loss = loss + mb_loss / NUM_MICRO_BATCHES
            grads = {f: g + mb_grads[f] / NUM_MICRO_BATCHES for f, g in grads.items()}
        grads = {f: jax.lax.with_sharding_constraint(g, grad_sh[f]) for f, g in grads.items()}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    params = {f: jp.global_array(x, param_sh[f]) for f, x in jp.flatten(host_params).items()}
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    assert [split.batch_ids.index(i) for i in loss_of.inputs] == list(range(len(host_batch)))
    stacked = [b.reshape(NUM_MICRO_BATCHES, MICRO_BATCH, *b.shape[1:]) for b in host_batch]
    batch = [jp.global_array(b, s) for b, s in zip(stacked, batch_sh)]
    step_fn = (
        jax.jit(
            train_step,
            in_shardings=(param_sh, opt_sh, batch_sh),
            out_shardings=(param_sh, opt_sh, replicated, grad_sh),
            donate_argnums=(0, 1),
        )
        .lower(params, opt_state, batch)
        .compile()
    )
    # Fidelity: the collectives XLA inserted for these layouts, read from the compiled HLO.
    hlo = {"0": jp.count_collectives(step_fn.as_text(), (stage["dp"], stage["tp"]))}
    losses, grads = [], None
    for _ in range(steps):
        params, opt_state, loss, grads = step_fn(params, opt_state, batch)
        losses.append(float(jp.to_host(loss)))
    return losses, params, grads, hlo, {"0": {"train_step": 1}}
"""

_PROGRAM_PIPELINE = """
# ---- pipeline: per-stage jitted forward / backward / update on sub-meshes ------------------
def train(handle, host_params, host_batch, steps):
    meshes = [jp.stage_mesh(s["ranks"], s["dp"], s["tp"]) for s in STAGES]
    last = len(STAGES) - 1

    def act_sharding(s, x, spec_key="input_spec"):
        return NamedSharding(meshes[s], jp.fit_spec(STAGES[s][spec_key], len(x.shape)))

    def pin_layer_boundary(s, _value, x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1 and x.shape[0] == MICRO_BATCH:
            spec = P(*jp.fit_spec(STAGES[s]["input_spec"], 1), *[P.UNCONSTRAINED] * (x.ndim - 1))
            return jax.lax.with_sharding_constraint(x, NamedSharding(meshes[s], spec))
        return x

    micro = [b[:MICRO_BATCH] for b in host_batch]
    split = jp.split_model(
        handle.loss_fn, handle.abstract_params(), micro, LAYERS, [s["layers"] for s in STAGES], pin_layer_boundary
    )
    tx = make_optimizer()
    flat = jp.flatten(host_params)
    fns, params, opt_states, grad_acc, hlo, calls = [], [], [], [], {}, {}
    for s, prog in enumerate(split.stages):
        mesh = meshes[s]
        rep = NamedSharding(mesh, P())
        p_sh = {f: NamedSharding(mesh, PARAM_SPECS[f]) for f in prog.param_fqns}
        g_sh = {
            f: NamedSharding(mesh, OPT_STATE_SPECS[f] if STAGES[s]["zero_stage"] >= 2 else PARAM_SPECS[f])
            for f in prog.param_fqns
        }
        o_sh = optax.tree_map_params(
            tx,
            lambda _, x: x,
            jax.eval_shape(tx.init, {f: flat[f] for f in prog.param_fqns}),
            {f: NamedSharding(mesh, OPT_STATE_SPECS[f]) for f in prog.param_fqns},
            transform_non_params=lambda _, rep=rep: rep,
        )
        in_sh = [act_sharding(s, split.avals[i]) for i in prog.inputs]
        out_sh = [act_sharding(s, split.avals[i], "output_spec") for i in prog.outputs]
        diff = [k for k, i in enumerate(prog.inputs) if split.producer[i] >= 0 and split.is_float(i)]

        def forward(p, xs, prog=prog, in_sh=in_sh, out_sh=out_sh):
            xs = [jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(xs, in_sh)]
            outs = prog.apply(p, xs)
            return [jax.lax.with_sharding_constraint(y, sh) if y.ndim else y for y, sh in zip(outs, out_sh)]

        fout = [k for k, i in enumerate(prog.outputs) if split.is_float(i)]

        def backward(p, xs, cots, acc, forward=forward, diff=diff, fout=fout, g_sh=g_sh, is_last=s == last):
            # Recomputes the stage forward (only stage inputs are kept between F and B).
            def stage_fn(p, dxs):
                full = list(xs)
                for k, x in zip(diff, dxs):
                    full[k] = x
                outs = forward(p, full)
                return [outs[k] for k in fout]

            outs, vjp = jax.vjp(stage_fn, p, [xs[k] for k in diff])
            gp, gx = vjp([jnp.ones_like(outs[0])] if is_last else cots)  # the last stage owns the loss
            acc = {k: jax.lax.with_sharding_constraint(acc[k] + gp[k], g_sh[k]) for k in acc}
            return (outs[0] if is_last else None), acc, gx

        def update(p, o, acc):
            grads = {k: g / NUM_MICRO_BATCHES for k, g in acc.items()}
            updates, o = tx.update(grads, o, p)
            return optax.apply_updates(p, updates), o, grads

        diff_sh = [in_sh[k] for k in diff]
        fwd = jax.jit(forward, in_shardings=(p_sh, in_sh), out_shardings=out_sh)
        params.append({f: jp.global_array(flat[f], p_sh[f]) for f in prog.param_fqns})
        opt_states.append(jax.jit(tx.init, out_shardings=o_sh)(params[s]))
        zeros = jax.jit(lambda p: {k: jnp.zeros_like(v) for k, v in p.items()}, out_shardings=g_sh)
        acc0 = zeros(params[s])
        ex_in = [
            jax.ShapeDtypeStruct(split.avals[i].shape, split.avals[i].dtype, sharding=sh)
            for i, sh in zip(prog.inputs, in_sh)
        ]
        ex_cot = [
            jax.ShapeDtypeStruct(
                split.avals[prog.outputs[k]].shape, split.avals[prog.outputs[k]].dtype, sharding=out_sh[k]
            )
            for k in fout
        ]
        if s == last:
            bwd = jax.jit(
                lambda p, xs, acc, b=backward: b(p, xs, None, acc),
                in_shardings=(p_sh, in_sh, g_sh),
                out_shardings=(rep, g_sh, diff_sh),
                donate_argnums=(2,),
            ).lower(params[s], ex_in, acc0)
        else:
            bwd = jax.jit(
                backward,
                in_shardings=(p_sh, in_sh, [out_sh[k] for k in fout], g_sh),
                out_shardings=(None, g_sh, diff_sh),
                donate_argnums=(3,),
            ).lower(params[s], ex_in, ex_cot, acc0)
        upd = jax.jit(
            update, in_shardings=(p_sh, o_sh, g_sh), out_shardings=(p_sh, o_sh, g_sh), donate_argnums=(0, 1, 2)
        ).lower(params[s], opt_states[s], acc0)
        lowered = {"backward": bwd, "update": upd} | ({"forward": fwd.lower(params[s], ex_in)} if s != last else {})
        compiled = {k: v.compile() for k, v in lowered.items()}
        fns.append((prog, compiled.get("forward"), compiled["backward"], compiled["update"], zeros, diff, fout))
        # Fidelity: collectives of each compiled stage function, weighted by its calls per step.
        per_fn = {k: jp.count_collectives(c.as_text(), (STAGES[s]["dp"], STAGES[s]["tp"])) for k, c in compiled.items()}
        calls[str(s)] = {"forward": NUM_MICRO_BATCHES if s != last else 0, "backward": NUM_MICRO_BATCHES, "update": 1}
        hlo[str(s)] = {"functions": per_fn, **jp.weighted_collectives(per_fn, calls[str(s)])}

    def inputs_of(s, mb, store):
        xs = []
        for i in fns[s][0].inputs:
            if split.producer[i] < 0:
                host = host_batch[split.batch_ids.index(i)][mb * MICRO_BATCH : (mb + 1) * MICRO_BATCH]
                xs.append(jp.global_array(host, act_sharding(s, split.avals[i])))
            else:  # stage-to-stage transfer onto this stage's mesh
                xs.append(jax.device_put(store[(mb, i)], act_sharding(s, split.avals[i])))
        return xs

    losses, grads = [], {}
    for _ in range(steps):
        acts, cots, saved, loss = {}, {}, {}, 0.0
        grad_acc = [fns[s][4](params[s]) for s in range(len(STAGES))]
        for action, s, mb in SCHEDULE:
            prog, fwd, bwd, _, _, diff, fout = fns[s]
            if action == "F":
                saved[(s, mb)] = inputs_of(s, mb, acts)
                acts.update({((mb, i)): y for i, y in zip(prog.outputs, fwd(params[s], saved[(s, mb)]))})
                continue
            xs = saved.pop((s, mb)) if (s, mb) in saved else inputs_of(s, mb, acts)
            if s == last:
                mb_loss, grad_acc[s], gx = bwd(params[s], xs, grad_acc[s])
                loss = loss + mb_loss
            else:
                out_cots = [cots.pop((mb, prog.outputs[k])) for k in fout]
                _, grad_acc[s], gx = bwd(params[s], xs, out_cots, grad_acc[s])
            for k, g in zip(diff, gx):  # cotangents go back to the producing stage's mesh
                i = prog.inputs[k]
                g = jax.device_put(g, act_sharding(split.producer[i], split.avals[i], "output_spec"))
                cots[(mb, i)] = cots[(mb, i)] + g if (mb, i) in cots else g
        for s in range(len(STAGES)):
            params[s], opt_states[s], g = fns[s][3](params[s], opt_states[s], grad_acc[s])
            grads.update(g)
        losses.append(float(jp.to_host(loss)) / NUM_MICRO_BATCHES)
    all_params = {f: x for p in params for f, x in p.items()}
    return losses, all_params, grads, hlo, calls
"""

_PROGRAM_COMMON = """
# ---- single-device reference (same model, data, optimizer; whole batch at once) -------------
def reference(handle, host_params, host_batch, steps):
    device = jax.devices()[0]
    tx = make_optimizer()

    @jax.jit
    def step(params, opt_state, batch):
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also train on one device and report its losses")
    ap.add_argument("--json-out", default="", help="write the result dict here (process 0)")
    ap.add_argument("--dump", default="", help="write final params and last gradients (.npz) to this folder")
    ap.add_argument("--coordinator", default="", help="HOST:PORT for jax.distributed (multi-process)")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    args = ap.parse_args()
    if args.num_processes > 1:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    handle = jp.load_model(MODEL)
    host_params = jax.tree.map(np.asarray, handle.init_params(SEED))
    host_batch = jp.make_batch(handle, GLOBAL_BATCH, SEQ_LEN, SEED)
    losses, params, grads, hlo, calls = train(handle, host_params, host_batch, args.steps)
    params = {f: jp.to_host(x) for f, x in params.items()}  # collective in multi-process runs
    grads = {f: jp.to_host(x) for f, x in grads.items()}
    result = {
        "losses": losses,
        "hlo_collectives": hlo,
        "predicted_collectives": PREDICTED_COLLECTIVES,
        "calls_per_step": calls,
        "num_devices": jax.device_count(),
        "num_processes": jax.process_count(),
    }
    if args.reference and jax.process_index() == 0:
        ref_losses, ref_params, ref_grads = reference(handle, host_params, host_batch, args.steps)
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
                f.write(text + "\\n")
        else:
            print(text)


if __name__ == "__main__":
    main()
"""
