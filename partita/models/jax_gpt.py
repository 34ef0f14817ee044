"""A small GPT in flax.linen with a cross-entropy LM loss, plus the JAX model handles.

The model zoo's JAX entries: ``"jax-gpt-tiny"`` (this GPT) and ``"jax-mlp"`` (``models/jax_mlp.py``).
Module names follow the torch GPT convention so ``passes/layers.py`` sees a repeated container:
``wte``, ``wpe``, ``blocks_<i>.{ln_1,attn.{qkv,proj},ln_2,mlp.{fc,proj}}``, ``ln_f``, ``lm_head``
(untied). Attention is written with einsums, so its two matmuls appear as MATMUL nodes after
``frontends/trace_jax.py``. Code is shape-polymorphic in batch and sequence (``S <= cfg.seq``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from partita.models.jax_mlp import (
    JaxMLPConfig,
    mlp_abstract_params,
    mlp_example_batch,
    mlp_init_params,
    mlp_loss_fn,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxGPTConfig:
    vocab: int = 128
    seq: int = 32  # max sequence length (size of the position table)
    hidden: int = 64
    heads: int = 4
    layers: int = 2


class Attention(nn.Module):
    cfg: JaxGPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, h = x.shape
        n = self.cfg.heads
        q, k, v = (t.reshape(b, s, n, h // n) for t in jnp.split(nn.Dense(3 * h, name="qkv")(x), 3, axis=-1))
        scores = jnp.einsum("bsnd,btnd->bnst", q, k) / math.sqrt(h // n)
        causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bnst,btnd->bsnd", probs, v).reshape(b, s, h)
        return nn.Dense(h, name="proj")(out)


class MLPBlock(nn.Module):
    cfg: JaxGPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.cfg.hidden
        return nn.Dense(h, name="proj")(nn.gelu(nn.Dense(4 * h, name="fc")(x)))


class Block(nn.Module):
    cfg: JaxGPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention(self.cfg, name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + MLPBlock(self.cfg, name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT(nn.Module):
    cfg: JaxGPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        s = tokens.shape[1]
        x = nn.Embed(cfg.vocab, cfg.hidden, name="wte")(tokens)
        x = x + nn.Embed(cfg.seq, cfg.hidden, name="wpe")(jnp.arange(s))[None]
        for i in range(cfg.layers):
            x = Block(cfg, name=f"blocks_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(cfg.vocab, use_bias=False, name="lm_head")(x)


def loss_fn(params: Any, tokens: jax.Array, labels: jax.Array, *, cfg: JaxGPTConfig = JaxGPTConfig()) -> jax.Array:
    """Mean next-token cross entropy of ``GPT(cfg)`` (labels are the already-shifted targets)."""
    logits = GPT(cfg).apply(params, tokens)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _dummy_tokens(cfg: JaxGPTConfig) -> jax.Array:
    return jnp.zeros((1, cfg.seq), jnp.int32)


def init_params(cfg: JaxGPTConfig, seed: int) -> Any:
    return GPT(cfg).init(jax.random.PRNGKey(seed), _dummy_tokens(cfg))


def abstract_params(cfg: JaxGPTConfig) -> Any:
    """Parameter shapes as ``jax.ShapeDtypeStruct`` (``jax.eval_shape``: nothing allocated)."""
    return jax.eval_shape(lambda: GPT(cfg).init(jax.random.PRNGKey(0), _dummy_tokens(cfg)))


def example_batch(cfg: JaxGPTConfig, batch: int, seq: int | None = None) -> tuple[jax.ShapeDtypeStruct, ...]:
    s = cfg.seq if seq is None else seq
    return (jax.ShapeDtypeStruct((batch, s), jnp.int32), jax.ShapeDtypeStruct((batch, s), jnp.int32))


# ---- handles -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JaxModelHandle:
    """What the zoo needs to know about a JAX model: no weights until ``init_params`` is called."""

    name: str
    config: Any
    loss_fn: Callable[..., jax.Array]
    _abstract: Callable[[], Any]
    _init: Callable[[int], Any]
    _batch: Callable[[int, int], tuple[jax.ShapeDtypeStruct, ...]]
    framework: str = "jax"

    def abstract_params(self) -> Any:
        return self._abstract()

    def init_params(self, seed: int = 0) -> Any:
        return self._init(seed)

    def example_batch(self, batch: int, seq: int | None = None) -> tuple[jax.ShapeDtypeStruct, ...]:
        return self._batch(batch, seq if seq is not None else 0)

    def num_params(self) -> int:
        return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(self.abstract_params())))


def gpt_handle(cfg: JaxGPTConfig = JaxGPTConfig(), name: str = "jax-gpt-tiny") -> JaxModelHandle:
    return JaxModelHandle(
        name,
        cfg,
        functools.partial(loss_fn, cfg=cfg),
        lambda: abstract_params(cfg),
        lambda seed: init_params(cfg, seed),
        lambda batch, seq: example_batch(cfg, batch, seq or None),
    )


def mlp_handle(cfg: JaxMLPConfig | None = None, name: str = "jax-mlp") -> JaxModelHandle:
    cfg = cfg or JaxMLPConfig()
    return JaxModelHandle(
        name,
        cfg,
        functools.partial(mlp_loss_fn, cfg=cfg),
        lambda: mlp_abstract_params(cfg),
        lambda seed: mlp_init_params(cfg, seed),
        lambda batch, seq: mlp_example_batch(cfg, batch),
    )


def jax_entries() -> list[tuple[Callable[[], JaxModelHandle], str]]:
    """The JAX zoo entries as (handle factory, description); ``models/zoo.py`` registers them."""
    return [
        (gpt_handle, "JAX/flax GPT: 2 layers, h=64, 4 heads, vocab 128, seq 32"),
        (mlp_handle, "JAX/flax 2-layer MLP 64-256-64 with biases, MSE loss"),
    ]
