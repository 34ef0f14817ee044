"""JAX front end: capture ``fn(params, *batch) -> loss`` as a Partita :class:`~partita.ir.Graph`.

First stage of the flow for JAX models (the PyTorch twin is ``trace_torch.py``). ``jax.make_jaxpr``
runs on abstract values (``jax.ShapeDtypeStruct``), so no weight is allocated; the jaxpr is then
interpreted equation by equation into IR nodes. Call-like primitives (``jit``, ``custom_jvp_call``,
``custom_vjp_call``, ``remat``, ``closed_call``) are inlined. Every node's :class:`~partita.ir.DimSig`
comes from :mod:`partita.prims`, so the same model traced from torch gets the same labelling rules.

Provenance: ``node.module`` is the equation's name stack (flax pushes one scope per module call),
with transform wrappers (``jvp(...)``) and the flax root class name removed and ``/`` turned into
``.``: ``GPT/blocks_0/attn/qkv`` becomes ``blocks_0.attn.qkv``.

Symbolic dims: with ``symbolic={"B": 8, "S": 32}`` every batch-leaf dim equal to one of the values
becomes a JAX symbolic dimension (``jax.export.symbolic_shape``) and the trace is redone
shape-polymorphically; JAX itself propagates the symbols (sound: it refuses to trace when a shape
fact cannot be proved). If that trace fails the graph is traced with concrete shapes and
``graph.meta["static_shapes"]`` is True.

The per-primitive rules are the ``RULES`` table at the end of this module.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import sympy

from partita import prims
from partita.errors import ModelError
from partita.frontends import jax_shim
from partita.ir import DTYPE_BYTES, DimSig, Graph, GraphBuilder, Node, Prim, Role

# Primitives whose body is inlined: (primitive name, param holding the body).
_CALLS: dict[str, tuple[str, ...]] = {
    "jit": ("jaxpr",),
    "pjit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "call_jaxpr"),
    "remat": ("jaxpr",),
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
}
# Identity-like primitives: outputs alias inputs, no node.
_ALIASES = {"optimization_barrier", "sharding_constraint", "mesh_cast", "reshard", "pvary", "copy", "copy_p"}

_DTYPES: dict[str, str] = {
    "float64": "f64",
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint64": "i64",
    "uint32": "i32",
    "uint16": "i16",
    "uint8": "u8",
    "bool": "bool",
    "complex64": "c64",
}


def ir_dtype(dtype: Any) -> str:
    """IR dtype name of a numpy / JAX dtype (unknown ones are mapped by item size)."""
    name = str(np.dtype(dtype)) if not hasattr(dtype, "name") else str(dtype.name)
    if name in _DTYPES:
        return _DTYPES[name]
    if name.startswith("float8"):
        return "f8"
    size = getattr(dtype, "itemsize", 4)
    return {1: "u8", 2: "i16", 4: "i32", 8: "i64"}.get(size, "i32")


class _Dims:
    """Converts JAX dims (ints or symbolic ``_DimExpr``) to sympy, with plain ``Symbol`` names."""

    _FUNCS: Mapping[str, Any] = {
        "floordiv": lambda a, b: sympy.floor(a / b),
        "mod": sympy.Mod,
        "max": sympy.Max,
        "min": sympy.Min,
        "non_negative": lambda a: sympy.Max(a, 0),
    }

    def __init__(self, names: Sequence[str]) -> None:
        self.locals = {**{n: sympy.Symbol(n) for n in names}, **self._FUNCS}
        self.cache: dict[str, sympy.Expr] = {}

    def __call__(self, d: Any) -> sympy.Expr:
        if isinstance(d, (int, np.integer)):
            return sympy.Integer(int(d))
        key = str(d)
        if key not in self.cache:
            try:
                self.cache[key] = sympy.sympify(key, locals=dict(self.locals))
            except (sympy.SympifyError, TypeError, SyntaxError) as err:
                raise ModelError(
                    f"symbolic JAX dim {key!r} has no sympy form", "trace without symbolic= (static shapes)"
                ) from err
        return self.cache[key]

    def shape(self, shape: Sequence[Any]) -> tuple[sympy.Expr, ...]:
        return tuple(self(d) for d in shape)


def _key_str(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k).strip(".[]'\"")


def _leaves(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(".".join(_key_str(k) for k in path), leaf) for path, leaf in flat], treedef


def _stack_parts(name_stack: Any) -> tuple[str, ...]:
    parts = []
    for p in str(name_stack).split("/"):
        while m := re.fullmatch(r"[A-Za-z_][\w.]*\((.*)\)", p):  # jvp(GPT), transpose(jvp(GPT))
            p = m.group(1)
        if re.fullmatch(r"[\w.\-]+", p):  # module names; drops scopes like jnp.einsum's "bsnd,btnd->bnst"
            parts.append(p)
    return tuple(parts)


@dataclasses.dataclass(frozen=True)
class Literal:
    """A scalar constant operand (JAX literal or rank-0 const): not a tensor of the graph."""

    value: Any
    dtype: str


Value = str | Literal  # what a JAX variable is bound to while interpreting


class _Interpreter:
    """Walks a jaxpr, binding each JAX variable to an IR tensor name (or a :class:`Literal`)."""

    def __init__(self, builder: GraphBuilder, dims: _Dims) -> None:
        self.b = builder
        self.dims = dims
        self.stacks: dict[str, tuple[str, ...]] = {}  # node name -> raw name stack
        self.opaque: set[str] = set()

    def constant(self, value: Any, stack: tuple[str, ...]) -> Value:
        arr = np.asarray(value) if not hasattr(value, "shape") else value
        dtype = ir_dtype(arr.dtype)
        if len(arr.shape) == 0:
            return Literal(arr.item() if hasattr(arr, "item") else value, dtype)
        out = (self.dims.shape(arr.shape), dtype)
        return Ctx(self, "constant", {}, [], [out], stack, "").emit(Prim.CONSTANT, [], [out])[0]

    def read(self, env: dict[Any, Value], v: Any) -> Value:
        if isinstance(v, jax.extend.core.Literal):
            return Literal(v.val.item() if hasattr(v.val, "item") else v.val, ir_dtype(v.aval.dtype))
        return env[v]

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Value], stack: tuple[str, ...]) -> list[Value]:
        env: dict[Any, Value] = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.constant(c, stack)
        for var, a in zip(jaxpr.invars, args):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [self.read(env, v) for v in eqn.invars]
            name = eqn.primitive.name
            where = stack + _stack_parts(eqn.source_info.name_stack)
            if name in _CALLS:
                body = next((eqn.params[k] for k in _CALLS[name] if k in eqn.params), None)
                if body is not None:
                    inner, inner_consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())
                    outs = self.run(inner, inner_consts, ins, where)
                    for var, val in zip(eqn.outvars, outs):
                        env[var] = val
                    continue
            if name in _ALIASES and len(eqn.invars) == len(eqn.outvars):
                for var, val in zip(eqn.outvars, ins):
                    env[var] = val
                continue
            out_avals = [(self.dims.shape(v.aval.shape), ir_dtype(v.aval.dtype)) for v in eqn.outvars]
            ctx = Ctx(self, name, dict(eqn.params), ins, out_avals, where, jax_shim.user_source(eqn.source_info))
            rule = RULES.get(name)
            if rule is None:
                self.opaque.add(name)
                warnings.warn(
                    f"trace_jax: no rule for JAX primitive {name!r} (module {'/'.join(where) or '<root>'}, "
                    f"{ctx.source or 'unknown source'}); kept as an OPAQUE node (replicated, priced by bytes)",
                    stacklevel=4,
                )
                rule = opaque_rule
            outs = rule(ctx)
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [self.read(env, v) for v in jaxpr.outvars]


def _batch_names(fn: Callable[..., Any], num: int) -> list[str]:
    try:
        ps = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        ps = []
    names = ps[1 : 1 + num]
    return names + [f"input{i}" for i in range(len(names), num)]


def _symbolize(batch: Sequence[Any], symbolic: Mapping[str, int]) -> list[Any]:
    """Batch pytrees with every dim equal to a symbol's value replaced by that JAX symbol."""
    by_value: dict[int, list[str]] = {}
    for n, v in symbolic.items():
        by_value.setdefault(int(v), []).append(n)
    syms = dict(zip(symbolic, jax.export.symbolic_shape(", ".join(symbolic))))

    def one(leaf: Any) -> Any:
        shape = []
        for i, d in enumerate(leaf.shape):
            cands = by_value.get(int(d), [])
            if len(cands) > 1:
                pick = [c for c in cands if (c == "B") == (i == 0)]
                if len(pick) != 1:
                    raise ModelError(
                        f"input dim {i} of size {d} matches several symbols {cands}",
                        "give the symbols distinct example values",
                    )
                cands = pick
            shape.append(syms[cands[0]] if cands else d)
        return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)

    return [jax.tree_util.tree_map(one, x) for x in batch]


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), tree)


