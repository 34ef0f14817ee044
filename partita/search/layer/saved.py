"""What the emitted torch program keeps for the backward, per tensor, in the dtype it runs: the layer ILP's activations.

Read by ``search/layer/intra_op.py`` (``_LayerProblem``) when it prices a strategy's saved activations
(``m_v`` of the ILP, ``LayerSolution.activation_bytes``). Imports only the IR. Two questions per
layer, answered once per precision mode:

* **which tensors autograd saves** (:func:`_rule`): a matmul / convolution its activation inputs,
  attention its q, k, v and output, a norm its input, softmax and ``rsqrt`` / ``tanh`` / ``exp``
  their output, ``mul`` / ``div`` each operand whose partner needs a gradient, ``pow`` / ``silu`` /
  ``gelu`` and other unary ops their input; views, casts, ``add`` / ``sub`` / ``neg``, ``cat``,
  ``mean`` / ``sum`` and dropout with ``p == 0`` save nothing. A tensor saved by several ops and all
  its views (``RESHAPE`` ... ``SPLIT``, ``contiguous``, a cast to its own dtype) share one storage,
  counted once (:attr:`SavedPlan.root`). Ops on tensors that need no gradient (masks, rotary tables
  built from buffers) save nothing;
* **in which dtype the program holds them** (``backends/torch/parallel.precision_of``), traced in f32:

  - ``"f32"``: the traced dtypes;
  - ``"low"`` (FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16/f16)``: ZeRO >= 1 with dp > 1):
    parameters and block inputs in the low dtype, every op in the dtype of its inputs (promotion),
    an explicit ``.to(float32)`` an f32 copy and the cast back (Llama's RMSNorm ``.to(input_dtype)``,
    traced as a second f32 cast of an up-cast tensor) low again;
  - ``"autocast"`` (``torch.autocast``: f32 master parameters, any other stage): the residual stream
    stays f32, matmuls and attention run in the low dtype on a low *copy* of each f32 activation
    input (one per consuming op: autocast caches only casts of parameters) and of each weight (kept
    for the input gradient, per micro-batch), norms return f32.
    In both low modes Hugging Face's RMSNorms and SwiGLU products run fused (``backends/torch/fused.py``,
    :func:`fused_norm_groups`, :func:`fused_swiglu_muls`): a norm keeps its input as it arrives and a per-row
    statistic, not HF's f32 copies; the product keeps SiLU's input and up's output, not SiLU's output.
    With ``fp8`` (torchao's ``Float8Linear``, ``search/pricing/fp8.saved_copies``) a linear keeps no
    weight copy (it saves the f32 weight) and, on CPU, no input copy (it saves the f32 input itself).

Measured on the HF GPT-2 / Llama blocks (``saved_tensors_hooks``, ``tests/search/test_saved.py``):
the bytes of these rules equal what autograd keeps, up to the per-row statistics (norm means, the
attention log-sum-exp), which are left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from partita.ir import Graph, Layer, Node, Prim, Role

MODES = ("f32", "low", "autocast")
_VIEWS = frozenset({Prim.RESHAPE, Prim.PERMUTE, Prim.EXPAND, Prim.SLICE, Prim.SPLIT})
_NOTHING = frozenset({Prim.CAT, Prim.CONSTANT, Prim.EMBEDDING, Prim.INDEX, Prim.GATHER, *_VIEWS})
_ALIAS_OPS = frozenset({"contiguous", "alias", "detach", "lift_fresh_copy"})
_CASTS = frozenset({"to", "_to_copy", "type_as", "float", "half", "bfloat16"})
_NO_SAVE_OPS = frozenset(
    {*_ALIAS_OPS, *_CASTS, "clone", "copy", "neg", "add", "sub", "rsub", "cumsum", "masked_fill", "where", "fill"}
    | {
        "eq",
        "ne",
        "le",
        "lt",
        "ge",
        "gt",
        "__and__",
        "__or__",
        "logical_and",
        "logical_or",
        "logical_not",
        "bitwise_and",
    }
)
_OUTPUT_OPS = frozenset({"rsqrt", "tanh", "sigmoid", "exp", "sqrt", "relu", "reciprocal", "softmax", "_softmax"})
_OUTPUT_OPS = _OUTPUT_OPS | {"log_softmax", "_log_softmax"}
FLOAT_DTYPES = frozenset({"f64", "f32", "bf16", "f16", "f8"})  # ir.DTYPE_BYTES's floating-point kinds


@dataclasses.dataclass(frozen=True)
class SavedPlan:
    """One layer's saved activations in one precision mode (module docstring)."""

    item: Mapping[str, float]  # tensor -> bytes per element as the program holds it
    root: Mapping[str, str]  # tensor -> the tensor whose storage it shares (itself if none)
    saved: frozenset[str]  # roots kept for the backward, each counted once
    owner: Mapping[str, str]  # saved root produced outside the layer -> the node that counts it
    copies: Mapping[str, tuple[int, ...]]  # node -> activation inputs it keeps a low copy of (autocast)
    weights: Mapping[str, tuple[int, ...]]  # node -> parameter inputs it keeps a low copy of (autocast)
    low: int  # bytes of the low dtype
    # saved root made in the layer that only a MoE dispatch matmul keeps -> that node, which counts it in its
    # own input layout (:func:`dispatch_kept`)
    at_dispatch: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _op(n: Node) -> str:
    parts = n.target.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]


