"""Baselines priced by the same cost path as the planner: Megatron grid, heterogeneity-unaware, brute force.

Used by the planner tests and ``bench/hetero.py``:

* :func:`megatron_grid`: every ``dp x tp x pp x micro-batch`` that divides (devices, blocks, batch)
  on one device type, each priced by ``evaluate_config`` with the program Partita emits (``tp_style_of``:
  the planner's costs, so grid and search price a layout alike, issue 32 item 5); the fastest that fits wins,
  among those where every stage places something on tp when tp > 1 (``Evaluation.tp_shards_nothing``, as the search);
* :func:`heterogeneity_unaware`: plan as if every GPU were the slowest type, then price that plan's
  stages on the devices its ranks really land on (a stage waits for its slowest replica);
* :func:`largest_homogeneous_subset`: the Megatron grid on the device type with most devices;
* :func:`brute_force`: every stage sequence of every outer configuration, for small instances.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from partita.cluster import Cluster, NodeGroup
from partita.device_reserve import tensor_cap
from partita.errors import ConfigError
from partita.ir import Graph
from partita.plan import Plan
from partita.search.entry.evaluate import Evaluation, block_kind, evaluate_config, tp_style_of
from partita.search.entry.planner import DEFAULT_OPTIONS, Option, Search, plan_graph, powers_of_two
from partita.search.pipeline import schedule as sched
from partita.search.pipeline.stage_cost import SolverCosts
from partita.search.pipeline.zero_bubble import HeldCounts, in_flight_table
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program.plan_build import Candidate, StagePick


@dataclasses.dataclass(frozen=True)
class GridPoint:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    zero_stage: int
    recompute: str
    evaluation: Evaluation


def megatron_grid(
    graph: Graph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    zero_stages: tuple[int, ...] = (0, 1),
    recompute: tuple[str, ...] = ("none", "full"),
    max_micro_batch: int = 32,
    costs: SolverCosts | None = None,
) -> tuple[GridPoint | None, int]:
    """Best fitting grid point and the number of points priced."""
    # the program the planner emits (evaluate.tp_style_of): the grid's layouts priced as the search prices them
    costs = costs or SolverCosts(graph, cluster, training, tp_style=tp_style_of(graph))
    n = cluster.num_devices
    gpn = cluster.gpus_per_node(cluster.device_types()[0].name)
    best, count = None, 0
    blocks = sum(lay.kind == block_kind(graph) for lay in graph.layers)
    for tp in powers_of_two(min(8, gpn)):
        for pp in (p for p in range(1, n // tp + 1) if blocks % p == 0):  # the grid's even splits only
            for dp in powers_of_two(n // (tp * pp)):
                for b in powers_of_two(max_micro_batch):
                    if training.global_batch % (b * dp):
                        continue
                    for z in zero_stages:
                        for r in recompute:
                            if z and dp == 1:
                                continue
                            try:
                                ev = evaluate_config(
                                    graph,
                                    cluster,
                                    training,
                                    tp=tp,
                                    pp=pp,
                                    dp=dp,
                                    micro_batch=b,
                                    zero_stage=z,
                                    recompute=r,
                                    costs=costs,
                                )
                            except ConfigError:
                                continue
                            count += 1
                            if any(ev.tp_shards_nothing):
                                continue  # tp places nothing on some stage: no tp layout (issue 31, as the search)
                            if ev.fits and (
                                best is None or ev.predicted_step_time_s < best.evaluation.predicted_step_time_s
                            ):
                                best = GridPoint(dp, tp, pp, b, z, r, ev)
    return best, count


def subset(cluster: Cluster, device_name: str) -> Cluster:
    return dataclasses.replace(
        cluster,
        name=f"{cluster.name}[{device_name}]",
        groups=tuple(g for g in cluster.groups if g.device.name == device_name),
    )


def largest_homogeneous_subset(
    graph: Graph, cluster: Cluster, training: TrainingConfig, **kw: object
) -> tuple[str, GridPoint | None]:
    name = max(cluster.device_types(), key=lambda d: (cluster.count(d.name), d.flops(training.dtype))).name
    return name, megatron_grid(graph, subset(cluster, name), training, **kw)[0]  # type: ignore[arg-type]


def heterogeneity_unaware(
    graph: Graph, cluster: Cluster, training: TrainingConfig, options: SearchOptions = DEFAULT_OPTIONS
) -> tuple[Plan, float]:
    """(plan made for an all-slowest cluster, its step time on the real cluster; inf if it does not fit)."""
    slow = min(cluster.device_types(), key=lambda d: (d.flops(training.dtype), d.memory_bytes))
    fake = dataclasses.replace(
        cluster, groups=tuple(NodeGroup(slow, g.num_nodes, g.gpus_per_node) for g in cluster.groups)
    )
    plan = plan_graph(graph, fake, training, options=options)
    real = Search(graph, cluster, training, dataclasses.replace(options, max_layer_units=0))
    kinds = [d for _r, d, _n in cluster.ranks()]
    used = plan.cluster["rank_map"]
    m, v = plan.num_micro_batches, plan.num_virtual_stages
    picks = []
    index = {name: i for i, name in enumerate(lay.name for lay in graph.layers)}
    p_num = len(plan.stages)
    if sched.splits_backward(
        plan.schedule
    ):  # issue 19: each stage weighs its own deferred W (search/pipeline/zero_bubble.py)
        vv = sched.virtual_stages(plan.schedule, v)
        in_flight: Any = HeldCounts(lambda held: in_flight_table(held, plan.schedule, m, vv, p_num))
    else:
        in_flight = np.array(sched.in_flight_by_stages_left(plan.schedule, p_num, m, v))
    for st in plan.stages:
        types = [kinds[used[r]] for r in st.ranks]
        devs = tuple((d, types.count(d.name) // st.tp, plan.micro_batch_size) for d in real.types if d.name in types)
        real.options = dataclasses.replace(
            options, zero_stages=(st.zero_stage,), recompute=(st.recompute,), max_layer_units=0
        )
        mult, split = sched.p2p_multiplier(plan.schedule, v), sched.splits_backward(plan.schedule)
        flat = plan.chunked or not st.grad_buckets  # the ZeRO-0 sync the plan runs: flat, or its buckets
        got = real.arrays(devs, st.dp, st.tp, in_flight, mult, split_backward=split, chunked=flat)
        if got is None:
            return plan, math.inf
        per_combo, combos, stack = got
        opt = Option(0, st.tp, st.tp, devs, (), per_combo, combos, stack)
        picks.append(StagePick(index[st.layers[0]], index[st.layers[-1]] + 1, opt, 0))
    cand = Candidate(plan.stages[0].dp, plan.micro_batch_size, m, plan.schedule, v, tuple(picks), real)
    fits = all(cand.memory(i) <= min(tensor_cap(d) for d, _, _ in p.option.devices) for i, p in enumerate(cand.stages))
    return plan, cand.step_time if fits else math.inf


def brute_force(
    graph: Graph, cluster: Cluster, training: TrainingConfig, options: SearchOptions = DEFAULT_OPTIONS
) -> float:
    """Fastest full step time over every stage sequence, ZeRO / recompute combo per stage and outer
    configuration (tiny cases), in the precision the planner picks (``search/pricing/precision.py``)."""
    from partita.search.pricing.precision import choose_precision

    training = choose_precision(cluster, training, options.allow_f16)
    search = Search(graph, cluster, training, options)
    best = math.inf
    for dp in powers_of_two(cluster.num_devices):
        for b in powers_of_two(options.max_micro_batch):
            if training.global_batch % (b * dp):
                continue
            m = training.global_batch // (b * dp)
            opts, caps, _ = search.options_for(dp, b, m, "1f1b", 1)
            families = [[o for o in opts if len(o.devices) == 1], [o for o in opts if len(o.devices) > 1]]
            for fam in families:
                best = min(best, _enumerate(search, fam, caps, dp, b, m))
    return best


def _enumerate(search: Search, fam: list[Option], caps: list[int], dp: int, b: int, m: int) -> float:
    num_units = len(search.units)
    best = [math.inf]

    def rec(k: int, seg: int, left: list[int], acc: list[tuple[int, int, Option]]) -> None:
        if k == num_units:
            # Every ZeRO / recompute combo per stage, exactly: for a cap on the largest tail, each
            # stage's fastest combo under the cap minimizes both sum and max of the stage times;
            # the step's minimum is over the caps the stages' own tails offer.
            n = len(acc)
            times = [o.stack[:, a, j, n - i] for i, (a, j, o) in enumerate(acc)]  # per combo
            fits = [[c for c in range(len(t)) if math.isfinite(t[c])] for t in times]
            if not all(fits):
                return
            tails = {float(o.tails[c, a, j]) for (a, j, o), cs in zip(acc, fits) for c in cs}
            for cap in sorted(tails):
                picks = []
                for (a, j, o), cs, t in zip(acc, fits, times):
                    ok = [c for c in cs if o.tails[c, a, j] <= cap]
                    if not ok:
                        break
                    picks.append(StagePick(a, j, o, min(ok, key=t.__getitem__)))
                else:
                    best[0] = min(best[0], Candidate(dp, b, m, "1f1b", 1, tuple(picks), search).step_time)
            return
        for o in fam:
            if o.segment < seg or o.width > left[o.segment] or len(acc) + 1 >= o.stack.shape[3]:
                continue
            for j in range(k + 1, num_units + 1):
                left[o.segment] -= o.width
                rec(j, o.segment, left, [*acc, (k, j, o)])
                left[o.segment] += o.width

    rec(0, 0, list(caps), [])
    return best[0]