def trace_jax(
    fn: Callable[..., Any],
    params: Any,
    *batch: Any,
    name: str,
    symbolic: dict[str, int] | None = None,
) -> Graph:
    """Trace ``fn(params, *batch) -> scalar loss`` into an IR graph without allocating arrays.

    ``params`` is a pytree of arrays or ``jax.ShapeDtypeStruct``; each leaf becomes a PARAMETER tensor
    whose fqn is its pytree path joined with ``"."``. ``batch`` leaves become INPUT tensors named after
    ``fn``'s argument names. ``symbolic`` maps symbol names to the example sizes used in ``batch``.
    """
    aparams, abatch = _abstract(params), [_abstract(x) for x in batch]
    static = True
    closed = None
    if symbolic:
        try:
            sbatch = _symbolize(abatch, symbolic)
            closed = jax.make_jaxpr(fn)(aparams, *sbatch)
            static = False
        except ModelError:
            raise
        except Exception as err:  # noqa: BLE001 - any shape-polymorphism failure falls back to static
            warnings.warn(
                f"trace_jax({name}): symbolic trace failed ({type(err).__name__}: {str(err)[:200]}); "
                "using static shapes",
                stacklevel=2,
            )
    if closed is None:
        closed = jax.make_jaxpr(fn)(aparams, *abatch)
    dims = _Dims(list(symbolic or {}) if not static else [])
    try:
        return _build(closed, aparams, abatch, fn, name, dims, symbolic or {}, static)
    except ModelError:
        if static:
            raise
        closed = jax.make_jaxpr(fn)(aparams, *abatch)
        return _build(closed, aparams, abatch, fn, name, _Dims([]), symbolic or {}, True)