def _rule(n: Node, g: Graph, grad: frozenset[str]) -> tuple[tuple[int, ...], bool]:
    """(positions of the activation inputs ``n`` saves, whether it saves its output)."""
    acts = [i for i, t in enumerate(n.inputs) if g.tensors[t].role is not Role.PARAMETER]
    floats = [i for i in acts if g.tensors[n.inputs[i]].dtype in FLOAT_DTYPES]
    if not any(o in grad for o in n.outputs):
        return (), False  # no gradient flows through: nothing kept
    op, prim = _op(n), n.prim
    if prim in _NOTHING or prim is Prim.DROPOUT or (prim is Prim.REDUCE and op in ("mean", "sum")):
        return (), False
    if prim in (Prim.SOFTMAX,) or op in _OUTPUT_OPS:
        return (), True
    if prim is Prim.ATTENTION:
        return tuple(i for i in floats if i < 3), True
    if prim is Prim.ELEMENTWISE and op in _NO_SAVE_OPS:
        return (), False
    if prim is Prim.ELEMENTWISE and op in ("mul", "div") and len(n.inputs) == 1:
        return (), False  # by a Python scalar: its backward reads nothing
    if prim is Prim.ELEMENTWISE and op in ("mul", "div") and len(n.inputs) == 2:
        a, b = n.inputs
        keep = [i for i, partner in ((0, b), (1, a)) if i in floats and (partner in grad or op == "div" and i == 1)]
        if op == "div" and b in grad and 0 in floats:
            keep.append(0)
        return tuple(sorted(set(keep))), False
    return tuple(floats), False


