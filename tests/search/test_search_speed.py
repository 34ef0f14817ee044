"""Issue 20's speed-ups change no result: each fast path against the plain computation it replaced,
on random inputs with ties and infinities (in-process, well under a second)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from partita.cluster import parse_cluster
from partita.device_reserve import tensor_cap
from partita.ir import Graph
from partita.search.entry.planner import Option, Search, plan_graph
from partita.search.pipeline.stage_cost import UnitTable, _range_max, _range_sum
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program.plan_build import Candidate


@pytest.fixture(scope="module")
def graph() -> Graph:
    from partita.frontends.trace import trace_handle
    from partita.models import resolve_model

    return trace_handle(resolve_model("gpt2-tiny"), seq=32)


def _masked_capped(option: Option, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """Rule R7's capped minimum as it was first written: mask every combo, then argmin."""
    masked = np.where(option.tails[:, :, :, None] < cap, option.stack, np.inf)
    pick = masked.argmin(axis=0)
    return np.take_along_axis(masked, pick[None], axis=0)[0], pick


@pytest.mark.parametrize("seed", range(8))
def test_capped_equals_masking_every_combo(seed: int) -> None:
    rng = np.random.default_rng(seed)
    combos, units, depth = 6, 7, 5
    stack = rng.integers(0, 5, (combos, units, units + 1, depth)).astype(float)  # small ints: many ties
    stack[rng.random(stack.shape) < 0.3] = np.inf
    tails = rng.integers(0, 6, (combos, units, units + 1)).astype(float)
    opt = Option(0, 1, 1, (), (), [], [(0, "none")] * combos, stack)
    opt.__dict__["tails"] = tails  # cached_property: the per-combo tails the arrays would give
    for cap in (np.inf, 6.0, 4.0, 2.5, 1.0, 0.0):
        want_best, want_pick = _masked_capped(opt, cap)
        assert np.array_equal(opt.capped_best(cap), want_best)  # the DP's path: best, then picks read one by one
        for k, j, s in zip(*np.nonzero(np.isfinite(want_best))):
            assert opt.pick_at(k, j, s, cap) == want_pick[k, j, s]


def test_graph_node_index_follows_changes(graph: Graph) -> None:
    """``Graph.node`` looks names up in an index that is rebuilt when the node list changes."""
    first, last = graph.nodes[0], graph.nodes[-1]
    assert graph.node(last.name) is last and graph.node(first.name) is first
    graph.nodes.reverse()
    try:
        assert graph.node(last.name) is last and graph.node(first.name) is first
        with pytest.raises(KeyError):
            graph.node("no such node")
    finally:
        graph.nodes.reverse()


def test_hand_best_prunes_without_changing_the_winner(graph: Graph) -> None:
    """The yardstick simulates only picks whose lower bound can still win; its record equals the one
    of simulating every (layout, combo), computed here the long way."""
    from partita.search.entry import hand_best
    from partita.search.program.plan_build import Candidate

    cl, tr = parse_cluster("8xA100-80G"), TrainingConfig(global_batch=64, seq_len=32)
    simulated: list[float] = []
    step = Candidate.__dict__["step_time"]  # a cached_property: counted here on every read
    try:
        Candidate.step_time = property(lambda c: simulated.append(1.0) or step.func(c))  # type: ignore[method-assign]
        rec = hand_best.best_hand_layout(graph, cl, tr)
    finally:
        Candidate.step_time = step  # type: ignore[method-assign]
    assert rec is not None and rec["fits"]
    assert 0 < len(simulated) < rec["num_priced"]  # pruned some, priced the rest
    full = _every_layout(graph, cl, tr)
    assert rec["num_priced"] == len(full)
    fitting = [x for x in full if x[2]]
    key = min(fitting, key=lambda x: x[1])  # first least step among the fitting ones
    assert (rec["tp"], rec["pp"], rec["dp"], rec["micro_batch"], rec["zero_stage"], rec["recompute"]) == key[0]
    assert rec["step_time_s"] == pytest.approx(key[1], rel=1e-12)


