"""One layout, one price (issue 32 item 5): ``evaluate``, ``compile`` of a hand layout and the search's own
pricing print the same step time for the same layout.

The search's own pricing is the Candidate its DP builds from ``Search.options_for`` (the stage options of one
configuration, every ZeRO / recompute combo) at the layout's stages, in a ``Search`` built as ``plan_graph``
builds it (default costs: the program Partita emits). On the old code ``evaluate_config`` priced Megatron-LM's
program by default (gpt2-tiny dp8 ZeRO-0 mb8 on 8xA100-80G: 1.4685 ms, against the search's and compile's
1.5005 ms; ``tests/search/test_planner.py::test_never_worse_than_megatron_grid``).
"""

from __future__ import annotations

import pytest

from partita.cluster import parse_cluster
from partita.ir import Graph
from partita.search.entry.evaluate import evaluate_config, megatron_split
from partita.search.entry.hand_plan import hand_plan
from partita.search.entry.planner import Search, plan_graph
from partita.search.pipeline import schedule as sched
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program.plan_build import Candidate, StagePick

TRAIN = TrainingConfig(global_batch=64, seq_len=512)
CLUSTER = "8xA100-80G"

# (dp, tp, pp, micro_batch, zero_stage, recompute, schedule)
LAYOUTS = [
    (8, 1, 1, 8, 0, "none", "1f1b"),
    (8, 1, 1, 4, 1, "none", "1f1b"),
    (8, 1, 1, 8, 3, "none", "1f1b"),
    (4, 2, 1, 4, 0, "selective", "1f1b"),
    (4, 1, 2, 2, 1, "none", "1f1b"),
    (2, 2, 2, 4, 0, "full", "1f1b"),
    (4, 1, 2, 2, 0, "none", "zb_h1"),
]


@pytest.fixture(scope="module")
def graph() -> Graph:
    """Four GPT blocks wide enough that the layer ILP shards them on tp (a gpt2-tiny block it leaves whole, so
    the search offers no tp for it: ``Search.mask_tp_shards_nothing``)."""
    from partita.passes.annotate import annotate
    from tests.search.builders import gpt

    return annotate(gpt(4, 1024, 16))


def search_price(graph: Graph, dp: int, tp: int, pp: int, b: int, z: int, r: str, schedule: str) -> float:
    """The step the planner's DP gives this layout: its stage options for (dp, b, schedule), the option of
    this tp, the (z, r) combo, at the layout's stages."""
    cl = parse_cluster(CLUSTER)
    search = Search(graph, cl, TRAIN, SearchOptions(max_layer_units=0))  # plan_graph's default costs
    m = TRAIN.global_batch // (b * dp)
    if sched.splits_backward(schedule):  # zero_bubble.solve_zero_bubble prices each depth with its own counts
        from partita.search.pipeline.zero_bubble import HeldCounts, in_flight_table

        table = HeldCounts(lambda held: in_flight_table(held, schedule, m, 1, pp))
        with search.pricing_in_flight(lambda _n: table):
            opts, _, _ = search.options_for(dp, b, m, schedule, 1)
    else:
        opts, _, _ = search.options_for(dp, b, m, schedule, 1)
    opt = next(o for o in opts if o.tp == tp)
    combo = opt.combos.index((z, r))
    picks = tuple(StagePick(a, c, opt, combo) for a, c in megatron_split(graph, pp))
    return Candidate(dp, b, m, schedule, 1, picks, search).step_time


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "dp{}-tp{}-pp{}-b{}-z{}-{}-{}".format(*x))
def test_evaluate_compile_and_search_price_a_layout_alike(graph: Graph, layout: tuple) -> None:
    dp, tp, pp, b, z, r, schedule = layout
    kw = {"tp": tp, "pp": pp, "dp": dp, "micro_batch": b, "zero_stage": z, "recompute": r, "schedule": schedule}
    cl = parse_cluster(CLUSTER)
    ev = evaluate_config(graph, cl, TRAIN, **kw).predicted_step_time_s  # the default: the program Partita emits
    compiled = hand_plan(graph, cl, TRAIN, **kw).predicted["step_time_s"]
    searched = search_price(graph, dp, tp, pp, b, z, r, schedule)
    assert ev == pytest.approx(compiled, rel=1e-9)
    assert ev == pytest.approx(searched, rel=1e-9)


def test_the_searched_plan_is_priced_alike_by_evaluate(graph: Graph) -> None:
    """The planner's winner, as a hand layout, prints the planner's step time through evaluate and compile."""
    cl = parse_cluster(CLUSTER)
    plan = plan_graph(graph, cl, TRAIN, options=SearchOptions(t_max_epsilon=0.0, schedules=("1f1b",)))
    s0 = plan.stages[0]
    assert all(
        (s.dp, s.tp, s.zero_stage, s.recompute) == (s0.dp, s0.tp, s0.zero_stage, s0.recompute) for s in plan.stages
    )
    assert [tuple(s.layers) for s in plan.stages] == [
        tuple(lay.name for lay in graph.layers[a:c]) for a, c in megatron_split(graph, len(plan.stages))
    ]  # a layout evaluate can express (one device type, the even split)
    kw = {"tp": s0.tp, "pp": len(plan.stages), "dp": s0.dp, "micro_batch": plan.micro_batch_size}
    kw |= {"zero_stage": s0.zero_stage, "recompute": s0.recompute}
    ev = evaluate_config(graph, cl, TRAIN, **kw).predicted_step_time_s
    assert ev == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    assert hand_plan(graph, cl, TRAIN, **kw).predicted["step_time_s"] == pytest.approx(ev, rel=1e-9)


@pytest.mark.parametrize(
    "kw",
    [
        {"tp": 1, "pp": 2, "dp": 4, "micro_batch": 2, "schedule": "zbv"},
        {"tp": 2, "pp": 2, "dp": 2, "micro_batch": 2, "schedule": "interleaved_1f1b", "num_virtual": 2},
    ],
    ids=["zbv", "interleaved"],
)
def test_chunked_schedules_priced_alike(graph: Graph, kw: dict) -> None:
    """ZB-V (evaluate refused it with an internal message: 'zbv places exactly 2 stages per rank') and interleaved
    1F1B: evaluate prices the chunk layout compile writes, step time and memory per device."""
    cl = parse_cluster(CLUSTER)
    ev = evaluate_config(graph, cl, TRAIN, **kw)
    plan = hand_plan(graph, cl, TRAIN, **kw)
    assert ev.predicted_step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    assert ev.layout["num_virtual_stages"] == 2
    if kw["schedule"] == "zbv":  # one record per rank group, as evaluate reports it
        assert list(ev.memory_per_device) == pytest.approx(list(plan.predicted["memory_per_device"].values()), rel=1e-9)
