"""The one place Partita touches private or unstable PyTorch APIs.

Used by ``frontends/trace_torch.py`` (capture), ``backends/torch/fidelity.py`` (collective counting) and
``backends/torch/parallel.py`` (selective recompute keeps collectives' outputs).
A torch upgrade that moves one of these names should only need an edit here.

* ``TorchDispatchMode`` (``torch.utils._python_dispatch``) is the base class of
  ``fidelity.CollectiveCounter``, which sees every ``c10d`` / ``_c10d_functional`` op a training
  step issues. The public ``torch.distributed.tensor.debug.CommDebugMode`` is the same kind of
  mode (and steps aside for DTensor ops the same way), but in torch 2.13 it counts no send/recv
  (its op set has no p2p, so pipeline transfers would go unseen), it tracks modules on every op,
  and FACTS.md records it crashing in FSDP2 hooks (a plain FSDP2 forward/backward under it
  counted fine when re-checked here); so Partita keeps its own small mode.
* ``_StridedShard`` (``torch.distributed.tensor.placement_types``) is the placement of a plan's
  ``"SS(d,g)"`` (``backends/torch/tp.py``): each of ``g`` equal chunks of dim ``d`` sharded on its
  own, GPT-2's q|k|v weight split by heads. DTensor propagates it through ``addmm`` / ``view``
  (checked in torch 2.13: no collective forward, one all-reduce of the input gradient) and
  ``full_tensor()`` returns the canonical layout, so gradients and checkpoints stay the model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy
import torch
from torch.export import Dim, ExportedProgram
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "export_program",
    "functional_collective_ops",
    "make_dim",
    "op_name",
    "schema_arg_names",
    "strided_shard",
    "strided_shard_spec",
    "sym_expr",
]


def functional_collective_ops() -> tuple[Any, ...]:
    """DTensor's collectives (``_c10d_functional``) and the wait that completes them."""
    ops = torch.ops._c10d_functional
    return (
        ops.all_reduce.default,
        ops.all_gather_into_tensor.default,
        ops.reduce_scatter_tensor.default,
        ops.all_to_all_single.default,
        ops.wait_tensor.default,
    )


def export_program(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    dynamic_shapes: Mapping[str, Any] | None,
) -> ExportedProgram:
    """``torch.export.export`` in non-strict mode (the training IR: ``aten.linear`` etc.)."""
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)


def make_dim(name: str, lo: int, hi: int) -> Any:
    return Dim(name, min=lo, max=hi)


def sym_expr(value: Any) -> sympy.Expr:
    """A python int or a ``torch.SymInt`` as a sympy expression (``SymInt.node.expr`` is private)."""
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))


def op_name(target: Any) -> str:
    """``aten.linear.default`` -> ``"linear"``; custom ops keep their namespace (``transformers.x``)."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        ns = getattr(target, "namespace", "aten")
        base = packet.__name__
        return base if ns == "aten" else f"{ns}.{base}"
    return getattr(target, "__name__", str(target))


def schema_arg_names(target: Any) -> list[str]:
    """Positional argument names from an OpOverload's schema (``[]`` for python callables)."""
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def strided_shard(dim: int, groups: int) -> Any:
    """DTensor placement: ``groups`` equal chunks of ``dim``, each sharded over the mesh axis."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=groups)


def strided_shard_spec(placement: Any) -> tuple[int, int] | None:
    """``(dim, groups)`` of a ``_StridedShard`` placement, None for any other placement."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return (int(placement.dim), int(placement.split_factor)) if isinstance(placement, _StridedShard) else None
