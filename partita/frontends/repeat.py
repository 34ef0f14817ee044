"""Trace only what is distinct: a deep model's repeated blocks traced a few times, expanded by reference.

Part of the capture stage (``frontends/``), called by ``trace.py`` before the passes run. Tracing a
96-block GPT-3 with ``torch.export`` costs seconds per block although every block is the same
program up to renaming. For a model whose handle can build a *shallow copy* of itself
(``handle.depth_builder(n)``: the Hugging Face config with ``num_hidden_layers = n``), we trace
``TRACED_BLOCKS`` blocks and expand the graph to the full depth:

* the blocks are the node runs whose module path starts with ``P.<i>.`` (``model.layers.2.``,
  ``transformer.h.2.``); block ``i >= TRACED_BLOCKS`` is a copy of the last traced block with
  its parameter / buffer FQNs re-indexed (``P.<last>.`` -> ``P.<i>.``) and its node names shifted
  the way ``torch.fx`` numbers them (``linear_14`` -> ``linear_21``: each block consumes a fixed
  count of names per op base, read off the difference between the last two traced blocks). Export
  also spends names on nodes the IR drops (symbolic-int arithmetic), not always the same count
  per block, so the copies' names are unique and deterministic but may differ from a full trace's;
* references to the previous block's tensors move with it; references to the prologue (embedding,
  rotary tables, masks) stay; nodes after the blocks are renamed by the names the extra blocks
  consumed;
* tensors keep the order a full trace gives them (parameters block by block, then activations
  in node order), so the expanded graph is the full trace's graph up to activation names: same
  parameter names, counts, FLOPs, layers and kinds (``tests/test_repeat.py`` compares the JSON
  with activations named by position, on 5- and 6-block Llama, GPT-2 and Mixtral).

Anything this cannot prove identical (the two traced blocks differ in structure, a block reads a
tensor two blocks back, nodes between blocks, a name collision) returns ``None`` and the caller
traces the full model, so the shortcut never changes a result.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from partita.ir import Graph, Node, Prim, Role, Tensor

TRACED_BLOCKS = 3  # blocks 0..2: block 0 may differ in names (first use of a base), 1 -> 2 gives the stride
MIN_BLOCKS = 5  # below this a full trace is as cheap

_SUFFIX = re.compile(r"(.*)_(\d+)$")  # torch.fx's name-suffix rule (Graph._Namespace.create_name)


def _split(name: str) -> tuple[str, int]:
    m = _SUFFIX.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _join(base: str, num: int) -> str:
    return f"{base}_{num}" if num else base


def _find_prefix(graph: Graph, num_blocks: int) -> str | None:
    """``P`` such that node modules ``P.0`` .. ``P.<num_blocks - 1>`` all exist (the deepest, most used)."""
    counts: dict[str, set[int]] = {}
    for n in graph.nodes:
        parts = n.module.split(".") if n.module else []
        for i, p in enumerate(parts):
            if p.isdigit():
                counts.setdefault(".".join(parts[:i]), set()).add(int(p))
    fits = [p for p, idx in counts.items() if idx == set(range(num_blocks))]
    return min(fits, key=lambda p: (p.count("."), p)) if fits else None


def _block_of(module: str, prefix: str) -> int | None:
    if not module.startswith(prefix + "."):
        return None
    head = module[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


@dataclasses.dataclass
class _Blocks:
    prefix: str
    spans: list[tuple[int, int]]  # per traced block: [first, last + 1) node indices
    stride: dict[str, int]  # per fx name base: names one block consumes


def _blocks(graph: Graph, traced: int, want: str | None = None) -> _Blocks | None:
    prefix = _find_prefix(graph, traced)
    if prefix is None or (want is not None and prefix != want):
        return None
    where: dict[int, list[int]] = {}
    for k, n in enumerate(graph.nodes):
        idx = _block_of(n.module, prefix)
        if idx is not None:
            where.setdefault(idx, []).append(k)
    spans = [(min(where[b]), max(where[b]) + 1) for b in range(traced)]
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if end != start:  # glue between blocks, or interleaved blocks: not a plain repeat
            return None
    if any(hi - lo != len(where[b]) for b, (lo, hi) in enumerate(spans)):
        return None
    a, b = spans[-2], spans[-1]
    if a[1] - a[0] != b[1] - b[0]:
        return None
    stride: dict[str, int] = {}
    nums: dict[str, list[int]] = {}
    for n1, n2 in zip(graph.nodes[a[0] : a[1]], graph.nodes[b[0] : b[1]]):
        (b1, k1), (b2, k2) = _split(n1.name), _split(n2.name)
        if b1 != b2 or k2 <= k1:
            return None
        stride[b1] = max(stride.get(b1, 0), k2 - k1)
        nums.setdefault(b2, []).append(k2)
    for base, ks in nums.items():  # copies of the last block never overlap each other
        stride[base] = max(stride[base], max(ks) - min(ks) + 1)
    return _Blocks(prefix, spans, stride)


def _rename_fqn(fqn: str, prefix: str, src: int, dst: int) -> str:
    head = f"{prefix}.{src}."
    return f"{prefix}.{dst}." + fqn[len(head) :] if fqn.startswith(head) else fqn


def _rename_module(module: str, prefix: str, src: int, dst: int) -> str:
    return _rename_fqn(module + ".", prefix, src, dst)[:-1]


def _same_block(graph: Graph, blk: _Blocks) -> bool:
    """Blocks ``-2`` and ``-1`` are one program up to renaming (prims, signatures, shapes, attrs)."""
    (a0, a1), (b0, b1) = blk.spans[-2], blk.spans[-1]
    last = len(blk.spans) - 1
    prev_names = {o for n in graph.nodes[a0:a1] for o in n.outputs}
    older = {o for lo, hi in blk.spans[:-2] for n in graph.nodes[lo:hi] for o in n.outputs}
    for n1, n2 in zip(graph.nodes[a0:a1], graph.nodes[b0:b1]):
        same = (
            n1.prim == n2.prim
            and n1.sig == n2.sig
            and n1.target == n2.target
            and dict(n1.attrs) == dict(n2.attrs)
            and n1.source == n2.source
            and _rename_module(n1.module, blk.prefix, last - 1, last) == n2.module
            and len(n1.inputs) == len(n2.inputs)
            and len(n1.outputs) == len(n2.outputs)
        )
        if not same:
            return False
        for o1, o2 in zip(n1.outputs, n2.outputs):
            t1, t2 = graph.tensors[o1], graph.tensors[o2]
            if (t1.shape, t1.dtype) != (t2.shape, t2.dtype):
                return False
        for i2 in n2.inputs:
            if i2 in older:  # reads two blocks back: the copy rule below would not hold
                return False
        for i1, i2 in zip(n1.inputs, n2.inputs):
            if i1 in prev_names or i2 in prev_names:
                continue  # block -2 reads block -3 (or the prologue) where -1 reads -2: checked by shape
            t1, t2 = graph.tensors[i1], graph.tensors[i2]
            if t1.role in (Role.PARAMETER, Role.BUFFER):
                if _rename_fqn(i1, blk.prefix, last - 1, last) != i2:
                    return False
            elif i1 != i2:  # both read the same prologue tensor
                return False
    return True


def expand_blocks(graph: Graph, traced: int, total: int, prefix: str | None = None) -> Graph | None:
    """``graph`` traced with ``traced`` repeated blocks, expanded to ``total`` blocks; ``None``
    when the blocks cannot be shown identical (module docstring). ``prefix``: the block list's
    module path where the caller knows it (any other list found is refused)."""
    if total <= traced:
        return graph if total == traced else None
    blk = _blocks(graph, traced, prefix)
    if blk is None or not _same_block(graph, blk):
        return None
    last = traced - 1
    lo, hi = blk.spans[-1]
    block_nodes = graph.nodes[lo:hi]
    block_out = {o for n in block_nodes for o in n.outputs}
    prev_out = {o for n in graph.nodes[blk.spans[-2][0] : blk.spans[-2][1]] for o in n.outputs}
    producer = {o: n.name for n in graph.nodes for o in n.outputs}

    def shift_act(name: str, k: int) -> str:
        node, dot, rest = producer[name].partition(".")[0], "", ""
        if name != node:
            dot, rest = ".", name[len(node) + 1 :]
        base, num = _split(node)
        return _join(base, num + k * blk.stride.get(base, 0)) + dot + rest

    def block_copy(i: int) -> list[Node]:
        k = i - last

        def ref(t: str) -> str:
            if t in block_out or t in prev_out:
                return shift_act(t, k)
            tt = graph.tensors[t]
            if tt.role in (Role.PARAMETER, Role.BUFFER):
                return _rename_fqn(t, blk.prefix, last, i)
            return t

        return [
            dataclasses.replace(
                n,
                name=_join(_split(n.name)[0], _split(n.name)[1] + k * blk.stride[_split(n.name)[0]]),
                inputs=tuple(ref(t) for t in n.inputs),
                outputs=tuple(shift_act(o, k) for o in n.outputs),
                module=_rename_module(n.module, blk.prefix, last, i),
            )
            for n in block_nodes
        ]

    extra = total - traced
    tail_map: Callable[[str], str]

    def tail_ref(t: str) -> str:
        if t in block_out or t in prev_out:
            return shift_act(t, extra)
        if t in producer and producer[t] in tail_names:
            return shift_act(t, extra)
        return t

    tail_map = tail_ref
    tail_names = {n.name for n in graph.nodes[hi:]}
    nodes: list[Node] = list(graph.nodes[:hi])
    for i in range(traced, total):
        nodes.extend(block_copy(i))
    for n in graph.nodes[hi:]:
        base, num = _split(n.name)
        nodes.append(
            dataclasses.replace(
                n,
                name=_join(base, num + extra * blk.stride.get(base, 0)) if num or base in blk.stride else n.name,
                inputs=tuple(tail_map(t) for t in n.inputs),
                outputs=tuple(tail_map(o) for o in n.outputs),
            )
        )
    if len({n.name for n in nodes}) != len(nodes):
        return None
    return _assemble(graph, nodes, blk, traced, total, tail_map)


def _assemble(
    graph: Graph, nodes: list[Node], blk: _Blocks, traced: int, total: int, tail_map: Callable[[str], str]
) -> Graph | None:
    """The expanded graph with tensors in a full trace's order."""
    last = traced - 1
    head = f"{blk.prefix}.{last}."
    fixed = [t for t in graph.tensors.values() if t.role is not Role.ACTIVATION]
    tensors: dict[str, Tensor] = {}
    for k, t in enumerate(fixed):
        tensors[t.name] = t
        in_run = t.name.startswith(head)
        run_ends = in_run and (
            k + 1 == len(fixed) or not fixed[k + 1].name.startswith(head) or fixed[k + 1].role != t.role
        )
        if run_ends:
            start = k
            while start > 0 and fixed[start - 1].name.startswith(head) and fixed[start - 1].role == t.role:
                start -= 1
            for i in range(traced, total):
                for s in fixed[start : k + 1]:
                    name = _rename_fqn(s.name, blk.prefix, last, i)
                    fqn = _rename_fqn(s.fqn, blk.prefix, last, i)
                    aliases = tuple(_rename_fqn(a, blk.prefix, last, i) for a in s.aliases)
                    tensors[name] = dataclasses.replace(s, name=name, fqn=fqn, aliases=aliases)
    # activations: each new node's outputs take the shape/dtype of the template output at its position
    for n, outs in zip(nodes, _template_outputs(graph.nodes, blk, traced, total)):
        for o, src in zip(n.outputs, outs):
            tensors[o] = dataclasses.replace(graph.tensors[src], name=o)
    if any(i not in tensors for n in nodes for i in n.inputs):
        return None
    meta = dict(graph.meta)
    meta["traced_blocks"] = [traced, total]  # provenance: this graph is an expansion
    if "num_opaque" in meta:
        meta["num_opaque"] = sum(1 for n in nodes if n.prim is Prim.OPAQUE)
    return dataclasses.replace(
        graph,
        tensors=tensors,
        nodes=nodes,
        outputs=[tail_map(o) for o in graph.outputs],
        layers=[],
        meta=meta,
    )


