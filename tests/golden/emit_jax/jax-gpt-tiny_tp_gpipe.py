"""Partita-generated JAX program: jax-gpt-tiny on 8xCPU.

1 stage(s), schedule gpipe, 2 micro-batches of 8 samples (global batch 16), optimizer adamw.
Run:  JAX_NUM_CPU_DEVICES=4 python program_jax.py --steps 3 [--reference] [--json-out F]
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
MODEL = "jax-gpt-tiny"
SEED = 0
SEQ_LEN = 16
NUM_MICRO_BATCHES = 2
MICRO_BATCH = 8  # samples per micro-batch, all dp replicas together
GLOBAL_BATCH = 16
LAYERS = ["wte", "wpe", "blocks_0", "blocks_1", "ln_f", "lm_head"]


def make_optimizer() -> optax.GradientTransformation:
    return optax.adamw(learning_rate=0.001, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


# One mesh per stage, axes (dp, tp): mesh coordinate (i, j) holds rank ranks[i * tp + j].
# input_spec / output_spec: the boundary activation layout (batch dim first).
STAGES = [
    dict(
        index=0,
        ranks=[0, 1, 2, 3],
        dp=1,
        tp=4,
        zero_stage=0,
        layers=["wte", "wpe", "blocks_0", "blocks_1", "ln_f", "lm_head"],
        input_spec=P("dp"),  # plan: (S(0), R)
        output_spec=P("dp"),  # plan: (S(0), R)
    ),
]

# Parameter layouts on their stage's mesh (ZeRO-3 adds dp here), and optimizer-state
# layouts (ZeRO-1/2/3 shard them over dp; ZeRO-2 also reduces gradients to that layout).
PARAM_STAGE = {
    "params.blocks_0.attn.proj.bias": 0,
    "params.blocks_0.attn.proj.kernel": 0,
    "params.blocks_0.attn.qkv.bias": 0,
    "params.blocks_0.attn.qkv.kernel": 0,
    "params.blocks_0.ln_1.bias": 0,
    "params.blocks_0.ln_1.scale": 0,
    "params.blocks_0.ln_2.bias": 0,
    "params.blocks_0.ln_2.scale": 0,
    "params.blocks_0.mlp.fc.bias": 0,
    "params.blocks_0.mlp.fc.kernel": 0,
    "params.blocks_0.mlp.proj.bias": 0,
    "params.blocks_0.mlp.proj.kernel": 0,
    "params.blocks_1.attn.proj.bias": 0,
    "params.blocks_1.attn.proj.kernel": 0,
    "params.blocks_1.attn.qkv.bias": 0,
    "params.blocks_1.attn.qkv.kernel": 0,
    "params.blocks_1.ln_1.bias": 0,
    "params.blocks_1.ln_1.scale": 0,
    "params.blocks_1.ln_2.bias": 0,
    "params.blocks_1.ln_2.scale": 0,
    "params.blocks_1.mlp.fc.bias": 0,
    "params.blocks_1.mlp.fc.kernel": 0,
    "params.blocks_1.mlp.proj.bias": 0,
    "params.blocks_1.mlp.proj.kernel": 0,
    "params.lm_head.kernel": 0,
    "params.ln_f.bias": 0,
    "params.ln_f.scale": 0,
    "params.wpe.embedding": 0,
    "params.wte.embedding": 0,
}
PARAM_SPECS = {
    "params.blocks_0.attn.proj.bias": P(),  # not in plan: (R, R)
    "params.blocks_0.attn.proj.kernel": P(),  # not in plan: (R, R)
    "params.blocks_0.attn.qkv.bias": P(),  # not in plan: (R, R)
    "params.blocks_0.attn.qkv.kernel": P(),  # not in plan: (R, R)
    "params.blocks_0.ln_1.bias": P(),  # not in plan: (R, R)
    "params.blocks_0.ln_1.scale": P(),  # not in plan: (R, R)
    "params.blocks_0.ln_2.bias": P(),  # not in plan: (R, R)
    "params.blocks_0.ln_2.scale": P(),  # not in plan: (R, R)
    "params.blocks_0.mlp.fc.bias": P("tp"),  # (R, S(0))
    "params.blocks_0.mlp.fc.kernel": P(None, "tp"),  # (R, S(1))
    "params.blocks_0.mlp.proj.bias": P(),  # not in plan: (R, R)
    "params.blocks_0.mlp.proj.kernel": P("tp"),  # (R, S(0))
    "params.blocks_1.attn.proj.bias": P(),  # not in plan: (R, R)
    "params.blocks_1.attn.proj.kernel": P(),  # not in plan: (R, R)
    "params.blocks_1.attn.qkv.bias": P(),  # not in plan: (R, R)
    "params.blocks_1.attn.qkv.kernel": P(),  # not in plan: (R, R)
    "params.blocks_1.ln_1.bias": P(),  # not in plan: (R, R)
    "params.blocks_1.ln_1.scale": P(),  # not in plan: (R, R)
    "params.blocks_1.ln_2.bias": P(),  # not in plan: (R, R)
    "params.blocks_1.ln_2.scale": P(),  # not in plan: (R, R)
    "params.blocks_1.mlp.fc.bias": P("tp"),  # (R, S(0))
    "params.blocks_1.mlp.fc.kernel": P(None, "tp"),  # (R, S(1))
    "params.blocks_1.mlp.proj.bias": P(),  # not in plan: (R, R)
    "params.blocks_1.mlp.proj.kernel": P("tp"),  # (R, S(0))
    "params.lm_head.kernel": P(),  # not in plan: (R, R)
    "params.ln_f.bias": P(),  # not in plan: (R, R)
    "params.ln_f.scale": P(),  # not in plan: (R, R)
    "params.wpe.embedding": P(),  # not in plan: (R, R)
    "params.wte.embedding": P(),  # not in plan: (R, R)
}
OPT_STATE_SPECS = {
    "params.blocks_0.attn.proj.bias": P(),
    "params.blocks_0.attn.proj.kernel": P(),
    "params.blocks_0.attn.qkv.bias": P(),
    "params.blocks_0.attn.qkv.kernel": P(),
    "params.blocks_0.ln_1.bias": P(),
    "params.blocks_0.ln_1.scale": P(),
    "params.blocks_0.ln_2.bias": P(),
    "params.blocks_0.ln_2.scale": P(),
    "params.blocks_0.mlp.fc.bias": P("tp"),
    "params.blocks_0.mlp.fc.kernel": P(None, "tp"),
    "params.blocks_0.mlp.proj.bias": P(),
    "params.blocks_0.mlp.proj.kernel": P("tp"),
    "params.blocks_1.attn.proj.bias": P(),
    "params.blocks_1.attn.proj.kernel": P(),
    "params.blocks_1.attn.qkv.bias": P(),
    "params.blocks_1.attn.qkv.kernel": P(),
    "params.blocks_1.ln_1.bias": P(),
    "params.blocks_1.ln_1.scale": P(),
    "params.blocks_1.ln_2.bias": P(),
    "params.blocks_1.ln_2.scale": P(),
    "params.blocks_1.mlp.fc.bias": P("tp"),
    "params.blocks_1.mlp.fc.kernel": P(None, "tp"),
    "params.blocks_1.mlp.proj.bias": P(),
    "params.blocks_1.mlp.proj.kernel": P("tp"),
    "params.lm_head.kernel": P(),
    "params.ln_f.bias": P(),
    "params.ln_f.scale": P(),
    "params.wpe.embedding": P(),
    "params.wte.embedding": P(),
}

# What the plan predicts each stage issues per step (kind -> count; by_axis kind@axis -> count).
PREDICTED_COLLECTIVES = {"0": {"by_axis": {}}}


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