def _every_layout(graph: Graph, cl, tr) -> list[tuple]:  # noqa: ANN001
    """Every (layout, combo) priced through the planner's own arrays over all layer ranges."""
    from partita.search.entry.evaluate import megatron_split
    from partita.search.entry.hand_best import SCHEDULE, _layouts, tp_style_of
    from partita.search.entry.planner import Search
    from partita.search.pipeline import schedule as sched
    from partita.search.pipeline.stage_cost import SolverCosts
    from partita.search.pricing.config import SearchOptions
    from partita.search.program.plan_build import Candidate, StagePick

    dev = cl.device_types()[0]
    costs = SolverCosts(graph, cl, tr, tp_style=tp_style_of(graph))
    search = Search(graph, cl, tr, SearchOptions(max_layer_units=0, max_tp=8), costs, None)
    cap = tensor_cap(dev)
    out = []
    for tp, pp, dp, b in _layouts(graph, cl, tr, 32):
        m = tr.global_batch // (b * dp)
        in_flight = np.array([0.0] + [sched.in_flight(SCHEDULE, 0, s, m, 1) for s in range(1, pp + 1)])
        got = search.arrays(((dev, dp, b),), dp, tp, in_flight, 1)
        if got is None:
            continue
        per_combo, combos, stack = got
        # the search's rule (issue 31): a stage where tp places nothing is no tp layout
        if tp > 1 and not search.mask_tp_shards_nothing(stack, dev, tp, b):
            continue
        opt = Option(0, tp, tp, ((dev, dp, b),), (), per_combo, combos, stack)
        for c, (z, r) in enumerate(combos):
            cand = Candidate(
                dp, b, m, SCHEDULE, 1, tuple(StagePick(a, e, opt, c) for a, e in megatron_split(graph, pp)), search
            )
            if not np.isfinite(max(cand.stage_times)):
                continue
            mem = max(cand.memory(i) for i in range(pp))
            out.append(((tp, pp, dp, b, z, r), cand.step_time, mem <= cap))
    return out


# ---- memoised paths (UnitTable.ranged, Candidate.pipeline / step_time) against plain recomputation ----
def _fresh(self: UnitTable, name: str) -> np.ndarray:
    """``UnitTable.ranged`` without its memo (the computation the stage arrays made per combo before)."""
    if name == "act-sel":
        return _range_sum(self.act - self.sel_bytes)
    if name.startswith("max_") or name == "transient":
        return _range_max(getattr(self, name))
    got = _range_sum(getattr(self, name))
    if self.shared is not None and name in ("params", "grads", "opt"):  # a tied weight held once per range
        got = got - self.shared[("params", "grads", "opt").index(name)]
    return got


def _body(graph: Graph, cluster: str, batch: int) -> str:
    plan = plan_graph(graph, parse_cluster(cluster), TrainingConfig(global_batch=batch, seq_len=32))
    d = json.loads(plan.to_json())
    d.pop("search", None)  # wall times and counters
    return json.dumps(d, sort_keys=True)


