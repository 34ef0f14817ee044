"""Partita-generated JAX program: jax-mlp on 8xCPU.

2 stage(s), schedule 1f1b, 2 micro-batches of 8 samples (global batch 16), optimizer adam.
Run:  JAX_NUM_CPU_DEVICES=8 python program_jax.py --steps 3 [--reference] [--json-out F]
      (or `partita run DIR --steps 3 --reference --json`). The data section is the plan; the code
      below it is the same for every plan with this many stages.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from partita.runtime import jax_parallel as jp

# ---- the plan ------------------------------------------------------------------------
MODEL = "jax-mlp"
SEED = 0
SEQ_LEN = 0
NUM_MICRO_BATCHES = 2
MICRO_BATCH = 8  # samples per micro-batch, all dp replicas together
GLOBAL_BATCH = 16
LAYERS = ["fc1", "fc2"]


def make_optimizer() -> optax.GradientTransformation:
    return optax.adam(learning_rate=0.001, b1=0.9, b2=0.999, eps=1e-8)


# One mesh per stage, axes (dp, tp): mesh coordinate (i, j) holds rank ranks[i * tp + j].
# input_spec / output_spec: the boundary activation layout (batch dim first).
STAGES = [
    dict(
        index=0,
        ranks=[0, 1, 2, 3],
        dp=2,
        tp=2,
        zero_stage=0,
        layers=["fc1"],
        input_spec=P("dp"),  # plan: (S(0), R)
        output_spec=P("dp"),  # plan: (S(0), R)
    ),
    dict(
        index=1,
        ranks=[4, 5, 6, 7],
        dp=2,
        tp=2,
        zero_stage=0,
        layers=["fc2"],
        input_spec=P("dp"),  # plan: (S(0), R)
        output_spec=P("dp"),  # plan: (S(0), R)
    ),
]

# Parameter layouts on their stage's mesh (ZeRO-3 adds dp here), and optimizer-state
# layouts (ZeRO-1/2/3 shard them over dp; ZeRO-2 also reduces gradients to that layout).
PARAM_STAGE = {
    "params.fc1.bias": 0,
    "params.fc1.kernel": 0,
    "params.fc2.bias": 1,
    "params.fc2.kernel": 1,
}
PARAM_SPECS = {
    "params.fc1.bias": P("tp"),  # (R, S(0))
    "params.fc1.kernel": P(None, "tp"),  # (R, S(1))
    "params.fc2.bias": P(),  # (R, R)
    "params.fc2.kernel": P("tp"),  # (R, S(0))
}
OPT_STATE_SPECS = {
    "params.fc1.bias": P("tp"),
    "params.fc1.kernel": P(None, "tp"),
    "params.fc2.bias": P(),
    "params.fc2.kernel": P("tp"),
}

# What the plan predicts each stage issues per step (kind -> count; by_axis kind@axis -> count).
PREDICTED_COLLECTIVES = {"0": {"by_axis": {}}, "1": {"by_axis": {}}}

# 1F1B: stage s runs num_stages-1-s warm-up forwards, then alternates one forward / one backward.
# (action, stage, micro-batch) in dispatch order; each device runs its work in dispatch order, so
# this is the order the stages execute. 'B' of the last stage is its fused forward+backward.
SCHEDULE_KIND = "1f1b"
# fmt: off
SCHEDULE = [
    ("F", 0, 0), ("B", 1, 0), ("F", 0, 1), ("B", 1, 1), ("B", 0, 0), ("B", 0, 1),
]
# fmt: on


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
                f.write(text + "\n")
        else:
            print(text)


if __name__ == "__main__":
    main()