def _build(
    closed: Any,
    aparams: Any,
    abatch: Sequence[Any],
    fn: Callable[..., Any],
    name: str,
    dims: _Dims,
    symbolic: Mapping[str, int],
    static: bool,
) -> Graph:
    b = GraphBuilder(name)
    interp = _Interpreter(b, dims)
    args: list[Value] = []
    param_leaves, _ = _leaves(aparams)
    jaxpr = closed.jaxpr
    invars = list(jaxpr.invars)
    for (fqn, _leaf), var in zip(param_leaves, invars):
        tname = fqn or "param"
        b.tensor(tname, dims.shape(var.aval.shape), ir_dtype(var.aval.dtype), Role.PARAMETER, fqn=fqn)
        args.append(tname)
    rest = invars[len(param_leaves) :]
    for arg_name, x in zip(_batch_names(fn, len(abatch)), abatch):
        for path, _leaf in _leaves(x)[0]:
            var = rest.pop(0)
            tname = f"{arg_name}.{path}" if path else arg_name
            while tname in b.tensors:
                tname += "_"
            b.tensor(tname, dims.shape(var.aval.shape), ir_dtype(var.aval.dtype), Role.INPUT)
            args.append(tname)
    outs = interp.run(jaxpr, closed.consts, args, ())
    for o in outs:
        if isinstance(o, Literal):  # a constant output still needs a producer
            o = Ctx(interp, "constant", {}, [], [((), o.dtype)], (), "").emit(Prim.CONSTANT, [], [((), o.dtype)])[0]
        b.outputs.append(o)
    b.nodes = _dead_code_eliminated(b.nodes, set(b.outputs))
    root = _common_root(interp.stacks[n.name] for n in b.nodes)
    b.nodes = [_with_module(n, interp.stacks.get(n.name, ()), root) for n in b.nodes]
    if not static:
        b.symbols = {s: (1, 2**31 - 1) for s in symbolic}
    meta: dict[str, Any] = {
        "framework": "jax",
        "jax_version": jax.__version__,
        "static_shapes": static,
        "symbol_values": {k: int(v) for k, v in symbolic.items()},
        "module_root": root,
        "opaque_primitives": sorted(interp.opaque),
    }
    graph = b.build(meta)
    assert all(t.dtype in DTYPE_BYTES for t in graph.tensors.values())
    return graph


