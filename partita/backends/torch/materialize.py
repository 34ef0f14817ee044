"""Per-stage materialization: one setup path for the GPU run and the rehearsal.

A pipeline stage is set up by :func:`build_stage` then :func:`setup_stage`, called by both
``backends/torch/train._train`` (the torchrun program) and ``backends/torch/rehearse._rehearse_rank``
(the rehearsal: fake process group, ``to_empty`` under a fake tensor mode, no fill):

1. ``handle.build("meta")``: every parameter and buffer is a meta tensor, nothing is allocated;
   boundary shapes (the activations between stages) come from running the layers on meta tensors
   (MoE experts answer with their input's shape: :func:`shape_only_experts`); the plan layers of
   other stages become ``nn.Identity`` (the rule of ``parallel.split_stage``: FQNs stay those of
   the full model); buffers computed at construction (Llama's rotary ``inv_freq``) are computed
   again on the host for the modules kept (small), from the owning module's ``config``;
2. the program's ``setup_stage_<i>`` runs on the meta model (``rt.device`` is meta meanwhile):
   the stage is split, tensor parallelism and FSDP2 shard its parameters, still on meta;
3. ``to_empty(device)`` allocates this rank's shards only, on the device; tied parameters are tied
   again (:func:`retie`: ``to_empty`` gives every holder of a plain parameter its own tensor);
4. :func:`fill_stage` fills each parameter's local shard, one parameter at a time: the full value
   from the per-name rule (:func:`init_rules`) on the host, then this rank's slice of it (the
   DTensor's placements, FSDP2's ``_StridedShard`` included) copied into the local tensor. Host
   memory peaks at the largest single parameter plus what the rank holds; the device never holds
   an unsharded stage.

The rule (:func:`init_rules`): every parameter comes from a generator seeded by ``(seed, canonical
FQN)``: a parameter's values depend on its name and shape only, not on which rank holds it or what
else was built. HF models: ``normal(0, initializer_range)`` for matrices and embeddings, ones for
norm weights, zeros for biases; other models: ``uniform(+-1/sqrt(fan_in))`` (``nn.Linear``'s rule).
:func:`materialize` builds the whole model on the CPU with the same rule: the single-device
reference (``train.reference_run``) starts from the same weights as every parallel layout.

A model whose meta build fails or whose buffers cannot be computed again is built whole on the CPU
instead (``Materialized.how == "full"``; the rehearsal refuses it), with the same initializer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from partita.backends.torch import parallel as tpar
from partita.errors import PlanError

ALLOCATE_ERRORS = (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError)


@dataclasses.dataclass
class InitRule:
    """How one parameter's full value is made (module docstring): from its canonical name and shape."""

    key: str  # canonical FQN: the generator's seed
    shape: tuple[int, ...]
    kind: str  # "ones", "zeros", "normal" (arg: std) or "uniform" (arg: bound)
    arg: float = 0.0

    def value(self, seed: int) -> torch.Tensor:
        """The full f32 value on the host."""
        if self.kind == "ones":
            return torch.ones(self.shape)
        if self.kind == "zeros":
            return torch.zeros(self.shape)
        g = torch.Generator().manual_seed(_param_seed(seed, self.key))
        if self.kind == "normal":
            return torch.empty(self.shape).normal_(0.0, self.arg, generator=g)
        return torch.empty(self.shape).uniform_(-self.arg, self.arg, generator=g)


@dataclasses.dataclass
class Materialized:
    model: nn.Module  # "stage": on meta, other layers nn.Identity; "full": built whole on the CPU, initialized
    tied: list[list[str]]  # tied FQN groups of the full model
    boundary: list[tuple[torch.Size, torch.dtype]]  # per stage: per-sample output shape and dtype
    how: str  # "stage" (meta, set up by setup_stage) or "full" (built whole on the CPU)
    seed: int = 0
    rules: dict[str, InitRule] = dataclasses.field(default_factory=dict)  # every FQN, tied aliases included
    buffers: list[tuple[nn.Module, str, torch.Tensor, bool]] = dataclasses.field(default_factory=list)


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def init_rules(model: nn.Module, tied: Sequence[Sequence[str]]) -> dict[str, InitRule]:
    """The rule of every parameter of ``model`` (on any device, meta included), keyed by every FQN a
    parameter has (tied aliases map to their group's rule)."""
    canon = {n: names[0] for names in tied for n in names}
    config = getattr(model, "config", None)
    std = float(getattr(config, "initializer_range", 0.02)) if config is not None else None
    owners = {
        f"{m}.{p}" if m else p: mod for m, mod in model.named_modules() for p, _ in mod.named_parameters(recurse=False)
    }
    rules: dict[str, InitRule] = {}
    for name, p in model.named_parameters():
        key = canon.get(name, name)
        owner = owners.get(name)
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(p.shape)
        if std is not None:
            if p.dim() == 1 and leaf == "weight" and owner is not None and _is_norm(owner):
                rule = InitRule(key, shape, "ones")
            elif p.dim() == 1:
                rule = InitRule(key, shape, "zeros")
            else:
                rule = InitRule(key, shape, "normal", std)
        else:
            fan_in = (
                p.shape[1]
                if p.dim() > 1
                else (
                    owner.weight.shape[1]
                    if owner is not None and hasattr(owner, "weight") and owner.weight.dim() > 1
                    else p.shape[0]
                )
            )
            rule = InitRule(key, shape, "uniform", 1.0 / math.sqrt(max(fan_in, 1)))
        rules[name] = rule
    for names in tied:
        first = next((rules[n] for n in names if n in rules), None)
        if first is not None:
            rules.update({n: first for n in names})
    return rules


