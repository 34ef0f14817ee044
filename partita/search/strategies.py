"""Sharding strategies of one IR node on a logical mesh, read off its dimension signature.

Used by ``search/intra_op.py``, which prices each strategy and picks one per node. One generic
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
* embedding vocab sharding and MoE expert parallelism need no rule: ``v`` is reduced (partial
  lookup result, all-reduce) and the expert label ``e`` is an ordinary label of the dispatch
  einsum and the expert matmuls, so sharding it is expert parallelism and the ``S(b) -> S(e)``
  resharding before it is the token all-to-all (``search/reshard.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

from partita.ir import Node, Prim
from partita.search.mesh import LogicalMesh
from partita.search.reshard import Layout


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
    if node.prim is Prim.MATMUL and len(sig.inputs) == 3 and set(sig.inputs[2]) <= set(sig.outputs[0]):
        # a linear's bias is added after the contraction: its grad sums the (replicated) output grad
        bias = grads[2]
        grads = (*grads[:2], tuple("R" if lab in sig.reduced and lab else p for p, lab in zip(bias, axis_labels)))
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
