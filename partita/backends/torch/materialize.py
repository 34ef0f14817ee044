"""Per-stage materialization: build the model on the meta device, allocate only this rank's stage.

Called by ``backends/torch/train.py`` before the program's ``setup_stage_<i>`` (which splits the stage,
applies tensor parallelism and FSDP2) and by :func:`~partita.backends.torch.train.reference_run` (the whole
model, the same way), so the single-device run and every parallel layout start from the same weights.

1. ``handle.build("meta")``: every parameter and buffer is a meta tensor, nothing is allocated;
2. the plan layers of other stages become ``nn.Identity`` (the rule of ``parallel.split_stage``: FQNs stay
   those of the full model);
3. ``to_empty(device="cpu")`` allocates what is left, tied parameters are tied again (``to_empty`` gives
   each module its own tensor), and :func:`init_parameters` fills every parameter from a generator
   seeded by ``(seed, canonical FQN)``: a parameter's values depend on its name and shape only, not on
   which rank holds it or what else was built. HF models: ``normal(0, initializer_range)`` for matrices
   and embeddings, ones for norm weights, zeros for biases; other models: ``uniform(+-1/sqrt(fan_in))``
   (``nn.Linear``'s rule) for matrices and biases;
4. buffers computed at construction (Llama's rotary ``inv_freq``) are rebuilt on the CPU from the owning
   module's ``config``; a model whose meta build fails or whose buffers cannot be rebuilt is built whole
   on the CPU instead (``Materialized.how == "full"``), with the same initializer.

Boundary shapes (the activations between stages) come from the meta model: :func:`boundary_shapes` runs
the layers on meta tensors, which computes shapes and allocates nothing.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from partita.backends.torch import parallel as tpar


@dataclasses.dataclass
class Materialized:
    model: nn.Module  # stage layers allocated and initialized; other layers nn.Identity (or all, for "full")
    tied: list[list[str]]  # tied FQN groups of the full model
    boundary: list[tuple[torch.Size, torch.dtype]]  # per stage: per-sample output shape and dtype
    how: str  # "stage" (meta + to_empty) or "full" (built whole on the CPU)


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def init_parameters(model: nn.Module, tied: Sequence[Sequence[str]], seed: int) -> None:
    """Fill every parameter of ``model`` from its own seeded generator (module docstring, step 3)."""
    canon = {n: names[0] for names in tied for n in names}
    config = getattr(model, "config", None)
    std = float(getattr(config, "initializer_range", 0.02)) if config is not None else None
    owners = {
        f"{m}.{p}" if m else p: mod for m, mod in model.named_modules() for p, _ in mod.named_parameters(recurse=False)
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = canon.get(name, name)
            g = torch.Generator().manual_seed(_param_seed(seed, key))
            owner = owners.get(name)
            leaf = name.rsplit(".", 1)[-1]
            if std is not None:
                if p.dim() == 1 and leaf == "weight" and owner is not None and _is_norm(owner):
                    value = torch.ones(p.shape)
                elif p.dim() == 1:
                    value = torch.zeros(p.shape)
                else:
                    value = torch.empty(p.shape).normal_(0.0, std, generator=g)
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
                bound = 1.0 / math.sqrt(max(fan_in, 1))
                value = torch.empty(p.shape).uniform_(-bound, bound, generator=g)
            p.copy_(value.to(p.dtype))


def retie(model: nn.Module, tied: Sequence[Sequence[str]]) -> None:
    """Tie each group of ``tied`` FQNs again to one Parameter (``to_empty`` gives every holder its own)."""
    for names in tied:
        present = []
        for n in names:
            mod_name, _, attr = n.rpartition(".")
            try:
                mod = model.get_submodule(mod_name) if mod_name else model
            except AttributeError:
                continue
            if isinstance(getattr(mod, attr, None), nn.Parameter):
                present.append((mod, attr))
        for mod, attr in present[1:]:
            setattr(mod, attr, getattr(*present[0]))


def _rebuild_buffers(model: nn.Module) -> bool:
    """Recompute buffers created at construction (False when one cannot be rebuilt)."""
    for _, mod in model.named_modules():
        own = [n for n, b in mod.named_buffers(recurse=False) if b is not None]
        if not own:
            continue
        cfg = getattr(mod, "config", None)
        if cfg is None:
            return False
        with torch.device("cpu"):
            fresh = type(mod)(config=cfg)
        for n in own:
            mod.register_buffer(n, getattr(fresh, n), persistent=n not in mod._non_persistent_buffers_set)
        for attr, val in vars(fresh).items():  # plain tensors kept beside the buffers (original_inv_freq)
            if isinstance(val, torch.Tensor) and attr not in own and not attr.startswith("_"):
                setattr(mod, attr, val)
    return True


def boundary_shapes(
    model: nn.Module, stage_layers: Sequence[Sequence[str]], x: torch.Tensor
) -> list[tuple[torch.Size, torch.dtype]]:
    """Per-sample output shape and dtype of each stage, computed on meta tensors (nothing allocated)."""
    return tpar.boundary_shapes(model, stage_layers, x.to("meta"))


def _drop_other_layers(model: nn.Module, keep_layers: Sequence[str], all_layers: Sequence[str]) -> None:
    keep = {p for name in keep_layers for p in tpar.layer_paths(model, name)}
    for name in all_layers:
        for path in tpar.layer_paths(model, name):
            if path not in keep:
                parent, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, nn.Identity())


def materialize(
    handle: Any,
    seed: int,
    stage_layers: Sequence[Sequence[str]] | None = None,
    keep: Sequence[str] | None = None,
    x0: torch.Tensor | None = None,
) -> Materialized:
    """The model with only ``keep`` (plan layer names; None: every layer) allocated and initialized;
    boundary shapes of ``stage_layers`` for the sample input ``x0`` (when both are given)."""
    all_layers = [n for layers in stage_layers or () for n in layers]
    want_boundary = stage_layers is not None and x0 is not None
    boundary: list[tuple[torch.Size, torch.dtype]] = []
    how = "stage"
    try:
        model = handle.build("meta")
        tied = tpar.tied_groups(model)
        if want_boundary:
            boundary = boundary_shapes(model, stage_layers, x0)  # type: ignore[arg-type]
        if keep is not None:
            _drop_other_layers(model, keep, all_layers)
        model.to_empty(device="cpu")
        retie(model, tied)
        ok = _rebuild_buffers(model)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError):
        ok = False
    if not ok:  # built whole on the CPU; same initializer, so the weights do not depend on the path
        model = handle.build("cpu", seed=seed).float()
        tied = tpar.tied_groups(model)
        if want_boundary:
            boundary = tpar.boundary_shapes(model, stage_layers, x0)  # type: ignore[arg-type]
        how = "full"
    init_parameters(model, tied, seed)
    return Materialized(model, tied, boundary, how)


def stage_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank allocated (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


def layers_of(stages: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    return [list(s["layers"]) for s in stages]
