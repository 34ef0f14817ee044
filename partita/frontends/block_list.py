"""Any torch model's list of identical blocks, cut to a few for tracing (``repeat.py`` expands them).

Part of the capture stage (``frontends/``), used by ``repeat.trace_by_blocks`` for a model whose
handle has no shallow builder (a ``config.json`` model, a user's factory or live module):
``torch.export`` costs about a second per block, so an 80-block model spends most of a cold
compile tracing 77 copies of one program. Here the full model is built on the meta device (no
weights: a tenth of a second for 72B) and its block list is found and checked:

* the candidate is an ``nn.ModuleList`` with at least ``MIN_BLOCKS`` children, the one holding the
  most parameters;
* children ``1 .. n-1`` must be one structure: for every submodule its class, every parameter's and
  buffer's name, shape, dtype and ``requires_grad``, and every plain attribute (numbers, strings,
  ``None``, tuples of those: ``sliding_window``, ``attention_type``, ``is_causal``). An int that
  counts the block's own position (``layer_idx``: block ``i`` holds ``i + c``) is the one attribute
  allowed to differ. Child 0 may differ (T5's relative-attention bias); ``repeat.expand_blocks``
  copies the last traced child, never child 0;
* the list is replaced by its first ``TRACED_BLOCKS`` children, the model traced, the list put back.

A model whose forward cannot run on the short list (it indexes ``self.blocks[i]`` for ``i`` past
it) raises in the trace; that, a list that fails the check, and any graph ``expand_blocks`` cannot
prove repeated return ``None``, and the caller traces the full model. What this cannot see: a
parent ``forward`` that treats block ``i`` differently by its position alone (``if i >= 40``, with no
attribute of the block saying so) beyond the traced prefix; a period of 2 shows in the traced
blocks and is refused by ``expand_blocks``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from partita.ir import Graph

_PLAIN = (int, float, str, bool, type(None))


def _plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v))


def _attrs(block: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """(submodule path, attribute) -> value for every plain public attribute of ``block``'s modules."""
    out: dict[tuple[str, str], Any] = {}
    for path, mod in block.named_modules():
        for k, v in vars(mod).items():
            if not k.startswith("_") and k != "training" and _plain(v):
                out[(path, k)] = v
    return out


def _tensors(block: torch.nn.Module) -> tuple[Any, ...]:
    ps = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in block.named_parameters())
    bs = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers())
    classes = tuple((path, f"{type(m).__module__}.{type(m).__qualname__}") for path, m in block.named_modules())
    return ps, bs, classes


def identical_from_one(blocks: list[torch.nn.Module]) -> bool:
    """Children ``1 ..`` of ``blocks`` are one structure up to an attribute counting their position."""
    rest = blocks[1:]
    if len({_tensors(b) for b in rest}) != 1:
        return False
    attrs = [_attrs(b) for b in rest]
    if any(a.keys() != attrs[0].keys() for a in attrs):
        return False
    for key in attrs[0]:
        vals = [a[key] for a in attrs]
        if all(v == vals[0] for v in vals):
            continue
        counts = all(type(v) is int for v in vals) and len({v - i for i, v in enumerate(vals)}) == 1
        if not counts:  # differs by more than the block's own position
            return False
    return True


def find_block_list(model: torch.nn.Module, min_blocks: int) -> tuple[torch.nn.Module, str, str] | None:
    """(parent module, attribute name, dotted path) of the model's repeated block list, or None."""
    import torch

    best: tuple[int, torch.nn.Module, str, str] | None = None
    for path, mod in model.named_modules():
        for name, child in mod.named_children():
            if not isinstance(child, torch.nn.ModuleList) or len(child) < min_blocks:
                continue
            size = sum(p.numel() for p in child.parameters())
            if best is None or size > best[0]:
                best = (size, mod, name, f"{path}.{name}" if path else name)
    if best is None:
        return None
    _, parent, name, full = best
    blocks = list(getattr(parent, name))
    return (parent, name, full) if identical_from_one(blocks) else None


def trace_cut(
    model: torch.nn.Module, keep: int, min_blocks: int, trace: Callable[[Any], Graph]
) -> tuple[Graph, str, int] | None:
    """Trace ``model`` with its block list cut to the first ``keep`` children: (raw graph, the list's
    path, its full length), or None (no checked list, or the forward cannot run on the short list)."""
    import torch

    found = find_block_list(model, min_blocks)
    if found is None:
        return None
    parent, name, path = found
    full = getattr(parent, name)
    setattr(parent, name, torch.nn.ModuleList(list(full)[:keep]))
    try:
        graph = trace(model)
    except Exception:  # noqa: BLE001 - the short list is ours: any failure means "trace it whole"
        return None
    finally:
        setattr(parent, name, full)
    return graph, path, len(full)
