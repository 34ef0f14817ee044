"""A searched or hand-made plan of ``dp * cp`` replicas of ``S / cp`` tokens written as the Plan of context parallelism ``cp``.

The search prices cp (``search/pipeline/cp_costs.ContextParallelCosts``) as ``dp * cp`` data-parallel
replicas of the sequence's ``S / cp`` tokens: every op but attention runs per token, the parameters are
replicated and their gradients synchronized over all ``dp * cp`` ranks. The plan built from such a
candidate (``plan_build.build_plan``) is that flat view; :func:`with_cp` writes it back as the Plan the
program runs: the whole sequence in ``training``, stages of ``dp`` replicas with ``Stage.cp`` (replica
``i * cp + c`` of the flat layout is rank block ``(i, c)``: ranks ``(dp, cp, tp)``, tp fastest), the
records completed by ``search/program/context_parallel.complete`` from the layers' ILP records, and the
MFU of the whole sequence's FLOPs (every query meets every key: :func:`model_flops` at ``S``; both MFUs,
the devices used and the whole cluster), and the runners-up's dp marked as counting dp x cp.

Used by ``search/entry/hand_plan.py`` (a hand layout's ``cp``) and ``search/entry/planner.py`` (the
search's cp degrees, ``search/program/realizable.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from partita.ir import Graph
from partita.plan import Collective, Plan, Stage, validate
from partita.search.pricing.config import TrainingConfig
from partita.search.pricing.context_parallel import local_training
from partita.search.program import context_parallel as cp_records

_FLOPS: dict[tuple[int, int], tuple[Graph, float, float]] = {}


def model_flops(graph: Graph, training: TrainingConfig, linear_batch: bool) -> float:
    """Forward + backward FLOPs of one step (the whole global batch), as the plan records them.

    Training FLOPs are affine in the batch: evaluated at B = 1 and 2 once per (graph, seq) and
    extrapolated (``layer_stats`` substitutes sympy per node: too slow to call per evaluation)."""
    from partita.passes.annotate import layer_stats

    key = (id(graph), training.seq_len)
    hit = _FLOPS.get(key)
    if hit is None or hit[0] is not graph:
        f1, f2 = (
            float(sum(s.forward_flops + s.backward_flops for s in layer_stats(graph, {"B": b, "S": training.seq_len})))
            for b in (1, 2)
        )
        hit = _FLOPS[key] = (graph, f1, f2)
    _, f1, f2 = hit
    flops = f1 + (f2 - f1) * (training.global_batch - 1)
    return flops * training.global_batch if linear_batch else flops


def with_cp(plan: Plan, search: Any, full: TrainingConfig, dp: int, cp: int) -> Plan:
    """``plan`` (laid out for ``dp * cp`` replicas of ``S / cp`` tokens by ``search``) as the Plan of
    ``cp`` (module docstring); ``full``: the training configuration at the whole sequence."""
    graph = search.graph
    stages = tuple(dataclasses.replace(s, dp=dp, cp=cp, collectives=ilp_records(search, s, plan)) for s in plan.stages)
    linear = search.costs.linear_batch  # as plan_build counts the FLOPs
    local = model_flops(graph, local_training(full, cp), linear)
    scale = model_flops(graph, full, linear) / local if local else 1.0
    predicted = {
        **plan.predicted,
        **{k: plan.predicted[k] * scale for k in ("mfu", "mfu_cluster") if k in plan.predicted},
    }
    # runners-up of the same search: their dp counts the dp x cp replicas of S / cp tokens
    alts = [
        {**a, "summary": f"{a['summary']} (cp {cp}: dp counts dp x cp)"} for a in plan.search.get("alternatives") or []
    ]
    search = {**plan.search, "alternatives": alts} if "alternatives" in plan.search else plan.search
    out = dataclasses.replace(plan, training=full.to_dict(), stages=stages, predicted=predicted, search=search)
    out = cp_records.complete(out, graph)
    validate(out)
    return out


def ilp_records(search: Any, s: Stage, plan: Plan) -> tuple[Collective, ...]:
    """Stage ``s``'s tensor-parallel records per micro-batch, from its layers' ILP solutions (``plan_build``'s)."""
    index = {lay.name: i for i, lay in enumerate(search.graph.layers)}
    dev = next(d for d in search.types if d.name == s.device_type)
    mb = plan.micro_batch_size
    scale = float(mb) if search.costs.linear_batch else 1.0
    out: list[Collective] = []
    for name in s.layers:
        for c in search.costs.solution(index[name], dev, s.tp, mb).collectives:
            out.append(c if c.phase == "optimizer" else dataclasses.replace(c, bytes=c.bytes * scale))
    return tuple(out)


def search_options(options: Any, cp: int) -> Any:
    """The search options of a cp search (``planner._plan_one``): what the cp records and layouts describe,
    no selective recompute, no zbv, one device type per stage."""
    from partita.errors import ConfigError

    recompute = tuple(r for r in options.recompute if r != "selective")
    if not recompute:
        raise ConfigError(f"cp={cp} with selective recompute only: cp plans recompute none or full.", "")
    kept = tuple(x for x in options.schedules if x != "zbv") or ("1f1b",)
    return dataclasses.replace(options, recompute=recompute, schedules=kept, uneven_shares=False)
