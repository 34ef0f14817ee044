"""Lay a priced interleaved-1F1B plan out as model chunks (virtual stages) the torch runtime runs.

Sits in ``search/`` after ``plan_build.build_plan``: the planner prices interleaved 1F1B per pipeline
position (one contiguous range of layers per rank group, its F/B/W times spread over its ``v``
chunks, ``schedule_cost._chunks``). The program needs the chunks themselves: with loop placement
chunk ``c`` of rank group ``r`` is virtual stage ``c * p + r``, and the model is cut into ``p * v``
consecutive pieces in that order (``plan.py``: a chunked plan lists one Stage per virtual stage).

:func:`lay_out` cuts rank group ``r``'s ``n_r`` layers into ``v`` pieces (``n_r // v`` each, the
remainder on the piece that holds the model's first layer, rank group 0's chunk 0, or its last,
rank group ``p - 1``'s last chunk), lays the pieces out in virtual-stage order over the model's
layers, and keeps the layout only when every rank group then holds the same layer kinds
(``ir.Layer.kind``: identical up to renaming) in the same order as the range it was priced with:
then each group's compute, memory and tensor-parallel collectives are the ones priced, and the
simulated interleaved action list prices its p2p (``schedule.p2p_multiplier``). Otherwise it raises
``ConfigError`` (the priced plan is not one the runtime can run). The chunks' placements, strategies,
tp roles and tensor-parallel records come from the per-layer solutions (``SolverCosts.solution``), as
``build_plan`` takes them, and ``records.complete`` adds the rest for the chunked layout (p2p of every
chunk, one dp gradient sync per rank group, tied weights across rank groups).

Used by ``search/entry/hand_plan.py`` (``partita compile --schedule interleaved_1f1b --virtual-stages V``).
ZB-V's V placement puts the model's first and last layers on rank group 0, which a position-priced
candidate never has: ``search/program/v_layout.py`` prices and lays out ZB-V on its own chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from partita.errors import ConfigError
from partita.plan import Collective, Plan, Stage, chunk_position, validate
from partita.search.program import records
from partita.search.program.plan_build import _held_names

# per micro-batch times of the rank group, split evenly over its chunks (as the planner priced them);
# per-device quantities (memory, FLOPs per step, in-flight counts) stay the rank group's on every chunk
TIME_KEYS = ("time_s", "compute_s", "comm_s", "forward_s", "f_action_s", "b_action_s", "w_action_s")


def piece_sizes(counts: list[int], v: int) -> list[int]:
    """Layers per virtual stage (model order) for rank groups of ``counts`` layers, ``v`` chunks each:
    ``n_r // v``; a remainder goes to the piece at the model's start (rank group 0, chunk 0) or end
    (rank group ``p - 1``, last chunk), and nowhere else."""
    p = len(counts)
    out = [counts[r] // v for _ in range(v) for r in range(p)]
    for r in range(p):
        extra = counts[r] % v
        if extra and 0 < r < p - 1:
            raise ConfigError(
                f"rank group {r} holds {counts[r]} layers, which do not split into {v} chunks.",
                f"use a layout whose middle stages hold a multiple of {v} layers.",
            )
        if extra:
            out[0 if r == 0 else -1] += extra
    return out


def runnable(cand: Any) -> bool:
    """Can the torch runtime run this interleaved candidate (``plan_build.Candidate``) as model chunks?

    Its rank groups' layers must cut into chunks that keep their priced kinds (:func:`lay_out`), each
    group one device type (no uneven batch shares), and no group may shard with ZeRO-2/3 over dp > 1
    (FSDP2 would sync per backward while the rank's other chunks accumulate:
    ``backends/torch/emit.check_schedule``; ZeRO-1 reduces once after the last action)."""
    if cand.schedule != "interleaved_1f1b" or cand.v < 2:
        return True
    s = cand.search
    if s.graph.meta.get("framework") == "jax":  # no per-chunk JAX records are built (search/pricing/config.py)
        return False
    for p in cand.stages:
        z = p.option.combos[p.combo][0]
        if len(p.option.devices) > 1 or (z >= 2 and cand.dp > 1):
            return False
    spans = [(s.units[p.k][0], s.units[p.j - 1][1]) for p in cand.stages]
    try:
        _bounds(s.graph, [list(range(a, b)) for a, b in spans], "interleaved_1f1b", cand.v)
    except ConfigError:
        return False
    return True


def check_ranges(g: Any, ranges: list[tuple[int, int]], v: int) -> None:
    """ConfigError (:func:`lay_out`'s words) unless rank groups holding the layer ranges ``ranges`` cut
    into ``v`` chunks each that keep their kinds: what ``partita evaluate`` and ``compile`` of an
    interleaved hand layout both require (``evaluate.check_layout``). Uneven groups pass when the extra
    layers sit at the model's ends: Llama 3 405B's 126 blocks on 16 rank groups of 8 chunks, the
    embedding and 7 blocks on group 0 and 7 blocks and the head on group 15, each chunk one layer."""
    _bounds(g, [list(range(a, b)) for a, b in ranges], "interleaved_1f1b", v)


def _bounds(g: Any, groups: list[list[int]], schedule: str, v: int) -> list[tuple[int, int]]:
    """Layer ranges of the ``p * v`` virtual stages for rank groups holding layer indices ``groups``;
    ConfigError unless every group keeps its kinds in order (module docstring)."""
    p = len(groups)
    sizes = piece_sizes([len(x) for x in groups], v)
    bounds, lo = [], 0
    for n in sizes:
        bounds.append((lo, lo + n))
        lo += n
    for r, want_idx in enumerate(groups):
        mine = [bounds[vs] for vs in range(p * v) if chunk_position(schedule, vs, p) == r]
        got = [g.layers[i].kind for a, b in mine for i in range(a, b)]
        want = [g.layers[i].kind for i in want_idx]
        if got != want or any(a == b for a, b in mine):
            raise ConfigError(
                f"interleaved 1F1B with {v} chunks per rank group cannot hold what rank group {r} was priced with "
                f"({len(want_idx)} layers): the loop placement would give it other layers.",
                f"use a layout whose stages hold a multiple of {v} blocks each, or --schedule 1f1b.",
            )
    return bounds


def lay_out(search: Any, plan: Plan) -> Plan:
    """``plan`` (interleaved, ``num_virtual_stages > 1``, one Stage per rank group) as a chunked plan
    (module docstring); ConfigError when the chunks would not hold what was priced."""
    g, v = search.graph, plan.num_virtual_stages
    if plan.schedule != "interleaved_1f1b" or v < 2 or plan.chunked or plan.num_stages < 2:
        return plan
    if g.meta.get("framework") == "jax":  # JAX per-chunk records are not built: the what-if plan stays per group
        return plan
    index = {lay.name: i for i, lay in enumerate(g.layers)}
    p = plan.num_stages
    bounds = _bounds(g, [[index[n] for n in s.layers] for s in plan.stages], plan.schedule, v)
    stages = []
    for vs, (a0, b0) in enumerate(bounds):
        head = plan.stages[chunk_position(plan.schedule, vs, p)]
        stages.append(_chunk(search, head, vs, a0, b0, v, plan.micro_batch_size))
    chunked = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, grad_buckets=()) for s in stages))
    if any(s.grad_buckets for s in plan.stages):  # each chunk's own buckets (records.grad_buckets), as priced
        chunked = records.with_grad_buckets(chunked, g)
    chunked = records.complete(chunked, g)
    validate(chunked)
    return chunked


def _chunk(search: Any, head: Stage, index: int, a0: int, b0: int, v: int, mb: int) -> Stage:
    """Virtual stage ``index`` (layers ``a0 .. b0 - 1``) on ``head``'s rank group, from the layer solutions."""
    g = search.graph
    dev = next((d for d in search.types if d.name == head.device_type), None)
    if dev is None or head.batch_shares:
        raise ConfigError("a stage mixing device types cannot be cut into chunks.", "use one device type per stage.")
    placements: dict[str, tuple[str, ...]] = {}
    strategies: dict[str, str] = {}
    tp_plan: dict[str, str] = {}
    colls: list[Collective] = []
    scale = float(mb) if search.costs.linear_batch else 1.0
    for li in range(a0, b0):
        sol = search.costs.solution(li, dev, head.tp, mb)
        placements.update({k: tuple(x) for k, x in sol.param_placements.items()})
        strategies.update(sol.op_strategies)
        tp_plan.update(getattr(sol, "tp_plan", {}))
        for cc in sol.collectives:
            colls.append(cc if cc.phase == "optimizer" else dataclasses.replace(cc, bytes=cc.bytes * scale))
    predicted = {k: (x / v if k in TIME_KEYS else x) for k, x in head.predicted.items()}
    return dataclasses.replace(
        head,
        index=index,
        layers=tuple(lay.name for lay in g.layers[a0:b0]),
        param_placements=_held_names(g, a0, b0, placements),
        op_strategies=strategies,
        tp_plan=tp_plan if head.tp > 1 else {},
        collectives=tuple(colls),
        predicted=predicted,
    )
