"""Partita's framework-neutral dataflow IR.

Sits at the bottom of the flow: tracers (``frontends/trace_torch.py``, ``trace_jax.py``) build a
:class:`Graph`, passes (``passes/``) rewrite and annotate it, the search reads it. No torch or jax
import here.

A graph is a topologically ordered list of :class:`Node` over named :class:`Tensor` values.
Every node has a :class:`Prim` from a small closed set and an einsum-like :class:`DimSig`:

* each tensor operand and result gets a label string, one character per tensor dim
  (``"bsk,nk->bsn"`` for ``linear``);
* ``reduced`` labels are summed over: sharding one leaves a *partial* result that needs an
  all-reduce or reduce-scatter;
* ``fixed`` labels may not be sharded (the softmax axis, a norm's hidden dim, the new dims a
  reshape creates);
* labels that appear only on some operands are broadcast.

That one description lets ``search/layer/strategies.py`` enumerate the sharding strategies of every op
with a single generic rule. Shapes are tuples of sympy expressions so batch and sequence can stay
symbolic (``B``, ``S``); :func:`dim_size` evaluates one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sympy

from partita.errors import IRError

IR_VERSION = 1

DTYPE_BYTES: dict[str, int] = {
    "f64": 8,
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "f8": 1,
    "i64": 8,
    "i32": 4,
    "i16": 2,
    "i8": 1,
    "u8": 1,
    "bool": 1,
    "c64": 8,
}


class Prim(str, enum.Enum):
    """The closed primitive set. Tracers map every framework op to one of these (or OPAQUE)."""

    MATMUL = "matmul"  # linear, matmul, bmm, einsum, addmm, dot_general
    ELEMENTWISE = "elementwise"  # unary/binary pointwise: add, mul, gelu, silu, cast, where...
    REDUCE = "reduce"  # sum, mean, max, argmax over dims
    SOFTMAX = "softmax"  # softmax / log_softmax along one fixed dim
    NORM = "norm"  # layer norm, RMS norm (normalized dims are fixed)
    BATCH_NORM = "batch_norm"
    EMBEDDING = "embedding"  # table lookup: weight[v,h], ids[...] -> [..., h]
    ATTENTION = "attention"  # scaled dot-product attention
    CONV = "conv"  # conv1d/2d/3d
    POOL = "pool"  # max/avg pool, adaptive pool
    RESHAPE = "reshape"  # view, reshape, flatten, unflatten, squeeze, unsqueeze
    PERMUTE = "permute"  # permute, transpose
    EXPAND = "expand"  # expand / broadcast_to / repeat
    SLICE = "slice"  # slice, select, narrow
    CAT = "cat"  # cat / stack / concatenate
    SPLIT = "split"  # split, chunk, unbind (several outputs)
    DROPOUT = "dropout"
    CROSS_ENTROPY = "cross_entropy"  # fused log-softmax + nll; output is a scalar loss
    TOPK = "topk"  # MoE router: top-k values and indices
    GATHER = "gather"  # gather / take_along_dim
    SCATTER = "scatter"  # scatter / scatter_add / index_add / index_put
    INDEX = "index"  # advanced indexing with an index tensor
    CONSTANT = "constant"  # factory ops: arange, zeros, full, ones_like
    OPAQUE = "opaque"  # op with no rule: kept, priced by bytes, replicated, reported loudly


class Role(str, enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    ACTIVATION = "activation"


@dataclasses.dataclass(frozen=True)
class DimSig:
    """Einsum-like signature: one label string per tensor operand and per result."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    reduced: str = ""
    fixed: str = ""

    @staticmethod
    def parse(spec: str, reduced: str | None = None, fixed: str = "") -> DimSig:
        """``"bsk,nk->bsn"``; ``reduced`` defaults to labels on the left that vanish on the right."""
        lhs, _, rhs = spec.partition("->")
        ins = tuple(lhs.split(",")) if lhs else ()
        outs = tuple(rhs.split(",")) if rhs else ()
        if reduced is None:
            right = set("".join(outs))
            reduced = "".join(sorted({c for c in "".join(ins) if c not in right}))
        return DimSig(ins, outs, reduced, fixed)

    @property
    def labels(self) -> str:
        """All iteration labels in first-seen order."""
        seen: dict[str, None] = {}
        for s in (*self.inputs, *self.outputs):
            for c in s:
                seen.setdefault(c, None)
        return "".join(seen)

    @property
    def shardable(self) -> str:
        return "".join(c for c in self.labels if c not in self.fixed)

    def __str__(self) -> str:
        s = ",".join(self.inputs) + "->" + ",".join(self.outputs)
        if self.reduced:
            s += f" red={self.reduced}"
        if self.fixed:
            s += f" fix={self.fixed}"
        return s


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[sympy.Expr, ...]
    dtype: str
    role: Role
    fqn: str = ""  # parameter / buffer name in the user's model
    aliases: tuple[str, ...] = ()  # other FQNs of a tied parameter (counted once)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    def nbytes(self) -> sympy.Expr:
        return self.numel() * self.itemsize


