"""Sharding strategies of one IR node on a logical mesh, read off its dimension signature.

Used by ``search/layer/intra_op.py``, which prices each strategy and picks one per node. One generic
rule covers every primitive:

* each mesh axis is assigned to at most one *shardable* label of the node (in the signature,
  not in ``sig.fixed``) or left unused (the op is replicated along it); several axes may share a
  label (``S(0)`` on both axes of a 2-D mesh); the label's size must be divisible by the product
  of the sizes of the axes assigned to it;
* an operand's layout on an axis is ``S(d)`` if it carries the axis' label at dim ``d``, else
  ``R`` (it is broadcast along the label); an output's is ``S(d)``, ``P`` when the label is
  ``reduced`` (each device holds a partial sum), else ``R``;
* an input's *gradient* comes out ``S(d)`` where the input is sharded, ``P`` where the input was
  broadcast along a used axis (Megatron's column-parallel input grad), ``R`` on unused axes;
* a label that is neither in an output nor reduced cannot be sharded (its result would be wrong).

Explicit rules, only where a signature cannot say it:

* vocab-parallel cross entropy: the class dim ``v`` (fixed for the generic rule) may be sharded on
  one axis; the loss then needs three small all-reduces (max, sum of exp, target logit) of one
  f32 per token, and the logits' gradient stays sharded;
* the torch runtime's tensor parallelism (:func:`torch_tp_strategies`, used for torch graphs):
  the ``tp`` axis may shard only what ``backends/torch/tp.py`` builds, one *tp role* per module;
* embedding vocab sharding and MoE expert parallelism need no rule: ``v`` is reduced (partial
  lookup result, all-reduce) and the expert label ``e`` is an ordinary label of the dispatch
  einsum and the expert matmuls, so sharding it is expert parallelism and the ``S(b) -> S(e)``
  resharding before it is the token all-to-all (``search/layer/reshard.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence, Set

from partita.ir import Node, Prim
from partita.search.layer.reshard import Layout
from partita.search.pricing.mesh import LogicalMesh


@dataclasses.dataclass(frozen=True)
class OpCollective:
    """A collective an op issues itself (not a resharding between ops)."""

    kind: str
    axis: int
    bytes: float
    phase: str  # forward | backward
    reason: str


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    axis_labels: tuple[str, ...]  # per mesh axis: the label it shards, "" when unused
    in_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout, ...]
    in_grad_layouts: tuple[Layout, ...]
    work_divisor: int  # iteration space / per-device iteration space
    op_collectives: tuple[OpCollective, ...] = ()
    tp_role: str = ""  # torch_tp_strategies: the module role the torch runtime builds ("" = none)


def strategy_name(axis_labels: tuple[str, ...], mesh: LogicalMesh) -> str:
    used = [f"{lab}@{ax}" for lab, ax in zip(axis_labels, mesh.axis_names) if lab]
    return ",".join(used) if used else "R"


def _operand_layout(labels: str, axis_labels: tuple[str, ...], reduced: str, is_output: bool) -> Layout:
    out = []
    for lab in axis_labels:
        if lab and lab in labels:
            out.append(f"S({labels.index(lab)})")
        elif lab and is_output and lab in reduced:
            out.append("P")
        else:
            out.append("R")
    return tuple(out)


def _grad_layout(labels: str, axis_labels: tuple[str, ...]) -> Layout:
    return tuple(f"S({labels.index(lab)})" if lab and lab in labels else ("P" if lab else "R") for lab in axis_labels)


def _divisible(axis_labels: tuple[str, ...], sizes: Mapping[str, int], mesh: LogicalMesh) -> bool:
    per_label: dict[str, int] = {}
    for lab, s in zip(axis_labels, mesh.shape):
        if lab:
            per_label[lab] = per_label.get(lab, 1) * s
    return all(sizes[lab] % n == 0 for lab, n in per_label.items())


def _make(node: Node, axis_labels: tuple[str, ...], mesh: LogicalMesh) -> Strategy:
    sig = node.sig
    ins = tuple(_operand_layout(s, axis_labels, sig.reduced, False) for s in sig.inputs)
    outs = tuple(_operand_layout(s, axis_labels, sig.reduced, True) for s in sig.outputs)
    grads = tuple(_grad_layout(s, axis_labels) for s in sig.inputs)
    if node.prim is Prim.MATMUL and len(sig.inputs) == 3:
        # a linear's bias (``aten.linear``: the last operand; ``aten.addmm``: the first) is added after
        # the contraction: its grad sums the (replicated) output grad, never a partial one
        out = set(sig.outputs[0])
        for b in (2, 0):
            if set(sig.inputs[b]) <= out and not set(sig.inputs[b]) & set(sig.reduced):
                fixed = tuple("R" if lab in sig.reduced and lab else p for p, lab in zip(grads[b], axis_labels))
                grads = (*grads[:b], fixed, *grads[b + 1 :])
                break
    div = math.prod(s for lab, s in zip(axis_labels, mesh.shape) if lab)
    return Strategy(strategy_name(axis_labels, mesh), axis_labels, ins, outs, grads, div)


def enumerate_strategies(node: Node, sizes: Mapping[str, int], mesh: LogicalMesh) -> list[Strategy]:
    """All strategies of ``node`` (label sizes already evaluated), replicated first, deterministic order."""
    sig = node.sig
    out_labels = set("".join(sig.outputs))
    shardable = [c for c in sig.shardable if c in out_labels or c in sig.reduced]
    options = [[""] + (shardable if size > 1 else []) for size in mesh.shape]
    result = []
    for combo in itertools.product(*options):
        if _divisible(combo, sizes, mesh):
            result.append(_make(node, combo, mesh))
    if node.prim is Prim.CROSS_ENTROPY:
        result.extend(_vocab_parallel_cross_entropy(node, sizes, mesh, result))
    return result


def _vocab_parallel_cross_entropy(
    node: Node, sizes: Mapping[str, int], mesh: LogicalMesh, generic: list[Strategy]
) -> list[Strategy]:
    """Shard the class dim on one unused axis of each generic strategy (Megatron's vocab-parallel loss)."""
    sig = node.sig
    logits = sig.inputs[0]
    cls = logits[-1]
    out = []
    for g in generic:
        for i, lab in enumerate(g.axis_labels):
            if lab or mesh.shape[i] == 1 or sizes[cls] % mesh.shape[i]:
                continue
            axis_labels = g.axis_labels[:i] + (cls,) + g.axis_labels[i + 1 :]
            s = _make(node, axis_labels, mesh)
            # the loss is complete (R) on the class axis after the all-reduces; logits' grad stays sharded
            outs = tuple(lay[:i] + ("R",) + lay[i + 1 :] for lay in s.out_layouts)
            tokens = math.prod(sizes[c] for c in logits[:-1]) / math.prod(
                sz for lab2, sz in zip(g.axis_labels, mesh.shape) if lab2 and lab2 in logits
            )
            colls = tuple(
                OpCollective("all_reduce", i, tokens * 4, "forward", f"vocab-parallel cross entropy {what} {node.name}")
                for what in ("max", "sum-exp", "target-logit")
            )
            labels_grad = s.in_grad_layouts[1][:i] + ("R",) + s.in_grad_layouts[1][i + 1 :]
            grads = (s.in_grad_layouts[0], labels_grad, *s.in_grad_layouts[2:])
            name = s.name.replace(f"{cls}@", "vocab@")
            out.append(dataclasses.replace(s, name=name, out_layouts=outs, in_grad_layouts=grads, op_collectives=colls))
    return out


# ---- the torch runtime's tensor parallelism -------------------------------------------------------
LINEAR_TARGETS = ("aten.linear", "aten.addmm")  # nn.Linear, transformers' Conv1D
EMBEDDING_TARGETS = ("aten.embedding",)
TP_ROLES = ("colwise", "colwise_gather", "rowwise", "rowwise_replicated", "vocab", "embed_dim", "expert")


def linear_operands(node: Node, is_param: Sequence[bool]) -> tuple[int, int, int | None] | None:
    """``(activation, weight, bias)`` operand indices of an ``nn.Linear`` / ``Conv1D`` node, else None.

    A traced torch op must be ``aten.linear`` / ``aten.addmm`` (a matmul with another parameter is
    no module the runtime can shard); any graph's node must read one activation and a weight whose
    labels are the contracted one and output features only (an expert weight's ``e`` is not).
    """
    if node.prim is not Prim.MATMUL or (node.target.startswith("aten.") and not node.target.startswith(LINEAR_TARGETS)):
        return None
    sig = node.sig
    acts = [i for i, p in enumerate(is_param) if not p]
    weights = [i for i, p in enumerate(is_param) if p and set(sig.inputs[i]) & set(sig.reduced)]
    biases = [i for i, p in enumerate(is_param) if p and i not in weights]
    if len(acts) != 1 or len(weights) != 1 or len(biases) > 1:
        return None
    lw, la = sig.inputs[weights[0]], sig.inputs[acts[0]]
    if len(set(lw) & set(sig.reduced)) != 1 or any(c in la for c in lw if c not in sig.reduced):
        return None
    return acts[0], weights[0], (biases[0] if biases else None)


def torch_tp_strategies(
    node: Node,
    strats: list[Strategy],
    sizes: Mapping[str, int],
    mesh: LogicalMesh,
    *,
    is_param: Sequence[bool],
    itemsizes: Sequence[float],
    tokens: Set[str],
    tied: Sequence[bool] = (),
) -> list[Strategy]:
    """``strats`` restricted on the ``tp`` axis to what ``backends/torch/tp.py`` builds.

    The torch runtime keeps activations between modules as plain local tensors: an op that is not
    a tp module runs on its local piece, so it may shard on ``tp`` only a label it keeps whole and
    reduces over nothing (heads of attention, features of an activation function), with every
    parameter replicated. The tp modules (``nn.Linear``, ``Conv1D``, ``nn.Embedding``) take one role:

    ======================  ============================  ===========================  ==================
    role                    tp axis shards                input -> output on tp        collectives
    ======================  ============================  ===========================  ==================
    ``colwise``             the out-feature label         R -> S(out)                  bwd: input grad P
    ``colwise_gather``      the out-feature label         R -> R                       fwd all_gather
    ``rowwise``             the contracted label          S(in) -> R                   fwd all_reduce
    ``rowwise_replicated``  the contracted label          R (sliced) -> R              fwd all_reduce,
                                                                                       bwd all_gather
    ``vocab``               ``nn.Embedding``'s vocabulary ids -> R                     fwd all_reduce
    ``embed_dim``           ``nn.Embedding``'s hidden dim ids -> R                     fwd all_gather
    ``expert``              the experts (3-D weights'     R -> R (rows: routed pairs   fwd 2 all_to_all +
                            dim 0), a whole experts       sharded in between)          2 all_gather, bwd 2
                            module at once                                             a2a + 2 all_gather
    ======================  ============================  ===========================  ==================

    The column input grad (partial on ``tp``) becomes the edge's backward all-reduce
    (``search/layer/intra_op.py``). Left out because the runtime cannot build them (they leave the
    search until it can): the batch or sequence on ``tp`` (``tokens``: sequence parallelism, data
    parallelism inside tp), a reduce-scattered row output, vocab-parallel cross entropy, a sharded
    norm weight, and other non-``nn.Linear`` weights sharded on ``tp`` (MoE experts only as a whole
    module, :func:`expert_tp_strategies`), and a parameter tied to another (``tied``: GPT-2's ``wte`` / ``lm_head``:
    two layers' solutions could ask two placements of one tensor).
    """
    if "tp" not in mesh.axis_names or mesh.shape[mesh.axis_names.index("tp")] == 1:
        return strats
    tp = mesh.axis_names.index("tp")
    experts = expert_tp_strategies(node, strats, sizes, mesh, tp, itemsizes)
    if experts is not None:
        return experts
    out: list[Strategy] = []
    for s in strats:
        lab = s.axis_labels[tp]
        if not lab:
            if not s.op_collectives:  # vocab-parallel loss variants shard the class dim of another axis
                out.append(s)
            continue
        if lab in tokens or s.op_collectives or any(tied):
            continue
        out.extend(_torch_tp_roles(node, s, tp, lab, sizes, mesh, is_param, itemsizes))
    return out or strats[:1]


def _torch_tp_roles(
    node: Node,
    s: Strategy,
    tp: int,
    lab: str,
    sizes: Mapping[str, int],
    mesh: LogicalMesh,
    is_param: Sequence[bool],
    itemsizes: Sequence[float],
) -> list[Strategy]:
    sig = node.sig
    o = sig.outputs[0] if sig.outputs else ""

    def per_device(labels: str, layout: Layout, itemsize: float) -> float:
        """Bytes of one device's piece after the tp collective (sharded on the other axes only)."""
        full = math.prod(sizes[c] for c in labels) * itemsize
        return full / math.prod(n for i, (p, n) in enumerate(zip(layout, mesh.shape)) if i != tp and p != "R")

    def on_tp(lay: Layout, p: str) -> Layout:
        return lay[:tp] + (p,) + lay[tp + 1 :]

    def named(role: str) -> str:
        return s.name.replace(f"{lab}@{mesh.axis_names[tp]}", f"{lab}@{mesh.axis_names[tp]}:{role}")

    def coll(kind: str, nbytes: float, phase: str, role: str) -> OpCollective:
        return OpCollective(kind, tp, nbytes, phase, f"{role} {node.module or node.name}")

    lin = linear_operands(node, is_param)
    if lin is not None:
        a, w, _ = lin
        la, lw = sig.inputs[a], sig.inputs[w]
        if lab in lw and lab in o and lab not in la:
            kept = dataclasses.replace(s, name=named("colwise"), tp_role="colwise")
            gathered_out = (on_tp(s.out_layouts[0], "R"), *s.out_layouts[1:])
            ag = coll("all_gather", per_device(o, s.out_layouts[0], itemsizes[-1]), "forward", "colwise_gather")
            gather = dataclasses.replace(
                s,
                name=named("colwise_gather"),
                tp_role="colwise_gather",
                out_layouts=gathered_out,
                op_collectives=(ag,),
            )
            return [kept, gather]
        if lab in sig.reduced and lab in lw and lab in la:
            outs = (on_tp(s.out_layouts[0], "R"), *s.out_layouts[1:])
            ar = coll("all_reduce", per_device(o, s.out_layouts[0], itemsizes[-1]), "forward", "rowwise")
            row = dataclasses.replace(
                s, name=named("rowwise"), tp_role="rowwise", out_layouts=outs, op_collectives=(ar,)
            )
            ins = tuple(on_tp(lay, "R") if i == a else lay for i, lay in enumerate(s.in_layouts))
            grads = tuple(on_tp(lay, "R") if i == a else lay for i, lay in enumerate(s.in_grad_layouts))
            ag = coll("all_gather", per_device(la, s.in_layouts[a], itemsizes[a]), "backward", "rowwise_replicated")
            rep = dataclasses.replace(
                row,
                name=named("rowwise_replicated"),
                tp_role="rowwise_replicated",
                in_layouts=ins,
                in_grad_layouts=grads,
                op_collectives=(dataclasses.replace(ar, reason=f"rowwise_replicated {node.module or node.name}"), ag),
            )
            return [row, rep]
        return []
    embedding = not node.target.startswith("aten.") or node.target.startswith(EMBEDDING_TARGETS)
    if node.prim is Prim.EMBEDDING and embedding and is_param[0]:
        outs = (on_tp(s.out_layouts[0], "R"),)
        if lab in sig.reduced:
            ar = coll("all_reduce", per_device(o, s.out_layouts[0], itemsizes[-1]), "forward", "vocab")
            return [
                dataclasses.replace(s, name=named("vocab"), tp_role="vocab", out_layouts=outs, op_collectives=(ar,))
            ]
        ag = coll("all_gather", per_device(o, s.out_layouts[0], itemsizes[-1]), "forward", "embed_dim")
        return [
            dataclasses.replace(s, name=named("embed_dim"), tp_role="embed_dim", out_layouts=outs, op_collectives=(ag,))
        ]
    if lab in sig.reduced or any(p and lab in labels for p, labels in zip(is_param, sig.inputs)):
        return []
    return [s]


# ---- expert parallelism on tp (traced MoE layers, passes/moe.py) --------------------------------------
def routed_rows(node: Node, s: Strategy, mesh: LogicalMesh, tp: int | None) -> tuple[float, float, float]:
    """``(input, output saved, output held)``: the share of its layout's bytes the program keeps of the dispatch
    matmul's token input and of the combine matmul's output, whose layouts say ``R`` (1 elsewhere). Under the
    ``expert`` strategy (:func:`expert_tp_strategies`) ``backends/torch/moe.py`` runs the experts on the
    pairs a rank received (balanced routing: ``2 B S / tp`` of the ``2 B S`` routed pairs, as the
    all_to_all bytes): it keeps those tokens for the backward (``1 / tp``); each expert's result, which
    ``index_add`` keeps, and the combined results on the rank's own pairs, which the weighting keeps (``2 /
    tp`` of the combine's output); a deferred W reads the output gradient of the received rows (``1 / tp``).
    Priced whole, mixtral-8x7b's tp 4 stages were 4.6-8.6% over their rehearsal."""
    moe = node.attrs.get("moe") or {}
    if tp is None or not s.name.endswith(":expert") or moe.get("role") not in ("dispatch", "combine"):
        return 1.0, 1.0, 1.0
    p = float(mesh.shape[tp])
    return (1.0 / p, 1.0, 1.0) if moe["role"] == "dispatch" else (1.0, 2.0 / p, 1.0 / p)


def expert_tp_strategies(
    node: Node,
    strats: list[Strategy],
    sizes: Mapping[str, int],
    mesh: LogicalMesh,
    tp: int,
    itemsizes: Sequence[float],
) -> list[Strategy] | None:
    """The ``tp`` choices of a node ``passes/moe.py`` marked (None for any other node).

    Every marked node may stay replicated on ``tp`` (the router only that); or the module runs the ``expert`` role
    (``backends/torch/moe.py``): the expert weights (their permute: ``weight``) ``S(0)``, each rank
    owning ``num_experts / tp`` experts; ``dispatch`` takes replicated tokens and leaves the routed
    pairs sharded (``S(0)`` on the rows), ``inner`` nodes run on the rank's pairs, ``combine`` returns
    them whole. The layouts chain the choices: a replicated node next to a sharded one would need a tp
    resharding, which the torch runtime does not build (``intra_op.tp_forbidden``), so the ILP takes
    the whole module expert-parallel or not at all. The collectives are the runtime's, per call:
    dispatch: forward all_gather of the per-expert counts (int64, tp x experts) and all_to_all of the
    pairs, backward all_to_all and the all_gathers of the token
    gradient and of the router weights' gradient (f32); combine: forward all_to_all and the all_gather
    of the output, backward all_to_all. all_to_all bytes are the balanced share (pairs / tp, the
    output a rank receives if the router spreads tokens evenly; the real size follows the routing).
    Needs ``num_experts`` and the micro-batch's token count divisible by ``tp``.
    """
    moe = node.attrs.get("moe")
    if not moe:
        return None
    p = mesh.shape[tp]
    role, num_experts, k = str(moe["role"]), int(moe["num_experts"]), int(moe["top_k"])
    replicated = [s for s in strats if not s.axis_labels[tp] and not s.op_collectives]
    if num_experts % p or role == "router":
        return replicated or strats[:1]

    def on_tp(lay: Layout, pl: str) -> Layout:
        return lay[:tp] + (pl,) + lay[tp + 1 :]

    def named(s: Strategy, labels: tuple[str, ...]) -> str:
        return strategy_name(labels, mesh) + ":expert"

    out = list(replicated)
    sig = node.sig
    if role in ("weight", "inner"):
        lab = sig.inputs[0][0] if role == "weight" else sig.outputs[0][0]
        for s in strats:
            if s.axis_labels[tp] == lab and not s.op_collectives and lab not in sig.reduced:
                tp_role = "expert" if role == "weight" else ""
                out.append(dataclasses.replace(s, name=named(s, s.axis_labels), tp_role=tp_role))
        return out
    rows, feat = sig.inputs[0][0], sig.outputs[0][-1]
    if sizes[rows] % (k * p):
        return out
    reason = f"expert parallel {node.module or node.name}"
    for base in replicated:
        labels = on_tp(base.axis_labels, sig.fixed[0] if sig.fixed else "e")  # type: ignore[arg-type]
        w = on_tp(base.in_layouts[1], "S(0)")
        colls: tuple[OpCollective, ...]
        if role == "dispatch":
            pairs = sizes[rows] * sizes[sig.inputs[0][1]] * itemsizes[0]
            ins = (on_tp(base.in_layouts[0], "R"), w, *base.in_layouts[2:])
            outs = (on_tp(base.out_layouts[0], "S(0)"),)
            grads = (on_tp(base.in_grad_layouts[0], "R"), w, *base.in_grad_layouts[2:])
            colls = (
                OpCollective("all_gather", tp, p * num_experts * 8.0, "forward", f"{reason}: routing counts"),
                OpCollective("all_to_all", tp, pairs / p, "forward", f"{reason}: dispatch"),
                OpCollective("all_to_all", tp, pairs / p, "backward", f"{reason}: dispatch (gradient)"),
                OpCollective("all_gather", tp, pairs / k, "backward", f"{reason}: token gradient"),
                OpCollective("all_gather", tp, sizes[rows] * 4.0, "backward", f"{reason}: router weight gradient"),
            )
        else:
            pairs = sizes[rows] * sizes[feat] * itemsizes[-1]
            ins = (on_tp(base.in_layouts[0], "S(0)"), w, *base.in_layouts[2:])
            outs = (on_tp(base.out_layouts[0], "R"),)
            grads = (on_tp(base.in_grad_layouts[0], "S(0)"), w, *base.in_grad_layouts[2:])
            colls = (
                OpCollective("all_to_all", tp, pairs / p, "forward", f"{reason}: combine"),
                OpCollective("all_gather", tp, pairs / k, "forward", f"{reason}: output"),
                OpCollective("all_to_all", tp, pairs / p, "backward", f"{reason}: combine (gradient)"),
            )
        out.append(
            Strategy(
                named(base, labels),
                labels,
                ins,
                outs,
                grads,
                base.work_divisor * p,
                colls,
            )
        )
    return out
