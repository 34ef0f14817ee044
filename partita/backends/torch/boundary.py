"""Stage boundaries that carry several tensors: which tensors cross a cut, and how they travel.

Sits under ``backends/torch/stages.py``, which probes a model once (the order its modules run in,
what each returns, which module reads which tensor) and asks :func:`cut_layout` what crosses the cut
after a plan layer. The rule is the graph side's (``passes/boundaries.py``, which the search prices
and ``search/program/records.py`` records): a cut carries every tensor a module before it produced, a module
after it reads, and that depends on a parameter (it needs a gradient back). Tensors that depend on no
parameter (masks, rotary tables, constant biases) are rebuilt by the later stage's own forward.

A T5 decoder cut carries three: the decoder hidden state, the encoder output (cross-attention reads
it in every decoder block) and block 0's relative position bias ``(1, heads, S, S)``, which every
later block reuses. The pipeline runners move one tensor per boundary and slice it by samples, so a
boundary with several tensors travels **packed** (:func:`pack`): each tensor flattened per sample
and concatenated on dim 1, a tensor without a batch dim (the position bias) repeated per sample; the
receiver (:func:`unpack`) takes views of the packed tensor (gradients flow back through them) and
reads a broadcast tensor from its first sample (each sender sums its copies' gradients, so the dp
gradient sum is the single-device one). A boundary of one batched tensor travels as it is. The bytes
sent are the per-sample elements of the layout, what the plan's p2p records predict.

Both ends build the layout from the same probe; :func:`pack` checks what the stage returns against
it (name, shape, dtype) and :func:`unpack` what the next stage receives, with a
:class:`~partita.errors.PlanError` naming the tensor when they differ.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from partita.errors import PlanError

INPUT = ("__input__", 0, 0)  # the first block's input, when a cut follows `embed` (not a module's output)


@dataclasses.dataclass(frozen=True)
class Carried:
    """One tensor crossing a cut: ``key`` = (module path, call, output leaf) or :data:`INPUT`."""

    key: tuple[str, int, int]
    shape: tuple[int, ...]  # per sample when ``batched``, else the whole tensor (its dim 0 is 1)
    dtype: torch.dtype
    batched: bool

    @property
    def name(self) -> str:
        path, call, leaf = self.key
        return "input of the first block" if self.key == INPUT else f"{path} (call {call}) output {leaf}"

    @property
    def elems(self) -> int:
        """Elements per sample on the wire (a broadcast tensor is sent once per sample)."""
        return math.prod(self.shape) if self.batched else math.prod(self.shape[1:])


def leaf_meta(
    shape: tuple[int, ...], dtype: torch.dtype, batch: int
) -> tuple[tuple[int, ...], torch.dtype, bool] | None:
    """(shape, dtype, batched) of a probed leaf of full ``shape`` (probe batch ``batch`` >= 3); None if
    it cannot cross a cut (dim 0 neither the batch nor 1)."""
    if shape and shape[0] == batch:
        return tuple(shape[1:]), dtype, True
    if shape and shape[0] == 1:
        return tuple(shape), dtype, False
    return None


def cut_layout(info: Mapping[str, Any], before: set[str], after: set[str], main: tuple[str, int, int]) -> list[Carried]:
    """What crosses a cut: ``main`` (the activation the next block reads) first, then every probed
    module output (call order) made by a module in ``before`` and read by one in ``after`` that needs
    a gradient. ``info`` is ``stages.probe``'s record."""
    out: list[Carried] = []
    arch = info.get("arch", "the model")
    for key in [main, *info["reads"]]:
        path, call, leaf = key
        if any(c.key == key for c in out):
            continue
        if key != main and (path not in before or not (info["reads"][key] & after) or not info["grad"].get(key, False)):
            continue
        full = info["first_input_full"] if key == INPUT else info["outs"][(path, call)][leaf]
        meta = leaf_meta(full[0], full[1], info["batch"]) if full is not None else None
        if meta is None:
            raise PlanError(
                f"{arch}: {path} output {leaf} crosses a pipeline cut, and its dim 0 is neither the batch nor 1, "
                "so it cannot be sent per sample.",
                "compile without pipeline stages for this model, or cut elsewhere.",
            )
        if key != main and not meta[1].is_floating_point:
            raise PlanError(
                f"{arch}: {path} output {leaf} ({meta[1]}) crosses a pipeline cut and needs a gradient, but it is "
                "not a floating tensor.",
                "compile without pipeline stages for this model, or cut elsewhere.",
            )
        out.append(Carried(key, *meta))
    return out


def is_packed(layout: Sequence[Carried]) -> bool:
    return len(layout) > 1 or not layout[0].batched


def wire_shape(layout: Sequence[Carried]) -> tuple[torch.Size, torch.dtype]:
    """Per-sample shape and dtype of the tensor that travels (the runners' ``boundary`` entry)."""
    if not is_packed(layout):
        return torch.Size(layout[0].shape), layout[0].dtype
    return torch.Size([sum(c.elems for c in layout)]), layout[0].dtype


def pack(tensors: Sequence[torch.Tensor], layout: Sequence[Carried], where: str) -> torch.Tensor:
    """The stage's output tensors as the one boundary tensor (module docstring), checked against
    ``layout``."""
    n = tensors[0].shape[0] if layout[0].batched else None
    parts = []
    for t, c in zip(tensors, layout):
        if n is None and c.batched:
            n = t.shape[0]
        want = (n, *c.shape) if c.batched else c.shape
        if tuple(t.shape) != tuple(want) or t.dtype.is_floating_point != c.dtype.is_floating_point:
            raise PlanError(
                f"{where}: boundary tensor {c.name} has shape {tuple(t.shape)} and dtype {t.dtype}, but the cut's "
                f"layout (from the probe) says {tuple(want)} {c.dtype}: the stage returns something other than "
                "what the next stage will read.",
                "re-probe the model with the inputs it trains on (rebuild the stages after changing batch or "
                "sequence length).",
            )
        parts.append(t)
    if not is_packed(layout):
        return parts[0]
    if n is None:
        raise PlanError(f"{where}: no tensor of the boundary has a batch dim.", "cut after a block.")
    dtype = parts[0].dtype
    flat = [(t if c.batched else t.expand(n, *c.shape[1:])).reshape(n, -1).to(dtype) for t, c in zip(parts, layout)]
    return torch.cat(flat, dim=1)


def unpack(x: torch.Tensor, layout: Sequence[Carried], where: str) -> dict[tuple[str, int, int], torch.Tensor]:
    """The received boundary tensor as ``{key: tensor}`` (views of ``x``), checked against ``layout``."""
    if not is_packed(layout):
        return {layout[0].key: x}
    total = sum(c.elems for c in layout)
    if x.dim() != 2 or x.shape[1] != total:
        raise PlanError(
            f"{where}: received a boundary tensor of shape {tuple(x.shape)}, but the cut's layout carries "
            f"{len(layout)} tensors ({', '.join(c.name for c in layout)}), {total} elements per sample.",
            "run every stage from the same plan and model (regenerate the program with `partita compile`).",
        )
    out, at, n = {}, 0, x.shape[0]
    for c in layout:
        piece = x[:, at : at + c.elems]
        at += c.elems
        out[c.key] = piece.reshape(n, *c.shape) if c.batched else piece[:1].reshape(c.shape)
    return out