def saved_plan(
    g: Graph, layer: Layer, mode: str, low: int, grad: frozenset[str], fp8: tuple[bool, bool] | None = None
) -> SavedPlan:
    """The layer's :class:`SavedPlan` in ``mode`` (``MODES``); ``low``: bytes of the training dtype; ``fp8``:
    the plan trains its linears with torchao's ``Float8Linear`` (``search/pricing/fp8.saved_copies``: which
    of autocast's input and weight copies such a linear keeps; one that keeps no input copy saves the
    input itself, as it is)."""
    item: dict[str, float] = {}
    up: set[str] = set()  # f32 tensors that are an up-cast of low data (the next f32 cast goes back)
    root: dict[str, str] = {}
    saved: set[str] = set()
    owner: dict[str, str] = {}
    copies: dict[str, tuple[int, ...]] = {}
    weights: dict[str, tuple[int, ...]] = {}
    keepers: dict[str, set[str]] = {}

    def it(t: str) -> float:
        if t not in item:  # produced outside the layer
            ten = g.tensors[t]
            traced = float(ten.itemsize)
            floating = ten.dtype in FLOAT_DTYPES
            if ten.role is Role.BUFFER or not floating or mode == "f32":
                item[t] = traced
            elif ten.role is Role.PARAMETER:
                item[t] = low if mode == "low" else traced
            else:  # a block input: FSDP2 casts it to param_dtype; under autocast the residual stays f32
                item[t] = low if mode == "low" else traced
            root[t] = t
        return item[t]

    def keep(t: str, n: Node) -> None:
        r = root.get(t, t)
        if g.tensors[r].role is Role.PARAMETER:
            return  # a parameter or a view of it (an expert GEMM's permuted weight): its own storage, no copy
        saved.add(r)
        keepers.setdefault(r, set()).add(n.name)
        if r not in owner and r not in produced:
            owner[r] = n.name

    produced = {o for name in layer.nodes for o in g.node(name).outputs}
    into_weights = _into_weights(g, layer)
    fused = fused_norm_groups(g, layer) if mode != "f32" else {}
    swiglu = fused_swiglu_muls(g, layer) if mode != "f32" else frozenset()
    for name in layer.nodes:
        n = g.node(name)
        ins = [it(t) for t in n.inputs]
        floats = [x for t, x in zip(n.inputs, ins) if g.tensors[t].dtype in FLOAT_DTYPES]
        op, prim = _op(n), n.prim
        acts = [i for i, t in enumerate(n.inputs) if g.tensors[t].role is not Role.PARAMETER]
        first = n.inputs[acts[0]] if acts else None
        for o in n.outputs:
            ten = g.tensors[o]
            out = float(ten.itemsize)
            alias = None
            if ten.dtype in FLOAT_DTYPES and mode != "f32":
                out = max(floats) if floats else out
                wide = [t for t in n.inputs if g.tensors[t].dtype in FLOAT_DTYPES and item[t] >= 4]
                if wide and all(t in up for t in wide) and min(floats) < 4:
                    # an f32 up-cast mixed with low data: the trace (in f32) read the cast where the model
                    # reads the original (Llama's residual add of the RMSNorm input): low, as the program runs
                    out = min(floats)
                if prim is Prim.ELEMENTWISE and op in _CASTS and first is not None:
                    src = it(first)
                    if ten.dtype != "f32" or g.tensors[first].dtype not in FLOAT_DTYPES:
                        out = float(ten.itemsize)
                    elif mode == "low" and o in into_weights:
                        out = float(low)  # a matmul's operands share a dtype: the low parameter's (HF's .to(w.dtype))
                    elif src < 4:
                        out = 4.0
                        up.add(o)
                    elif first in up:
                        out = float(low)
                    if out == src:
                        alias = first
                elif prim in (Prim.MATMUL, Prim.CONV, Prim.ATTENTION) and mode == "autocast":
                    out = float(low)
                elif prim is Prim.NORM and mode == "autocast":
                    out = 4.0
                elif prim is Prim.EMBEDDING:
                    out = max((x for t, x in zip(n.inputs, ins) if g.tensors[t].role is Role.PARAMETER), default=out)
                if prim is not Prim.ELEMENTWISE or op not in _CASTS:
                    if out >= 4 and any(t in up for t in n.inputs) and not (wide and min(floats) < 4 and out < 4):
                        up.add(o)
            elif (
                prim is Prim.ELEMENTWISE and op in _CASTS and first is not None and ten.dtype == g.tensors[first].dtype
            ):
                alias = first
            if prim in _VIEWS or (prim is Prim.ELEMENTWISE and op in _ALIAS_OPS):
                alias = first if first is not None else n.inputs[0]  # a view of a parameter: the parameter
            if prim is Prim.DROPOUT and (float(n.attrs.get("p", 0.0)) == 0.0 or not n.attrs.get("train", True)):
                alias = first
            item[o] = out
            root[o] = root.get(alias, alias) if alias is not None else o
            if alias is not None and alias in up:
                up.add(o)
        pos, out_saved = _rule(n, g, grad)
        if name in fused:  # a fused RMSNorm (backends/torch/fused.py): its input as it arrives, nothing else
            pos, out_saved = ((0,) if fused[name] and any(o in grad for o in n.outputs) else ()), False
        if name in swiglu:  # a fused SwiGLU: up's output; SiLU's input is kept by the silu node, its output by none
            pos = tuple(i for i in pos if i != 0)
        cast = mode == "autocast" and prim in (Prim.MATMUL, Prim.CONV, Prim.ATTENTION)
        f8 = (
            fp8 if cast and prim is Prim.MATMUL and any(g.tensors[t].role is Role.PARAMETER for t in n.inputs) else None
        )
        mine = []
        for i in pos:
            if cast and item[n.inputs[i]] > low and (f8 is None or f8[0]):
                mine.append(i)  # autocast keeps its own low copy, not the f32 tensor
            else:
                keep(n.inputs[i], n)
        if mine:
            copies[n.name] = tuple(mine)
        if cast and prim is not Prim.ATTENTION and (f8 is None or f8[1]):
            ws = tuple(
                i
                for i, t in enumerate(n.inputs)
                if g.tensors[t].role is Role.PARAMETER and item[t] > low and _is_weight(n, i, g)
            )
            if ws:
                weights[n.name] = ws
        if out_saved:
            for o in n.outputs[:1]:
                keep(o, n)
    at_dispatch = dispatch_kept(g, layer, root, produced, keepers)
    return SavedPlan(item, root, frozenset(saved), owner, copies, weights, low, at_dispatch)


_RMS_OPS = ("to", "pow", "mean", "add", "rsqrt", "mul", "to", "mul")