def _dead_code_eliminated(nodes: list[Node], live: set[str]) -> list[Node]:
    """Drop nodes none of whose outputs is used (the index reshapes an embedding bypasses...)."""
    kept: list[Node] = []
    for n in reversed(nodes):
        if any(o in live for o in n.outputs):
            kept.append(n)
            live.update(n.inputs)
    return kept[::-1]


def _common_root(stacks: Any) -> str:
    """The flax root module's class name when every named node sits under it (else "")."""
    firsts = {s[0] for s in stacks if s}
    if len(firsts) == 1:
        (root,) = firsts
        if root[:1].isupper():
            return root
    return ""


def _with_module(node: Node, stack: tuple[str, ...], root: str) -> Node:
    parts = stack[1:] if root and stack[:1] == (root,) else stack
    return dataclasses.replace(node, module=".".join(parts))


# ---- per-primitive rules -------------------------------------------------------------------
OutSpec = tuple[tuple[sympy.Expr, ...], str]


@dataclasses.dataclass
class Ctx:
    """One equation being lowered: its operands, output avals and provenance."""

    interp: _Interpreter
    prim: str
    params: dict[str, Any]
    ins: list[Value]
    outs: list[OutSpec]
    stack: tuple[str, ...]
    source: str

    @property
    def tensors(self) -> list[str]:
        """The tensor operands (literals dropped), in operand order."""
        return [v for v in self.ins if isinstance(v, str)]

    def shape(self, tensor: str) -> tuple[sympy.Expr, ...]:
        return self.interp.b.tensors[tensor].shape

    def emit(
        self,
        prim: Prim,
        inputs: Sequence[str],
        outs: Sequence[OutSpec],
        sig: DimSig | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """Add one node; ``sig=None`` means the all-fixed ``prims.opaque`` signature."""
        b = self.interp.b
        if sig is None:
            sig = prims.opaque([len(self.shape(t)) for t in inputs], [len(s) for s, _ in outs])
        names = [(b.fresh("t"), shp, dt) for shp, dt in outs]
        node = b.fresh("n")
        b.add(
            prim,
            list(inputs),
            names,
            sig,
            target=self.prim,
            attrs={**_attrs(self), **(attrs or {})},
            source=self.source,
            name=node,
        )
        self.interp.stacks[node] = self.stack
        return [n for n, _, _ in names]


def _attrs(ctx: Ctx) -> dict[str, Any]:
    """JSON-friendly scalar params of the equation (axes, dimension, y...) and literal operands."""
    out: dict[str, Any] = {}
    for k, v in ctx.params.items():
        if isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, tuple) and all(isinstance(x, (bool, int, float, str)) for x in v):
            out[k] = list(v)
    lits = {str(i): v.value for i, v in enumerate(ctx.ins) if isinstance(v, Literal)}
    if lits:
        out["literals"] = {k: (v if isinstance(v, (bool, int, float)) else str(v)) for k, v in lits.items()}
    return out


Rule = Callable[[Ctx], list[Value]]


def _eq(a: sympy.Expr, b: sympy.Expr) -> bool:
    return bool(sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0)


def _numel(shape: Sequence[sympy.Expr]) -> sympy.Expr:
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def opaque_rule(ctx: Ctx) -> list[Value]:
    return list(ctx.emit(Prim.OPAQUE, ctx.tensors, ctx.outs))


def _constant(ctx: Ctx) -> list[Value]:
    return list(ctx.emit(Prim.CONSTANT, [], ctx.outs))


def _elementwise(ctx: Ctx) -> list[Value]:
    ins = ctx.tensors
    if not ins:
        return _constant(ctx)
    out_shape = ctx.outs[0][0]
    return list(ctx.emit(Prim.ELEMENTWISE, ins, ctx.outs, prims.elementwise(out_shape, [ctx.shape(t) for t in ins])))


def _reshape_to(ctx: Ctx, x: str, shape: tuple[sympy.Expr, ...], dtype: str) -> str:
    return ctx.emit(Prim.RESHAPE, [x], [(shape, dtype)], prims.reshape(ctx.shape(x), shape))[0]