def init_parameters(model: nn.Module, tied: Sequence[Sequence[str]], seed: int) -> None:
    """Fill every parameter of ``model`` (plain tensors, whole) from its rule (module docstring)."""
    rules = init_rules(model, tied)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(rules[name].value(seed).to(p.dtype))


def retie(model: nn.Module, tied: Sequence[Sequence[str]]) -> None:
    """Tie each group of ``tied`` FQNs again to one Parameter (``to_empty`` gives every holder its own).

    Only parameters a module registers count: a pipeline stage's ghost of another stage's module
    (``stages.Ghost``) answers ``getattr`` with that module's meta parameter without holding it."""
    for names in tied:
        present = []
        for n in names:
            mod_name, _, attr = n.rpartition(".")
            try:
                mod = model.get_submodule(mod_name) if mod_name else model
            except (AttributeError, PlanError):  # dropped, or inside another stage's ghost
                continue
            if isinstance(mod._parameters.get(attr), nn.Parameter):
                present.append((mod, attr))
        for mod, attr in present[1:]:
            if mod._parameters[attr] is not present[0][0]._parameters[present[0][1]]:
                mod._parameters[attr] = present[0][0]._parameters[present[0][1]]


def _fresh_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, bool]] | None:
    """Buffers created at construction, computed again on the CPU for every module still in ``model``
    (None when one cannot be): ``(module, name, value, is_buffer)``; plain tensors kept beside the
    buffers (``original_inv_freq``) have ``is_buffer`` False."""
    out: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
    for _, mod in model.named_modules():
        own = [n for n, b in mod.named_buffers(recurse=False) if b is not None]
        if not own:
            continue
        cfg = getattr(mod, "config", None)
        if cfg is None:
            return None
        with torch.device("cpu"):
            fresh = type(mod)(config=cfg)
        out += [(mod, n, getattr(fresh, n), True) for n in own]
        for attr, val in vars(fresh).items():
            if isinstance(val, torch.Tensor) and attr not in own and not attr.startswith("_"):
                out.append((mod, attr, val, False))
    return out


def boundary_shapes(
    model: nn.Module, stage_layers: Sequence[Sequence[str]], x: torch.Tensor
) -> list[tuple[torch.Size, torch.dtype]]:
    """Per-sample output shape and dtype of each stage, computed on meta tensors (nothing allocated)."""
    return tpar.boundary_shapes(model, stage_layers, x.to("meta"))