def fused_norm_groups(g: Graph, layer: Layer) -> dict[str, bool]:
    """The nodes of each Hugging Face RMSNorm in ``layer`` that a low-precision program runs as one fused
    op (``backends/torch/fused.py``, written into the program for every bf16 / f16 stage), each mapped
    to whether it is the norm's first node (the up-cast of the norm's input, the one tensor the fused
    norm keeps besides its per-row statistic). A norm is the nodes of one module path whose ops are
    exactly HF's ``weight * (x.to(f32) * rsqrt(x.pow(2).mean(-1) + eps)).to(dtype)`` with the module's
    own ``weight``; anything else (Gemma's ``1 + weight``) is left to the per-op rules, as the program
    leaves it."""
    by_module: dict[str, list[Node]] = {}
    for name in layer.nodes:
        n = g.node(name)
        if n.module:
            by_module.setdefault(n.module, []).append(n)
    out: dict[str, bool] = {}
    for mod, nodes in by_module.items():
        if tuple(_op(n) for n in nodes) != _RMS_OPS or f"{mod}.weight" not in nodes[-1].inputs:
            continue
        if g.tensors[f"{mod}.weight"].role is not Role.PARAMETER:
            continue
        out.update({n.name: i == 0 for i, n in enumerate(nodes)})
    return out


def fused_swiglu_muls(g: Graph, layer: Layer) -> frozenset[str]:
    """The ``mul`` nodes of ``layer`` that a low-precision program runs as a fused SwiGLU
    (``backends/torch/fused.py``): Hugging Face's ``act_fn(gate_proj(x)) * up_proj(x)`` in module ``M``, the
    ``silu`` of ``M.act_fn`` on ``M.gate_proj``'s output times ``M.up_proj``'s output (operand 0 is the
    SiLU's output, which the fused product does not keep)."""
    producer = {o: g.node(name) for name in layer.nodes for o in g.node(name).outputs}
    out = set()
    for name in layer.nodes:
        n = g.node(name)
        if _op(n) != "mul" or len(n.inputs) != 2 or not n.module:
            continue
        act, up = (producer.get(t) for t in n.inputs)
        if act is None or up is None or _op(act) != "silu" or act.module != f"{n.module}.act_fn":
            continue
        gate = producer.get(act.inputs[0]) if act.inputs else None
        if up.module == f"{n.module}.up_proj" and gate is not None and gate.module == f"{n.module}.gate_proj":
            out.add(name)
    return frozenset(out)


def dispatch_kept(
    g: Graph, layer: Layer, root: Mapping[str, str], produced: set[str], keepers: Mapping[str, set[str]]
) -> dict[str, str]:
    """Saved roots made in the layer whose only keeper is a MoE ``dispatch`` matmul (``passes/moe.py``: the
    experts' first grouped GEMM), mapped to that node. The trace gathers every routed (token, expert)
    pair into one tensor before it (mixtral-8x7b: ``hidden[token_idx]``, ``2 B S`` rows); under expert
    parallelism (``backends/torch/moe.py``) a rank keeps only the pairs its own experts received, so
    the dispatch node counts the tensor in its own strategy's terms (``strategies.routed_rows``), not
    its producer, whose layout (replicated) cannot say which rows the experts keep."""
    out = {}
    for name in layer.nodes:
        n = g.node(name)
        if (n.attrs.get("moe") or {}).get("role") != "dispatch" or not n.inputs:
            continue
        r = root.get(n.inputs[0], n.inputs[0])
        if r in produced and keepers.get(r) == {name}:
            out[r] = name
    return out


def _into_weights(g: Graph, layer: Layer) -> frozenset[str]:
    """The activation operands of the layer's matmuls and convolutions with a parameter operand (directly
    or through views: a permuted expert weight). Torch multiplies equal dtypes only, so under FSDP2's low
    ``param_dtype`` a cast the trace made to f32 in front of such a weight is a cast to the low dtype in
    the program (transformers' experts: ``x.to(weight.dtype)``; the f32 trace cannot tell the two
    apart). mixtral-8x7b's grouped experts counted two f32 casts of their inputs, 0.28 GiB a layer and
    micro-batch at tp = 1, which ``partita rehearse`` of the FSDP2 program never held."""
    producers = {o: g.node(name) for name in layer.nodes for o in g.node(name).outputs}

    def param(t: str) -> bool:
        while (u := producers.get(t)) is not None and u.prim in _VIEWS and u.inputs:
            t = u.inputs[0]
        return g.tensors[t].role is Role.PARAMETER

    out: set[str] = set()
    for name in layer.nodes:
        n = g.node(name)
        if n.prim in (Prim.MATMUL, Prim.CONV) and any(param(t) for t in n.inputs):
            out.update(t for t in n.inputs if not param(t))
    return frozenset(out)


