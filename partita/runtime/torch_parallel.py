"""Helpers the generated PyTorch program calls: meshes, stage split, placements, recompute, grad sync.

Sits under ``compiler/emit_torch.py`` (which writes calls to these functions with the plan's
literal data) and beside ``torch_train.py`` (the loop); the schedules are in ``torch_schedule.py``.

How a plan's layer names map to modules (``split_stage``):

* a dotted module path (``"transformer.h.0"``, ``"model.layers.1"``) is that submodule;
* ``"embed"`` is the token/position embedding group, ``"head"`` the final norm + LM head, per
  architecture (see :data:`ADAPTERS`: GPT-2 ``transformer.{wte,wpe,drop}`` / ``transformer.ln_f,
  lm_head``; Llama ``model.embed_tokens`` / ``model.norm, lm_head``). Models outside the table run
  their layers as a chain of module paths, ``x = layer(x)``.

Modules of other stages are replaced by ``nn.Identity`` so parameter FQNs stay those of the full
model (checkpoints and gradient checks compare by FQN). Tensor parallelism is generic: every
parameter becomes a DTensor on the stage's ``tp`` mesh with the plan's placement and DTensor's
sharding propagation runs the layer; attention runs through :func:`dtensor_attention`, which shards
heads over ``tp`` when they divide (CPU SDPA has no DTensor rule in torch 2.13).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from partita.errors import PlanError

ATTN_IMPL = "partita_dtensor"


# ---- launch checks and meshes -------------------------------------------------------------
def check_launch(world_size: int, device_kinds: Sequence[str], env_world_size: int, cuda: bool) -> str:
    """Refuse a launch that disagrees with the plan before any work starts; return the backend."""
    if env_world_size != world_size:
        raise PlanError(
            f"this plan needs {world_size} ranks but the launch has WORLD_SIZE={env_world_size}.",
            f"launch with `torchrun --nproc-per-node {world_size}` (or `partita run DIR`), or recompile for "
            f"{env_world_size} devices.",
        )
    kinds = set(device_kinds)
    if "gpu" in kinds and not cuda:
        raise PlanError(
            "this plan was compiled for GPUs but torch.cuda is not available on this machine.",
            "run it on the cluster it was compiled for, or recompile with a CPU cluster such as `4xCPU`.",
        )
    return "nccl" if "gpu" in kinds else "gloo"


def build_mesh(device_type: str, ranks: Sequence[int], dp: int, tp: int) -> DeviceMesh:
    """A ``("dp", "tp")`` mesh over one stage's ranks. Every rank builds every stage's mesh, in order."""
    return DeviceMesh(device_type, torch.tensor(list(ranks)).reshape(dp, tp), mesh_dim_names=("dp", "tp"))


def parse_placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    m = re.fullmatch(r"S\((-?\d+)\)", text)
    if m:
        return Shard(int(m.group(1)))
    raise PlanError(
        f"parameter placement {text!r} cannot be applied to a parameter.",
        "parameters take 'R' or 'S(d)' per mesh axis; 'P' (partial) is only for activations.",
    )


# ---- architecture adapters ----------------------------------------------------------------
@dataclass(frozen=True)
class Adapter:
    embed: tuple[str, ...]
    head: tuple[str, ...]
    run_embed: Callable[[nn.Module, Any, StageContext], Any]
    run_block: Callable[[nn.Module, nn.Module, Any, StageContext], Any]
    run_head: Callable[[nn.Module, Any, StageContext], Any]


def _gpt2_embed(root: nn.Module, ids: Any, ctx: StageContext) -> Any:
    t = root.transformer
    pos = ctx.wrap(torch.arange(ids.shape[1], device=ctx.device).unsqueeze(0))
    return t.drop(t.wte(ids) + t.wpe(pos))


def _llama_block(root: nn.Module, block: nn.Module, x: Any, ctx: StageContext) -> Any:
    pos = torch.arange(x.shape[1], device=ctx.device).unsqueeze(0)
    cos, sin = root.model.rotary_emb(torch.ones(1, device=ctx.device), pos)
    return block(x, attention_mask=None, position_embeddings=(ctx.wrap(cos), ctx.wrap(sin)), position_ids=pos)


ADAPTERS: dict[str, Adapter] = {
    "GPT2LMHeadModel": Adapter(
        ("transformer.wte", "transformer.wpe", "transformer.drop"),
        ("transformer.ln_f", "lm_head"),
        _gpt2_embed,
        lambda root, block, x, ctx: block(x),
        lambda root, x, ctx: root.lm_head(root.transformer.ln_f(x)),
    ),
    "LlamaForCausalLM": Adapter(
        ("model.embed_tokens",),
        ("model.norm", "lm_head"),
        lambda root, ids, ctx: root.model.embed_tokens(ids),
        _llama_block,
        lambda root, x, ctx: root.lm_head(root.model.norm(x)),
    ),
}
GENERIC = Adapter(("embed",), ("head",), lambda r, x, c: r.embed(x), lambda r, b, x, c: b(x), lambda r, x, c: r.head(x))


def adapter_for(model: nn.Module) -> Adapter:
    return ADAPTERS.get(type(model).__name__, GENERIC)


def layer_paths(model: nn.Module, name: str) -> tuple[str, ...]:
    """Module paths a plan layer name stands for (``"embed"``/``"head"`` are groups)."""
    ad = adapter_for(model)
    return ad.embed if name == "embed" else ad.head if name == "head" else (name,)


@dataclass
class StageContext:
    device: torch.device
    tp_mesh: DeviceMesh | None = None

    def wrap(self, t: torch.Tensor) -> Any:
        """A plain tensor entering a tensor-parallel region becomes a replicated DTensor."""
        if self.tp_mesh is None or isinstance(t, DTensor):
            return t
        return DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)


class StageModule(nn.Module):
    """One pipeline stage: the full model's children (FQNs unchanged) running only ``layers``."""

    def __init__(self, model: nn.Module, layers: Sequence[str], device: torch.device) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.config = getattr(model, "config", None)
        self.arch = type(model).__name__
        self.layers = tuple(layers)
        self.recompute = "none"
        self.ctx = StageContext(device)

    def blocks(self) -> list[nn.Module]:
        return [self.get_submodule(n) for n in self.layers if n not in ("embed", "head")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_layers(self, self.arch, self.layers, x, self.ctx, self.recompute)


def run_layers(
    root: nn.Module, arch: str, layers: Sequence[str], x: torch.Tensor, ctx: StageContext, recompute: str = "none"
) -> torch.Tensor:
    """Run plan layers in order on ``root``; DTensor in the middle when ``ctx.tp_mesh``, plain out."""
    ad = ADAPTERS.get(arch, GENERIC)
    h: Any = ctx.wrap(x)
    for name in layers:
        if name == "embed":
            h = ad.run_embed(root, h, ctx)
        elif name == "head":
            h = ad.run_head(root, h, ctx)
        else:
            h = _run_block(ad, root, root.get_submodule(name), h, ctx, recompute)
    if isinstance(h, DTensor):
        h = h.redistribute(ctx.tp_mesh, [Replicate()]).to_local()
    return h


def boundary_shapes(
    model: nn.Module, stage_layers: Sequence[Sequence[str]], x: torch.Tensor
) -> list[tuple[torch.Size, torch.dtype]]:
    """Per-sample shape and dtype of each stage's output, from one no-grad pass of the full model."""
    out = []
    ctx = StageContext(x.device)
    with torch.no_grad():
        h = x
        for layers in stage_layers:
            h = run_layers(model, type(model).__name__, layers, h, ctx)
            out.append((h.shape[1:], h.dtype))
    return out


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _run_block(ad: Adapter, root: nn.Module, block: nn.Module, h: Any, ctx: StageContext, recompute: str) -> Any:
    if recompute == "none" or not torch.is_grad_enabled():
        return ad.run_block(root, block, h, ctx)
    kw: dict[str, Any] = {"use_reentrant": False}
    if recompute == "selective":  # keep matmul outputs, recompute pointwise/norm/softmax
        kw["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls)
    return checkpoint(ad.run_block, root, block, h, ctx, **kw)


def split_stage(
    model: nn.Module, layers: Sequence[str], all_layers: Sequence[str], device: torch.device
) -> StageModule:
    """Keep ``layers`` of ``model``; modules of the other plan layers become ``nn.Identity``."""
    keep = {p for name in layers for p in layer_paths(model, name)}
    for name in all_layers:
        for path in layer_paths(model, name):
            try:
                model.get_submodule(path)
            except AttributeError:
                raise PlanError(
                    f"plan layer {name!r} names module {path!r}, which {type(model).__name__} does not have.",
                    "recompile the plan for this model (`partita compile MODEL ...`).",
                ) from None
            if path not in keep:
                parent, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, nn.Identity())
    return StageModule(model, layers, device).to(device)


def apply_recompute(module: StageModule, mode: str) -> None:
    """Activation checkpointing per block: ``full`` recomputes the block, ``selective`` keeps matmuls."""
    module.recompute = mode


# ---- tensor parallelism ----------------------------------------------------------------------
def dtensor_attention(
    module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0, **kw: Any
) -> tuple[Any, None]:
    """Causal SDPA on DTensor q/k/v ``[b, heads, s, d]``: shard heads over tp, attend locally.

    Registered as a Hugging Face attention implementation; returns ``[b, s, heads, d]`` like theirs.
    """
    scale = kw.get("scaling")
    causal = attention_mask is None and query.shape[2] > 1
    if not isinstance(query, DTensor):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    mesh = query.device_mesh
    n = mesh.size()
    pl: Placement = Shard(1) if query.shape[1] % n == 0 and key.shape[1] % n == 0 else Replicate()
    q, k, v = (t.redistribute(mesh, [pl]).to_local() for t in (query, key, value))
    mask = attention_mask.full_tensor() if isinstance(attention_mask, DTensor) else attention_mask
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    out = out.transpose(1, 2).contiguous()
    return DTensor.from_local(out, mesh, [Shard(2) if pl == Shard(1) else Replicate()], run_check=False), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, dtensor_attention)


