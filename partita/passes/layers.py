"""Layer grouping: cut the node list into pipeline units and tag identical ones with one kind.

A pass in ``passes/pipeline.py``. The repeated container is found from module paths: every numeric
path component ``P.<i>`` is a candidate (``transformer.h.3``, ``model.layers.7``,
``resnet.encoder.stages.1.layers.2``); the candidate pattern with the most distinct blocks wins,
provided its blocks average at least ``MIN_BLOCK_NODES`` nodes (so a ResNet's conv+bn+relu triples
lose to its bottleneck blocks). Nodes before the first block form ``embed``, after the last
``head``; nodes without a module path between blocks join the block before them. Without a
repeated container each top-level submodule becomes a layer.

``Layer.kind`` is a structural hash (prims, signatures, targets, attrs, shapes, dtypes, tensor
names canonicalised), so the N blocks of a transformer share one kind and the search solves it once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence

from partita.ir import Graph, Layer, Node, Role, _jsonable

MIN_BLOCK_NODES = 8
_NUM = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _block_key(path: str, pattern: str) -> str | None:
    """The prefix of ``path`` matching ``pattern`` (numerics as ``*``), e.g. ``transformer.h.3``."""
    parts, pat = path.split("."), pattern.split(".")
    if len(parts) < len(pat):
        return None
    for a, b in zip(parts, pat):
        if not (a == b or (b == "*" and a.isdigit())):
            return None
    return ".".join(parts[: len(pat)])


def _find_container(nodes: Sequence[Node]) -> str | None:
    keys: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for n in nodes:
        parts = n.module.split(".") if n.module else []
        for i, p in enumerate(parts):
            if p.isdigit():
                key = ".".join(parts[: i + 1])
                pattern = ".".join("*" if x.isdigit() else x for x in parts[: i + 1])
                keys.setdefault(pattern, set()).add(key)
                counts[pattern] = counts.get(pattern, 0) + 1
    best: tuple[int, int, str] | None = None
    for pattern, ks in keys.items():
        if len(ks) < 2 or counts[pattern] / len(ks) < MIN_BLOCK_NODES:
            continue
        score = (len(ks), -pattern.count("."), pattern)
        if best is None or score[:2] > best[:2]:
            best = score
    return best[2] if best else None


def _assign(graph: Graph) -> list[str]:
    nodes = graph.nodes
    pattern = _find_container(nodes)
    if pattern is None:
        tops = [n.module.split(".")[0] if n.module else "" for n in nodes]
        names: list[str] = []
        for i, t in enumerate(tops):
            names.append(t or (names[-1] if names else next((x for x in tops[i:] if x), "model")))
        return names
    keys = [_block_key(n.module, pattern) if n.module else None for n in nodes]
    first = next(i for i, k in enumerate(keys) if k)
    last = max(i for i, k in enumerate(keys) if k)
    out: list[str] = []
    for i, k in enumerate(keys):
        if i < first:
            out.append("embed")
        elif i > last:
            out.append("head")
        else:
            out.append(k or out[-1])
    return out


def _kind(graph: Graph, nodes: Sequence[Node]) -> str:
    """Hash of the layer's structure with tensor names replaced by first-use indices."""
    canon: dict[str, str] = {}

    def name(t: str) -> str:
        if t not in canon:
            tt = graph.tensors[t]
            canon[t] = f"{tt.role.value[0]}{len(canon)}:{tt.dtype}[{','.join(str(d) for d in tt.shape)}]"
        return canon[t]

    rows = []
    for n in nodes:
        ins = [name(i) for i in n.inputs]
        outs = [name(o) for o in n.outputs]
        rows.append([n.prim.value, str(n.sig), n.target, _jsonable(dict(n.attrs)), ins, outs])
    blob = json.dumps(rows, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def group_layers(graph: Graph) -> Graph:
    """Set ``node.layer`` on every node and build ``graph.layers`` (in node order)."""
    if not graph.nodes:
        return graph.replace_nodes([], [])
    names = _assign(graph)
    order: list[str] = []
    members: dict[str, list[Node]] = {}
    for n, lay in zip(graph.nodes, names):
        if lay not in members:
            order.append(lay)
            members[lay] = []
        members[lay].append(n)
    layer_of = {o: lay for n, lay in zip(graph.nodes, names) for o in n.outputs}
    readers: dict[str, set[str]] = {}
    for n, lay in zip(graph.nodes, names):
        for i in n.inputs:
            readers.setdefault(i, set()).add(lay)
    position = {lay: k for k, lay in enumerate(order)}
    graph_outs = set(graph.outputs)
    seen_params: set[str] = set()
    layers = []
    for lay in order:
        nodes = members[lay]
        ins: list[str] = []
        params: list[str] = []
        for n in nodes:
            for i in n.inputs:
                role = graph.tensors[i].role
                if role is Role.PARAMETER:
                    if i not in seen_params:
                        seen_params.add(i)
                        params.append(i)
                elif role is not Role.BUFFER and layer_of.get(i) != lay and i not in ins:
                    ins.append(i)
        outs = [
            o
            for n in nodes
            for o in n.outputs
            if o in graph_outs or any(position[r] > position[lay] for r in readers.get(o, ()))
        ]
        layers.append(
            Layer(lay, tuple(n.name for n in nodes), _kind(graph, nodes), tuple(ins), tuple(outs), tuple(params))
        )
    new_nodes = [dataclasses.replace(n, layer=lay) for n, lay in zip(graph.nodes, names)]
    return graph.replace_nodes(new_nodes, layers)
