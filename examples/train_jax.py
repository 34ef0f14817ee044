"""A user's JAX training script with Partita's decorator on the loss function.

    python examples/train_jax.py               # 8 simulated CPU devices (JAX_NUM_CPU_DEVICES=8)
    python examples/train_jax.py --reference   # also trains the undecorated loss on one device

Two models train for a few steps: a flax MLP regressor and a tiny flax GPT (``partita.models.jax_gpt``).
The decorator plans each loss for the cluster on its first call (the compile cache makes later
runs instant) and ``loss_fn.train_step(optimizer)`` runs the plan's step, jitted with its
NamedShardings. Prints one JSON line per model: ``{"model", "losses", "reference_losses", "plan"}``.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # simulate an 8-device machine on CPU; set before jax starts

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import partita  # noqa: E402
from partita.models.jax_gpt import GPT, JaxGPTConfig  # noqa: E402

CLUSTER = "8xCPU"


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(512, name="fc1")(x))
        h = nn.gelu(nn.Dense(512, name="fc2")(h))
        return nn.Dense(32, name="fc3")(h)


@partita.parallelize(cluster=CLUSTER, global_batch=64, seq_len=1)  # <- the one line
def mlp_loss(params, x, y):
    return jnp.mean((MLP().apply(params, x) - y) ** 2)


GPT_CFG = JaxGPTConfig(vocab=128, seq=32, hidden=64, heads=4, layers=2)


@partita.parallelize(cluster=CLUSTER, global_batch=16, seq_len=32)
def gpt_loss(params, tokens, labels):
    logp = jax.nn.log_softmax(GPT(GPT_CFG).apply(params, tokens), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def train(loss_fn, params, batches, lr: float) -> list[float]:
    tx = optax.adam(lr)
    step = loss_fn.train_step(tx)
    params, opt_state = loss_fn.init(params, tx, *batches[0])
    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss))
    return losses


def train_reference(loss_fn, params, batches, lr: float) -> list[float]:
    """The undecorated function, one device: what the decorated run must match."""
    tx = optax.adam(lr)

    @jax.jit
    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss))
    return losses


def report(name: str, loss_fn, losses: list[float], ref: list[float] | None) -> None:
    plan = loss_fn.plan
    info = {"model": name, "losses": losses, "devices": jax.device_count(), "cache_hit": loss_fn.cache_hit}
    info["plan"] = [{"ranks": len(s.ranks), "dp": s.dp, "tp": s.tp, "zero_stage": s.zero_stage} for s in plan.stages]
    if ref is not None:
        info["reference_losses"] = ref
    print(json.dumps(info), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reference", action="store_true")
    args = ap.parse_args()
    keys = jax.random.split(jax.random.PRNGKey(0), 3 * args.steps + 2)

    teacher = jax.random.normal(keys[0], (64, 32))
    xs = [jax.random.normal(k, (64, 64)) for k in keys[2 : 2 + args.steps]]
    batches = [(x, jnp.tanh(x @ teacher)) for x in xs]
    params = MLP().init(keys[1], xs[0])
    losses = train(mlp_loss, params, batches, 1e-3)
    ref = train_reference(mlp_loss.__wrapped__, params, batches, 1e-3) if args.reference else None
    report("mlp", mlp_loss, losses, ref)

    starts = [jax.random.randint(k, (16, 1), 0, 128) for k in keys[2 + args.steps : 2 + 2 * args.steps]]
    seqs = [(s + jnp.arange(33)) % 128 for s in starts]  # counting sequences: learnable next tokens
    batches = [(s[:, :-1].astype(jnp.int32), s[:, 1:].astype(jnp.int32)) for s in seqs]
    params = GPT(GPT_CFG).init(keys[1], batches[0][0])
    losses = train(gpt_loss, params, batches, 1e-2)
    ref = train_reference(gpt_loss.__wrapped__, params, batches, 1e-2) if args.reference else None
    report("gpt", gpt_loss, losses, ref)


if __name__ == "__main__":
    main()