@dataclasses.dataclass(frozen=True)
class Node:
    """One primitive application. ``target`` is the framework op it came from."""

    name: str
    prim: Prim
    inputs: tuple[str, ...]  # tensor names; only tensor operands, in operand order
    outputs: tuple[str, ...]
    sig: DimSig
    target: str = ""
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    module: str = ""  # provenance: module path in the user's model ("transformer.h.3.mlp")
    source: str = ""  # provenance: "file.py:123" where known
    layer: str = ""  # assigned by passes/layers.py
    flops: sympy.Expr = sympy.Integer(0)  # assigned by passes/annotate.py (forward)
    bytes_moved: sympy.Expr = sympy.Integer(0)  # assigned by passes/annotate.py (forward)


@dataclasses.dataclass(frozen=True)
class Layer:
    """A pipeline unit: consecutive nodes (a transformer block, the embedding, the head)."""

    name: str
    nodes: tuple[str, ...]
    kind: str  # structural hash: layers with the same kind are identical up to renaming
    inputs: tuple[str, ...]  # activations read from earlier layers (or graph inputs)
    outputs: tuple[str, ...]  # activations read by later layers (or graph outputs)
    params: tuple[str, ...]  # parameter tensors used by this layer (first use only)


@dataclasses.dataclass
class Graph:
    name: str
    tensors: dict[str, Tensor]
    nodes: list[Node]
    inputs: list[str]  # input tensors fed per step (ids, labels, images)
    outputs: list[str]  # the loss (training) or model outputs
    symbols: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # name -> (min, max)
    layers: list[Layer] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # framework, model class...

    # ---- queries -------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        # an index by name (issue 20: the search looks nodes up ~10^5 times at scale), checked on
        # every hit and rebuilt when ``nodes`` changed under it; the first node of a name wins
        index = self.__dict__.get("_node_index")
        i = None if index is None else index.get(name)
        if i is None or i >= len(self.nodes) or self.nodes[i].name != name:
            index = {}
            for k, n in enumerate(self.nodes):
                index.setdefault(n.name, k)
            self.__dict__["_node_index"] = index
            i = index.get(name)
            if i is None:
                raise KeyError(name)
        return self.nodes[i]

    def params(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.role is Role.PARAMETER]

    def num_params(self) -> int:
        return int(sum(int(t.numel()) for t in self.params()))

    def param_bytes(self) -> int:
        return int(sum(int(t.nbytes()) for t in self.params()))

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {t: [] for t in self.tensors}
        for n in self.nodes:
            for i in n.inputs:
                out.setdefault(i, []).append(n)
        return out

    def forward_flops(self) -> sympy.Expr:
        return sympy.Add(*[n.flops for n in self.nodes]) if self.nodes else sympy.Integer(0)

    def replace_nodes(self, nodes: Iterable[Node], layers: Sequence[Layer] | None = None) -> Graph:
        return dataclasses.replace(self, nodes=list(nodes), layers=list(self.layers if layers is None else layers))

    # ---- verifier, printer, JSON ---------------------------------------------------------
    def verify(self) -> None:
        verify(self)

    def as_text(self) -> str:
        return print_graph(self)

    def to_json(self) -> str:
        return json.dumps(graph_to_dict(self), sort_keys=True, indent=1)

    @staticmethod
    def from_json(text: str) -> Graph:
        return graph_from_dict(json.loads(text))

    def hash(self) -> str:
        """Content hash of the graph (structure, shapes, params), stable across processes. The
        provenance keys of :data:`PROVENANCE_META` (how the graph was obtained, not what it is) are
        left out: a graph expanded from a few traced blocks hashes as the full trace it equals."""
        d = graph_to_dict(self)
        d["meta"] = {k: v for k, v in d["meta"].items() if k not in PROVENANCE_META}
        return hashlib.sha256(json.dumps(d, sort_keys=True, indent=1).encode()).hexdigest()[:16]


PROVENANCE_META = ("traced_blocks",)  # meta keys that say how a graph was captured (frontends/repeat.py)


