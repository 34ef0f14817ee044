"""The one place Partita touches private or unstable PyTorch APIs.

Used by ``compiler/trace_torch.py`` (capture) and ``models/`` (nothing yet). A torch upgrade that
moves one of these names should only need an edit here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy
import torch
from torch.export import Dim, ExportedProgram


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