def distribute_params(module: StageModule, tp_mesh: DeviceMesh, placements: Mapping[str, str]) -> None:
    """Make every parameter a DTensor on ``tp_mesh`` with its plan placement ("R" when not listed).

    Tied parameters (one object under several FQNs) stay one object. Names in ``placements`` that
    are not parameters of this stage raise PlanError (plan and model disagree).
    """
    alias: dict[str, nn.Parameter] = dict(module.named_parameters(remove_duplicate=False))
    unknown = sorted(set(placements) - set(alias))
    if unknown:
        raise PlanError(
            f"the plan places parameters {unknown[:4]} that stage layers {list(module.layers)} do not have.",
            "recompile the plan for this model.",
        )
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, attr))
    for p in list(dict(module.named_parameters()).values()):  # snapshot: tied params are replaced once
        names = [n for n, q in alias.items() if q is p]
        given = {placements[n] for n in names if n in placements}
        if len(given) > 1:
            raise PlanError(f"tied parameter {names} has conflicting placements {sorted(given)}.", "recompile.")
        pl = parse_placement(given.pop() if given else "R")
        new = nn.Parameter(distribute_tensor(p.data, tp_mesh, [pl]), requires_grad=p.requires_grad)
        for mod, attr in owners[id(p)]:
            mod._parameters[attr] = new
    module.ctx.tp_mesh = tp_mesh
    if module.config is not None and hasattr(module.config, "_attn_implementation"):
        _register_attention()
        module.config._attn_implementation = ATTN_IMPL


