"""Zero-bubble schedules in the search (issue 19): priced by simulation, chosen where they win, kept to what runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from partita.cluster import Cluster, cluster_from_dict
from partita.errors import InfeasibleError
from partita.ir import Graph
from partita.search.entry.planner import plan_graph
from partita.search.pipeline import schedule as sched
from partita.search.pipeline.pipeline_sim import simulate
from partita.search.pipeline.schedule_cost import stage_split, weight_grad_flops
from partita.search.pipeline.stage_cost import costs_held
from partita.search.pricing.config import SearchOptions, TrainingConfig

TRAIN = TrainingConfig(global_batch=16, seq_len=32)
# ZeRO-0, no recompute, no tp: the model only fits split into pipeline stages on these devices
PIPELINED = {"zero_stages": (0,), "recompute": ("none",), "max_tp": 1, "max_micro_batch": 1}


@pytest.fixture(scope="module")
def graph() -> Graph:
    from partita.frontends.trace import trace_handle
    from partita.models import resolve_model

    return trace_handle(resolve_model("gpt2-tiny"), batch=1, seq=32)


def _tiny(memory_gb: float = 0.0025 * 0.92 * 0.95, n: int = 4) -> Cluster:
    # (0.95, was 1.05: the loss backward is priced at 2 f32 logits, not 3, so one stage fit at 1.05)
    # the same tensor capacity as under the old 0.92 fraction: a declared type reserves the allocator
    # margin only (device_reserve.UNKNOWN), and these cases sit at the memory edge on purpose
    return cluster_from_dict(
        {
            "nodes": [{"device": "Tiny", "num_nodes": 1, "gpus_per_node": n}],
            "device_types": [{"name": "Tiny", "peak_tflops": {"bf16": 10}, "memory_GB": memory_gb, "hbm_GBps": 100}],
        }
    )


def _layer_range(graph: Graph, layers: tuple[str, ...]) -> tuple[int, int]:
    names = [lay.name for lay in graph.layers]
    return names.index(layers[0]), names.index(layers[-1]) + 1


def _option_held(graph: Graph, cl: Cluster, st: Any, mb: int) -> float:
    """The weight of stage ``st``'s deferred W as its option priced it: its layers' own held output
    gradients over their saved activations (``LayerCost``, in the stage's precision mode and tp)."""
    from partita.search.pipeline.stage_cost import SolverCosts

    a, b = _layer_range(graph, st.layers)
    dev = cl.device_types()[0]
    costs = [SolverCosts(graph, cl, TRAIN).layer(li, dev, st.tp, mb)[0] for li in range(a, b)]
    return costs_held(costs, a == 0, not (st.dp > 1 and st.zero_stage >= 1))


def test_weight_gradients_are_the_parameter_matmuls(graph: Graph) -> None:
    from partita.passes.annotate import layer_stats

    env = {"B": 1, "S": 32}
    stats, wg = layer_stats(graph, env), weight_grad_flops(graph, env)
    blocks = [i for i, s in enumerate(stats) if s.kind == stats[1].kind and s.param_count]
    for i in blocks:
        # a transformer block: every matmul but attention's two has a weight; W is most of their forward FLOPs
        assert 0.5 * stats[i].forward_flops < wg[i] < stats[i].forward_flops
        assert wg[i] < stats[i].backward_flops / 2  # B keeps the input gradients and attention's backward
    f, w = stage_split(graph, env, 0, len(stats), "none")
    assert 0.25 < f < 0.4 and 0.15 < w < f
    assert stage_split(graph, env, 0, len(stats), "full")[0] < f  # the recomputed forward is part of B


def test_search_picks_zb_h1_where_it_wins_and_prices_it_by_simulation(graph: Graph) -> None:
    cl = _tiny()
    one = plan_graph(graph, cl, TRAIN, options=SearchOptions(schedules=("1f1b",), **PIPELINED))
    zb = plan_graph(graph, cl, TRAIN, options=SearchOptions(schedules=("zb_h1",), **PIPELINED))
    both = plan_graph(graph, cl, TRAIN, options=SearchOptions(schedules=("1f1b", "zb_h1"), **PIPELINED))
    assert one.num_stages > 1 and zb.num_stages > 1
    assert zb.predicted["step_time_s"] < one.predicted["step_time_s"]
    assert both.schedule == "zb_h1" and both.predicted["step_time_s"] == zb.predicted["step_time_s"]
    assert any("1f1b" in a["summary"] for a in both.search["alternatives"])  # the loser is reported with its gap
    # the recorded step is the simulated action list on the recorded F, B, W times plus the tail
    st = zb.stages
    sim = simulate(
        "zb_h1",
        zb.num_stages,
        zb.num_micro_batches,
        [s.predicted["f_action_s"] for s in st],
        [s.predicted["b_action_s"] for s in st],
        [s.predicted["w_action_s"] for s in st],
    )
    assert zb.predicted["step_time_s"] == pytest.approx(sim.step_s + zb.predicted["tail_s"], rel=1e-9)
    assert zb.predicted["bubble_s"] < one.predicted["bubble_s"]
    # the stage at position i holds what rank i's action list holds until their W (the list the runtime
    # runs), each stage weighing its own output gradients between B and W (a stage with the head does
    # not price the blocks' stages)
    p, m = zb.num_stages, zb.num_micro_batches
    helds = [_option_held(graph, cl, s, zb.micro_batch_size) for s in st]
    assert p == 2 and 1.0 < helds[1] < 2.0  # a deferred W's micro-batch also holds the output gradients
    # the first stage's B computes no input gradient, so its W is the whole backward and nothing but
    # the activations waits for it (zero_bubble.held_weight)
    assert helds[0] == 1.0
    want = [sched.peak_in_flight("zb_h1", p, m, 1, h)[i] for i, h in enumerate(helds)]
    assert [s.predicted["in_flight"] for s in st] == pytest.approx(want, rel=1e-12)
    assert st[0].predicted["in_flight"] == min(p, m)  # as 1F1B's first stage
    assert st[1].predicted["in_flight"] > min(p - 1, m)  # a deferred W's output gradients weigh on the next
    assert all(s.zero_stage == 0 and s.recompute == "none" for s in st)


def test_zero_bubble_search_keeps_to_what_the_runtime_runs(graph: Graph) -> None:
    plan = plan_graph(graph, _tiny(), TRAIN, options=SearchOptions(schedules=("zb_h1",), max_tp=1, max_micro_batch=1))
    assert all(s.zero_stage in (0, 1) and s.recompute == "none" for s in plan.stages)  # emit_torch.check_schedule
    assert {"zb_h1", "zbv"} <= set(
        SearchOptions().schedules
    )  # both run and rehearse as priced (search/pricing/config.py)
    jax_graph = dataclasses.replace(graph, meta={**graph.meta, "framework": "jax"})
    plan = plan_graph(jax_graph, _tiny(), TRAIN, options=SearchOptions(**PIPELINED))
    assert plan.schedule == "1f1b"  # no JAX runtime splits the backward


def test_zbv_prices_two_chunks_per_rank(graph: Graph) -> None:
    """ZB-V is priced on the V layout the runtime runs (search/program/v_layout.py): rank group 0 holds the
    model's first and last layers, which do not fit together on the 2.5 MB devices (no ZB-V plan:
    zbv alone falls back to 1F1B); with 4 MB they do, and the plan is the chunked V layout."""
    tight = plan_graph(graph, _tiny(), TRAIN, options=SearchOptions(schedules=("zbv",), **PIPELINED))
    assert tight.schedule == "1f1b"
    plan = plan_graph(graph, _tiny(0.004), TRAIN, options=SearchOptions(schedules=("zbv",), **PIPELINED))
    assert plan.schedule == "zbv" and plan.num_virtual_stages == 2 and plan.chunked
    names = [lay.name for lay in graph.layers]
    assert {names[0], names[-1]} <= {x for s in plan.positions()[0] for x in s.layers}
    for grp in plan.positions():  # both chunks of a rank group carry the group's memory per device
        assert len({s.predicted["memory_bytes"] for s in grp}) == 1
        assert grp[0].predicted["memory_bytes"] <= 0.004e9


def test_emitters_refuse_what_they_cannot_run(graph: Graph) -> None:
    """zb_h1 runs on torch (ZeRO-0, no recompute); no JAX program splits the backward; the searched zbv
    plan (its V layout, search/program/v_layout.py) runs on torch."""
    from partita.backends.jax.emit import emit_jax
    from partita.backends.torch.emit import check_schedule
    from partita.errors import PlanError

    zb = plan_graph(graph, _tiny(), TRAIN, options=SearchOptions(schedules=("zb_h1",), **PIPELINED))
    check_schedule(zb)  # accepted
    with pytest.raises(PlanError, match="splits the backward"):
        emit_jax(zb, "gpt2-tiny")
    zbv = plan_graph(graph, _tiny(0.004), TRAIN, options=SearchOptions(schedules=("zbv",), **PIPELINED))
    assert zbv.schedule == "zbv"
    check_schedule(zbv)  # accepted


def test_plan_says_by_how_much_each_schedule_loses(graph: Graph) -> None:
    from partita.report.fmt import time_s
    from partita.report.terminal import plan_text

    opts = SearchOptions(schedules=("1f1b", "zb_h1"), **PIPELINED)
    plan = plan_graph(graph, _tiny(), TRAIN, options=opts)
    got = plan.search["schedules"]
    assert set(got) == {"1f1b", "zb_h1"} and min(got.values()) == plan.predicted["step_time_s"]
    assert next(iter(got)) == plan.schedule == "zb_h1"
    text = plan_text(plan, width=200)
    loss = (got["1f1b"] / got["zb_h1"] - 1) * 100
    row = next(ln for ln in text.split("Schedules searched")[1].splitlines() if ln.startswith("│ 1f1b "))
    assert f"│ {time_s(got['1f1b'])}" in row and f"+{loss:.1f}%" in row  # the schedules table (issue 35)


def test_zb_h1_searches_zero1_with_data_parallel_replicas(graph: Graph) -> None:
    """ZeRO-1 keeps each replica's gradients whole until the step's one reduce-scatter, after the last W:
    the torch runtime runs it (tests/runtime/test_schedules_runtime.py, ``pp_zero1``), so the search has it;
    ZeRO-2/3 and recompute stay out (their syncs / recompute would run at B, before W)."""
    from partita.backends.torch.emit import check_schedule

    opts = SearchOptions(schedules=("zb_h1",), zero_stages=(0, 1), recompute=("none",), max_tp=1, max_micro_batch=1)
    mem, plan = 0.003, None
    while plan is None or plan.num_stages == 1:  # shrink the devices until the model is pipelined
        plan = plan_graph(graph, _tiny(mem, n=8), TRAIN, options=opts)  # InfeasibleError: nothing pipelined fits
        mem *= 0.97  # the window where a pipelined plan fits and a one-stage one does not is narrow
    assert plan.schedule == "zb_h1"
    assert all(s.dp > 1 and s.zero_stage == 1 for s in plan.stages)  # the optimizer state sharded over replicas
    check_schedule(plan)  # the torch emitter accepts it
    every = SearchOptions(schedules=("zb_h1",), max_tp=1, max_micro_batch=1)
    plan = plan_graph(graph, _tiny(0.0015, n=8), TRAIN, options=every)
    assert all(s.zero_stage in (0, 1) and s.recompute == "none" for s in plan.stages)
    with pytest.raises(InfeasibleError):  # recompute only: no zero-bubble plan at all
        plan_graph(
            graph, _tiny(0.0015, n=8), TRAIN, options=dataclasses.replace(every, recompute=("selective", "full"))
        )


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv", "1f1b", "gpipe"])
def test_in_flight_envelope_equals_the_action_lists(schedule: str) -> None:
    """``zero_bubble.counts`` (ZB-H1 read off its order in O(p), the others off their lists) is the most
    loaded rank's peak that ``schedule.peak_in_flight`` counts on the action lists, at any B-to-W weight."""
    import numpy as np

    from partita.search.pipeline.zero_bubble import counts

    v = 2 if schedule == "zbv" else 1
    for p in range(1, 9):
        for m in (*range(1, 19), 33):
            got = counts(schedule, p, m, v, np.array([1.0, 1.37, 2.9]))
            want = [max(sched.peak_in_flight(schedule, p, m, v, h)) for h in (1.0, 1.37, 2.9)]
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (p, m)


class _Table:
    """The two ranged fields ``zero_bubble.range_held_of`` reads off a unit table."""

    def __init__(self, act: Any, held: Any) -> None:
        import numpy as np

        self.held = np.asarray(held, dtype=float)
        self._f = {"act": np.asarray(act, dtype=float), "held": self.held}

    def ranged(self, name: str) -> Any:
        return self._f[name]


def test_held_counts_share_a_table_only_between_equal_weights() -> None:
    """Options whose ranges weigh alike share one count table (issue 20); others never do."""
    import numpy as np

    from partita.search.pipeline.zero_bubble import HeldCounts, in_flight_table

    counts = HeldCounts(lambda held: in_flight_table(held, "zb_h1", 8, 1, 3))
    a = _Table([[1.0, 2.0], [1.0, 4.0]], [[0.5, 1.0], [0.5, 2.0]])
    twice = _Table([[2.0, 4.0], [2.0, 8.0]], [[1.0, 2.0], [1.0, 4.0]])  # every byte doubled: same weights
    other = _Table([[1.0, 2.0], [1.0, 4.0]], [[0.5, 1.0], [0.5, 3.0]])
    assert counts(twice) is counts(a)
    got = counts(other)
    assert got is not counts(a) and not np.array_equal(got, counts(a))
    # range_held_of: 1 + held / saved, and 1 on the first row (the model's first layer)
    assert np.array_equal(got, in_flight_table(np.array([[1.0, 1.0], [1.5, 1.75]]), "zb_h1", 8, 1, 3))