def _template_outputs(src: list[Node], blk: _Blocks, traced: int, total: int) -> list[tuple[str, ...]]:
    """For every node of the expanded list, the output names of the traced node it copies."""
    lo, hi = blk.spans[-1]
    out = [n.outputs for n in src[:hi]]
    for _ in range(traced, total):
        out.extend(n.outputs for n in src[lo:hi])
    out.extend(n.outputs for n in src[hi:])
    return out


def trace_by_blocks(handle: Any, trace: Callable[[Any], Graph]) -> Graph | None:
    """Trace ``handle``'s model with :data:`TRACED_BLOCKS` blocks (``trace`` maps a module to its raw
    graph) and expand it to the full depth; ``None`` when the model is shallow or the blocks cannot
    be shown identical. A handle with a shallow builder (the zoo's Hugging Face models) builds the
    shallow copy from its config; any other torch model is built whole on meta and its block list
    cut (``block_list.py``)."""
    builder = getattr(handle, "depth_builder", None)
    cfg = getattr(handle, "config", None) or {}
    total = int(cfg.get("num_layers") or 0) if isinstance(cfg, dict) else 0
    if builder is None:
        from partita.frontends.block_list import trace_cut

        got = trace_cut(handle.build(device="meta"), TRACED_BLOCKS, MIN_BLOCKS, trace)
        return None if got is None else expand_blocks(got[0], TRACED_BLOCKS, got[2], prefix=got[1])
    if total < MIN_BLOCKS:
        return None
    import torch

    with torch.device("meta"):
        module = builder(TRACED_BLOCKS)
    return expand_blocks(trace(module), TRACED_BLOCKS, total)
