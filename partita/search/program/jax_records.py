"""The Plan's collective records for a JAX model: every collective the emitted JAX program issues per step.

Used by ``search/program/plan_build.py`` for graphs traced from JAX (``graph.meta["framework"] == "jax"``); the
torch twin is ``search/program/records.py``. These records are the single prediction: the generated
``program_jax.py`` carries them (``backends/jax/emit.py`` folds them to ``kind@axis``), its run compares
the HLO it compiled with them (``backends/jax/train.fidelity_report``) and ``partita rehearse`` compares
the step XLA compiles at full size with them. One record per HLO collective op the compiled step
issues (``count`` = how many times per step), ``bytes`` per device of the whole tensor the op moves
(all-reduce: the tensor; all-gather: the gathered result; reduce-scatter: its input), in the dtype the
program holds: the JAX program differentiates the model's own parameters as the model declares them
(every JAX model here: f32) and applies no mixed precision, so gradients, their sync and the ZeRO
gathers move the parameters' dtype whatever ``training.dtype`` says. Which line issues each
(``backends/jax/train.StageRun``):

* tensor parallel (the layer ILP's records, as XLA's SPMD partitioner lowers the plan's layouts):
  per micro-batch, ``count * m``, the gradient all-reduce of a parameter whose tp gradient is partial
  too (XLA reduces it in each micro-batch's backward: the gradient accumulator has the parameter's
  layout). Each record is one HLO op: the program turns XLA's CPU all-reduce combiner off
  (``backends/jax/train.NO_COMBINE``), so no two all-reduces merge by adjacency. Where XLA's SPMD
  partitioner realizes a strategy with other collectives than the ILP's resharding (tp layouts that
  shard the sequence of the loss at seq 32 on jax-gpt-tiny: an extra backward all-gather and a
  scalar all-reduce in place of the ILP's gather), the records differ from the program; the
  rehearsal reports it (known gap, issue 15).
* data parallel, ZeRO-0: one all-reduce over ``dp`` per step of all the stage's gradients, flattened
  into one buffer per dtype (``train._flat_psum``: a ``psum`` of several arrays would lower to one
  all-reduce each).
* ZeRO-1/2/3: every parameter whose largest dimension divisible by ``dp`` (times its tp split) exists
  is dp-sharded (``parallel.zero_spec``); each such tensor has its own layout, so its collectives are
  its own ops: ZeRO-1 one reduce-scatter per tensor in the update and one all-gather per tensor of
  the updated parameters; ZeRO-2 one reduce-scatter per tensor per micro-batch (``accumulate``) and
  the all-gathers after the update; ZeRO-3 one all-gather per tensor per micro-batch (``replicas``:
  the gathered copy is a residual of that micro-batch's backward, not gathered again) and its
  transpose, one reduce-scatter per tensor per micro-batch. The tensors no dp layout divides sync in
  one flat all-reduce (``_flat_psum``): per step (ZeRO-1), per micro-batch (ZeRO-2); under
  ZeRO-3 each one's own all-reduce per micro-batch (the transpose of its broadcast to the replicas).
* pipeline: per boundary one send per micro-batch and model chunk (``jax.device_put`` onto the next
  stage's mesh), bytes of one replica's share of the boundary activations (the program counts its
  sends; they are no HLO op). The cotangents travelling back are not counted.
* no gradient clipping and no loss scaling: the JAX program's optimizer (``emit._optimizer_src``)
  applies neither, so nothing is recorded for them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from partita.ir import Graph
from partita.plan import Collective

AXES = ("dp", "tp")
_SHARD = re.compile(r"S\((-?\d+)\)")


@dataclasses.dataclass(frozen=True)
class HeldParam:
    """One parameter as the stage's program holds it: its per-device bytes with only tp applied (what
    a dp collective of it moves) and whether ZeRO shards it over dp."""

    fqn: str
    shape: tuple[int, ...]
    itemsize: int
    tp_dims: tuple[int, ...]  # dims the plan splits over tp
    dp_dim: int | None  # the dim ZeRO shards over dp (None: no dp layout divides it, or no ZeRO)

    def tp_bytes(self, tp: int) -> float:
        n = float(self.itemsize)
        for s in self.shape:
            n *= s
        return n / (tp if self.tp_dims else 1)


def zero_dim(shape: Sequence[int], tp_dims: Sequence[int], dp: int, tp: int) -> int | None:
    """The dim ZeRO shards over dp: the largest one whose size divides by dp times its tp split
    (``backends/jax/parallel.zero_spec``, which the program applies; a test checks they agree)."""
    if dp == 1:
        return None
    for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[d] % ((tp if d in tp_dims else 1) * dp) == 0:
            return d
    return None


def _tp_dims(placement: Sequence[str], ndim: int) -> tuple[int, ...]:
    """Dims split over tp by a (dp, tp) placement such as ``("R", "S(1)")``."""
    out = []
    for axis, p in zip(AXES, placement):
        m = _SHARD.fullmatch(p)
        if axis == "tp" and m:
            d = int(m.group(1))
            out.append(d + ndim if d < 0 else d)
    return tuple(out)


def stage_params(
    graph: Graph, layers: Sequence[str], placements: Mapping[str, Sequence[str]], dp: int, tp: int, zero: int
) -> list[HeldParam]:
    """The parameters of the stage's layers, in layer order, with their tp and ZeRO layouts. A
    repeated layer the plan lists no placements for takes its first same-kind layer's, by position
    (``backends/jax/emit._complete`` does the same for the program)."""
    by_name = {lay.name: lay for lay in graph.layers}
    out: list[HeldParam] = []
    seen: set[str] = set()
    for name in layers:
        lay = by_name[name]
        src = lay
        fqns = [graph.tensors[t].fqn or t for t in lay.params]
        if tp > 1 and not any(f in placements for f in fqns):
            src = next(
                (s for s in graph.layers if s.kind == lay.kind and s.params and _placed(graph, s, placements)), lay
            )
        for t, ts in zip(lay.params, src.params):
            ten = graph.tensors[t]
            fqn = ten.fqn or t
            if t in seen:
                continue
            seen.add(t)
            shape = tuple(int(s) for s in ten.shape)
            pl = placements.get(graph.tensors[ts].fqn or ts, ("R", "R")) if tp > 1 else ("R", "R")
            dims = _tp_dims(pl, len(shape))
            dp_dim = zero_dim(shape, dims, dp, tp) if zero >= 1 and dp > 1 else None
            out.append(HeldParam(fqn, shape, ten.itemsize, dims, dp_dim))
    return out


def _placed(graph: Graph, lay: Any, placements: Mapping[str, Sequence[str]]) -> bool:
    return all((graph.tensors[t].fqn or t) in placements for t in lay.params)


def dp_records(params: Sequence[HeldParam], dp: int, tp: int, zero: int, m: int) -> list[Collective]:
    """The data-parallel collectives of a stage per step (module docstring), one record per HLO op kind
    and tensor."""
    if dp == 1 or not params:
        return []
    out: list[Collective] = []
    sharded = [p for p in params if p.dp_dim is not None]
    rest = [p for p in params if p.dp_dim is None]
    if zero == 0:
        return _bucketed(params, tp, 1, "optimizer", "gradient sync")
    per_mb = zero >= 2  # ZeRO-2/3 reduce every micro-batch, ZeRO-1 once per step
    n = m if per_mb else 1
    phase = "backward" if per_mb else "optimizer"
    for p in sharded:
        out.append(Collective("reduce_scatter", "dp", p.tp_bytes(tp), n, phase, f"ZeRO-{zero} gradient {p.fqn}"))
    if rest and zero >= 3:  # the transpose of each one's broadcast to the replicas, inside the backward
        for p in rest:
            out.append(
                Collective("all_reduce", "dp", p.tp_bytes(tp), m, "backward", f"gradient {p.fqn} (no dp layout)")
            )
    elif rest:
        out += _bucketed(rest, tp, n, phase, f"gradients no dp layout divides ({len(rest)} tensors)")
    for p in sharded:
        if zero >= 3:
            why = f"ZeRO-3 parameter {p.fqn}, once per micro-batch"
            out.append(Collective("all_gather", "dp", p.tp_bytes(tp), m, "forward", why))
        else:
            out.append(Collective("all_gather", "dp", p.tp_bytes(tp), 1, "optimizer", f"ZeRO-{zero} updated {p.fqn}"))
    return out


def _bucketed(params: Sequence[HeldParam], tp: int, count: int, phase: str, why: str) -> list[Collective]:
    """One all-reduce per dtype of the gradients flattened into one buffer (``train._flat_psum``)."""
    by_item: dict[int, float] = {}
    for p in params:
        by_item[p.itemsize] = by_item.get(p.itemsize, 0.0) + p.tp_bytes(tp)
    return [Collective("all_reduce", "dp", b, count, phase, f"{why} (one flat bucket)") for b in by_item.values()]


def jax_records(
    search: Any,
    best: Any,
    i: int,
    p: Any,
    a0: int,
    b0: int,
    z: int,
    colls: Sequence[Collective],
    placements: Mapping[str, Sequence[str]],
) -> list[Collective]:
    """Stage ``i``'s records (module docstring) from the ILP's per-micro-batch ``colls`` and the plan's
    structure: ``best`` the planner's Candidate, ``p`` its StagePick, layers ``a0:b0``, ZeRO stage ``z``."""
    g = search.graph
    dev0, tp, mb = p.option.devices[0][0], p.option.tp, p.option.devices[0][2]
    # the ILP's own dp gradient records (if any) are replaced by the program's sync below
    ilp = [c for c in colls if not (c.axis == "dp" and c.phase == "optimizer")]
    # every ILP record runs once per micro-batch: a parameter's partial tp gradient too (the ILP's
    # "optimizer" phase), which XLA reduces inside each micro-batch's backward (the accumulator has the
    # parameter's layout), not once per step
    out = [
        dataclasses.replace(c, count=c.count * best.m, phase="backward" if c.phase == "optimizer" else c.phase)
        for c in ilp
    ]
    layers = [lay.name for lay in g.layers[a0:b0]]
    out += dp_records(stage_params(g, layers, placements, best.dp, tp, z), best.dp, tp, z, best.m)
    if i + 1 < len(best.stages):
        bnd = float(search.costs.layer(b0 - 1, dev0, tp, mb)[0].boundary_bytes)
        out.append(Collective("p2p", "pp", bnd, best.m * best.v, "forward", f"activation to stage {i + 1}"))
    return out
