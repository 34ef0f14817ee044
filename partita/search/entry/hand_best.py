"""The best Megatron-style hand layout over all GPUs of a type: what the compile report compares with.

Sits beside ``search/entry/evaluate.py`` and ``search/entry/hand_plan.py`` (it prices layouts with the same
path: ``Search.arrays`` with the tensor parallelism ``partita compile --tp`` emits, blocks split
evenly over the stages) and
is called once per compile (``driver.Traced.plan``) to give the report a yardstick a user would
pick by hand (issue 18): every ``tp`` (power of two, within a node, dividing the heads and block
weight dims) x ``pp`` (dividing the blocks) x ``dp`` with ``dp * tp * pp`` = every device of the
cluster's first device type, every micro-batch (power of two dividing the replica's batch),
every stage of it placing something on tp where tp > 1 (``Stage.tp_shards_nothing``, as the search), with the fastest ZeRO stage and recompute policy (the same on every stage) that fits memory, on
the 1F1B schedule in the plan's precision. The record it returns goes into ``plan.search``
(``"best_hand_layout"``): the layout, its step time, its largest memory per device, the devices
it uses, and how many layouts were priced. When no layout over all devices fits, it says so and
keeps the fastest that came closest (``fits: false``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from partita.cluster import Cluster
from partita.device_reserve import tensor_cap
from partita.errors import ConfigError
from partita.ir import Graph
from partita.search.entry.evaluate import block_kind, check_layout, megatron_split, tp_dims, tp_style_of
from partita.search.entry.planner import Option, Search, powers_of_two
from partita.search.pipeline import schedule as sched
from partita.search.pipeline.stage_cost import SolverCosts
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program.plan_build import Candidate, StagePick

SCHEDULE = "1f1b"


def _layouts(graph: Graph, cluster: Cluster, training: TrainingConfig, max_micro_batch: int) -> list[tuple]:
    """``(tp, pp, dp, micro_batch)`` that use every device of the first type and can be built."""
    dev = cluster.device_types()[0]
    n, gpn = cluster.count(dev.name), cluster.gpus_per_node(dev.name)
    blocks = sum(lay.kind == block_kind(graph) for lay in graph.layers)
    dims = tp_dims(graph)  # the same for every layout: once, not per check_layout
    out = []
    for tp in powers_of_two(min(gpn, n)):
        for pp in (p for p in range(1, blocks + 1) if blocks % p == 0 and n % (tp * p) == 0):
            dp = n // (tp * pp)
            for b in powers_of_two(max_micro_batch):
                if training.global_batch % (b * dp):
                    continue
                try:
                    check_layout(graph, cluster, training, tp=tp, pp=pp, dp=dp, micro_batch=b, dims=dims)
                except ConfigError:
                    continue
                out.append((tp, pp, dp, b))
    return out


def best_hand_layout(
    graph: Graph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    costs: SolverCosts | None = None,
    max_micro_batch: int = 32,
) -> dict[str, Any] | None:
    """The record described in the module docstring, or None when no layout over all devices can
    be built (e.g. the device count does not factor into the model's tp and pp divisors).

    Priced cheaply, with the same winner (issue 20): a layout's stages are the only layer ranges it
    needs, so each ``pp`` gets a ``Search`` whose units *are* its Megatron split (stage arrays of
    ``pp x (pp + 1)`` ranges instead of every range of every layer), and the simulated step of a
    (layout, combo) runs only when it could win: a rank runs its ``m`` micro-batches one after
    another, so ``m * busiest stage period + largest tail`` bounds the step from below, and a
    fitting pick is skipped once that bound exceeds the best fitting step. Ties go to the first
    layout in the enumeration order, as when every layout was simulated."""
    dev = cluster.device_types()[0]
    costs = costs or SolverCosts(graph, cluster, training, tp_style=tp_style_of(graph))
    opts = SearchOptions(max_layer_units=0, max_tp=max(1, cluster.gpus_per_node(dev.name)))
    searches: dict[int, Search] = {}
    picks: list[tuple[float, int, Candidate, float, int, str]] = []  # (bound, order, cand, mem, z, r)
    for tp, pp, dp, b in _layouts(graph, cluster, training, max_micro_batch):
        if pp not in searches:
            searches[pp] = Search(graph, cluster, training, opts, costs, None)
            searches[pp].units = megatron_split(graph, pp)  # the stages are the units
        search = searches[pp]
        m = training.global_batch // (b * dp)
        in_flight = np.array(sched.in_flight_by_stages_left(SCHEDULE, pp, m))
        # the arguments of layout_price.layout_candidate (evaluate's, compile's): m says whether the gradients
        # live at the activation peak; all combos at once here (every ZeRO stage and recompute of the layout)
        got = search.arrays(((dev, dp, b),), dp, tp, in_flight, sched.p2p_multiplier(SCHEDULE, 1), m)
        if got is None:
            continue
        per_combo, combos, stack = got
        # issue 31: a stage where tp places nothing is no tp layout (every tp rank computes it whole); the
        # search does not offer one (Search.mask_tp_shards_nothing: such ranges priced inf), nor does this
        if tp > 1 and not search.mask_tp_shards_nothing(stack, dev, tp, b):
            continue
        opt = Option(0, tp, tp, ((dev, dp, b),), (), per_combo, combos, stack)
        for c in range(len(combos)):
            cand = Candidate(dp, b, m, SCHEDULE, 1, tuple(StagePick(i, i + 1, opt, c) for i in range(pp)), search)
            mem = max(cand.memory(i) for i in range(pp))
            if not np.isfinite(mem):
                continue
            bound = m * max(cand.stage_times) + max(cand.tails)
            if not np.isfinite(bound):
                continue  # a stage that shards nothing on tp (masked above) or does not run
            picks.append((bound, len(picks), cand, mem, *combos[c]))
    if not picks:
        return None
    cap = tensor_cap(dev)
    best: tuple[bool, float, int, Candidate, float, int, str] | None = None  # (not fits, step or mem, order, ...)
    for bound, order, cand, mem, z, r in sorted(picks, key=lambda x: (x[0], x[1])):
        fits = mem <= cap
        if fits and best is not None and not best[0] and bound * (1 - 1e-9) > best[1]:
            continue  # its step is at least the bound: it cannot beat the best fitting layout
        key = (not fits, cand.step_time if fits else mem, order)
        if best is None or key < best[:3]:
            best = (*key, cand, mem, z, r)
    assert best is not None  # picks is not empty: the first one is always taken
    _, _, _, cand, mem, z, r = best
    fits = mem <= cap
    rec = {
        "tp": cand.stages[0].option.tp, "pp": len(cand.stages), "dp": cand.dp, "micro_batch": cand.b,
        "num_micro_batches": cand.m, "zero_stage": z, "recompute": r, "schedule": SCHEDULE, "dtype": training.dtype,
        "device": dev.name, "devices_used": cand.dp * cand.stages[0].option.tp * len(cand.stages),
        "step_time_s": float(cand.step_time), "memory_bytes": float(mem), "memory_capacity": float(cap),
        "fits": bool(fits),
    }  # fmt: skip
    return {**rec, "num_priced": len(picks)}


def summary(rec: dict[str, Any]) -> str:
    """``tp 8 x pp 1 x dp 8, micro-batch 1, ZeRO-1, recompute none`` (the report's words)."""
    return (
        f"tp {rec['tp']} x pp {rec['pp']} x dp {rec['dp']}, micro-batch {rec['micro_batch']}, "
        f"ZeRO-{rec['zero_stage']}, recompute {rec['recompute']}"
    )


def yardstick(graph: Graph, cluster: Cluster, memo: Any = None) -> Any:
    """``training -> record``: :func:`best_hand_layout` in ``training``'s precision, reading ``memo``
    (the planner's ``IntraOpMemo``; a copy), as :func:`with_best_hand_layout` adds it to a plan;
    ``planner.plan_graph(yardstick=...)`` runs it beside its search."""

    def record(training: TrainingConfig) -> dict[str, Any] | None:
        # a copy: run beside the search or after it, the planner's memo counts (plan.search) stay its own
        mine = None if memo is None else memo.copy()
        costs = None if mine is None else SolverCosts(graph, cluster, training, memo=mine, tp_style=tp_style_of(graph))
        return best_hand_layout(graph, cluster, training, costs=costs)

    return record


def with_best_hand_layout(plan: Any, graph: Graph, cluster: Cluster, training: TrainingConfig, memo: Any = None) -> Any:
    """``plan`` with ``search["best_hand_layout"]`` (module docstring), priced in the plan's precision.
    ``memo``: the planner's ``IntraOpMemo`` (the same solves, keyed by all their inputs, not redone)."""
    import dataclasses

    dtype = str(plan.training.get("dtype", training.dtype))
    tr = dataclasses.replace(training, dtype=dtype)
    costs = None if memo is None else SolverCosts(graph, cluster, tr, memo=memo, tp_style=tp_style_of(graph))
    rec = best_hand_layout(graph, cluster, tr, costs=costs)
    if rec is None:
        return plan
    return dataclasses.replace(plan, search={**plan.search, "best_hand_layout": rec})
