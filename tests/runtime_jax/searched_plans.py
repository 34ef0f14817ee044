"""Plans made by the search for forced shapes (dp, tp, pp, ZeRO stage), for the JAX fidelity tests.

``partita compile`` picks one plan per (model, cluster, batch); to test every layout the search can
emit, :func:`searched_plan` runs the planner's own machinery (``Search`` prices the layers with the
intra-op ILP, ``Candidate`` + ``build_plan`` write the Plan) for one fixed outer configuration, the
way ``search/entry/evaluate.py`` prices a hand-written configuration. Placements, op strategies and the
predicted collectives therefore all come from the search, not from the test.
"""

from __future__ import annotations

import numpy as np

from partita.cluster import parse_cluster
from partita.driver import trace_model
from partita.ir import Graph
from partita.plan import Plan
from partita.search.entry.evaluate import megatron_split
from partita.search.entry.planner import Option, Search
from partita.search.pipeline import schedule as sched
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program.plan_build import Candidate, StagePick, build_plan

_GRAPHS: dict[tuple[str, int], Graph] = {}


def searched_plan(
    model: str,
    *,
    dp: int,
    tp: int,
    pp: int = 1,
    micro_batch: int,
    global_batch: int,
    seq: int = 16,
    zero: int = 0,
    schedule: str = "1f1b",
    cluster: str = "8xCPU",
    dtype: str = "f32",
) -> Plan:
    """The search's plan for this configuration (stages split like ``partita evaluate``)."""
    key = (model, seq)
    if key not in _GRAPHS:
        _GRAPHS[key] = trace_model(model, seq=seq).graph
    graph = _GRAPHS[key]
    cl = parse_cluster(cluster)
    training = TrainingConfig(global_batch=global_batch, seq_len=seq, dtype=dtype, optimizer="adam")
    opts = SearchOptions(zero_stages=(zero,), recompute=("none",), max_layer_units=0, max_tp=tp)
    search = Search(graph, cl, training, opts)
    dev = cl.device_types()[0]
    m = global_batch // (micro_batch * dp)
    in_flight = np.array([0.0] + [sched.in_flight(schedule, 0, s, m, 1) for s in range(1, pp + 1)])
    got = search.arrays(((dev, dp, micro_batch),), dp, tp, in_flight, sched.p2p_multiplier(schedule, 1))
    assert got is not None, (model, dp, tp)
    per_combo, combos, stack = got
    opt = Option(0, tp, tp, ((dev, dp, micro_batch),), (), per_combo, combos, stack)
    picks = tuple(StagePick(a, b, opt, 0) for a, b in _split(graph, pp))
    return build_plan(search, [Candidate(dp, micro_batch, m, schedule, 1, picks, search)], 0.0)


def _split(graph: Graph, pp: int) -> list[tuple[int, int]]:
    if pp == 1:
        return [(0, len(graph.layers))]
    if len({lay.kind for lay in graph.layers}) == len(graph.layers):  # no repeated block (the MLP)
        cuts = [round(i * len(graph.layers) / pp) for i in range(pp + 1)]
        return [(cuts[i], cuts[i + 1]) for i in range(pp)]
    return megatron_split(graph, pp)


# name -> the forced configuration (8 CPU devices; seq 16). Each makes the search emit that layout.
CASES: dict[str, dict[str, int]] = {
    "dp": dict(dp=8, tp=1, micro_batch=2, global_batch=32),
    "tp": dict(dp=1, tp=8, micro_batch=8, global_batch=16),
    "dp_tp": dict(dp=2, tp=4, micro_batch=4, global_batch=16),
    "zero1": dict(dp=8, tp=1, micro_batch=1, global_batch=16, zero=1),
    "zero2": dict(dp=4, tp=2, micro_batch=2, global_batch=16, zero=2),
    "zero3": dict(dp=8, tp=1, micro_batch=1, global_batch=16, zero=3),
    "pp": dict(dp=2, tp=2, pp=2, micro_batch=2, global_batch=16),
}