def dim_size(expr: sympy.Expr | int, env: Mapping[str, int] | None = None) -> int:
    """Evaluate a (possibly symbolic) dim or count with ``env`` binding symbol names to ints."""
    if isinstance(expr, int):
        return expr
    try:
        return _dim_size_cached(expr, tuple(sorted(env.items())) if env else ())
    except TypeError:  # an unhashable expression: evaluate it directly
        return _dim_size(expr, env)


@functools.lru_cache(maxsize=1 << 16)
def _dim_size_cached(expr: sympy.Expr, env_items: tuple[tuple[str, int], ...]) -> int:
    """:func:`dim_size` memoised: a 96-block model repeats each shape 96 times, and sympy's
    ``subs`` costs ~0.1 ms a call (FACTS.md)."""
    return _dim_size(expr, dict(env_items))


def _dim_size(expr: sympy.Expr | int, env: Mapping[str, int] | None) -> int:
    e = sympy.sympify(expr)
    if env and e.free_symbols:
        e = e.subs({s: env[s.name] for s in e.free_symbols if s.name in env})
    if e.free_symbols:
        raise IRError(f"dimension {e} is still symbolic", f"bind {sorted(str(s) for s in e.free_symbols)}")
    return int(e)


def label_sizes(node: Node, graph: Graph) -> dict[str, sympy.Expr]:
    """Size of each iteration label of ``node`` read off its operand shapes."""
    sizes: dict[str, sympy.Expr] = {}
    for names, labels in ((node.inputs, node.sig.inputs), (node.outputs, node.sig.outputs)):
        for tname, lab in zip(names, labels):
            for c, d in zip(lab, graph.tensors[tname].shape):
                sizes.setdefault(c, d)
    return sizes


# ---- verifier ----------------------------------------------------------------------------
def verify(g: Graph) -> None:
    """Check the graph's invariants; raise :class:`IRError` naming the first offending node."""
    defined: set[str] = {n for n, t in g.tensors.items() if t.role is not Role.ACTIVATION}
    for i in g.inputs:
        if i not in g.tensors:
            raise IRError(f"graph input {i!r} is not a tensor of the graph", "add it to graph.tensors")
    seen_nodes: set[str] = set()
    for n in g.nodes:
        where = f"node {n.name!r} ({n.target or n.prim.value}, module {n.module or '<root>'})"
        if n.name in seen_nodes:
            raise IRError(f"{where}: duplicate node name", "give every node a unique name")
        seen_nodes.add(n.name)
        if not isinstance(n.prim, Prim):
            raise IRError(f"{where}: prim {n.prim!r} is not a Prim", "use a member of partita.ir.Prim")
        if len(n.sig.inputs) != len(n.inputs) or len(n.sig.outputs) != len(n.outputs):
            raise IRError(
                f"{where}: signature {n.sig} has {len(n.sig.inputs)}/{len(n.sig.outputs)} operands "
                f"but the node has {len(n.inputs)} inputs and {len(n.outputs)} outputs",
                "give one label string per tensor operand",
            )
        for tname in n.inputs:
            if tname not in g.tensors:
                raise IRError(f"{where}: input {tname!r} is not a tensor of the graph", "define it")
            if tname not in defined:
                raise IRError(f"{where}: input {tname!r} is used before it is produced", "order nodes topologically")
        sizes: dict[str, sympy.Expr] = {}
        for names, labels in ((n.inputs, n.sig.inputs), (n.outputs, n.sig.outputs)):
            for tname, lab in zip(names, labels):
                t = g.tensors.get(tname)
                if t is None:
                    raise IRError(f"{where}: output {tname!r} is not a tensor of the graph", "define it")
                if len(lab) != t.rank:
                    raise IRError(
                        f"{where}: labels {lab!r} for {tname!r} do not match its rank {t.rank}",
                        "one label per tensor dim",
                    )
                if len(set(lab)) != len(lab):
                    raise IRError(f"{where}: labels {lab!r} repeat a label", "use distinct labels per tensor")
                for c, d in zip(lab, t.shape):
                    # a reshape shares a group's major label between dims of different sizes (prims.reshape)
                    mismatch = c in sizes and n.prim is not Prim.RESHAPE and sympy.simplify(sizes[c] - d) != 0
                    if mismatch and d != 1 and sizes[c] != 1:
                        raise IRError(
                            f"{where}: label {c!r} has size {sizes[c]} and {d} on different operands",
                            "fix the shapes or the signature",
                        )
                    sizes.setdefault(c, d)
        out_labels = set("".join(n.sig.outputs))
        bad = [c for c in n.sig.reduced if c in out_labels]
        if bad:
            raise IRError(f"{where}: reduced labels {bad} appear in an output", "a reduced dim must vanish")
        for o in n.outputs:
            if o in defined:
                raise IRError(f"{where}: output {o!r} is produced twice", "SSA: one producer per tensor")
            defined.add(o)
    for o in g.outputs:
        if o not in defined:
            raise IRError(f"graph output {o!r} is never produced", "produce it or drop it from outputs")
    node_names = set(seen_nodes)
    for layer in g.layers:
        for nn in layer.nodes:
            if nn not in node_names:
                raise IRError(f"layer {layer.name!r} lists unknown node {nn!r}", "rebuild layers after rewriting")