def _is_weight(n: Node, i: int, g: Graph) -> bool:
    """A matmul's weight operand (rank >= 2), not its bias (the backward never reads a bias)."""
    return g.tensors[n.inputs[i]].rank >= 2


def replicated_bytes(
    g: Graph, layer: Layer, sp: SavedPlan, replicated: frozenset[str], env: Mapping[str, int]
) -> float:
    """Bytes of ``sp`` that the nodes named in ``replicated`` count (the outputs they save and the roots from
    before the layer they first read), at the sizes ``env`` gives, without autocast's copies of matmul
    inputs and weights, and without a root that a node outside ``replicated`` also reads (a column
    matmul's input, which sequence parallelism all-gathers and keeps whole): what a tp-replicated region
    keeps whole on every rank, and Megatron's sequence parallelism keeps for ``s/t`` rows
    (``search/program/sequence_parallel.py``; the same tensors ``intra_op``'s ``_saved_bytes`` prices)."""
    import math

    from partita.ir import dim_size

    def numel(t: str) -> float:
        return float(math.prod(dim_size(d, env) for d in g.tensors[t].shape))

    outside = {sp.root.get(t, t) for name in layer.nodes if name not in replicated for t in g.node(name).inputs}
    total = 0.0
    for name in layer.nodes:
        if name not in replicated:
            continue
        n = g.node(name)
        for t in n.outputs:
            if sp.root.get(t) == t and t in sp.saved and t not in outside:
                total += numel(t) * sp.item[t]
        seen: set[str] = set()
        for t in n.inputs:
            r = sp.root.get(t, t)
            if sp.owner.get(r) == n.name and r not in seen and r not in outside:
                seen.add(r)
                total += numel(r) * sp.item[r]
    return total


def freed_at_b(g: Graph, nodes: list[Node], consumers: Mapping[str, list[Node]], base: Any) -> set[str]:
    """The loss layer's nodes that lead to no parameter op (the loss, and the casts and shifts between the
    head's matmul and it; ``base``: a tensor through its views). A split backward
    (``backends/torch/wsplit.py``) keeps a micro-batch's graph from B to W only below its split nodes (the
    parameter ops), so these nodes' saved tensors (the f32 log-probabilities) die with the stage's output
    at B: ``partita rehearse`` of a ZB-H1 head stage held each deferred micro-batch's logits gradient and
    not its log-probabilities, which the plan priced as held to W (qwen2-7b's head stage 27.8% over).
    Empty for a layer without a loss: a block's tail feeds the next block's parameter ops."""
    if not any(n.prim is Prim.CROSS_ENTROPY for n in nodes):
        return set()
    leads: set[str] = set()
    for n in reversed(nodes):  # topological: a node's consumers come after it
        reads_param = any(g.tensors[base(t)].role is Role.PARAMETER for t in n.inputs)
        if reads_param or any(m.name in leads for t in n.outputs for m in consumers.get(t, [])):
            leads.add(n.name)
    return {n.name for n in nodes if n.name not in leads}


def stacked_low_grad(grad_bytes: float, grad_item: float, low: float) -> tuple[float, float]:
    """``(one backward, one split W)``: the low-precision gradient of a stacked expert weight the program
    holds beside its f32 one where the experts module is not expert-parallel (tp 1, or replicated on tp):
    the grouped matmul's backward makes the whole stack's gradient in the compute dtype (FSDP2's
    ``param_dtype``, or autocast's cast of the weight, ``backends/torch/moe.experts_in_autocast_dtype``), and
    under FSDP2 each stack keeps it in the unsharded ``.grad`` until the layer's unit folds them into its
    f32 gradient: every stacked weight of the layer at once (``grad_bytes``: the f32 gradient,
    ``grad_item`` bytes an element; ``low``: the compute dtype's). A split W's copy (a ZB stage past the
    first) is the stage's whole low gradient, priced per stage (``stage_cost.state_memory``), hence 0 here.
    ``partita rehearse`` of mixtral-8x7b-search's first stage (tp 1, ZB-H1, dp 2 ZeRO-1 in bf16): 9.3%
    over its plan without it (2.6 GiB a layer). An f32 program (``low >= grad_item``) makes none."""
    if low >= grad_item:
        return 0.0, 0.0
    return grad_bytes * low / grad_item, 0.0