def _reshape(ctx: Ctx) -> list[Value]:
    if not ctx.tensors:
        return _constant(ctx)
    if ctx.params.get("dimensions") is not None:  # reshape of a transpose: keep it honest
        return opaque_rule(ctx)
    return [_reshape_to(ctx, ctx.tensors[0], *ctx.outs[0])]


def _broadcast_in_dim(ctx: Ctx) -> list[Value]:
    if not ctx.tensors:
        return _constant(ctx)
    x = ctx.tensors[0]
    in_shape, (out_shape, dtype) = ctx.shape(x), ctx.outs[0]
    if _eq(_numel(in_shape), _numel(out_shape)):  # only adds size-1 dims: a reshape
        return [_reshape_to(ctx, x, out_shape, dtype)]
    bdims = tuple(ctx.params["broadcast_dimensions"])
    off = len(out_shape) - len(in_shape)
    if bdims != tuple(range(off, len(out_shape))):  # not numpy-aligned: unsqueeze, then expand
        mid = [sympy.Integer(1)] * len(out_shape)
        for i, d in enumerate(bdims):
            mid[d] = in_shape[i]
        x, in_shape = _reshape_to(ctx, x, tuple(mid), dtype), tuple(mid)
    return list(ctx.emit(Prim.EXPAND, [x], ctx.outs, prims.expand(in_shape, out_shape)))


def _squeeze(ctx: Ctx) -> list[Value]:
    return [_reshape_to(ctx, ctx.tensors[0], *ctx.outs[0])]


def _transpose(ctx: Ctx) -> list[Value]:
    perm = tuple(ctx.params["permutation"])
    return list(ctx.emit(Prim.PERMUTE, ctx.tensors, ctx.outs, prims.permute(len(perm), perm)))


def _dot_general(ctx: Ctx) -> list[Value]:
    if len(ctx.tensors) != 2:
        return opaque_rule(ctx)
    a, b = ctx.tensors
    ra, rb = len(ctx.shape(a)), len(ctx.shape(b))
    (lc, rc), (lb, rbatch) = ctx.params["dimension_numbers"]
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    la = [next(letters) for _ in range(ra)]  # lhs dims in order; rhs shares batch + contracting labels
    shared = {j: la[i] for i, j in (*zip(lb, rbatch), *zip(lc, rc))}
    lr = [shared[j] if j in shared else next(letters) for j in range(rb)]
    free_a = [la[i] for i in range(ra) if i not in lb and i not in lc]
    free_b = [lr[j] for j in range(rb) if j not in rbatch and j not in rc]
    out = "".join([la[i] for i in lb] + free_a + free_b)
    eq = f"{''.join(la)},{''.join(lr)}->{out}"
    return list(ctx.emit(Prim.MATMUL, [a, b], ctx.outs, prims.einsum(eq), {"equation": eq}))


def _reduce(ctx: Ctx) -> list[Value]:
    x = ctx.tensors[0]
    axes = tuple(ctx.params["axes"])
    return list(ctx.emit(Prim.REDUCE, [x], ctx.outs, prims.reduce(len(ctx.shape(x)), axes)))


def _slice_chain(ctx: Ctx, x: str, extra: Sequence[str], new_shape: Sequence[sympy.Expr], dtype: str) -> str:
    """One SLICE node per dim whose size changes (``prims.along`` describes one dim)."""
    shape = list(ctx.shape(x))
    changed = [d for d in range(len(shape)) if not _eq(shape[d], new_shape[d])] or [0]
    for d in changed:
        shape[d] = new_shape[d]
        ranks = [len(shape)] + [len(ctx.shape(t)) for t in extra]
        sig = prims.along(ranks, [len(shape)], d)
        x = ctx.emit(Prim.SLICE, [x, *extra], [(tuple(shape), dtype)], sig, {"dim": d})[0]
    return x


def _slice(ctx: Ctx) -> list[Value]:
    x = ctx.tensors[0]
    strided = any(s not in (None, 1) for s in (ctx.params.get("strides") or ()))
    if strided:
        return opaque_rule(ctx)
    shp, dt = ctx.outs[0]
    return [_slice_chain(ctx, x, [], shp, dt)]