@pytest.mark.parametrize(("cluster", "batch"), [("8xA100-80G", 64), ("4xA100-80G+4xV100-32G", 64)])
def test_memoised_search_gives_the_same_plan(
    graph: Graph, cluster: str, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = _body(graph, cluster, batch)
    monkeypatch.setattr(UnitTable, "ranged", _fresh)
    monkeypatch.setattr(Candidate, "pipeline", property(Candidate.__dict__["pipeline"].func))
    monkeypatch.setattr(Candidate, "step_time", property(Candidate.__dict__["step_time"].func))
    plain = _body(graph, cluster, batch)
    assert fast == plain


def test_ranged_is_read_only_and_matches(graph: Graph) -> None:
    """The memo hands out one read-only array per field (the stage arrays never write into it)."""
    cl = parse_cluster("8xA100-80G")
    search = Search(graph, cl, TrainingConfig(global_batch=64, seq_len=32), SearchOptions())
    tab = search.table(search.types[0], 1, 1)
    assert tab is not None
    for name in ("fwd", "act-sel", "max_layer_params", "num_layers"):
        got = tab.ranged(name)
        assert got is tab.ranged(name) and not got.flags.writeable
        assert np.array_equal(got, _fresh(tab, name))
    with pytest.raises(ValueError):
        tab.ranged("fwd")[0, 1] = 1.0


@pytest.mark.parametrize("seed", range(4))
def test_premasked_tables_give_the_same_dp(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``inter_op._run`` with small tables masked whole (``_premasked``) fills the same ``G`` as with
    every table masked slice by slice, for every t_max candidate (ties and infinities included)."""
    from partita.search.pipeline import inter_op

    rng = np.random.default_rng(seed)
    units, depth = 9, 6
    times = rng.integers(1, 6, (4, units, units + 1, depth)).astype(float)  # small ints: ties
    times[rng.random(times.shape) < 0.25] = np.inf
    p = inter_op.stage_problem(times, [0, 0, 1, 1], [1, 2, 1, 2], [4, 3], 3.0, 1.0)
    for t in [np.inf, *np.unique(times[np.isfinite(times)])]:
        monkeypatch.setattr(inter_op, "PREMASK_MAX", 1 << 16)
        whole = inter_op._run(p, float(t))
        monkeypatch.setattr(inter_op, "PREMASK_MAX", 0)
        sliced = inter_op._run(p, float(t))
        assert all(np.array_equal(a, b) for a, b in zip(whole, sliced, strict=True))


# ---- stage parts shared between pricings (Search.sharing_stage_parts) --------------------------------
def _plan_json(graph: Graph, cluster: str, batch: int) -> str:
    return plan_graph(graph, parse_cluster(cluster), TrainingConfig(global_batch=batch, seq_len=32)).to_json()


@pytest.mark.parametrize(("cluster", "batch"), [("4xA100-80G+4xV100-32G", 64)])
def test_shared_stage_parts_give_the_same_plan(
    graph: Graph, cluster: str, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan file, search statistics included, is the same with the zero-bubble passes' parts
    shared (the default), with nothing shared, and with everything shared over the whole search (one
    table's parts reused across every dp, combo, schedule and micro-batch count: 1,268 of 1,784
    pricings here would be handed another combo's arrays with ``recompute`` left out of the key, yet
    this plan happens not to change then; a missing ``zero`` changes it.
    ``test_stage_parts_key_holds_every_input`` checks each input of the key alone)."""
    import contextlib

    shared = _plan_json(graph, cluster, batch)
    monkeypatch.setattr(Search, "sharing_stage_parts", lambda self: contextlib.nullcontext())
    unshared = _plan_json(graph, cluster, batch)
    init = Search.__init__

    def everywhere(self: Search, *a: object, **k: object) -> None:
        init(self, *a, **k)  # type: ignore[arg-type]
        self._parts = {}

    monkeypatch.setattr(Search, "__init__", everywhere)
    whole = _plan_json(graph, cluster, batch)
    assert json.loads(shared)["search"]["dp_runs"] > 0
    assert shared == unshared == whole


def test_stage_parts_key_holds_every_input(graph: Graph) -> None:
    """Each argument of ``stage_parts`` changed alone, after a pricing with the first values: the
    shared parts, and the parts built from shared terms (``stage_parts(terms=...)``, the memo one
    option's ZeRO / recompute combos share), are the fresh ones (and differ from the first, so the
    check can fail)."""
    import dataclasses

    from partita.search.pipeline.stage_cost import StageFactors
    from partita.search.pipeline.stage_ranges import stage_parts

    cl = parse_cluster("8xA100-80G")
    search = Search(graph, cl, TrainingConfig(global_batch=64, seq_len=32), SearchOptions())
    tab, other = search.table(search.types[0], 1, 1), search.table(search.types[0], 1, 2)
    assert tab is not None and other is not None
    base: dict[str, Any] = dict(
        dp=2,
        zero=1,
        recompute="none",
        allreduce=(1e-5, 1e-10),
        reduce_scatter=(2e-5, 2e-10),
        all_gather=(3e-5, 3e-10),
        p2p=(1e-5, 1e-9),
        p2p_mult=1,
        hbm_bandwidth=2e12,
        factors=StageFactors(),
        flat_sync=True,
        split_backward=False,
    )
    changes: dict[str, Any] = dict(
        dp=4,
        zero=3,
        recompute="selective",
        allreduce=(1e-5, 5e-10),
        reduce_scatter=(2e-5, 5e-10),
        all_gather=(3e-5, 5e-10),
        p2p=(1e-5, 5e-9),
        p2p_mult=2,
        hbm_bandwidth=1e12,
        factors=StageFactors(optimizer_passes=3.0),
        split_backward=True,
    )

    def fields(p: Any) -> list[np.ndarray]:
        return [np.asarray(getattr(p, f.name)) for f in dataclasses.fields(p) if f.name not in ("recompute",)]

    def same(a: Any, b: Any) -> bool:
        return all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(fields(a), fields(b), strict=True))

    terms: dict[tuple, Any] = {}
    with search.sharing_stage_parts():
        first = search.stage_parts(tab, **base)
        assert search.stage_parts(tab, **base) is first  # shared within the scope
        for name, value in [*changes.items(), ("flat_sync", False), ("buckets", True)]:
            at: dict[str, Any] = {
                **base,
                **({"zero": 0} if name in ("allreduce", "flat_sync", "buckets") else {}),
                **({"flat_sync": False} if name == "buckets" else {}),  # the torch program's buckets (issue 32)
            }  # ZeRO-0's sync
            kw = {**at, name: value}
            got, fresh = search.stage_parts(tab, **kw), stage_parts(tab, **kw)
            assert same(got, fresh), name
            # the terms one option's combos share (stage_parts' own memo), kept across every change too
            assert same(stage_parts(tab, terms=terms, **at), stage_parts(tab, **at)), name
            assert same(stage_parts(tab, terms=terms, **kw), fresh), name
            assert not same(got, stage_parts(tab, **at)), f"{name} changes nothing here"
        assert same(search.stage_parts(other, **base), stage_parts(other, **base))  # another table
    assert search._parts is None  # dropped with its scope


# ---- strategies and saved-activation plans shared between layer problems (layer_strategies._SHARED) ---
def test_shared_layer_pieces_give_the_same_solutions(graph: Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers solved on a run of meshes, batches, styles and devices that each differ from the one
    before in one input of the shared strategies' key (tp width, label sizes, style, axis names,
    device): the solutions equal those of solving with nothing shared, so a key that missed an
    input would hand a problem another's strategies and fail here (each part of the key was
    dropped once to see it fail). A GPT block large enough that tensor parallelism pays, and the
    traced model (torch style, saved-activation plans in two precision modes)."""
    import dataclasses

    from partita.cluster import DEVICE_PRESETS
    from partita.search.layer import intra_op, layer_strategies
    from partita.search.pricing.cost_model import CostModel
    from partita.search.pricing.mesh import LogicalMesh
    from tests.search import builders

    a100, v100 = DEVICE_PRESETS["A100-80G"], DEVICE_PRESETS["V100-32G"]
    block = builders.gpt(1, 1024, 16)
    runs = [
        (block, a100, (1, 2), ("dp", "tp"), 1, "auto"),
        (block, a100, (1, 4), ("dp", "tp"), 1, "auto"),  # tp width
        (block, a100, (1, 4), ("dp", "tp"), 8, "auto"),  # label sizes (B)
        (block, a100, (1, 4), ("dp", "tp"), 8, "megatron"),  # style
        (block, a100, (1, 4), ("tp", "dp"), 8, "megatron"),  # axis names
        (block, v100, (1, 4), ("tp", "dp"), 8, "megatron"),  # device (not in the key: the same strategies)
        (graph, a100, (1, 2), ("dp", "tp"), 1, "torch"),
        (graph, v100, (1, 2), ("dp", "tp"), 2, "torch"),
    ]

    def solve_all() -> list[Any]:
        layer_strategies._SHARED.clear()
        out = []
        for g, dev, shape, names, b, style in runs:
            mesh = LogicalMesh(shape, names, dev, 8)
            cm = CostModel.for_device(dev)
            for lay in g.layers:
                env = {"B": b, "S": 512}
                sol = intra_op.solve_layer(g, lay, mesh, env=env, dtype="bf16", cost_model=cm, tp_style=style)
                out.append(dataclasses.replace(sol, stats=dataclasses.replace(sol.stats, solve_time_s=0.0)))
        return out

    shared = solve_all()
    assert len(layer_strategies._SHARED) == 2  # both graphs shared pieces
    monkeypatch.setattr(intra_op, "strategies_of", layer_strategies.node_strategies)
    monkeypatch.setattr(intra_op, "saved_plan_of", layer_strategies.saved_plan)
    apart = solve_all()
    assert not layer_strategies._SHARED  # nothing shared this time
    assert shared == apart
