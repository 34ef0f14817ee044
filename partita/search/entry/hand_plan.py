"""A Plan for a hand-made Megatron layout (tp, pp, dp, micro-batch, ZeRO, recompute, sequence parallelism), priced by the search's model.

The what-if path of issue 15 (``partita compile MODEL --tp T --pp P --dp D ...``): the layout is
checked and priced as ``search/evaluate.evaluate_config`` prices it (blocks split evenly over
stages, the cluster's first device type), with the tensor parallelism the program builds
(``tp_style="torch"`` for a torch graph: the ILP picks each module's role, ``Stage.tp_plan``), and
the winning-candidate path of the planner (``search/plan_build.build_plan``) writes the Plan, so its records (collectives per stage with bytes, memory by category, FLOPs) are the ones a
searched plan carries. Used by ``bench/rehearse.py`` and the rehearsal tests. ``sequence_parallel``:
Megatron's sequence parallelism, written into that Plan by ``search/program/sequence_parallel.py`` (roles,
records, memory); no search builds it. ``cp``: context parallelism (issue 36): the layers solved at ``S / cp``
by ``search/pipeline/cp_costs.ContextParallelCosts`` (what ``evaluate --cp`` prices), the plan laid out for
``dp * cp`` replicas of ``S / cp`` tokens (ranks ``(dp, cp, tp)``, tp fastest), then written back as stages of
``dp`` replicas with ``Stage.cp`` over the whole sequence and completed by ``search/program/context_parallel.py``
(K/V all-gathers over ``cp``, dp records over ``dp_cp``). The PyTorch program builds it for one stage of dp x cp ranks (``backends/torch/emit.check_cp``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from partita.cluster import Cluster
from partita.ir import Graph
from partita.plan import Plan
from partita.search.entry.evaluate import check_layout, megatron_split, stage_tps, tp_style_of
from partita.search.entry.layout_price import layout_candidate
from partita.search.entry.planner import Search
from partita.search.pipeline.cp_costs import ContextParallelCosts
from partita.search.pipeline.stage_cost import SolverCosts
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program import chunk_layout, records, v_layout
from partita.search.program.cp_layout import with_cp
from partita.search.program.plan_build import build_plan
from partita.search.program.sequence_parallel import apply as sequence_parallel_apply
from partita.search.program.sequence_parallel import check as sequence_parallel_check


def hand_plan(
    graph: Graph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    tp: int | Sequence[int],
    pp: int,
    dp: int,
    micro_batch: int,
    zero_stage: int = 0,
    recompute: str = "none",
    schedule: str = "1f1b",
    sequence_parallel: bool = False,
    num_virtual: int = 1,
    cp: int = 1,
) -> Plan:
    """The Plan of one Megatron layout (module docstring); ConfigError if it cannot be built. ``tp``:
    one degree for every stage, or one per stage (``evaluate.stage_tps``: a heterogeneous pipeline)."""
    from partita.errors import ConfigError

    t0 = time.perf_counter()
    notes = check_layout(
        graph,
        cluster,
        training,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=micro_batch,
        schedule=schedule,
        num_virtual=num_virtual,
        cp=cp,
    )
    if cp > 1 and schedule == "zbv":
        raise ConfigError(
            f"context parallelism (cp={cp}) with the zbv schedule has no Plan layout yet: the records of the two "
            "together are not written.",
            "use --schedule 1f1b, gpipe, zb_h1 or interleaved_1f1b with --cp.",
        )
    if sequence_parallel:  # built and recorded by search/program/sequence_parallel.py after the plan without it
        sequence_parallel_check(
            tp=tp, dp=dp, zero_stage=zero_stage, recompute=recompute, schedule=schedule, num_virtual=num_virtual, cp=cp
        )
    v = num_virtual if schedule == "interleaved_1f1b" else 1  # model chunks per rank group (chunk_layout.py)
    if zero_stage and dp * cp == 1:
        notes.append(f"ZeRO-{zero_stage} with dp=1 shards nothing: priced as ZeRO-0.")
        zero_stage = 0
    tps = stage_tps(tp, pp)
    opts = SearchOptions(zero_stages=(zero_stage,), recompute=(recompute,), max_layer_units=0, max_tp=max(tps))
    # the program's own tp (issue 15 item 1): torch graphs take the roles backends/torch/tp.py builds
    if cp > 1:  # layers at S / cp, plus the attention's gathers (evaluate_config's costs for cp)
        costs: SolverCosts = ContextParallelCosts(graph, cluster, training, cp, tp_style=tp_style_of(graph))
    else:
        costs = SolverCosts(graph, cluster, training, tp_style=tp_style_of(graph))  # evaluate_model's too
    full, dp_cp = training, dp * cp  # laid out as dp * cp replicas of S / cp tokens (module docstring)
    search = Search(graph, cluster, costs.training, opts, costs, None)
    dev = cluster.device_types()[0]
    m = full.global_batch // (micro_batch * dp)
    cand = layout_candidate(  # evaluate_config's pricing of the same layout (issue 32 item 5)
        search,
        dev,
        tps=tps,
        ranges=megatron_split(graph, pp),
        dp=dp_cp,
        micro_batch=micro_batch,
        num_micro_batches=m,
        schedule=schedule,
        num_virtual=v,
    )
    if isinstance(cand, v_layout.VCandidate):  # zbv: the V layout layout_candidate priced
        plan = v_layout.lay_out(search, build_plan(search, [cand], time.perf_counter() - t0), cand)
    else:
        plan = chunk_layout.lay_out(search, build_plan(search, [cand], time.perf_counter() - t0))
    if sequence_parallel:
        plan = sequence_parallel_apply(plan, graph)
    if cp > 1:
        plan = with_cp(plan, search, full, dp, cp)
    plan = records.memory_items(plan, graph)  # memory beyond tensors, host peak (issue 33)
    layout = {
        "tp": tps[0] if len(set(tps)) == 1 else list(tps),
        "pp": pp,
        "dp": dp,
        "micro_batch": micro_batch,
        "zero_stage": zero_stage,
        "recompute": recompute,
        "schedule": schedule,
        **({"sequence_parallel": True} if sequence_parallel else {}),
        **({"cp": cp} if cp > 1 else {}),
        **({"num_virtual_stages": v} if v > 1 else {}),
        "dtype": training.dtype,
        "device": dev.name,
        "notes": notes,
    }
    return dataclasses.replace(plan, search={**plan.search, "hand_layout": layout})