@contextlib.contextmanager
def shape_only_experts(model: nn.Module) -> Iterator[None]:
    """MoE experts modules return an empty tensor of their input's shape while the boundary shapes are
    computed on the meta device: the model's own routing loops over the experts a router picked
    (``nonzero``, ``.item()``), which meta tensors cannot answer; an experts module's output has its
    input's shape and dtype. (The stage itself runs ``moe.py``.)"""
    from partita.backends.torch import moe

    patched = [m for m in model.modules() if moe.is_experts_module(m)]
    for m in patched:
        m.forward = types.MethodType(lambda _self, h, *_a, **_k: torch.empty_like(h), m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Hugging Face's causal-mask builder reads the position ids' values to detect packed sequences
    (``masking_utils.find_packed_sequence_indices``: a ``.all()`` on the ids), which meta and fake
    tensors do not have. The program's batches hold one sequence per row (``train.make_batch``), for
    which that function answers None: the meta build (boundary shapes) and the rehearsal give that
    answer without reading values."""
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers: no Hugging Face model to rehearse
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def find(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if position_ids.device.type == "meta" or _is_fake(position_ids):
            return None
        return original(position_ids, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _is_fake(t: torch.Tensor) -> bool:
    from partita.frontends.torch_shim import is_fake

    return bool(is_fake(t))


def _drop_other_layers(model: nn.Module, keep_layers: Sequence[str], all_layers: Sequence[str]) -> None:
    keep = {p for name in keep_layers for p in tpar.layer_paths(model, name)}
    for name in all_layers:
        for path in tpar.layer_paths(model, name):
            if path not in keep:
                parent, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, nn.Identity())


def materialize(handle: Any, seed: int) -> Materialized:
    """The whole model on the CPU, every parameter from its rule: the single-device reference."""
    try:
        model = handle.build("meta")
        tied = tpar.tied_groups(model)
        model.to_empty(device="cpu")
        retie(model, tied)
        buffers = _fresh_buffers(model)
        if buffers is None:
            raise ValueError("buffers")
        _put_buffers(buffers, torch.device("cpu"))
        how = "stage"
    except ALLOCATE_ERRORS:  # built whole on the CPU; same initializer, so the weights do not depend on the path
        model = handle.build("cpu", seed=seed).float()
        tied = tpar.tied_groups(model)
        how = "full"
    init_parameters(model, tied, seed)
    return Materialized(model, tied, [], how, seed)


def build_stage(
    handle: Any,
    seed: int,
    stage_layers: Sequence[Sequence[str]],
    keep: Sequence[str],
    x0: torch.Tensor,
    *,
    fallback: bool = True,
) -> Materialized:
    """Step 1 of the module docstring: the model on meta with only ``keep`` (plan layer names) left,
    the rules of every parameter and the boundary shapes of ``stage_layers`` for the sample ``x0``.
    ``fallback``: a model that cannot be built on meta is built whole on the CPU (else the error)."""
    all_layers = [n for layers in stage_layers for n in layers]
    try:
        model = handle.build("meta")
        tied = tpar.tied_groups(model)
        rules = init_rules(model, tied)  # before other layers are dropped: a tied group's first holder may be
        with shape_only_experts(model), unpacked_sequences():
            boundary = boundary_shapes(model, stage_layers, x0)
        _drop_other_layers(model, keep, all_layers)
        buffers = _fresh_buffers(model)
        if buffers is None:
            raise ValueError(f"{type(model).__name__}: a module holds buffers but no config to compute them again")
    except ALLOCATE_ERRORS:
        if not fallback:
            raise
        model = handle.build("cpu", seed=seed).float()
        tied = tpar.tied_groups(model)
        boundary = tpar.boundary_shapes(model, stage_layers, x0)
        init_parameters(model, tied, seed)
        return Materialized(model, tied, boundary, "full", seed)
    return Materialized(model, tied, boundary, "stage", seed, rules, buffers)


def _put_buffers(buffers: Sequence[tuple[nn.Module, str, torch.Tensor, bool]], device: torch.device) -> None:
    for mod, name, value, is_buffer in buffers:
        if is_buffer and mod._buffers.get(name) is not None and mod._buffers[name].shape == value.shape:
            with torch.no_grad():
                mod._buffers[name].copy_(value)
        elif is_buffer:
            mod._buffers[name] = value.to(device)
        else:
            setattr(mod, name, value.to(device))


def _place(module: nn.Module, device: torch.device) -> None:
    """Where the stage computes what it makes itself (its context's device, a generic stage's ghosts' zeros)."""
    from partita.backends.torch import stages as torch_stages

    if isinstance(module, tpar.StageModule):
        module.ctx.device = device
    elif isinstance(module, torch_stages.GenericStage):
        module.__dict__["_device"] = device


def setup_stage(
    built: Materialized,
    setup: Callable[[nn.Module, Any], nn.Module],
    rt: Any,
    device: torch.device,
    *,
    fill: bool = True,
    allocate: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    host_fill: HostFill | None = None,
) -> nn.Module:
    """Steps 2-4 of the module docstring: ``setup(model, rt)`` (the program's ``setup_stage_<i>``)
    on meta, ``to_empty(device)`` inside ``allocate()`` (the rehearsal: its fake tensor mode), the
    tied parameters tied again, buffers and (``fill``) every parameter's local shard filled. The one
    function both the torchrun program and the rehearsal set a stage up with. A ``"full"`` build
    (already on the CPU, initialized) is set up on ``device`` directly. ``host_fill`` (the
    rehearsal): the parameters are streamed through the host as :class:`HostFill` says, buffers left
    as allocated."""
    if built.how == "full":
        rt.device = device
        module = setup(built.model, rt)
        _place(module, device)
        return module
    rt.device = torch.device("meta")
    module = setup(built.model, rt)
    with allocate():
        module.to_empty(device=device)
        retie(module, built.tied)
        if fill and host_fill is None:
            _put_buffers(built.buffers, device)
            fill_stage(module, built.rules, built.seed)
    if host_fill is not None:
        with host_fill.context():
            fill_stage(module, built.rules, built.seed, value=host_fill.value)
    rt.device = device
    _place(module, device)
    return module


def local_shard(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` for parameter ``p``: ``full`` itself for a plain tensor, the slice a
    DTensor's placements give this rank (as ``distribute_tensor`` cuts it, on the host, no communication)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if not isinstance(p, DTensor):
        return full
    mesh, t = p.device_mesh, full
    done: set[int] = set()
    for idx, pl in enumerate(p.placements):
        if idx in done:
            continue
        views = _strided_views(p, t, idx)
        if views is not None:
            t, later = views
            done.add(later)
            continue
        if isinstance(pl, _StridedShard):
            dim = pl.dim + t.dim() if pl.dim < 0 else pl.dim
            t = _StridedShard._make_shard_tensor(dim, t, mesh, idx, None, split_factor=pl.split_factor)
        elif isinstance(pl, Shard):
            dim = pl.dim + t.dim() if pl.dim < 0 else pl.dim
            t = Shard._make_shard_tensor(dim, t, mesh, idx, None)
    return t


@dataclasses.dataclass(frozen=True)
class HostFill:
    """The rehearsal's fill (``backends/torch/rehearse.host_fill``): every parameter streamed through the
    host as the run streams it (its full f32 value allocated on the host, cut to this rank's shard,
    copied into the local tensor, freed), with ``value`` making the full value (the rehearsal's is
    allocated, unwritten: values never matter there) and ``context`` around the whole fill (the fake
    mode's permission to copy a host tensor into a fake one, and the rehearsal's host meter)."""

    value: Callable[[InitRule], torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def _strided_views(p: Any, t: torch.Tensor, idx: int) -> tuple[torch.Tensor, int] | None:
    """FSDP2 over tensor parallelism on one dim: ``_StridedShard(dim, split_factor=k)`` on mesh dim ``idx``
    and a later ``Shard(dim)`` over ``k`` ranks. The local shard is then two views, the tp chunk of the
    full value and this rank's chunk of it, where the dim divides evenly; torch's strided split copies
    (1.5 x the full value for a 256 MiB one: the gpt3-175b last stage's fill measured a full extra
    parameter). ``(the views, the later mesh dim)``, or None where this shortcut does not apply."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    pl, mesh = p.placements[idx], p.device_mesh
    if not isinstance(pl, _StridedShard):
        return None
    dim = pl.dim + t.dim() if pl.dim < 0 else pl.dim
    later = next(
        (
            k
            for k in range(idx + 1, len(p.placements))
            if type(p.placements[k]) is Shard and (p.placements[k].dim + t.dim()) % t.dim() == dim
        ),
        None,
    )
    coord = mesh.get_coordinate()
    if later is None or coord is None:
        return None
    k, n = mesh.size(later), mesh.size(idx)
    if k != pl.split_factor or t.shape[dim] % (k * n):
        return None
    return t.chunk(k, dim)[coord[later]].chunk(n, dim)[coord[idx]], later


def fill_stage(
    module: nn.Module,
    rules: Mapping[str, InitRule],
    seed: int,
    value: Callable[[InitRule], torch.Tensor] | None = None,
) -> None:
    """Fill every parameter's local shard of the set-up stage, one parameter at a time (the full value on
    the host, then this rank's slice copied to the device). ``value``: the rehearsal's stand-in for
    ``InitRule.value`` (:class:`HostFill`)."""
    from torch.distributed.tensor import DTensor

    make = value or (lambda rule: rule.value(seed))
    with torch.no_grad():
        for name, p in module.named_parameters():
            rule = rules[name.replace("_checkpoint_wrapped_module.", "")]
            if tuple(p.shape) != rule.shape:
                raise ValueError(f"{name}: set up as {tuple(p.shape)}, the model's parameter is {rule.shape}")
            local = local_shard(p, make(rule))
            target = p._local_tensor if isinstance(p, DTensor) else p
            target.copy_(local.to(target.dtype))
            # freed before the next parameter's full value exists: held over, two full values were alive at
            # once (the rehearsal's host meter measured 2 x 64 MiB for a fill of 64 MiB parameters)
            del local


def stage_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank allocated (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


def layers_of(stages: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    return [list(s["layers"]) for s in stages]
