"""Context parallelism in the torch runtime: the all-gather-K/V scheme ``search/pricing/context_parallel.py`` prices.

Each of the ``cp`` ranks of a context-parallel group holds ``S / cp`` consecutive tokens of every sample
(:func:`shard_sequence`; rank ``r`` the tokens ``r * S / cp`` to ``(r + 1) * S / cp - 1``). Every op
but attention is per token and runs unchanged on that slice. Attention (:func:`attention`, registered
with Hugging Face's attention interface under :data:`ATTENTION` by :func:`install`) all-gathers the
keys and values of the whole sequence over the group (:func:`gather_sequence`: one all-gather
(``all_gather_single``) for K and one for V forward; their gradients one reduce-scatter
(``reduce_scatter_single``) each backward, summed: every rank's queries read every rank's keys), then runs SDPA of the local
queries against them under the causal mask of the local queries' global positions. Rotary
embeddings read the tokens' global positions (:func:`position_ids`), and the labels are shifted over
the whole sequence before it is split (:func:`shift_then_shard`), so a next-token target that crosses
a shard boundary is counted once, on the rank of its input token; the loss of each rank is its targets'
sum over the global target count, and the gradients summed over the ``dp x cp`` ranks are the
single-device mean (parameters are replicated over cp exactly as over dp).

torch's own ``torch.distributed.tensor.experimental.context_parallel`` is not used: in torch 2.13 it
dispatches on the CUDA SDPA kernels (flash, efficient, cuDNN) only, so on CPU and gloo it would not
intercept the attention (``_context_parallel/_attention.py``: no entry for
``_scaled_dot_product_flash_attention_for_cpu``).

The emitted program (``backends/torch/emit.py``) calls :func:`split_sequence` in a cp stage's
``setup_stage`` with the stage mesh's ``cp`` axis: it installs the attention, sets the model's
``_attn_implementation`` and the stage's sequence shard (``parallel.StageContext.seq_shard``: the rotary
embedding's global positions), and returns the :class:`SequenceSplit` that ``train.forward_backward``
applies to every micro-batch (inputs split, labels shifted then split); in a pipeline each stage does so
and boundaries carry the rank's ``S / cp`` tokens to the rank of the same cp coordinate
(``train.local_sample``). Tested against one device through the emitted program in
``tests/runtime/test_context_parallel_program.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION = "partita_cp"  # the name models' configs set as _attn_implementation
IGNORE_INDEX = -100  # F.cross_entropy's default: the one target a shifted sequence lacks

_GROUP: list[Any] = [None]  # the process group of this rank's cp axis (install)


class _GatherSequence(torch.autograd.Function):
    """All-gather of ``x [B, H, s, D]`` on dim 2 over ``group``; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        cp = dist.get_world_size(group)
        chunks = torch.empty((cp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _gather(chunks, x.contiguous(), group=group)  # ranks' tensors stacked on dim 0
        return torch.cat(chunks.chunk(cp, dim=0), dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        cp = dist.get_world_size(ctx.group)
        stacked = torch.cat(grad.chunk(cp, dim=2), dim=0).contiguous()  # rank r's slice at rows r * B ...
        out = torch.empty((stacked.shape[0] // cp, *stacked.shape[1:]), dtype=grad.dtype, device=grad.device)
        _scatter(out, stacked, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def _gather(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    """``all_gather_single`` (``all_gather_into_tensor``'s name since torch 2.11), else the older name."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _scatter(out: torch.Tensor, x: torch.Tensor, op: Any, group: Any) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, op=op, group=group)


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` of every rank of ``group``, concatenated on the sequence dim (2) in rank order."""
    return _GatherSequence.apply(x, group)


def attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention interface (``[B, H, s, D]`` in, ``[B, s, H, D]`` out) with the keys and
    values gathered over the cp group (module docstring). ``attention_mask`` (the model's mask of the local
    slice alone) is not used: the causal mask is built from the queries' global positions."""
    group = _GROUP[0]
    if group is None:
        raise RuntimeError("context_parallel.attention called before context_parallel.install(group)")
    if dropout:
        raise RuntimeError("context-parallel attention runs without attention dropout (set attention_dropout=0)")
    s = query.shape[2]
    kind = query.device.type
    if torch.is_autocast_enabled(kind):  # SDPA would cast its inputs to the autocast dtype: gather them in it
        # (the rotary embedding leaves K in f32 under autocast; the plan prices K and V in the compute dtype)
        low = torch.get_autocast_dtype(kind)
        key, value = key.to(low), value.to(low)
    k, v = gather_sequence(key, group), gather_sequence(value, group)
    q_pos = torch.arange(s, device=query.device) + dist.get_rank(group) * s
    mask = q_pos[:, None] >= torch.arange(k.shape[2], device=query.device)[None, :]
    out = F.scaled_dot_product_attention(
        query, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def install(group: Any) -> None:
    """Register :func:`attention` as :data:`ATTENTION` (and SDPA's mask builder under the same name) and
    bind this rank's cp group; a model then uses it with ``config._attn_implementation = ATTENTION``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _GROUP[0] = group


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s ``1 / cp`` of ``x`` along the sequence ``dim`` (consecutive tokens)."""
    s = x.shape[dim]
    if s % cp:
        raise ValueError(f"sequence length {s} is not divisible by cp={cp}")
    return x.narrow(dim, rank * (s // cp), s // cp)


def position_ids(seq_len: int, rank: int, cp: int, device: Any = None) -> torch.Tensor:
    """``[1, S / cp]``: the global positions of rank ``rank``'s tokens (rotary embeddings read them)."""
    local = seq_len // cp
    return (torch.arange(local, device=device) + rank * local).unsqueeze(0)


def shift_then_shard(labels: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """Next-token targets of rank ``rank``'s tokens: ``labels[:, 1:]`` over the whole sequence, the last
    position :data:`IGNORE_INDEX`, then split (module docstring)."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    return shard_sequence(shifted, rank, cp)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Rank ``index``'s slice of every micro-batch of a cp stage (``cp`` ranks, sequences of ``seq_len``)."""

    index: int
    cp: int
    seq_len: int

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, self.index, self.cp)

    def labels(self, y: torch.Tensor) -> torch.Tensor:
        return shift_then_shard(y, self.index, self.cp)


ARCHS = ("LlamaForCausalLM",)  # models whose attention and rotary positions this module sets (parallel.ADAPTERS)


def split_sequence(module: Any, mesh: Any, seq_len: int) -> SequenceSplit:
    """Set ``module`` (a ``parallel.StageModule``) up for context parallelism over the 1-D ``mesh`` (the
    stage mesh's ``cp`` axis): :func:`install` with its group, the model's attention switched to
    :data:`ATTENTION`, the rotary embedding's positions offset to this rank's shard; return the split
    ``train.forward_backward`` applies to each micro-batch."""
    if getattr(module, "arch", "") not in ARCHS:
        from partita.errors import PlanError

        raise PlanError(
            f"context parallelism is built for {', '.join(ARCHS)} (its attention interface and rotary "
            f"positions), and this stage holds a {getattr(module, 'arch', type(module).__name__)}.",
            "recompile the plan without --cp for this model.",
        )
    install(mesh.get_group())
    module.config._attn_implementation = ATTENTION
    index = mesh.get_local_rank()
    module.ctx.seq_shard = index
    return SequenceSplit(index, mesh.size(), seq_len)
