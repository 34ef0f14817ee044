"""Rule table of the PyTorch tracer: ATen op name -> (Prim, DimSig) for one FX node.

Used only by :mod:`partita.frontends.trace_torch`. Each rule reads a :class:`Call` (tensor operand
names and shapes, output shapes, non-tensor arguments as json-able ``attrs``) and returns
``(prim, sig)`` or ``(prim, sig, inputs)`` when the IR operands differ from the ATen ones (factories
drop the ``*_like`` template). A rule returns ``None`` when it cannot describe the call; the tracer
then emits ``Prim.OPAQUE`` and warns. Signatures come from :mod:`partita.prims` wherever one fits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from partita import prims
from partita.frontends import torch_shim
from partita.ir import DimSig, Prim

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = "f8"


def torch_dtype(dt: torch.dtype) -> str:
    return _DTYPES.get(dt, "f32")


Shape = tuple[sympy.Expr, ...]
Result = tuple[Prim, DimSig] | tuple[Prim, DimSig, Sequence[str]] | None


@dataclasses.dataclass
class Call:
    """One FX call lowered to IR terms."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[str]
    in_shapes: list[Shape]
    out_shapes: list[Shape]
    out_dtypes: list[str]
    is_tuple: bool
    attrs: dict[str, Any]

    @staticmethod
    def from_node(n: torch.fx.Node, op: str, low: Any) -> Call:
        inputs: list[str] = []
        in_shapes: list[Shape] = []

        def visit(a: Any) -> None:
            if isinstance(a, torch.fx.Node):
                if isinstance(a.meta.get("val"), torch.Tensor) and (a.name in low.env):
                    inputs.append(low.env[a.name])
                    in_shapes.append(low.shape(a.meta["val"]))
            elif isinstance(a, (list, tuple)):
                for x in a:
                    visit(x)

        for a in (*n.args, *n.kwargs.values()):
            visit(a)
        val = n.meta["val"]
        is_tuple = isinstance(val, (tuple, list))
        outs = [v for v in (val if is_tuple else [val]) if isinstance(v, torch.Tensor)]
        names = torch_shim.schema_arg_names(n.target)
        attrs: dict[str, Any] = {}
        for i, a in enumerate(n.args):
            if not _has_tensor(a):
                attrs[names[i] if i < len(names) else f"arg{i}"] = _jsonable(a, low)
        for k, a in n.kwargs.items():
            if not _has_tensor(a) and k not in ("device", "pin_memory", "layout"):
                attrs[k] = _jsonable(a, low)
        args = tuple(_plain(a, low) for a in n.args)
        kwargs = {k: _plain(a, low) for k, a in n.kwargs.items()}
        return Call(
            op,
            args,
            kwargs,
            inputs,
            in_shapes,
            [low.shape(v) for v in outs],
            [torch_dtype(v.dtype) for v in outs],
            is_tuple,
            attrs,
        )

    def arg(self, i: int, key: str, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(key, default)


TENSOR = "<tensor>"


def _has_tensor(a: Any) -> bool:
    if isinstance(a, torch.fx.Node):
        return isinstance(a.meta.get("val"), torch.Tensor)
    if isinstance(a, (list, tuple)):
        return any(_has_tensor(x) for x in a)
    return False


def _plain(a: Any, low: Any) -> Any:
    """FX argument with SymInt nodes replaced by sympy expressions (tensor nodes become ``TENSOR``)."""
    if isinstance(a, torch.fx.Node):
        v = a.meta.get("val")
        return TENSOR if isinstance(v, torch.Tensor) else low.expr(v) if v is not None else None
    if isinstance(a, (list, tuple)):
        return [_plain(x, low) for x in a]
    if isinstance(a, torch.SymInt):
        return low.expr(a)
    return a


def _jsonable(a: Any, low: Any) -> Any:
    a = _plain(a, low)
    if isinstance(a, list):
        return [_jsonable(x, low) for x in a]
    if isinstance(a, sympy.Basic):
        return int(a) if a.is_Integer else str(a)
    if isinstance(a, torch.dtype):
        return torch_dtype(a)
    if isinstance(a, float) and a != a:  # nan is not json
        return "nan"
    if isinstance(a, (str, bool, int, float)) or a is None:
        return a
    return str(a)


# ---- label helpers -----------------------------------------------------------------------
@functools.lru_cache(maxsize=65536)
def _eq(a: Any, b: Any) -> bool:
    if a == b:
        return True
    d = sympy.expand(sympy.sympify(a) - sympy.sympify(b))
    return bool(d == 0 or sympy.simplify(d) == 0)


# The prims constructors compare shapes with sympy.simplify; transformer blocks repeat the same
# shapes, so memoising on the (hashable) shape tuples makes a 96-layer trace cheap.
_reshape_sig = functools.lru_cache(maxsize=8192)(prims.reshape)
_elementwise_sig = functools.lru_cache(maxsize=8192)(lambda out, ins: prims.elementwise(out, ins))
_expand_sig = functools.lru_cache(maxsize=8192)(prims.expand)
_matmul_sig = functools.lru_cache(maxsize=8192)(prims.matmul)
_attention_sig = functools.lru_cache(maxsize=8192)(prims.attention)


class _Fresh:
    def __init__(self, taken: str) -> None:
        self.lab = prims._Labels(taken)

    def new(self) -> str:
        return self.lab.new()


def _align(ref_labels: str, ref_shape: Shape, shape: Shape, fresh: _Fresh) -> tuple[str, str]:
    """Right-aligned labels for ``shape`` against ``ref``: equal sizes share, others get fixed labels."""
    off = len(ref_shape) - len(shape)
    out, fixed = "", ""
    for i, d in enumerate(shape):
        j = off + i
        if 0 <= j < len(ref_shape) and _eq(d, ref_shape[j]):
            out += ref_labels[j]
        else:
            c = fresh.new()
            out += c
            fixed += c
    return out, fixed


def _with_extra_outputs(sig: DimSig, call: Call) -> DimSig:
    """Label extra tuple outputs (indices, saved stats) against the first input."""
    if len(sig.outputs) >= len(call.out_shapes):
        return sig
    base_lab, base_shape = sig.inputs[0] if sig.inputs else "", call.in_shapes[0] if call.in_shapes else ()
    fresh = _Fresh("".join(sig.inputs) + "".join(sig.outputs))
    outs, fixed = list(sig.outputs), sig.fixed
    for shp in call.out_shapes[len(sig.outputs) :]:
        if len(shp) == len(call.out_shapes[0]) and all(_eq(a, b) for a, b in zip(shp, call.out_shapes[0])):
            outs.append(sig.outputs[0])
        elif len(shp) == 1 and len(base_shape) > 1 and _eq(shp[0], base_shape[1]):
            outs.append(base_lab[1])  # per-channel statistics
        else:
            lab, fx = _align(base_lab, base_shape, shp, fresh) if len(shp) == len(base_shape) else ("", "")
            if len(lab) != len(shp):
                lab = "".join(fresh.new() for _ in shp)
                fx = lab
            outs.append(lab)
            fixed += fx
    return DimSig(sig.inputs, tuple(outs), sig.reduced, fixed)


def _dim(d: Any, rank: int) -> int:
    return int(d) % rank if rank else 0


# ---- rules -------------------------------------------------------------------------------
def _elementwise(c: Call) -> Result:
    sig = _elementwise_sig(c.out_shapes[0], tuple(c.in_shapes))
    return Prim.ELEMENTWISE, _with_extra_outputs(sig, c)


def _dropout(c: Call) -> Result:
    return Prim.DROPOUT, _with_extra_outputs(_elementwise_sig(c.out_shapes[0], tuple(c.in_shapes[:1])), c), c.inputs[:1]


def _along_dim_elementwise(c: Call) -> Result:
    """cumsum / diff / flip / roll: pointwise except along one dim, which is fixed."""
    rank = len(c.in_shapes[0])
    d = c.arg(1, "dim", -1)
    d = d[0] if isinstance(d, list) else d
    if rank == 0:
        return _elementwise(c)
    sig = prims.along([rank], [len(c.out_shapes[0])], _dim(d, rank))
    return Prim.ELEMENTWISE, sig, c.inputs[:1]


def _triangle(c: Call) -> Result:
    s = prims._Labels().many(len(c.in_shapes[0]))
    return Prim.ELEMENTWISE, DimSig((s,), (s,), "", s[-2:])


def _linear(c: Call) -> Result:
    return Prim.MATMUL, prims.linear(len(c.in_shapes[0]), has_bias=len(c.inputs) == 3)


def _matmul(c: Call) -> Result:
    return Prim.MATMUL, _matmul_sig(c.in_shapes[0], c.in_shapes[1])


def _addmm(c: Call) -> Result:
    """``bias + a @ b`` (addmm / baddbmm): the matmul signature plus a broadcast bias operand."""
    mm = _matmul_sig(c.in_shapes[1], c.in_shapes[2])
    fresh = _Fresh(mm.labels)
    bias, fx = _align(mm.outputs[0], c.out_shapes[0], c.in_shapes[0], fresh)
    return Prim.MATMUL, DimSig((bias, *mm.inputs), mm.outputs, mm.reduced, mm.fixed + fx)


def _einsum(c: Call) -> Result:
    eq = str(c.arg(0, "equation")).replace(" ", "")
    if "..." in eq:
        lhs, _, rhs = eq.partition("->")
        free = [ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch not in eq]
        n_ell = max(len(s) - (len(t.replace("...", ""))) for s, t in zip(c.in_shapes, lhs.split(",")))
        ell = "".join(free[:n_ell])
        parts = []
        for s, t in zip(c.in_shapes, lhs.split(",")):
            k = len(s) - len(t.replace("...", ""))
            parts.append(t.replace("...", ell[n_ell - k :]))
        eq = ",".join(parts) + ("->" + rhs.replace("...", ell) if "->" in eq else "")
    return Prim.MATMUL, prims.einsum(eq)


def _grouped_mm(c: Call) -> Result:
    """MoE grouped GEMM ``x[t,k] @ w[e,k,n]`` with per-expert offsets: each token meets one expert."""
    if len(c.in_shapes) < 2 or len(c.in_shapes[1]) != 3 or len(c.in_shapes[0]) != 2:
        return None
    ins = ("tk", "ekn") + tuple("e" for _ in c.in_shapes[2:])
    c.attrs["num_groups"] = int(c.in_shapes[1][0]) if c.in_shapes[1][0].is_Integer else str(c.in_shapes[1][0])
    return Prim.MATMUL, DimSig(ins, ("tn",), "k", "e")


def _attention(c: Call) -> Result:
    q, k, v = c.in_shapes[:3]
    sig = _attention_sig(q, k, v)
    if len(c.inputs) == 3:
        return Prim.ATTENTION, sig
    q_lab = sig.inputs[0][:-1] + sig.inputs[1][-2]  # b h s t (or batch..., s, t)
    ref = (*q[:-1], k[-2])
    mask, fx = _align(q_lab, ref, c.in_shapes[3], _Fresh(sig.labels))
    return Prim.ATTENTION, DimSig((*sig.inputs, mask), sig.outputs, "", sig.fixed + fx), c.inputs[:4]


def _reduce(c: Call) -> Result:
    rank = len(c.in_shapes[0])
    if c.op in ("max", "min") and len(c.inputs) == 2:
        return _elementwise(c)
    d = c.arg(1, "dim")
    if c.op in ("var", "std", "var_mean", "std_mean") and d is None:
        d = c.kwargs.get("dim")
    if d is None or (isinstance(d, list) and not d):
        dims = list(range(rank))
    else:
        dims = [int(x) for x in (d if isinstance(d, list) else [d])]
    keep = bool(c.arg(2, "keepdim", False)) if c.op not in ("var", "std") else bool(c.kwargs.get("keepdim", False))
    sig = prims.reduce(rank, dims, keep)
    return Prim.REDUCE, _with_extra_outputs(sig, c), c.inputs[:1]


def _histc(c: Call) -> Result:
    s = prims._Labels().many(len(c.in_shapes[0]))
    out = prims._Labels(s).many(len(c.out_shapes[0]))
    return Prim.REDUCE, DimSig((s,), (out,), s, out), c.inputs[:1]


def _softmax(c: Call) -> Result:
    rank = len(c.in_shapes[0])
    return Prim.SOFTMAX, prims.softmax(rank, _dim(c.arg(1, "dim", -1), rank)), c.inputs[:1]


def _norm(c: Call) -> Result:
    ns = c.arg(1, "normalized_shape")
    sig = prims.norm(len(c.in_shapes[0]), len(ns), len(c.inputs) - 1)
    return Prim.NORM, _with_extra_outputs(sig, c)


def _batch_norm(c: Call) -> Result:
    sig = prims.batch_norm(len(c.in_shapes[0]), len(c.inputs) - 1)
    return Prim.BATCH_NORM, _with_extra_outputs(sig, c)


def _embedding(c: Call) -> Result:
    return Prim.EMBEDDING, prims.embedding(len(c.in_shapes[1]))


def _conv(c: Call) -> Result:
    x, w = c.in_shapes[0], c.in_shapes[1]
    sig = prims.conv(len(x), len(c.inputs) == 3)
    if not _eq(x[1], w[1]) and not _eq(w[1], 1):  # grouped conv: weight has c/groups channels
        g = _Fresh(sig.labels).new()
        w_lab = sig.inputs[1][0] + g + sig.inputs[1][2:]
        sig = DimSig((sig.inputs[0], w_lab, *sig.inputs[2:]), sig.outputs, sig.reduced, sig.fixed + g + "c")
    return Prim.CONV, sig


def _pool(c: Call) -> Result:
    return Prim.POOL, _with_extra_outputs(prims.pool(len(c.in_shapes[0])), c), c.inputs[:1]


def _reshape(c: Call) -> Result:
    return Prim.RESHAPE, _reshape_sig(c.in_shapes[0], c.out_shapes[0]), c.inputs[:1]


def _permute(c: Call) -> Result:
    rank = len(c.in_shapes[0])
    if c.op in ("transpose", "swapaxes", "swapdims"):
        perm = list(range(rank))
        a, b = _dim(c.arg(1, "dim0"), rank), _dim(c.arg(2, "dim1"), rank)
        perm[a], perm[b] = perm[b], perm[a]
    elif c.op in ("t", "numpy_T"):
        perm = list(range(rank))[::-1]
    else:
        perm = [_dim(p, rank) for p in c.arg(1, "dims")]
    return Prim.PERMUTE, prims.permute(rank, perm), c.inputs[:1]


def _expand(c: Call) -> Result:
    return Prim.EXPAND, _expand_sig(c.in_shapes[0], c.out_shapes[0]), c.inputs[:1]


def _slice(c: Call) -> Result:
    rank = len(c.in_shapes[0])
    d = c.arg(1, "dim", 0)
    return Prim.SLICE, prims.along([rank], [len(c.out_shapes[0])], _dim(d, rank)), c.inputs[:1]


def _cat(c: Call) -> Result:
    out_rank = len(c.out_shapes[0])
    keep = [(n, s) for n, s in zip(c.inputs, c.in_shapes) if not (len(s) == 1 and _eq(s[0], 0))]
    d = c.arg(1, "dim", 0)
    sig = prims.along([len(s) for _, s in keep], [out_rank], _dim(d, out_rank))
    return Prim.CAT, sig, [n for n, _ in keep]


def _pad(c: Call) -> Result:
    """Constant padding = concatenation with constants: padded dims are fixed, others shared."""
    x, out = c.in_shapes[0], c.out_shapes[0]
    lab = prims._Labels()
    ins, outs, fixed = "", "", ""
    for a, b in zip(x, out):
        if _eq(a, b):
            ch = lab.new()
            ins, outs = ins + ch, outs + ch
        else:
            i, o = lab.new(), lab.new()
            ins, outs, fixed = ins + i, outs + o, fixed + i + o
    return Prim.CAT, DimSig((ins,), (outs,), "", fixed), c.inputs[:1]


def _split(c: Call) -> Result:
    rank = len(c.in_shapes[0])
    d = c.arg(1, "dim", 0) if c.op == "unbind" else c.arg(2, "dim", 0)
    return Prim.SPLIT, prims.along([rank], [len(s) for s in c.out_shapes], _dim(d, rank)), c.inputs[:1]


def _cross_entropy(c: Call) -> Result:
    logits, target = c.in_shapes[0], c.in_shapes[1]
    if len(target) != len(logits) - 1:
        return None  # soft labels: no rule
    sig = prims.cross_entropy(len(logits))
    ins = list(sig.inputs) + ["v"] * (len(c.inputs) - 2)  # class weights
    if c.op.startswith("nll_loss"):
        c.attrs["from_log_probs"] = True
    red = c.arg(3, "reduction", 1) if c.op != "cross_entropy_loss" else c.arg(3, "reduction", 1)
    outs = [sig.inputs[1] if red == 0 else ""] + [""] * (len(c.out_shapes) - 1)
    reduced = "" if red == 0 else sig.reduced
    return Prim.CROSS_ENTROPY, DimSig(tuple(ins), tuple(outs), reduced, sig.fixed)


def _pointwise_loss(c: Call) -> Result:
    """mse / l1 / bce-with-logits: pointwise then mean or sum over everything."""
    red = c.arg(2, "reduction", 1)
    if red == 0:
        return _elementwise(c)
    s = prims._Labels().many(len(c.out_shapes[0]) if c.out_shapes[0] else len(c.in_shapes[0]))
    ins = tuple(prims.elementwise(c.in_shapes[0], c.in_shapes).inputs)
    return Prim.REDUCE, DimSig(ins, ("",), ins[0] if ins else s, "")


def _topk(c: Call) -> Result:
    rank = len(c.in_shapes[0])
    d = c.arg(2, "dim", -1) if c.op == "topk" else c.arg(1, "dim", -1)
    return Prim.TOPK, prims.topk(rank, _dim(d, rank), len(c.out_shapes)), c.inputs[:1]


def _gather(c: Call) -> Result:
    rank = len(c.in_shapes[0])
    prim = Prim.GATHER if c.op in ("gather", "take_along_dim") else Prim.SCATTER
    sig = prims.along([len(s) for s in c.in_shapes], [len(s) for s in c.out_shapes], _dim(c.arg(1, "dim"), rank))
    return prim, sig


def _index_select(c: Call) -> Result:
    """``x.index_select(dim, idx)`` / ``index_add``: the indexed dim is fixed everywhere."""
    x = c.in_shapes[0]
    rank = len(x)
    d = _dim(c.arg(1, "dim"), rank)
    lab = prims._Labels()
    base = lab.many(rank)
    xd, idx, od = lab.new(), lab.new(), lab.new()
    x_lab = base[:d] + xd + base[d + 1 :]
    out_lab = base[:d] + od + base[d + 1 :]
    ins = [x_lab, idx] + [out_lab.replace(od, lab.new()) for _ in c.in_shapes[2:]]
    fixed = xd + idx + od + "".join(s[d] for s in ins[2:])
    if c.op == "index_select":
        return Prim.GATHER, DimSig((x_lab, idx), (base[:d] + idx + base[d + 1 :],), "", xd + idx)
    return Prim.SCATTER, DimSig(tuple(ins), (x_lab,), "", fixed)


def _index(c: Call) -> Result:
    """``x[:, idx]`` advanced indexing: leading un-indexed dims are shared, the rest fixed."""
    indices = c.arg(1, "indices") or []
    x, out = c.in_shapes[0], c.out_shapes[0]
    k = 0
    while k < len(indices) and indices[k] is None:
        k += 1
    m = len(indices) - k
    lab = prims._Labels()
    x_lab = lab.many(len(x))
    fixed = x_lab[k : k + m]
    n_idx = len(out) - k - (len(x) - k - m)
    if n_idx < 0:
        return None
    mid = lab.many(n_idx)
    out_lab = x_lab[:k] + mid + x_lab[k + m :]
    idx_labs = [lab.many(len(s)) for s in c.in_shapes[1:]]
    fixed += mid + "".join(idx_labs)
    prim = Prim.INDEX if c.op == "index" else Prim.SCATTER
    if c.op == "index":
        return prim, DimSig((x_lab, *idx_labs), (out_lab,), "", fixed)
    return prim, DimSig((x_lab, *idx_labs), (x_lab,), "", fixed + x_lab)  # index_put: replicated


def _one_hot(c: Call) -> Result:
    s = prims._Labels().many(len(c.in_shapes[0]))
    n = prims._Labels(s).new()
    return Prim.ELEMENTWISE, DimSig((s,), (s + n,), "", n)


def _constant(c: Call) -> Result:
    outs = tuple(prims._Labels().many(len(s)) for s in c.out_shapes)
    return Prim.CONSTANT, DimSig((), outs), []


_ELEMENTWISE = """add sub rsub mul div true_divide floor_divide remainder fmod neg abs exp exp2 expm1 log log2
log10 log1p sqrt rsqrt pow reciprocal sin cos tan tanh sigmoid relu relu6 gelu silu mish elu selu celu
leaky_relu hardtanh hardswish hardsigmoid softplus logsigmoid erf erfc sign sgn floor ceil round trunc clamp
clamp_min clamp_max where masked_fill maximum minimum fmax fmin eq ne lt le gt ge __and__ __or__ __xor__
__invert__ __lshift__ __rshift__ bitwise_and bitwise_or bitwise_xor bitwise_not logical_and logical_or
logical_xor logical_not isnan isinf isfinite nan_to_num lerp addcmul addcdiv threshold to _to_copy type_as
contiguous clone copy fill zero scalar_tensor_like square atan atan2 asin acos sinh cosh
_unsafe_masked_index""".split()

RULES: dict[str, Callable[[Call], Result]] = {n: _elementwise for n in _ELEMENTWISE}
RULES.update({n: _dropout for n in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout")})
RULES.update({n: _along_dim_elementwise for n in ("cumsum", "cumprod", "cummax", "diff", "flip", "roll")})
RULES.update({n: _triangle for n in ("tril", "triu")})
RULES.update({"linear": _linear, "mm": _matmul, "bmm": _matmul, "matmul": _matmul, "addmm": _addmm})
RULES.update({"baddbmm": _addmm, "einsum": _einsum, "scaled_dot_product_attention": _attention})
RULES.update({n: _grouped_mm for n in ("transformers.grouped_mm_fallback", "_grouped_mm", "grouped_mm")})
_REDUCE = "sum mean amax amin max min argmax argmin prod any all var std logsumexp linalg_vector_norm nansum"
RULES.update({n: _reduce for n in _REDUCE.split()})
RULES.update({"histc": _histc, "bincount": _histc})
RULES.update({n: _softmax for n in ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax")})
RULES.update({n: _norm for n in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm")})
_BN = "batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training"
RULES.update({n: _batch_norm for n in (*_BN.split(), "_native_batch_norm_legit_functional")})
RULES.update({"embedding": _embedding})
RULES.update({n: _conv for n in ("conv1d", "conv2d", "conv3d", "convolution", "_convolution")})
_POOL = "max_pool1d max_pool2d max_pool3d avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d"
_POOL += " adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d max_pool2d_with_indices _adaptive_avg_pool2d"
RULES.update({n: _pool for n in _POOL.split()})
_VIEW = "view reshape _unsafe_view flatten unflatten unsqueeze squeeze view_as reshape_as alias detach lift_fresh_copy"
RULES.update({n: _reshape for n in _VIEW.split()})
RULES.update({n: _permute for n in ("permute", "transpose", "swapaxes", "swapdims", "t", "numpy_T")})
RULES.update({n: _expand for n in ("expand", "expand_as", "broadcast_to", "repeat", "tile")})
RULES.update({n: _slice for n in ("slice", "select", "narrow")})
RULES.update({"cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _cat, "pad": _pad, "constant_pad_nd": _pad})
RULES.update({n: _split for n in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split")})
_CE = ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss_nd")
RULES.update({n: _cross_entropy for n in _CE})
_LOSS = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits")
RULES.update({n: _pointwise_loss for n in _LOSS})
RULES.update({"topk": _topk, "sort": _topk, "argsort": _topk})
RULES.update({n: _gather for n in ("gather", "take_along_dim", "scatter", "scatter_add", "scatter_reduce")})
RULES.update({"index_select": _index_select, "index_add": _index_select, "index_copy": _index_select})
RULES.update({"index": _index, "index_put": _index, "one_hot": _one_hot})
_FACTORY = """arange zeros ones full empty empty_like zeros_like ones_like full_like rand randn randint rand_like
randn_like new_ones new_zeros new_full new_empty scalar_tensor eye tensor empty_strided linspace""".split()
RULES.update({n: _constant for n in _FACTORY})