def _dynamic_slice(ctx: Ctx) -> list[Value]:
    x, *idx = ctx.tensors
    if x != ctx.ins[0]:
        return opaque_rule(ctx)
    shp, dt = ctx.outs[0]
    return [_slice_chain(ctx, x, idx, shp, dt)]


def _dynamic_update_slice(ctx: Ctx) -> list[Value]:
    if len(ctx.ins) < 2 or not all(isinstance(v, str) for v in ctx.ins[:2]):
        return opaque_rule(ctx)
    op, upd, *idx = ctx.tensors
    s_op, s_upd = ctx.shape(op), ctx.shape(upd)
    diff = [d for d in range(len(s_op)) if not _eq(s_op[d], s_upd[d])]
    if len(diff) > 1:
        return list(ctx.emit(Prim.SCATTER, ctx.tensors, ctx.outs))
    ranks = [len(s_op), len(s_upd)] + [len(ctx.shape(t)) for t in idx]
    sig = prims.along(ranks, [len(s_op)], diff[0] if diff else 0)
    return list(ctx.emit(Prim.SCATTER, ctx.tensors, ctx.outs, sig))


def _concatenate(ctx: Ctx) -> list[Value]:
    ins = ctx.tensors
    rank = len(ctx.outs[0][0])
    sig = prims.along([rank] * len(ins), [rank], int(ctx.params["dimension"]))
    return list(ctx.emit(Prim.CAT, ins, ctx.outs, sig))


def _split(ctx: Ctx) -> list[Value]:
    rank = len(ctx.outs[0][0])
    sig = prims.along([rank], [rank] * len(ctx.outs), int(ctx.params["axis"]))
    return list(ctx.emit(Prim.SPLIT, ctx.tensors, ctx.outs, sig))


def _index_vector(ctx: Ctx, idx: str) -> str | None:
    """Indices ``[..., 1]`` as ``[...]``: reuse the reshape that added the 1 when there is one."""
    shape = ctx.shape(idx)
    if not shape or not _eq(shape[-1], 1):
        return None
    b = ctx.interp.b
    prod = next((n for n in reversed(b.nodes) if idx in n.outputs), None)
    if prod is not None and prod.prim is Prim.RESHAPE and b.tensors[prod.inputs[0]].shape == shape[:-1]:
        return prod.inputs[0]
    return _reshape_to(ctx, idx, shape[:-1], b.tensors[idx].dtype)


def _gather(ctx: Ctx) -> list[Value]:
    if len(ctx.tensors) != 2 or not all(isinstance(v, str) for v in ctx.ins[:2]):
        return opaque_rule(ctx)
    op, idx = ctx.tensors
    dn = ctx.params["dimension_numbers"]
    op_shape, out_shape = ctx.shape(op), ctx.outs[0][0]
    r = len(op_shape)
    sizes = tuple(ctx.params["slice_sizes"])
    batching = tuple(dn.operand_batching_dims)
    is_param = ctx.interp.b.tensors[op].role is Role.PARAMETER
    # weight[v, h] looked up by integer ids: an embedding.
    if (
        is_param
        and r == 2
        and tuple(dn.offset_dims) == (len(out_shape) - 1,)
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and not batching
        and _eq(sizes[1], op_shape[1])
    ):
        ids = _index_vector(ctx, idx)
        if ids is not None:
            sig = prims.embedding(len(ctx.shape(ids)))
            return list(ctx.emit(Prim.EMBEDDING, [op, ids], ctx.outs, sig))
    # take_along_axis(x, idx, d): every dim but d is a batching dim.
    if len(dn.start_index_map) == 1 and tuple(dn.collapsed_slice_dims) == tuple(dn.start_index_map):
        d = dn.start_index_map[0]
        others = tuple(i for i in range(r) if i != d)
        if batching == others and tuple(dn.start_indices_batching_dims) == others and not dn.offset_dims:
            ids = _index_vector(ctx, idx)
            if ids is not None and len(ctx.shape(ids)) == r == len(out_shape):
                return list(ctx.emit(Prim.GATHER, [op, ids], ctx.outs, prims.along([r, r], [r], d)))
    return list(ctx.emit(Prim.GATHER, ctx.tensors, ctx.outs, attrs={"conservative": True}))


def _scatter(ctx: Ctx) -> list[Value]:
    return list(ctx.emit(Prim.SCATTER, ctx.tensors, ctx.outs, attrs={"conservative": True}))


