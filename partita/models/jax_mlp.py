"""A 2-layer flax MLP with an MSE loss: the JAX twin of the torch zoo's ``"mlp"`` entry.

``fc1: Dense(d_in -> d_hidden) + gelu`` then ``fc2: Dense(d_hidden -> d_out)``, both with biases.
Used by the tests of ``frontends/trace_jax.py`` and registered as ``"jax-mlp"`` by
``models/zoo.register_jax_models``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxMLPConfig:
    d_in: int = 64
    d_hidden: int = 256
    d_out: int = 64


class MLP(nn.Module):
    cfg: JaxMLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(self.cfg.d_hidden, name="fc1")(x))
        return nn.Dense(self.cfg.d_out, name="fc2")(h)


def mlp_loss_fn(params: Any, x: jax.Array, y: jax.Array, *, cfg: JaxMLPConfig = JaxMLPConfig()) -> jax.Array:
    """Mean squared error of the MLP's prediction against ``y``."""
    pred = MLP(cfg).apply(params, x)
    return jnp.mean((pred - y) ** 2)


def _dummy(cfg: JaxMLPConfig) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((1, cfg.d_in), jnp.float32)


def mlp_init_params(cfg: JaxMLPConfig, seed: int) -> Any:
    return MLP(cfg).init(jax.random.PRNGKey(seed), jnp.zeros((1, cfg.d_in), jnp.float32))


def mlp_abstract_params(cfg: JaxMLPConfig) -> Any:
    """Parameter shapes as ``jax.ShapeDtypeStruct`` (``jax.eval_shape``: nothing allocated)."""
    return jax.eval_shape(lambda: MLP(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, cfg.d_in), jnp.float32)))


def mlp_example_batch(cfg: JaxMLPConfig, batch: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return (
        jax.ShapeDtypeStruct((batch, cfg.d_in), jnp.float32),
        jax.ShapeDtypeStruct((batch, cfg.d_out), jnp.float32),
    )
