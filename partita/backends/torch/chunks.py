"""Model chunks (virtual stages) for the torch program: a chunked Plan seen per pipeline position.

Used by ``backends/torch/emit.py`` (no torch import: the emitter runs at compile time). A chunked
plan (``Plan.chunked``: interleaved 1F1B with ``v > 1`` chunks per rank group, or ZB-V) lists one
Stage per virtual stage; the program builds one module per rank holding the layers of all its chunks
(one optimizer, one gradient sync, tied weights shared in memory when both chunks hold them), and
``backends/torch/schedule.P2PPipeline`` runs each action on its chunk's layers only. So the program's
``PROGRAM["stages"]`` are the positions (:func:`physical_plan`: every chunk of a position merged into
one Stage whose layers are the chunks' layers in model order and whose records are the chunks'
records together), and ``PROGRAM["chunks"]`` (:func:`chunk_table`) says which layers each virtual
stage runs on which position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from partita.plan import Plan, Stage, chunk_position


def position_of(plan: Plan) -> list[int]:
    """Per listed stage, its pipeline position (its own index in a plain plan)."""
    if not plan.chunked:
        return list(range(plan.num_stages))
    return [chunk_position(plan.schedule, s.index, plan.num_positions) for s in plan.stages]


def chunk_table(plan: Plan) -> list[dict[str, Any]]:
    """``[{"stage", "position", "layers"}]`` per virtual stage, in model order."""
    pos = position_of(plan)
    return [{"stage": s.index, "position": pos[s.index], "layers": list(s.layers)} for s in plan.stages]


def _merge(index: int, group: tuple[Stage, ...]) -> Stage:
    head = group[0]

    def union(field: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in group:
            out.update(getattr(s, field))
        return out

    return dataclasses.replace(
        head,
        index=index,
        layers=tuple(x for s in group for x in s.layers),
        param_placements=union("param_placements"),
        op_strategies=union("op_strategies"),
        tp_plan=union("tp_plan"),
        collectives=tuple(c for s in group for c in s.collectives),
        predicted=union("predicted"),
        # every chunk's buckets in the order the rank's backward finishes them: the last chunk's first (the
        # last micro-batch's backward runs the chunks from the model's end down), each issued from its own
        # chunk's last backward (grad_buckets.GradBuckets counts every parameter's accumulations)
        grad_buckets=tuple(b for s in reversed(group) for b in s.grad_buckets),
    )


def physical_plan(plan: Plan) -> Plan:
    """One Stage per pipeline position (chunks merged, module docstring); ``plan`` when not chunked.

    Not a valid Plan on its own (its stages' layers are not contiguous): the emitter's view only."""
    if not plan.chunked:
        return plan
    return dataclasses.replace(plan, stages=tuple(_merge(r, g) for r, g in enumerate(plan.positions())))


def placement_lines(plan: Plan) -> list[str]:
    """Human lines naming the chunk placement (the program's docstring and ``make_runner``)."""
    if not plan.chunked:
        return []
    how = (
        "V placement: rank group r holds stages r and 2p-1-r"
        if plan.schedule == "zbv"
        else ("loop placement: chunk c of rank group r is stage c*p + r")
    )
    lines = [
        f"Model chunks ({plan.schedule}, {len(plan.stages)} virtual stages on {plan.num_positions} rank groups, {how}):"
    ]
    for group in plan.positions():
        parts = "; ".join(f"stage {s.index} = {', '.join(s.layers)}" for s in group)
        lines.append(f"  ranks {list(group[0].ranks)}: {parts}")
    return lines