def _sort(ctx: Ctx) -> list[Value]:
    ins = ctx.tensors
    rank = len(ctx.shape(ins[0]))
    dim = int(ctx.params.get("dimension", ctx.params.get("axis", -1)))
    sig = prims.topk(rank, dim, len(ctx.outs))
    sig = dataclasses.replace(sig, inputs=sig.inputs * len(ins))
    return list(ctx.emit(Prim.TOPK, ins, ctx.outs, sig))


def _permute_to(ctx: Ctx, x: str, perm: Sequence[int]) -> str:
    if tuple(perm) == tuple(range(len(perm))):
        return x
    shape = ctx.shape(x)
    new = tuple(shape[p] for p in perm)
    return ctx.emit(Prim.PERMUTE, [x], [(new, ctx.interp.b.tensors[x].dtype)], prims.permute(len(perm), perm))[0]


def _conv(ctx: Ctx) -> list[Value]:
    """Lowered to NC... / OI... layout (``prims.conv``) with permutes around it."""
    if (
        len(ctx.tensors) != 2
        or ctx.params.get("feature_group_count", 1) != 1
        or ctx.params.get("batch_group_count", 1) != 1
    ):
        return list(ctx.emit(Prim.CONV, ctx.tensors, ctx.outs, attrs={"conservative": True}))
    lhs_spec, rhs_spec, out_spec = ctx.params["dimension_numbers"]
    x, w = _permute_to(ctx, ctx.tensors[0], lhs_spec), _permute_to(ctx, ctx.tensors[1], rhs_spec)
    out_shape, dtype = ctx.outs[0]
    canon = tuple(out_shape[d] for d in out_spec)
    y = ctx.emit(Prim.CONV, [x, w], [(canon, dtype)], prims.conv(len(canon), False))[0]
    back = [0] * len(out_spec)
    for i, d in enumerate(out_spec):
        back[d] = i
    return [_permute_to(ctx, y, back)]


def _attention(ctx: Ctx) -> list[Value]:
    """Fused SDPA in JAX layout [B, T, N, H]: permuted to [B, N, T, H] for ``prims.attention``."""
    ins = ctx.tensors
    if len(ins) < 3 or any(len(ctx.shape(t)) != 4 for t in ins[:3]):
        return opaque_rule(ctx)
    q, k, v = (_permute_to(ctx, t, (0, 2, 1, 3)) for t in ins[:3])
    out_shape, dtype = ctx.outs[0]
    canon = tuple(out_shape[p] for p in (0, 2, 1, 3))
    sig = prims.attention(ctx.shape(q), ctx.shape(k), ctx.shape(v))
    y = ctx.emit(Prim.ATTENTION, [q, k, v], [(canon, dtype)], sig)[0]
    extra = ctx.emit(Prim.OPAQUE, [], ctx.outs[1:]) if len(ctx.outs) > 1 else []  # e.g. logsumexp residuals
    return [_permute_to(ctx, y, (0, 2, 1, 3)), *extra]


_ELEMENTWISE = (
    "add add_any sub mul div rem pow max min neg sign floor ceil round nextafter abs exp exp2 log log1p expm1 "
    "tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt cbrt square "
    "integer_pow erf erfc erf_inv lgamma digamma convert_element_type bitcast_convert_type reduce_precision "
    "select_n clamp eq ne lt le gt ge and or not xor shift_left shift_right_logical shift_right_arithmetic "
    "population_count is_finite stop_gradient real imag conj complex"
).split()

RULES: dict[str, Rule] = {
    **{p: _elementwise for p in _ELEMENTWISE},
    "dot_general": _dot_general,
    **{p: _reduce for p in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or")},
    "argmax": _reduce,
    "argmin": _reduce,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "expand_dims": _squeeze,
    "transpose": _transpose,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "concatenate": _concatenate,
    "split": _split,
    "gather": _gather,
    **{p: _scatter for p in ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min", "scatter-max")},
    "iota": _constant,
    "dim_as_value": _constant,
    "full": _constant,
    "constant": _constant,
    "sort": _sort,
    "top_k": _sort,
    "conv_general_dilated": _conv,
    "dot_product_attention": _attention,
    "dot_product_attention_fwd": _attention,
}
