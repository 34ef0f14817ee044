"""Signature constructors: the one place that decides how each primitive's dims are labelled.

Both tracers call these so a torch model and the same JAX function produce the same IR. Each
function takes shapes (tuples of sympy expressions or ints) and returns a :class:`DimSig`.
Labels are single characters; generic dims use ``a..z``-style letters handed out in order, and
dims that may never be sharded (a size-1 broadcast dim, a sliced or concatenated dim, the new
dims of a reshape) get fresh *fixed* labels.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import sympy

from partita.ir import DimSig

Shape = Sequence[sympy.Expr | int]
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789αβγδεζηθικλμνξοπρστυφχψω"


class _Labels:
    def __init__(self, taken: str = "") -> None:
        self.taken = set(taken)

    def new(self) -> str:
        for c in _LETTERS:
            if c not in self.taken:
                self.taken.add(c)
                return c
        raise ValueError("ran out of dimension labels")

    def many(self, n: int) -> str:
        return "".join(self.new() for _ in range(n))


def _eq(a: sympy.Expr | int, b: sympy.Expr | int) -> bool:
    """Whether two dims are the same expression: ``simplify(a - b) == 0``, without simplify where a
    cheaper test decides it (issue 35: ``simplify`` cost ~7 ms a call, ~0.7 CPU s per trace of a
    transformer, mostly to learn that ``S`` is not ``1``). Memoised: the blocks of a model repeat their shapes."""
    try:
        return _eq_cached(a, b)
    except TypeError:  # an unhashable dim: decided uncached
        return _eq_uncached(a, b)


@functools.lru_cache(maxsize=4096)
def _eq_cached(a: sympy.Expr | int, b: sympy.Expr | int) -> bool:
    return _eq_uncached(a, b)


def _eq_uncached(a: sympy.Expr | int, b: sympy.Expr | int) -> bool:
    a, b = sympy.sympify(a), sympy.sympify(b)
    if a == b:  # structurally equal (most calls): no simplify
        return True
    if a.is_Integer and b.is_Integer:
        return False
    d = a - b
    if _nonzero_at_a_point(d):
        return False
    return bool(sympy.simplify(d) == 0)


_PROBES = (7919, 7927, 7933, 7937, 7949, 7951, 7963, 7993)  # distinct primes: no accidental cancellation


def _nonzero_at_a_point(d: sympy.Expr) -> bool:
    """True when ``d`` evaluates to a finite nonzero number with each free symbol bound to a probe
    value: then ``d`` is not identically zero, so ``simplify(d)`` (an equivalence transformation) is
    not ``0`` either. Only for symbols without assumptions (the tracers' dims, ``Symbol(name)``),
    where any value is admissible; False (undecided) otherwise, and the caller simplifies."""
    syms = sorted(d.free_symbols, key=str)
    if len(syms) > len(_PROBES) or any(s.assumptions0 != {"commutative": True} for s in syms):
        return False
    v = d.xreplace({s: sympy.Integer(p) for s, p in zip(syms, _PROBES)})
    return bool(v.is_Number and v.is_finite and v != 0)  # a number, evaluated (not an unevaluated call)


def elementwise(out_shape: Shape, in_shapes: Sequence[Shape]) -> DimSig:
    """Numpy broadcasting, right-aligned. A size-1 input dim broadcast to a larger one is fixed."""
    lab = _Labels()
    out = lab.many(len(out_shape))
    fixed = ""
    ins = []
    for shp in in_shapes:
        off = len(out_shape) - len(shp)
        s = ""
        for i, d in enumerate(shp):
            od = out_shape[off + i]
            if _eq(d, od):
                s += out[off + i]
            else:  # broadcast size-1 dim
                c = lab.new()
                s += c
                fixed += c
        ins.append(s)
    return DimSig(tuple(ins), (out,), "", fixed)


def linear(x_rank: int, has_bias: bool = False) -> DimSig:
    """``y = x @ w.T (+ b)`` with ``w: [n, k]`` as in torch.nn.Linear."""
    lab = _Labels("nk")
    batch = lab.many(x_rank - 1)
    ins = [batch + "k", "nk"] + (["n"] if has_bias else [])
    return DimSig(tuple(ins), (batch + "n",), "k", "")


def matmul(a_shape: Shape, b_shape: Shape) -> DimSig:
    """``a @ b`` with numpy batch broadcasting (1-D operands promoted as numpy does)."""
    lab = _Labels("mkn")
    ra, rb = len(a_shape), len(b_shape)
    nb = max(ra, rb) - 2
    batch = lab.many(max(nb, 0))
    fixed = ""

    def batch_labels(shape: Shape) -> str:
        nonlocal fixed
        k = len(shape) - 2
        s = ""
        for i in range(k):
            full = batch[nb - k + i]
            if len(a_shape) >= 2 and len(b_shape) >= 2 and _eq(shape[i], 1) and not _eq(_other(shape, i), 1):
                c = lab.new()
                fixed += c
                s += c
            else:
                s += full
        return s

    def _other(shape: Shape, i: int) -> sympy.Expr | int:
        other = b_shape if shape is a_shape else a_shape
        j = i + len(other) - len(shape)
        return other[j] if 0 <= j < len(other) - 2 else 1

    if ra == 1 and rb == 1:
        return DimSig(("k", "k"), ("",), "k", "")
    if ra == 1:
        return DimSig(("k", batch_labels(b_shape) + "kn"), (batch + "n",), "k", fixed)
    if rb == 1:
        return DimSig((batch_labels(a_shape) + "mk", "k"), (batch + "m",), "k", fixed)
    return DimSig((batch_labels(a_shape) + "mk", batch_labels(b_shape) + "kn"), (batch + "mn",), "k", fixed)


def einsum(equation: str) -> DimSig:
    """An einsum equation is already a signature (``...`` is not supported: tracers expand it)."""
    eq = equation.replace(" ", "")
    if "->" not in eq:
        ins = eq.split(",")
        counts: dict[str, int] = {}
        for s in ins:
            for c in s:
                counts[c] = counts.get(c, 0) + 1
        eq = eq + "->" + "".join(sorted(c for c, n in counts.items() if n == 1))
    return DimSig.parse(eq)


def reduce(in_rank: int, dims: Sequence[int], keepdim: bool = False) -> DimSig:
    """Sum / mean / max over ``dims``. Reduced dims are shardable (partial result)."""
    lab = _Labels()
    ins = lab.many(in_rank)
    dims = sorted(d % in_rank for d in dims) if in_rank else []
    out, fixed = "", ""
    for i, c in enumerate(ins):
        if i in dims:
            if keepdim:
                k = lab.new()
                out += k
                fixed += k
        else:
            out += c
    return DimSig((ins,), (out,), "".join(ins[d] for d in dims), fixed)


def softmax(rank: int, dim: int) -> DimSig:
    lab = _Labels()
    s = lab.many(rank)
    return DimSig((s,), (s,), "", s[dim % rank])


def norm(rank: int, normalized_ndim: int, num_affine: int) -> DimSig:
    """Layer / RMS norm over the last ``normalized_ndim`` dims, with 0, 1 (weight) or 2 affine params."""
    lab = _Labels()
    s = lab.many(rank)
    tail = s[rank - normalized_ndim :]
    return DimSig((s,) + (tail,) * num_affine, (s,), "", tail)


def batch_norm(rank: int, num_affine: int) -> DimSig:
    """Channel dim 1; statistics are per replica (as under plain DDP), so every dim is shardable."""
    lab = _Labels()
    s = lab.many(rank)
    return DimSig((s,) + (s[1],) * num_affine, (s,), "", "")


def embedding(ids_rank: int) -> DimSig:
    """``weight[v, h]`` looked up by ``ids``: sharding ``v`` gives Megatron's vocab-parallel lookup
    (masked local lookup, partial result summed by an all-reduce)."""
    lab = _Labels("vh")
    ids = lab.many(ids_rank)
    return DimSig(("vh", ids), (ids + "h",), "v", "")


def attention(q_shape: Shape, k_shape: Shape, v_shape: Shape) -> DimSig:
    """SDPA on ``[batch, heads, seq, head_dim]``. Batch, heads and query seq are shardable; the key
    seq and head dims are fixed (sharding them needs a softmax rescale, not a plain sum). Grouped
    query attention (fewer k/v heads) labels the k/v heads separately and fixes them."""
    if len(q_shape) == 4:
        same_heads = _eq(q_shape[1], k_shape[1])
        kh = "h" if same_heads else "g"
        fixed = "tde" + ("" if same_heads else "g")
        return DimSig(("bhsd", f"b{kh}td", f"b{kh}te"), ("bhse",), "", fixed)
    lab = _Labels("stde")
    batch = lab.many(len(q_shape) - 2)
    return DimSig((batch + "sd", batch + "td", batch + "te"), (batch + "se",), "", "tde")


def conv(x_rank: int, has_bias: bool) -> DimSig:
    """``x[b, c, *spatial]``, ``w[o, c/groups, *kernel]``: input channels reduced, spatial fixed."""
    lab = _Labels("bco")
    n = x_rank - 2
    sp_in, kern, sp_out = lab.many(n), lab.many(n), lab.many(n)
    ins = ["bc" + sp_in, "oc" + kern] + (["o"] if has_bias else [])
    return DimSig(tuple(ins), ("bo" + sp_out,), "c", sp_in + kern + sp_out)


def pool(rank: int) -> DimSig:
    """Pooling over the spatial dims (all but the first two)."""
    lab = _Labels()
    keep = lab.many(2)
    sp_in, sp_out = lab.many(rank - 2), lab.many(rank - 2)
    return DimSig((keep + sp_in,), (keep + sp_out,), "", sp_in + sp_out)


def reshape(in_shape: Shape, out_shape: Shape) -> DimSig:
    """Group dims whose products match (row-major). Within a group only the major (first) dim is
    shardable, and it shares its label with the major dim of the matching output group: splitting
    either into n contiguous blocks splits the flattened group the same way. Size-1 dims and the
    minor dims of a group are fixed."""
    lab = _Labels()
    ins = [""] * len(in_shape)
    outs = [""] * len(out_shape)
    fixed = ""
    for shape, labels in ((in_shape, ins), (out_shape, outs)):
        for k, d in enumerate(shape):
            if _eq(d, 1):
                labels[k] = lab.new()
                fixed += labels[k]
    ii = [k for k, d in enumerate(in_shape) if not _eq(d, 1)]
    oo = [k for k, d in enumerate(out_shape) if not _eq(d, 1)]
    p = q = 0
    while p < len(ii) or q < len(oo):
        gi, gj = ii[p : p + 1], oo[q : q + 1]
        p, q = p + len(gi), q + len(gj)
        pi = sympy.sympify(in_shape[gi[0]]) if gi else sympy.Integer(1)
        pj = sympy.sympify(out_shape[gj[0]]) if gj else sympy.Integer(1)
        while not _eq(pi, pj) and (p < len(ii) or q < len(oo)):
            if q >= len(oo) or (p < len(ii) and _grow_left(pi, pj)):
                pi, p = pi * in_shape[ii[p]], p + 1
                gi.append(ii[p - 1])
            else:
                pj, q = pj * out_shape[oo[q]], q + 1
                gj.append(oo[q - 1])
        major = lab.new()
        for group, labels in ((gi, ins), (gj, outs)):
            for n, k in enumerate(group):
                if n == 0:
                    labels[k] = major
                else:
                    labels[k] = lab.new()
                    fixed += labels[k]
        if not (gi and gj):
            fixed += major
    return DimSig(("".join(ins),), ("".join(outs),), "", fixed)


def _grow_left(pi: sympy.Expr, pj: sympy.Expr) -> bool:
    """True when the left product is the smaller one (so the next input dim joins the group)."""
    r = sympy.simplify(pj / pi)
    if r.is_number:
        return bool(r > 1)
    _, den = r.as_numer_denom()
    return bool(den.is_number)


def permute(rank: int, perm: Sequence[int]) -> DimSig:
    lab = _Labels()
    s = lab.many(rank)
    return DimSig((s,), ("".join(s[p % rank] for p in perm),), "", "")


def expand(in_shape: Shape, out_shape: Shape) -> DimSig:
    """Broadcast to a larger shape: new or size-1 dims get fixed labels."""
    lab = _Labels()
    out = lab.many(len(out_shape))
    off = len(out_shape) - len(in_shape)
    ins, fixed = "", out[:off]
    for i, d in enumerate(in_shape):
        if _eq(d, out_shape[off + i]):
            ins += out[off + i]
        else:
            c = lab.new()
            ins += c
            fixed += c + out[off + i]
    return DimSig((ins,), (out,), "", fixed)


def along(in_ranks: Sequence[int], out_ranks: Sequence[int], dim: int) -> DimSig:
    """slice / select / cat / split / gather / scatter / index along ``dim``: every operand shares
    its other dims; the dim itself is fixed on each operand (a select drops it from the output)."""
    lab = _Labels()
    base = max([*in_ranks, *out_ranks])
    shared = lab.many(base)
    d = dim % base
    fixed = ""

    def one(rank: int) -> str:
        nonlocal fixed
        s = list(shared[:rank])
        if rank == base:
            c = lab.new()
            s[d] = c
            fixed += c
            return "".join(s)
        return "".join(shared[:d] + shared[d + 1 : base])[:rank]  # a select dropped ``dim``

    ins = tuple(one(r) for r in in_ranks)
    outs = tuple(one(r) for r in out_ranks)
    return DimSig(ins, outs, "", fixed)


def cross_entropy(logits_rank: int) -> DimSig:
    """``logits[..., v]`` with integer ``labels[...]`` -> scalar loss. Batch dims are reduced (a
    sharded batch gives a partial loss); the class dim is fixed for the generic rule (vocab-parallel
    cross entropy is an explicit rule in ``search/layer/strategies.py``)."""
    lab = _Labels("v")
    batch = lab.many(logits_rank - 1)
    return DimSig((batch + "v", batch), ("",), batch, "v")


def topk(rank: int, dim: int = -1, num_outputs: int = 2) -> DimSig:
    lab = _Labels()
    s = lab.many(rank)
    d = dim % rank
    k = lab.new()
    out = s[:d] + k + s[d + 1 :]
    return DimSig((s,), (out,) * num_outputs, "", s[d] + k)


def opaque(in_ranks: Sequence[int], out_ranks: Sequence[int]) -> DimSig:
    """No rule: every dim of every operand is its own fixed label (the op runs replicated)."""
    lab = _Labels()
    ins = tuple(lab.many(r) for r in in_ranks)
    outs = tuple(lab.many(r) for r in out_ranks)
    return DimSig(ins, outs, "", "".join(ins) + "".join(outs))