class StrideFix(TorchDispatchMode):
    """Work around DTensor stride metadata drifting from the local tensor's (torch 2.13).

    DTensor takes an output's global strides from meta propagation, which for broadcasting
    pointwise ops on transposed inputs (Llama's rotary ``q * cos``) and for ``to_local``'s backward
    disagrees with the eager local result; a later ``view`` then fails on the local tensor
    ("view size is not compatible..."). Inside this mode such a ``view`` first clones the DTensor
    to contiguous memory. Values are unchanged; the result no longer aliases its input, which
    nothing in forward/backward of these models relies on. Active only in stages with tp > 1.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.view.default and isinstance(args[0], DTensor):
            t = args[0]
            if t.is_contiguous() and not t._local_tensor.is_contiguous():
                t = torch.ops.aten.clone.default(t, memory_format=torch.contiguous_format)
                args = (t, *args[1:])
        return func(*args, **(kwargs or {}))


# ---- gradients -------------------------------------------------------------------------------
def tied_groups(model: nn.Module) -> list[list[str]]:
    """FQN groups that name one parameter object (GPT-2's ``wte.weight`` / ``lm_head.weight``)."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return [names for names in by_id.values() if len(names) > 1]


def local_grad(p: nn.Parameter) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    return g._local_tensor if isinstance(g, DTensor) else g


def align_grads(module: nn.Module) -> None:
    """Give each DTensor gradient its parameter's placements (R -> S(d) is a local slice, no comm)."""
    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def scale_grads(module: nn.Module, factor: float) -> None:
    """Multiply every (local shard of a) gradient by ``factor``, in place, no communication."""
    for p in module.parameters():
        g = local_grad(p)
        if g is not None:
            g.mul_(factor)


def all_reduce_grads(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Data-parallel gradient sync without ZeRO: the stage's gradients are flattened into one bucket
    per dtype and summed by one all-reduce over ``dp`` (the plan prices exactly this: one bucketed
    gradient all-reduce per stage).

    A sum, not a mean: each replica's loss is already weighted by its batch share (see
    ``torch_train.loss_scale``), which is how uneven shares weight the average.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in module.parameters():
        g = local_grad(p)
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sync_tied_grads(module: nn.Module, tied: Sequence[Sequence[str]], group: dist.ProcessGroup | None, n: int) -> None:
    """Sum a tied parameter's gradient over the stages that hold a copy of it.

    Every rank of those stages holds the full gradient (after its own dp/tp sync), so each adds
    ``grad / ranks_in_its_stage`` into one all-reduce over the union of the stages' ranks.
    """
    if group is None:
        return
    alias = dict(module.named_parameters(remove_duplicate=False))
    for names in tied:
        present = [alias[n] for n in names if n in alias]
        if not present:
            continue
        p = present[0]
        g = p.grad
        full = g.full_tensor() if isinstance(g, DTensor) else g
        full = full / n
        dist.all_reduce(full, group=group)
        if isinstance(g, DTensor):
            p.grad = distribute_tensor(full, g.device_mesh, g.placements, src_data_rank=None)
        else:
            p.grad.copy_(full)


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients by FQN (a collective over each DTensor's mesh: call on all stage ranks)."""
    out = {}
    for n, p in module.named_parameters():
        g = p.grad
        if g is not None:
            out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone().cpu()
    return out
