"""Helpers the generated PyTorch program calls: meshes, stage split, placements, recompute, grad sync.

Sits under ``backends/torch/emit.py`` (which writes calls to these functions with the plan's
literal data) and beside ``torch_train.py`` (the loop); the schedules are in ``torch_schedule.py``.

How a plan's layer names map to modules (``split_stage``):

* a dotted module path (``"transformer.h.0"``, ``"model.layers.1"``) is that submodule;
* ``"embed"`` is the token/position embedding group, ``"head"`` the final norm + LM head, per
  architecture (see :data:`ADAPTERS`: GPT-2 ``transformer.{wte,wpe,drop}`` / ``transformer.ln_f,
  lm_head``; Llama ``model.embed_tokens`` / ``model.norm, lm_head``). Models outside the table run
  their layers as a chain of module paths, ``x = layer(x)``.

Modules of other stages are replaced by ``nn.Identity`` so parameter FQNs stay those of the full
model (checkpoints and gradient checks compare by FQN). Tensor parallelism is Megatron-style
(``torch_tp``): the modules whose parameters the plan shards run on DTensors, activations between
modules stay plain local tensors, so attention runs the model's own kernel on the local heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from partita.backends.torch import fused as torch_fused
from partita.backends.torch import moe as torch_moe
from partita.backends.torch import stages as torch_stages
from partita.backends.torch import tp as torch_tp
from partita.backends.torch.grad_buckets import GradBuckets  # noqa: F401 - the emitted program's API
from partita.backends.torch.tp import parse_placement  # noqa: F401 - the emitted program's API
from partita.errors import PlanError
from partita.frontends import torch_shim


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
    # NCCL takes only CUDA tensors: host-side collectives (the step's loss, the clipping norm, result
    # gathering) go to gloo through the same group, by tensor device.
    return "cpu:gloo,cuda:nccl" if "gpu" in kinds else "gloo"


def backend_for(device_type: str, backend: str) -> str:
    """The backend a collective on a ``device_type`` tensor reaches under ``backend`` ("" if none).

    ``"gloo"`` alone serves cpu (and cuda); ``"nccl"`` alone serves only cuda; ``"cpu:gloo,cuda:nccl"``
    maps each device type to its backend (torch's own rule for the init_process_group string).
    """
    if ":" not in backend:
        serves = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",)}.get(backend, ("cpu", "cuda"))
        return backend if device_type in serves else ""
    table = dict(part.split(":", 1) for part in backend.split(","))
    return table.get(device_type, "")


def build_mesh(device_type: str, ranks: Sequence[int], dp: int, tp: int, cp: int = 1) -> DeviceMesh:
    """A ``("dp", "tp")`` mesh over one stage's ranks, ``("dp", "cp", "tp")`` with context parallelism
    (``Stage.cp``: tp fastest, then cp). Every rank builds every stage's mesh, in order."""
    if cp == 1:
        return DeviceMesh(device_type, torch.tensor(list(ranks)).reshape(dp, tp), mesh_dim_names=("dp", "tp"))
    # With cp the mesh is made from groups of its own (DeviceMesh.from_group): DeviceMesh would reuse the default
    # group for an axis spanning every rank (dp 1 x cp N), and the cp axis' K/V all-gathers would then share
    # their group, and its name, with the world-wide all-reduces the plan records on dp_cp (f16's overflow check).
    grid = torch.tensor(list(ranks)).reshape(dp, cp, tp)
    mine: list[Any] = []
    for d in range(3):
        rows = grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()
        for row in rows:
            g = dist.new_group(row)
            if dist.get_rank() in row:
                mine.append(g)
    if len(mine) != 3:  # a rank outside this stage: it only took part in making the groups
        return None  # type: ignore[return-value]
    return DeviceMesh.from_group(mine, device_type, mesh=grid, mesh_dim_names=("dp", "cp", "tp"))


def build_meshes(device_type: str, stages: Sequence[Mapping[str, Any]]) -> list[DeviceMesh]:
    """Every stage's mesh, in order (``PROGRAM["stages"]``: ``cp`` present only when > 1)."""
    return [build_mesh(device_type, s["ranks"], s["dp"], s["tp"], s.get("cp", 1)) for s in stages]


def replica_mesh(device_type: str, stages: Sequence[Mapping[str, Any]], rank: int) -> DeviceMesh | None:
    """The 1-D ``("dp_cp",)`` mesh of ``rank``'s cp stage: the ``dp * cp`` ranks at its tp coordinate,
    over which parameters are replicated (gradient sync, FSDP2); None for a stage without cp. Every rank
    makes every cp stage's groups (``dist.new_group`` is collective), in order. A group of its own, not a
    flattened mesh axis (``DeviceMesh._flatten`` is private) nor the default group: its collectives are
    counted under their own name, ``dp_cp``."""
    mine = None
    for s in stages:
        cp, tp, ranks = s.get("cp", 1), s["tp"], list(s["ranks"])
        if cp == 1:
            continue
        for j in range(tp):
            group = dist.new_group(ranks[j::tp])
            if rank in ranks[j::tp]:
                mine = DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp_cp",))
    return mine


# ---- architecture adapters ----------------------------------------------------------------
@dataclass(frozen=True)
class Adapter:
    embed: tuple[str, ...]
    head: tuple[str, ...]
    run_embed: Callable[[nn.Module, Any, StageContext], Any]
    run_block: Callable[[nn.Module, nn.Module, Any, StageContext], Any]
    run_head: Callable[[nn.Module, Any, StageContext], Any]
    fused: tuple[str, ...] = ()  # modules whose output the model splits on the feature dim (torch_tp)
    strided_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # parent attrs sizing that split


def _gpt2_embed(root: nn.Module, ids: Any, ctx: StageContext) -> Any:
    t = root.transformer
    pos = torch.arange(ids.shape[1], device=ctx.device).unsqueeze(0)
    return t.drop(t.wte(ids) + t.wpe(pos))


def _llama_block(root: nn.Module, block: nn.Module, x: Any, ctx: StageContext) -> Any:
    # under sequence parallelism a block after the stage's first gets 1/tp of the rows (tp.SEQ_SPLIT);
    # under context parallelism the rank holds sequence shard ctx.seq_shard: global positions
    n = x.shape[1] * getattr(block, "partita_seq_split", 1)
    pos = (torch.arange(n, device=ctx.device) + ctx.seq_shard * n).unsqueeze(0)
    cos, sin = root.model.rotary_emb(torch.ones(1, device=ctx.device), pos)
    return block(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos)


ADAPTERS: dict[str, Adapter] = {
    "GPT2LMHeadModel": Adapter(
        ("transformer.wte", "transformer.wpe", "transformer.drop"),
        ("transformer.ln_f", "lm_head"),
        _gpt2_embed,
        lambda root, block, x, ctx: block(x),
        lambda root, x, ctx: root.lm_head(root.transformer.ln_f(x)),
        fused=("attn.c_attn",),  # q|k|v in one [h, 3h] weight, split after the matmul
        strided_attrs={"attn.c_attn": ("split_size",)},  # GPT2Attention: c_attn(x).split(split_size, dim=2)
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


def adapter_for_arch(arch: str) -> Adapter:
    return ADAPTERS.get(arch, GENERIC)


def layer_paths(model: nn.Module, name: str) -> tuple[str, ...]:
    """Module paths a plan layer name stands for (``"embed"``/``"head"`` are groups)."""
    if type(model).__name__ not in ADAPTERS and not isinstance(model, StageModule):  # any module tree
        return torch_stages.layer_paths(model, name)
    ad = adapter_for(model)
    return ad.embed if name == "embed" else ad.head if name == "head" else (name,)


@dataclass
class StageContext:
    device: torch.device
    seq_shard: int = 0  # context parallelism: which 1/cp of the sequence this rank holds (context_parallel.py)


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
    """Run plan layers in order on ``root`` (plain tensors in and out, also under tensor parallelism)."""
    if arch not in ADAPTERS:  # any module tree: the plan layers in order are the model's forward
        return torch_stages.run_all(root, layers, x)
    ad = ADAPTERS.get(arch, GENERIC)
    h: Any = x
    for name in layers:
        if name == "embed":
            h = ad.run_embed(root, h, ctx)
        elif name == "head":
            h = ad.run_head(root, h, ctx)
        else:
            h = _run_block(ad, root, root.get_submodule(name), h, ctx, recompute)
    return h


def boundary_shapes(
    model: nn.Module, stage_layers: Sequence[Sequence[str]], x: torch.Tensor
) -> list[tuple[torch.Size, torch.dtype]]:
    """Per-sample shape and dtype of each stage's output, from one no-grad pass of the full model."""
    if type(model).__name__ not in ADAPTERS:  # any module tree (backends/torch/stages.py)
        return torch_stages.boundary_shapes(model, stage_layers, x)
    out = []
    ctx = StageContext(x.device)
    with torch.no_grad():
        h = x
        for layers in stage_layers:
            h = run_layers(model, type(model).__name__, layers, h, ctx)
            out.append((h.shape[1:], h.dtype))
    return out


_SAVED_OPS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    *torch_shim.functional_collective_ops(),  # tp collectives: recomputing them would communicate again
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


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
    if type(model).__name__ not in ADAPTERS:  # any module tree: cut by module paths and call order
        return torch_stages.split(model, layers, all_layers, device)  # type: ignore[return-value]
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


# ---- precision (issue 15 item 2: the program trains in the plan's dtype) -------------------------
LOW_PRECISION = {"bf16": torch.bfloat16, "f16": torch.float16}


def precision_of(dtype: str, fsdp: bool) -> str:
    """How a stage runs the plan's ``dtype``: ``"f32"``; ``"fsdp"`` (FSDP2 ``MixedPrecisionPolicy``:
    parameters cast to ``dtype`` for compute, gradients reduced and kept in f32); ``"autocast"``
    (f32 master parameters, ``torch.autocast`` runs matmuls in ``dtype``)."""
    if dtype not in LOW_PRECISION:
        return "f32"
    return "fsdp" if fsdp else "autocast"


def apply_autocast(module: nn.Module, dtype: str) -> None:
    """Run ``module``'s forward under ``torch.autocast(device, LOW_PRECISION[dtype])`` and hand its
    floating outputs on in ``dtype`` (a boundary activation travels in the plan's dtype, as priced).
    Recompute replays the autocast state (``torch.utils.checkpoint`` records it)."""
    dt = LOW_PRECISION[dtype]
    dev = next((p.device.type for p in module.parameters()), "cpu")
    active: list[Any] = []

    def pre(mod: nn.Module, args: Any) -> None:
        # the device the parameters live on when the forward runs (a stage set up on meta and then
        # allocated, as `partita rehearse` does, autocasts on its final device)
        here = next((p.device.type for p in mod.parameters()), dev)
        ctx = torch.autocast(here, dtype=dt)
        ctx.__enter__()
        active.append(ctx)

    def post(mod: nn.Module, args: Any, out: Any) -> Any:
        active.pop().__exit__(None, None, None)
        return out.to(dt) if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
    torch_moe.experts_in_autocast_dtype(module)  # grouped experts matmuls in dt too (autocast skips them)


def boundary_in(boundary: Sequence[tuple[torch.Size, torch.dtype]], dtype: str) -> list[tuple[torch.Size, torch.dtype]]:
    """Boundary activations as a low-precision program sends them (floating ones in ``dtype``)."""
    dt = LOW_PRECISION.get(dtype)
    return [(s, dt if dt is not None and d.is_floating_point else d) for s, d in boundary]


def reference_forward(model: nn.Module, x: torch.Tensor, precision: str, dtype: str) -> Any:
    """The single-device reference's forward in the program's precision (``precision_of``):
    ``"fsdp"`` computes with ``dtype`` copies of the f32 parameters (gradients flow back to them in
    f32, as FSDP2's reduce_dtype keeps them); ``"autocast"`` runs under ``torch.autocast``."""
    if precision == "f32" or dtype not in LOW_PRECISION:
        return model(x)
    dt = LOW_PRECISION[dtype]
    torch_fused.fuse_ops(model)  # as the program's low-dtype stages (emit._fused_lines)
    if precision == "autocast":
        torch_moe.experts_in_autocast_dtype(model)  # as apply_autocast: grouped experts in dt too
        with torch.autocast(x.device.type, dtype=dt):
            return model(x)
    from torch.func import functional_call

    low = {n: p.to(dt) for n, p in model.named_parameters()}
    return functional_call(model, low, (x.to(dt) if x.is_floating_point() else x,), tie_weights=True)


# ---- tensor parallelism (backends/torch/tp.py) -------------------------------------------------
def distribute_params(
    module: StageModule, tp_mesh: DeviceMesh, placements: Mapping[str, str], roles: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Megatron-style tensor parallelism of a stage from its plan placements (see ``torch_tp``).

    Every parameter of a module the plan shards becomes a DTensor on ``tp_mesh`` ("R" when not
    listed); other parameters stay plain. Names in ``placements`` that are not parameters of this
    stage raise PlanError (plan and model disagree). Returns ``{module path: role}``.
    """
    ad = adapter_for_arch(module.arch)
    return torch_tp.tensor_parallel(module, tp_mesh, placements, ad.fused, roles, ad.strided_attrs)


def tp_roles(
    model: nn.Module, placements: Mapping[str, str], plan_roles: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The roles :func:`distribute_params` gives ``model``'s modules (``model`` may live on meta):
    the plan's ``tp_plan`` when it has one (checked), else derived from the placements."""
    return torch_tp.module_roles(model, placements, adapter_for(model).fused, plan_roles)


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
    if isinstance(g, DTensor):
        with torch.no_grad():
            return g.to_local()  # the local shard itself (no autograd), so in-place updates reach the grad
    return g


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
    """Data-parallel gradient sync without ZeRO and without ``Stage.grad_buckets`` (a plan with model chunks,
    or written before them): the stage's gradients are flattened into one bucket per dtype and summed by
    one all-reduce over ``dp`` after the schedule (the plan prices exactly this, fully exposed). With
    buckets, ``grad_buckets.GradBuckets`` syncs them inside the last backward instead.

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
        if not present or len(present) == len(names):  # all aliases in this stage: no other stage holds one
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


def check_dp_units(module: nn.Module, dp: int, zero: int) -> None:
    """Every parameter the stage's forward reads belongs to exactly one data-parallel unit (issue 31):
    it is among the stage module's parameters (the optimizer's, and what the dp gradient sync and the
    FSDP2 units of ``module`` cover), and under ZeRO (dp > 1) it is an FSDP2-managed DTensor on ``dp`` (``dp_cp``
    under context parallelism: ``dp`` is then the number of dp x cp replicas).
    PlanError naming the parameters otherwise: their replicas would train apart silently."""
    share = getattr(module, "share_own", None)
    if share is not None:  # a generic stage: the root's own parameters as the forward will read them
        share()
    root = module.__dict__.get("_root", module)
    ours = {id(p) for p in module.parameters()}
    outside = [n for n, p in root.named_parameters() if id(p) not in ours]
    unsynced = []
    if dp > 1 and zero > 0:
        unsynced = [
            n
            for n, p in module.named_parameters()
            if not (isinstance(p, DTensor) and {"dp", "dp_cp"} & set(p.device_mesh.mesh_dim_names or ()))
        ]
    if outside or unsynced:
        names = sorted(outside + unsynced)
        raise PlanError(
            f"parameter(s) {names[:6]}{' ...' if len(names) > 6 else ''} of this stage belong to no data-parallel "
            f"unit (dp={dp}, ZeRO-{zero}): their gradients would not be synchronized and the replicas would drift.",
            "this is a Partita bug in setting up the stage; as a workaround move the parameters into a submodule "
            "of the model, and report the model.",
        )


def refuse_batch_stats(model: nn.Module, split: bool) -> None:
    """PlanError when ``model`` normalizes over the batch in training (BatchNorm) and the plan ``split``s
    the batch (dp > 1 or several micro-batches): the program's twin of the compile-time refusal
    (``driver._refuse_batch_stats``), for plans written by hand."""
    bn = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if bn and split:
        raise PlanError(
            f"{type(model).__name__} normalizes over the batch in training (BatchNorm at {', '.join(bn[:4])}), and "
            "this plan splits the batch over replicas or micro-batches: each piece would use its own batch "
            "statistics, unlike one device (Partita does not synchronize them).",
            "replace BatchNorm with GroupNorm or LayerNorm, or use a plan with dp=1 and one micro-batch.",
        )


def check_tp_shards_nothing(module: nn.Module, roles: Mapping[str, str]) -> None:
    """The program's side of ``Stage.tp_shards_nothing`` (plan.json): the plan says tp shards nothing in this
    stage, so :func:`distribute_params` gave no module a role and no parameter a sharded placement; every tp
    rank then holds and computes the whole stage on the same batch. PlanError if the stage set up otherwise."""
    sharded = [
        n for n, p in module.named_parameters() if isinstance(p, DTensor) and not p.placements[-1].is_replicate()
    ]
    if roles or sharded:
        raise PlanError(
            f"the plan says tp shards nothing in this stage (tp_shards_nothing), yet the program gave "
            f"{', '.join([*roles][:3] + sharded[:3])} a tp role or placement: plan and program disagree.",
            "recompile the plan with this Partita version; do not edit plan.json by hand.",
        )


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters by FQN (a collective over each DTensor's mesh: call on all stage ranks)."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().cpu()
        for n, p in module.named_parameters()
    }


def leave_process_group() -> None:
    """Destroy the process group and end this process at once (exit code 0), skipping interpreter
    finalization: there gloo (torch 2.13) sometimes aborts after a clean finish ("terminate called
    without an active exception", no Python frame on the stack; about 1 run in 10 on a loaded 2-core
    machine), and torchrun or ``torch.multiprocessing`` then reports the run as failed. Call it only
    after a clean finish, with every result written: after a failure peers may sit in a collective,
    and destroy would wait for them."""
    import logging
    import os
    import sys

    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