# ---- printer -----------------------------------------------------------------------------
def _shape_str(shape: Sequence[sympy.Expr]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def print_graph(g: Graph) -> str:
    """Deterministic text form: one line per tensor parameter and per node."""
    lines = [f"graph {g.name} (ir v{IR_VERSION})"]
    for s, (lo, hi) in sorted(g.symbols.items()):
        lines.append(f"  symbol {s} in [{lo}, {hi}]")
    for name in g.inputs:
        t = g.tensors[name]
        lines.append(f"  input {name}: {t.dtype}{_shape_str(t.shape)}")
    for t in g.tensors.values():
        if t.role in (Role.PARAMETER, Role.BUFFER):
            alias = f" aliases={','.join(t.aliases)}" if t.aliases else ""
            lines.append(f"  {t.role.value} {t.name}: {t.dtype}{_shape_str(t.shape)} fqn={t.fqn}{alias}")
    layer = None
    for n in g.nodes:
        if n.layer != layer:
            layer = n.layer
            lines.append(f" layer {layer or '-'}:")
        outs = ", ".join(f"{o}: {g.tensors[o].dtype}{_shape_str(g.tensors[o].shape)}" for o in n.outputs)
        attrs = " ".join(f"{k}={_attr_str(v)}" for k, v in sorted(n.attrs.items()))
        lines.append(
            f"  {outs} = {n.prim.value}[{n.sig}]({', '.join(n.inputs)})"
            f"{' ' + attrs if attrs else ''}  # {n.target} @{n.module or '<root>'}"
        )
    lines.append(f"  return {', '.join(g.outputs)}")
    for lay in g.layers:
        lines.append(f"  layer {lay.name} kind={lay.kind} nodes={len(lay.nodes)} params={len(lay.params)}")
    return "\n".join(lines) + "\n"


def _attr_str(v: Any) -> str:
    return json.dumps(_jsonable(v), sort_keys=True)


# ---- JSON --------------------------------------------------------------------------------
def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, bool, int, float)) or v is None:
        return v
    if isinstance(v, sympy.Basic):
        return str(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return repr(v)


_EXPR_FUNCS: dict[str, Any] = {
    "floor": sympy.floor,
    "ceiling": sympy.ceiling,
    "Mod": sympy.Mod,
    "Max": sympy.Max,
    "Min": sympy.Min,
}


@functools.lru_cache(maxsize=None, typed=True)  # immutable results; a deep model repeats its shapes
def _expr(s: str | int) -> sympy.Expr:
    # Every other identifier is a plain Symbol: bare sympify reads "S" as sympy.S, "E" as e, "I" as i.
    if isinstance(s, int):
        return sympy.Integer(s)
    names = set(re.findall(r"[A-Za-z_]\w*", s)) - set(_EXPR_FUNCS)
    return sympy.sympify(s, locals={**{n: sympy.Symbol(n) for n in names}, **_EXPR_FUNCS})


def graph_to_dict(g: Graph) -> dict[str, Any]:
    memo: dict[tuple[type, Any], str] = {}  # sympy's printer is slow; a deep model repeats its shapes

    def text(x: Any) -> str:
        key = (type(x), x)  # 2 == 2.0 == Integer(2) print differently
        got = memo.get(key)
        if got is None:
            got = memo[key] = str(x)
        return got

    return {
        "ir_version": IR_VERSION,
        "name": g.name,
        "symbols": {k: list(v) for k, v in g.symbols.items()},
        "inputs": list(g.inputs),
        "outputs": list(g.outputs),
        "meta": _jsonable(g.meta),
        "tensors": [
            {
                "name": t.name,
                "shape": [text(d) for d in t.shape],
                "dtype": t.dtype,
                "role": t.role.value,
                "fqn": t.fqn,
                "aliases": list(t.aliases),
            }
            for t in g.tensors.values()
        ],
        "nodes": [
            {
                "name": n.name,
                "prim": n.prim.value,
                "inputs": list(n.inputs),
                "outputs": list(n.outputs),
                "sig": {
                    "inputs": list(n.sig.inputs),
                    "outputs": list(n.sig.outputs),
                    "reduced": n.sig.reduced,
                    "fixed": n.sig.fixed,
                },
                "target": n.target,
                "attrs": _jsonable(n.attrs),
                "module": n.module,
                "source": n.source,
                "layer": n.layer,
                "flops": text(n.flops),
                "bytes_moved": text(n.bytes_moved),
            }
            for n in g.nodes
        ],
        "layers": [dataclasses.asdict(lay) for lay in g.layers],
    }


def graph_from_dict(d: Mapping[str, Any]) -> Graph:
    if d.get("ir_version") != IR_VERSION:
        raise IRError(f"IR version {d.get('ir_version')!r} is not supported", f"re-trace with IR v{IR_VERSION}")
    tensors = {
        t["name"]: Tensor(
            t["name"],
            tuple(_expr(s) for s in t["shape"]),
            t["dtype"],
            Role(t["role"]),
            t.get("fqn", ""),
            tuple(t.get("aliases", ())),
        )
        for t in d["tensors"]
    }
    nodes = [
        Node(
            n["name"],
            Prim(n["prim"]),
            tuple(n["inputs"]),
            tuple(n["outputs"]),
            DimSig(tuple(n["sig"]["inputs"]), tuple(n["sig"]["outputs"]), n["sig"]["reduced"], n["sig"]["fixed"]),
            n.get("target", ""),
            dict(n.get("attrs", {})),
            n.get("module", ""),
            n.get("source", ""),
            n.get("layer", ""),
            _expr(n.get("flops", 0)),
            _expr(n.get("bytes_moved", 0)),
        )
        for n in d["nodes"]
    ]
    layers = [
        Layer(x["name"], tuple(x["nodes"]), x["kind"], tuple(x["inputs"]), tuple(x["outputs"]), tuple(x["params"]))
        for x in d.get("layers", [])
    ]
    return Graph(
        d["name"],
        tensors,
        nodes,
        list(d["inputs"]),
        list(d["outputs"]),
        {k: (int(v[0]), int(v[1])) for k, v in d.get("symbols", {}).items()},
        layers,
        dict(d.get("meta", {})),
    )


# ---- builder -----------------------------------------------------------------------------
class GraphBuilder:
    """Incremental construction used by the tracers and by tests."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tensors: dict[str, Tensor] = {}
        self.nodes: list[Node] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.symbols: dict[str, tuple[int, int]] = {}
        self._count = 0

    def fresh(self, prefix: str = "t") -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def tensor(
        self,
        name: str,
        shape: Sequence[sympy.Expr | int],
        dtype: str,
        role: Role = Role.ACTIVATION,
        fqn: str = "",
        aliases: Sequence[str] = (),
    ) -> str:
        if dtype not in DTYPE_BYTES:
            raise IRError(f"tensor {name!r} has unknown dtype {dtype!r}", f"use one of {sorted(DTYPE_BYTES)}")
        self.tensors[name] = Tensor(name, tuple(sympy.sympify(d) for d in shape), dtype, role, fqn, tuple(aliases))
        if role is Role.INPUT:
            self.inputs.append(name)
        return name

    def add(
        self,
        prim: Prim,
        inputs: Sequence[str],
        outputs: Sequence[tuple[str, Sequence[Any], str]],
        sig: DimSig | str,
        *,
        target: str = "",
        attrs: Mapping[str, Any] | None = None,
        module: str = "",
        source: str = "",
        name: str | None = None,
    ) -> list[str]:
        """Add a node; ``outputs`` are ``(name, shape, dtype)`` triples of new activations."""
        if isinstance(sig, str):
            sig = DimSig.parse(sig)
        outs = [self.tensor(o, shp, dt) for o, shp, dt in outputs]
        self.nodes.append(
            Node(
                name or self.fresh("n"),
                prim,
                tuple(inputs),
                tuple(outs),
                sig,
                target,
                dict(attrs or {}),
                module,
                source,
            )
        )
        return outs

    def build(self, meta: Mapping[str, Any] | None = None) -> Graph:
        return Graph(
            self.name,
            dict(self.tensors),
            list(self.nodes),
            list(self.inputs),
            list(self.outputs),
            dict(self.symbols),
            [],
            dict(meta or {}),
        )
