"""The planner: ``plan_graph(graph, cluster, training) -> Plan``, the search's entry point.

Called by ``driver.py``. For every outer configuration (data-parallel degree ``dp``,
per-replica micro-batch ``b``, hence ``m = global_batch / (b * dp)`` micro-batches) it prices every
stage option with ``stage_cost.py`` (per-layer LayerSolutions from the intra-op ILP, memoised by
layer kind), runs the stage DP of ``inter_op.py`` and keeps the best plans; the winner is written
as a :class:`~partita.plan.Plan` with its runners-up and why they lost. Before the loop the layer
ILPs are solved (``search/entry/prefetch.py``, in worker processes where it pays); the zero-bubble
loop runs beside the others there, and each schedule skips what cannot beat its own bar
(:func:`loops.schedule_loop`, ``search/pipeline/step_bounds.py``).

Families of stage options (pruning rules R3-R6 are in ``inter_op``'s docstring):

* *pure*: each stage runs on one device type, ``dp x tp`` devices, ``tp`` a power of two within a
  node; device types are DP segments in descending memory per device;
* *mixed* (Cephalo): every stage has the same mix, ``a_t = dp * n_t / N`` replicas of type ``t``;
  replica shares of each micro-batch are proportional to the type's throughput (integers summing
  to ``b * dp``), the gradient average is weighted by them; the stage's period is its slowest
  replica's. A mixed class is searched at a ``tp`` only where every replica type's intra-op ILP
  chose the same layout (``Search.same_layout``): the emitted stage has one layout for all replicas.

All stages share ``dp`` (the Plan keeps one ``micro_batch_size``); ``tp``, device type, ZeRO stage
and recompute are per stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from partita.cluster import Cluster, DeviceType
from partita.device_reserve import tensor_cap
from partita.errors import ConfigError
from partita.ir import Graph
from partita.plan import Plan, flat_sync_chunks, shards_on_tp
from partita.search.entry import choices
from partita.search.entry import prefetch as beside
from partita.search.entry.infeasible import check_states_fit, infeasible
from partita.search.entry.loops import Extras, schedule_loop
from partita.search.entry.loops import beside as _beside
from partita.search.entry.prefetch import in_background, prefetch
from partita.search.pipeline import schedule as sched
from partita.search.pipeline import schedule_cost
from partita.search.pipeline.cp_costs import ContextParallelCosts
from partita.search.pipeline.inter_op import DPStats, solve_stages
from partita.search.pipeline.stage_cost import (
    SolverCosts,
    StageFactors,
    UnitTable,
    affine,
    dp_link,
    p2p_time_fn,
    scatter_gather_p2p,
)
from partita.search.pipeline.stage_ranges import StageParts, stage_parts, sync_mode
from partita.search.pipeline.step_bounds import (
    area_floor,
    chain_bound,
    chains,
    families,
    problem,
    t_limit,
    tail_bound,
    time_floor,
)
from partita.search.pipeline.zero_bubble import solve_zero_bubble
from partita.search.pricing.config import SearchOptions, TrainingConfig, powers_of_two
from partita.search.pricing.precision import choose_precision
from partita.search.program import chunk_layout, cp_layout, realizable, receive_buffers, records, v_layout
from partita.search.program.plan_build import Candidate, StagePick, build_plan

DEFAULT_OPTIONS = SearchOptions()
ZERO_RECOMPUTE = [(z, r) for r in ("none", "selective", "full") for z in (0, 1, 2, 3)]


def layer_units(num_layers: int, max_units: int) -> list[tuple[int, int]]:
    """Rule R3: consecutive layers grouped so there are at most ``max_units`` units."""
    if max_units <= 0 or num_layers <= max_units:
        return [(i, i + 1) for i in range(num_layers)]
    g = math.ceil(num_layers / max_units)
    return [(a, min(a + g, num_layers)) for a in range(0, num_layers, g)]


def _pure_tables(s: Search, configs: list[tuple[int, int]]) -> list[tuple[DeviceType, int, int]]:
    """The (device type, tp, micro-batch) of the unit tables the configurations' pure classes read."""
    out = []
    for dp, b in configs:
        for d in s.types:
            out += [(d, tp, b) for tp in s.tps(d) if tp <= s.cluster.count(d.name) // dp]
    return out


def _mixed_tables(s: Search, configs: list[tuple[int, int]]) -> list[tuple[DeviceType, int, int]]:
    """The (device type, tp, share) of the unit tables the configurations' mixed classes read
    (``Search.options_for``: each replica type's share of a micro-batch, at every tp they share)."""
    out = []
    for dp, b in configs:
        for cls, cap in s.classes(dp, b):
            if len(cls) < 2:
                continue
            tps = set.intersection(*[set(s.tps(d)) for d, _, _ in cls])
            out += [(d, tp, share) for tp in sorted(tps) if tp <= cap for d, _, share in cls]
    return out


@dataclasses.dataclass
class Option:
    """One DP option: a device class and a tp width, with per (zero, recompute) arrays."""

    segment: int
    width: int
    tp: int
    devices: tuple[tuple[DeviceType, int, int], ...]  # (device, replicas of it, share per replica)
    shares: tuple[int, ...]  # per replica
    arrays: list  # per combo: StageArrays (slowest device class)
    combos: list[tuple[int, str]]
    stack: np.ndarray  # [C, U, U+1, S+1] time per combo, inf where it does not fit

    def pick_at(self, k: int, j: int, s: int, cap: float = math.inf) -> int:
        """The combo of entry ``[k, j, s]``: the first least one whose tail is below ``cap`` (``argmin``
        over the masked combos, NaN included), read one entry at a time: the DP reads its stages'
        entries only (issue 20: a whole pick array was 0.3 s of the 175B search, for about one entry
        in ten thousand read)."""
        col = self.stack[:, k, j, s]
        if math.isfinite(cap):
            col = np.where(self.tails[:, k, j] < cap, col, np.inf)
        return int(col.argmin())

    def capped_best(self, cap: float) -> np.ndarray:
        """[U, U+1, S+1] ``best`` over the combos whose step tail is below ``cap`` (rule R7): every combo
        over the cap masked, one minimum over the leading axis; the DP reads its stages' picks with
        :meth:`pick_at` (whole pick arrays were 0.8 s of the 175B search's 821 capped solves)."""
        if not math.isfinite(cap):
            return self.best
        return np.where(self.tails[:, :, :, None] < cap, self.stack, np.inf).min(axis=0)

    @functools.cached_property
    def tails(self) -> np.ndarray:
        """[C, U, U+1] step tail per combo."""
        return np.stack([a.tail for a in self.arrays])

    @functools.cached_property
    def best(self) -> np.ndarray:
        """[U, U+1, S+1] min time over the combos that fit."""
        return self.stack.min(axis=0)


class Search:
    """Prices stage options for one (graph, cluster, training) and runs the DP per configuration."""

    # the stage DP (``inter_op.solve_stages``); bench/search_speed.py swaps in the scan it replaced
    stage_solver: Callable[..., Any] = staticmethod(solve_stages)

    def __init__(
        self,
        graph: Graph,
        cluster: Cluster,
        training: TrainingConfig,
        options: SearchOptions,
        costs: SolverCosts | None = None,
        factors: StageFactors | None = None,
    ) -> None:
        self.graph, self.cluster, self.training, self.options = graph, cluster, training, options
        self.costs = costs or SolverCosts(graph, cluster, training)
        self.factors = factors or StageFactors()
        self.units = layer_units(len(graph.layers), options.max_layer_units)
        self.types = sorted(cluster.device_types(), key=lambda d: (-d.memory_bytes, -d.flops(training.dtype), d.name))
        self.stats = DPStats()
        self.num_configs = 0
        self._tables: dict[tuple, UnitTable | None] = {}
        self._same_layout: dict[tuple, bool] = {}
        self._tp_sharded: dict[tuple, list[bool]] = {}  # mask_tp_shards_nothing's per-unit answers
        self._in_flight: dict[tuple, list[float]] = {}
        self._parts: dict[tuple, tuple[UnitTable, StageParts]] | None = None  # sharing_stage_parts

    # ---- per-unit tables -----------------------------------------------------------------
    def table(self, dev: DeviceType, tp: int, b: int) -> UnitTable | None:
        key = (dev.name, tp, b)
        if key not in self._tables:
            rows = [self.costs.layer(i, dev, tp, b) for i in range(len(self.graph.layers))]
            self._tables[key] = (
                None
                if any(r is None for r in rows)
                else UnitTable.build([r[0] for r in rows], self.units, self.costs.shared_copies(dev, tp, b))
            )
        return self._tables[key]

    def in_flight(self, schedule: str, m: int, v: int, max_stages: int) -> np.ndarray:
        """``[0, in_flight(s stages)...]`` of the first stage, per s; memoised (configurations with the
        same micro-batch count share it, and a simulated schedule's count is not cheap)."""
        got = self._in_flight.setdefault((schedule, m, v), [0.0])
        if len(got) > max_stages:
            return np.array(got[: max_stages + 1])
        # the B-to-W weight (issue 19) only where the backward splits; other counts ignore it
        held = schedule_cost.w_held(self.graph, self.training.seq_len) if sched.splits_backward(schedule) else 1.0
        got.extend(sched.in_flight(schedule, 0, s, m, v, w_held=held) for s in range(len(got), max_stages + 1))
        return np.array(got[: max_stages + 1])

    @contextlib.contextmanager
    def pricing_in_flight(self, table: Callable[[int], Any]) -> Iterator[None]:
        """Within it, stage options are priced with ``table(max_stages)`` in place of :meth:`in_flight`
        (the first stage of an ``s``-stage pipeline, per ``s``): the counts of a pipeline of one depth,
        each position its own, where they depend on the depth too (``zero_bubble.solve_zero_bubble``
        per depth tried, :func:`_solve_interleaved` at its base's depth)."""
        self.in_flight = lambda _s, _m, _v, max_stages: table(max_stages)  # type: ignore[method-assign, assignment]
        try:
            yield
        finally:
            self.__dict__.pop("in_flight", None)

    @contextlib.contextmanager
    def sharing_stage_parts(self) -> Iterator[None]:
        """Within it, :meth:`stage_parts` keeps what it computed: the zero-bubble search prices one
        configuration's options once per pipeline depth tried, with other in-flight counts only
        (``zero_bubble.solve_zero_bubble``; 9,000 of the 175B search's 20,000 pricings, half of them
        repeats). Scoped, so that one configuration's parts are held at a time (they are ~40 kB each)."""
        outer = self._parts
        if outer is None:
            self._parts = {}
        try:
            yield
        finally:
            if outer is None:
                self._parts = None

    def stage_parts(self, tab: UnitTable, terms: dict[tuple, Any] | None = None, **kw: Any) -> StageParts:
        """``stage_ranges.stage_parts(tab, terms=terms, **kw)``, kept within :meth:`sharing_stage_parts`
        (keyed by the table and every other argument: the same inputs, the same arrays; ``terms`` is
        the caller's memo of their shared terms, not an input)."""
        if self._parts is None:
            return stage_parts(tab, terms=terms, **kw)
        key = (id(tab), tuple(sorted(kw.items())))
        hit = self._parts.get(key)
        if hit is None or hit[0] is not tab:
            hit = self._parts[key] = (tab, stage_parts(tab, terms=terms, **kw))
        return hit[1]

    def tps(self, dev: DeviceType) -> list[int]:
        top = min(self.options.max_tp, self.cluster.gpus_per_node(dev.name))
        return powers_of_two(realizable.fp8_max_tp(self.training, dev, top))  # fp8 allowed: tp 1 on FP8 types

    # ---- stage options -----------------------------------------------------------------
    def arrays(
        self,
        devs: tuple[tuple[DeviceType, int, int], ...],
        dp: int,
        tp: int,
        in_flight: np.ndarray | Callable[[Any], np.ndarray],  # or per unit table (zero_bubble.HeldCounts)
        p2p_mult: int,
        num_micro_batches: int | None = None,  # StageParts.memory: gradients live at the activation peak or not
        split_backward: bool = False,  # a zero-bubble schedule: W's gradient copy (stage_cost.static_memory)
        chunked: bool = False,  # ZB-V's model chunks (plan.flat_sync_chunks): the flat ZeRO-0 sync
    ) -> tuple[list, list[tuple[int, str]], np.ndarray] | None:
        """Per combo arrays for a device class, the combos, and their times (inf where a combo does
        not fit on every device of the class) stacked ``[C, U, U+1, S+1]``."""
        per_combo: list[Any] = []
        stack: np.ndarray | None = None
        combos = [(z, r) for z, r in ZERO_RECOMPUTE if z in self.options.zero_stages and r in self.options.recompute]
        if dp == 1:
            combos = [(z, r) for z, r in combos if z == 0]
        tabs = []
        for dev, _, share in devs:
            tab = self.table(dev, tp, share)
            if tab is None:
                return None
            tabs.append(tab)
        net = self.cluster.network_among([d.name for d, _, _ in devs])  # per group; mixed: the slowest
        prices = []  # per device: the combo-independent link prices
        for dev, _, _ in devs:
            cm = self.costs.cost_model(dev)
            gpn = self.cluster.gpus_per_node(dev.name)
            link = dp_link(dev, dp, tp, tp if len(devs) > 1 else gpn, net)
            single_node = self.cluster.count(dev.name) <= gpn and len(devs) == 1 and len(self.types) == 1
            p2p = p2p_time_fn(dev, cm, net, single_node, self.factors, gpn)
            if getattr(self.costs, "scatter_gather", self.costs.tp_style == "megatron") and tp > 1 and not single_node:
                p2p = scatter_gather_p2p(p2p, tp, dev, cm)
            kinds = ("all_reduce", "reduce_scatter", "all_gather")
            prices.append((p2p, *(affine(cm, kind, link) for kind in kinds)))
        flat_sync, buckets = sync_mode(self.costs, chunked)  # the ZeRO-0 sync as the program runs it
        terms: dict[tuple, Any] = {}  # stage_parts' terms shared by the combos (per recompute / ZeRO stage)
        for z, r in combos:
            worst: Any = None
            ok: Any = None
            for (dev, _, _), tab, (p2p, allreduce, reduce_scatter, all_gather) in zip(devs, tabs, prices):
                parts = self.stage_parts(
                    tab,
                    terms,
                    dp=dp,
                    zero=z,
                    recompute=r,
                    allreduce=allreduce,
                    reduce_scatter=reduce_scatter,
                    all_gather=all_gather,
                    p2p=p2p,
                    p2p_mult=p2p_mult,
                    p2p_overlap=self.options.p2p_overlap,
                    hbm_bandwidth=dev.hbm_bandwidth,
                    factors=self.factors,
                    flat_sync=flat_sync,
                    split_backward=split_backward,
                    buckets=buckets,
                )
                a = parts.arrays(in_flight, num_micro_batches)
                fit = a.memory <= tensor_cap(dev)
                ok = fit if ok is None else ok & fit
                worst = (
                    a
                    if worst is None
                    else dataclasses.replace(
                        worst,
                        time=np.maximum(worst.time, a.time),
                        tail=np.maximum(worst.tail, a.tail),
                        memory=np.maximum(worst.memory, a.memory),
                    )
                )
            per_combo.append(worst)
            if stack is None:  # [C, U, U+1, S+1], filled combo by combo (no np.stack copy)
                stack = np.empty((len(combos), *ok.shape))
            stack[len(per_combo) - 1] = np.inf
            np.copyto(stack[len(per_combo) - 1], worst.time[:, :, None], where=ok)
        return per_combo, combos, stack if stack is not None else np.stack([])  # (no combo: numpy's error)

    def units_shard_on_tp(self, dev: DeviceType, tp: int, b: int) -> list[bool]:
        """Per unit: does any of its layers' solutions at ``tp`` place something on tp (``plan.shards_on_tp``)?
        Once per (device, tp, micro-batch): options are priced per configuration and schedule."""
        key = (dev.name, tp, b)
        sharded = self._tp_sharded.get(key)
        if sharded is None:
            sharded = self._tp_sharded[key] = [
                any(
                    got is not None and shards_on_tp(got[1].param_placements, got[1].tp_plan, got[1].op_strategies)
                    for got in (self.costs.layer(i, dev, tp, b) for i in range(a, b1))
                )
                for a, b1 in self.units
            ]
        return sharded

    def mask_tp_shards_nothing(self, stack: np.ndarray, dev: DeviceType, tp: int, b: int) -> bool:
        """``stack[:, k, j] = inf`` where units ``[k, j)`` place nothing on tp (every tp rank would compute the
        whole range: not offered; a hand layout states it, ``Stage.tp_shards_nothing``); False: every range."""
        sharded = self.units_shard_on_tp(dev, tp, b)
        count = np.concatenate([[0], np.cumsum(sharded)])
        none = (count[None, :] - count[:, None])[:-1] <= 0  # [U, U + 1]: range [k, j) shards nothing
        stack[:, none] = np.inf
        return bool(any(sharded))

    def mixes(self, dp: int, b: int) -> list[tuple[tuple[DeviceType, int, int], ...]]:
        """Device classes: each type alone, and the Cephalo mix (replicas proportional to counts)."""
        out: list[tuple[tuple[DeviceType, int, int], ...]] = [((d, dp, b),) for d in self.types]
        n = self.cluster.num_devices
        if self.options.uneven_shares and len(self.types) > 1 and dp > 1:
            reps = [dp * self.cluster.count(d.name) / n for d in self.types]
            if all(x == int(x) and x >= 1 for x in reps):
                thr = []
                for d in self.types:
                    tab = self.table(d, 1, b)
                    thr.append(0.0 if tab is None else 1.0 / float(tab.fwd.sum() + tab.bwd.sum()))
                if all(t > 0 for t in thr):
                    tot = sum(int(a) * t for a, t in zip(reps, thr))
                    raw = [b * dp * t / tot for t in thr]
                    shares = [max(1, round(x)) for x in raw]
                    diff = b * dp - sum(int(a) * s for a, s in zip(reps, shares))
                    order = sorted(range(len(shares)), key=lambda i: -thr[i])
                    while diff != 0:  # fix the total on the fastest types, whole replicas at a time
                        moved = False
                        for i in order:
                            step = int(reps[i]) * (1 if diff > 0 else -1)
                            if abs(diff) >= int(reps[i]) and shares[i] + step // int(reps[i]) >= 1:
                                shares[i] += step // int(reps[i])
                                diff -= step
                                moved = True
                                break
                        if not moved:
                            break
                    if diff == 0 and len(set(shares)) > 1:
                        out.append(tuple((d, int(a), s) for d, a, s in zip(self.types, reps, shares)))
        return out

    def same_layout(self, cls: tuple[tuple[DeviceType, int, int], ...], tp: int) -> bool:
        """Do all replica types of a mixed class get the same ILP layout (placements and op strategies)
        for every layer? One stage has one mesh and one program text, so a mixed stage whose replica
        types' ILPs disagree cannot be emitted (issue 15 item 7): such classes leave the search."""
        if len(cls) < 2 or tp == 1:
            return True
        key = (tuple((d.name, share) for d, _, share in cls), tp)
        if key in self._same_layout:
            return self._same_layout[key]
        # layers of one kind share one solve per type (renamed by position): one representative per kind decides
        reps: dict[tuple[str, bool], int] = {}
        for i, lay in enumerate(self.graph.layers):
            reps.setdefault((lay.kind, i == 0), i)
        same = True
        for i in reps.values():
            sols = [self.costs.solution(i, d, tp, share) for d, _, share in cls]
            if any(x is None for x in sols):
                same = False
                break
            first = (dict(sols[0].param_placements), dict(sols[0].op_strategies))
            if any((dict(x.param_placements), dict(x.op_strategies)) != first for x in sols[1:]):
                same = False
                break
        self._same_layout[key] = same
        return same

    def max_stages(self, dp: int) -> int:
        """The most pipeline stages at ``dp``: a unit each, a slot each, 1 where the runtime cannot cut
        the model (the tracer says why)."""
        if self.graph.meta.get("no_pipeline"):
            return 1
        return max(1, min(len(self.units), sum(self.cluster.count(d.name) // dp for d in self.types)))

    def classes(self, dp: int, b: int) -> list[tuple[tuple[tuple[DeviceType, int, int], ...], int]]:
        """:meth:`mixes` with each class's capacity in slots (at least one)."""
        out = []
        for cls in self.mixes(dp, b):
            cap = min(self.cluster.count(d.name) // (dp if len(cls) == 1 else a) for d, a, _ in cls)
            if cap >= 1 and realizable.fp8_mix_ok(self.training, [d for d, _, _ in cls]):
                out.append((cls, cap))
        return out

    def options_for(self, dp: int, b: int, m: int, schedule: str, v: int) -> tuple[list[Option], list[int], list]:
        in_flight = self.in_flight(schedule, m, v, self.max_stages(dp))
        opts: list[Option] = []
        segments: list[int] = []
        for cls, cap in self.classes(dp, b):
            seg = len(segments)
            segments.append(cap)
            tps = sorted(set.intersection(*[set(self.tps(d)) for d, _, _ in cls]))
            for tp in tps:
                if tp > cap or not self.same_layout(cls, tp):
                    continue
                # a split backward (zero bubble) makes the gradients while its W still holds the activations
                split = sched.splits_backward(schedule)
                mult, chunked = sched.p2p_multiplier(schedule, v), flat_sync_chunks(schedule, v)
                got = self.arrays(cls, dp, tp, in_flight, mult, None if split else m, split, chunked)
                if got is None:
                    continue
                per_combo, combos, stack = got
                if tp > 1 and not self.mask_tp_shards_nothing(stack, cls[0][0], tp, cls[0][2]):
                    continue  # no range shards anything at this tp: not a choice (issue 31, design rule 1)
                shares = tuple(s for _, a, s in cls for _ in range(a))
                opts.append(Option(seg, tp, tp, cls, shares, per_combo, combos, stack))
        return opts, segments, [len(c) > 1 for c in self.mixes(dp, b)]

    def solve_config(
        self,
        dp: int,
        b: int,
        schedule: str,
        v: int = 1,
        incumbent: float = math.inf,
        keep: Callable[[Candidate], bool] | None = None,
    ) -> list[Candidate]:
        """Best plan of each family (pure / mixed) for one outer configuration; with ``keep``, the best
        of the candidates it keeps (the re-solves priced for one depth: interleaved 1F1B at its base's
        and runnable as chunks, the zero-bubble depth passes; the best of all there was often of
        another depth, or not runnable, and the configuration then gave nothing).

        A step is the simulated pipeline (``Candidate.pipeline``) plus the largest stage *tail*
        (exposed gradient sync and optimizer step, once per step), and the tail depends on each
        stage's ZeRO / recompute combo. Rule R7: solve with every combo allowed, then again with only
        the combos whose tail is below ``(1 - tail_epsilon)`` times the last solution's largest tail,
        and so on; keep the best total; stop when nothing fits or when no stage sequence that fits
        under the cap can beat that total or ``incumbent`` (what the configurations searched before
        leave it to beat): rule R6 (``search/pipeline/step_bounds.py``), whose bounds hold for the simulated
        step (the DP's closed form does not bound it: a pipeline whose slowest stage comes first
        simulates faster than ``sum + (m - 1) max``, by up to 22% on random 1F1B stages). The DP keeps
        to stages fast enough to reach the bar (``step_bounds.t_limit``); a configuration whose unit
        tables alone cannot reach it is not priced at all (``step_bounds.time_floor``).
        ``tail_epsilon=0`` is exact; otherwise the result is within that fraction of the optimum's tail.
        """
        m = self.training.global_batch // (b * dp)
        pairs = chains(self, dp, b, schedule, v)  # inter_op.chain_floor bounds the simulated step with them
        if math.isfinite(incumbent) and time_floor(self, dp, b, schedule, v, incumbent) > incumbent:
            self.stats.configs_cut += 1  # R6: not even its fastest ranges, memory aside, can reach the best
            return []
        opts, caps, _ = self.options_for(dp, b, m, schedule, v)
        if not opts:
            return []
        alpha, beta = sched.coefficients(schedule, m, v)
        out = []
        for fam in families(opts):
            best: Candidate | None = None
            cap = math.inf
            lb = tail_bound(fam)
            while True:
                # each option's best under the cap; its pick is read only at the stages chosen (Option.pick_at)
                p = problem(fam, [o.capped_best(cap) for o in fam], caps, alpha, beta)
                bar = min(incumbent, math.inf if best is None else best.step_time)
                limit = t_limit(m, lb, bar)
                if math.isfinite(bar) and chain_bound(self, p, m, limit, pairs) + lb > bar:
                    self.stats.configs_cut += 1  # R6: no stage sequence under the cap can reach the bar
                    break
                sol = self.stage_solver(p, epsilon=self.options.t_max_epsilon, stats=self.stats, t_limit=limit)
                if sol is None:  # nothing fits under the cap, or nothing can beat the best total
                    break
                n = len(sol.stages)
                picks = [
                    StagePick(k, j, fam[o], fam[o].pick_at(k, j, n - i, cap)) for i, (k, j, o) in enumerate(sol.stages)
                ]
                cand = Candidate(dp, b, m, schedule, v, tuple(picks), self)
                better = best is None or cand.step_time < best.step_time
                if better and (keep is None or keep(cand)) and receive_buffers.fit(cand):
                    best = cand
                tail = max(cand.tails)
                if tail <= 0:
                    break
                self.stats.tail_caps += 1
                cap = tail * (1.0 - self.options.tail_epsilon)
            if best is not None:
                out.append(best)
        return out


def plan_graph(
    graph: Graph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    options: SearchOptions = DEFAULT_OPTIONS,
    progress: Callable[[str], None] | bool | None = None,
    costs: SolverCosts | None = None,
    factors: StageFactors | None = None,
    memo: Any = None,
    yardstick: Callable[[TrainingConfig], dict[str, Any] | None] | None = None,
) -> Plan:
    """Search the plan space (module docstring) and return the fastest plan that fits. ``memo``: an
    ``IntraOpMemo`` to share intra-op solutions with a later pricing of the same graph; its keys hold
    every input of a solve, so sharing changes no result. ``yardstick``: a record for
    ``plan.search["best_hand_layout"]`` from the training configuration in the plan's precision (the
    driver's ``hand_best`` pricing), computed beside the search (``prefetch.in_background``) once the
    layer ILPs are solved. Context parallelism and FP8 (issue 36): each a search of its own where offered,
    the fastest plan kept (``search/entry/choices.py``)."""
    t0 = time.perf_counter()
    say = progress if callable(progress) else (print if progress else (lambda _s: None))

    def run(
        tr: TrainingConfig, *, cp: int = 1, types: list[str] | None = None, options: SearchOptions = options
    ) -> Plan:
        first = cp == 1 and types is None and tr.fp8 is None  # the search as before issue 36
        return _plan_one(
            graph,
            cluster,
            tr,
            options=options,
            costs=costs if first else None,
            factors=factors,
            memo=memo,
            yardstick=yardstick if first else None,
            say=say,
            t0=t0,
            cp=cp,
            types=types,
        )

    return choices.choose(graph, cluster, training, options, run, say)


def _plan_one(
    graph: Graph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    options: SearchOptions,
    costs: SolverCosts | None,
    factors: StageFactors | None,
    memo: Any,
    yardstick: Any,
    say: Callable[[str], None],
    t0: float,
    cp: int = 1,
    types: list[str] | None = None,
) -> Plan:
    """The search of one choice of ``search/entry/choices.py``: context parallelism ``cp`` (the layers at
    ``S / cp``, ``search/pipeline/cp_costs.py``; ``dp * cp`` replicas searched, written back as ``Stage.cp``
    by ``search/program/cp_layout.with_cp``), on the device ``types`` named (all when None)."""
    if costs is None and training.fp8 is None:  # fp16 when it lets GPUs without bf16 tensor cores contribute
        training = choose_precision(cluster, training, getattr(options, "allow_f16", True))
    if cp > 1:
        options = cp_layout.search_options(options, cp)  # what the cp records and layouts describe
        costs = ContextParallelCosts(graph, cluster, training, cp, memo=memo)
    elif costs is None and memo is not None:
        costs = SolverCosts(graph, cluster, training, memo=memo)
    search = Search(graph, cluster, costs.training if cp > 1 else training, options, costs, factors)  # type: ignore[union-attr]
    if types is not None:  # e.g. the FP8 types of an fp8 plan (choices.py): the others stay idle
        search.types = [d for d in search.types if d.name in types]
    check_states_fit(search)  # fails fast, before any configuration is priced
    chunks = graph.meta.get("framework") != "jax" and not graph.meta.get("no_chunks")  # no JAX chunk records;
    # a model the torch runtime cuts with its generic splitter runs one layer range per rank (passes/pipeline.py)
    # zbv is priced on its V layout below (search/program/v_layout.py), never per rank group
    schedules = [s for s in options.schedules if s not in ("interleaved_1f1b", "zbv")] or ["1f1b"]
    if graph.meta.get("framework") == "jax":  # no JAX runtime splits the backward (backends/jax/emit._check)
        schedules = [s for s in schedules if not sched.splits_backward(s)] or ["1f1b"]
    n = sum(cluster.count(d.name) for d in search.types)
    configs = [
        (dp, b)
        for b in powers_of_two(options.max_micro_batch)
        for dp in powers_of_two(n)
        if search.training.global_batch % (b * dp) == 0 and dp % cp == 0  # cp: dp x cp replicas
    ]
    # the unit tables the configurations read, solved first (in parallel where it pays, search/entry/prefetch.py):
    # the pure device types' (which the mixed classes' shares come from), then the mixed classes'
    layers = range(len(graph.layers))
    solves = prefetch(search.costs, [(i, *t) for t in _pure_tables(search, configs) for i in layers])
    solves += prefetch(search.costs, [(i, *t) for t in _mixed_tables(search, configs) for i in layers])
    configs.sort(key=lambda c: area_floor(search, *c))
    # the zero-bubble configurations (the costliest) beside the others, where there are others
    here = [s for s in schedules if not sched.splits_backward(s)] or schedules
    there = [s for s in schedules if s not in here]
    extras = Extras(yardstick, here=bool(there))
    side = in_background(
        functools.partial(_beside, search, configs, there, chunks, extras.beside()), solves >= beside.MIN_SOLVES
    )
    try:
        plan, rec = _search(search, configs, here, chunks, say, side, t0, cp, extras)
    except BaseException:
        side.cancel()
        raise
    return plan if rec is None else dataclasses.replace(plan, search={**plan.search, "best_hand_layout": rec})


def _search(
    search: Search,
    configs: list[tuple[int, int]],
    schedules: list[str],
    chunks: bool,
    say: Callable[[str], None],
    side: Any,
    t0: float,
    cp: int = 1,
    extras: Extras | None = None,
) -> tuple[Plan, Any]:
    """:func:`plan_graph`'s outer loop and what follows it; ``(plan, yardstick record)``."""
    options = search.options
    cands: list[Candidate] = []
    for schedule in schedules:
        got, lines = schedule_loop(search, configs, schedule, chunks)
        cands += got
        for line in lines:
            say(line)
    mine = extras(search) if extras is not None and extras.here else None
    graph_hash, rec, there, lines, delta, added = side()
    if mine is not None:
        graph_hash, rec = mine
    for c in there:
        c.search = search  # (sent without it)
    cands += there
    search.stats.add(delta)
    search.num_configs += added
    for line in lines:
        say(line)
    incumbents: dict[str, float] = {}  # per interleaved schedule key, its best so far (rule R6)
    if "interleaved_1f1b" in options.schedules and chunks:
        base = sorted(cands, key=lambda c: c.step_time)[:3]
        seen: set[tuple[int, int, int]] = set()
        for c in base:
            if (c.dp, c.b, len(c.stages)) in seen:  # re-solved already: the same configuration and depth
                continue
            seen.add((c.dp, c.b, len(c.stages)))
            for v in options.virtual_stages:
                # re-solved with the interleaved objective; whether chunks hold what a rank group was priced
                # with is decided on the new partition (chunk_layout.runnable: layers, not units)
                if len(c.stages) > 1:
                    search.num_configs += 1
                    key = f"interleaved_1f1b v{v}"
                    found = _solve_interleaved(search, c, v, incumbents.get(key, math.inf))
                    cands.extend(found)
                    incumbents[key] = min([incumbents.get(key, math.inf), *(x.step_time for x in found)])
    if "zbv" in options.schedules and chunks:  # issue 19: V layouts
        vc: list[Candidate] = list(v_layout.v_candidates(_zbv_bases(search, cands)))
        # zbv alone asked for: its V layouts, 1F1B (searched as their base) only when none exists
        cands = vc if vc and set(options.schedules) == {"zbv"} else cands + vc
    if not cands:
        raise infeasible(search)
    plan = build_plan(search, cands, time.perf_counter() - t0, graph_hash)
    best = min(cands, key=lambda c: (round(c.step_time, 12), c.summary()))  # build_plan's pick
    if isinstance(best, v_layout.VCandidate) and plan.schedule == "zbv":
        plan = v_layout.lay_out(search, plan, best)
    else:
        plan = chunk_layout.lay_out(search, plan)
    if cp > 1:  # the flat dp x cp replicas written as the Plan of cp (search/program/cp_layout.py)
        assert isinstance(search.costs, ContextParallelCosts)
        plan = cp_layout.with_cp(plan, search, search.costs.full_training, plan.stages[0].dp // cp, cp)
    return records.memory_items(plan, search.graph), rec  # memory beyond tensors, host peak (issue 33)


def _solve_interleaved(search: Search, base: Candidate, v: int, incumbent: float = math.inf) -> list[Candidate]:
    """``base``'s configuration re-solved under interleaved 1F1B with ``v`` chunks per rank group, at
    ``base``'s depth: a position's in-flight count depends on the depth too
    (``schedule.in_flight_by_stages_left``), so the DP is priced for exactly that many stages and only
    its picks of that depth are kept (as ``zero_bubble.solve_zero_bubble`` does per depth); and only
    what the torch program runs as model chunks (``chunk_layout.runnable``): the ZeRO stages and
    classes it refuses are not searched at all."""
    depth = len(base.stages)
    try:
        table = np.array(sched.in_flight_by_stages_left("interleaved_1f1b", depth, base.m, v))
    except ConfigError:  # m micro-batches do not split into rounds (schedule.interleave_round)
        return []
    opts = search.options
    if base.dp > 1:  # what chunk_layout.runnable keeps: no ZeRO-2/3 over dp > 1, no uneven batch shares
        zeros = tuple(z for z in opts.zero_stages if z < 2)
        if not zeros:
            return []
        search.options = dataclasses.replace(opts, zero_stages=zeros, uneven_shares=False)
    try:
        with search.pricing_in_flight(lambda _n: table):
            found = search.solve_config(
                base.dp,
                base.b,
                "interleaved_1f1b",
                v,
                incumbent=incumbent,
                keep=lambda x: len(x.stages) == depth and chunk_layout.runnable(x),
            )
    except ConfigError:
        return []
    finally:
        search.options = opts
    return [x for x in found if len(x.stages) == depth and chunk_layout.runnable(x)]


def _zbv_bases(search: Search, cands: list[Candidate]) -> list[Candidate]:
    """The multi-stage ZB-H1 candidates ZB-V layouts start from (``search/program/v_layout.py``): the best
    three found (ZB-H1 searched here when ``options.schedules`` leaves it out; dp below the device
    count, so that two stages or more are left)."""
    zb = [c for c in cands if c.schedule == "zb_h1" and len(c.stages) > 1]
    if "zb_h1" not in search.options.schedules:  # searched here, as plan_graph would (its configurations)
        for dp in powers_of_two(search.cluster.num_devices // 2):
            for b in powers_of_two(search.options.max_micro_batch):
                if search.training.global_batch % (b * dp) == 0:
                    zb += [c for c in solve_zero_bubble(search, dp, b, "zb_h1") if len(c.stages) > 1]
    return sorted(zb, key=lambda c: c.step_time)[:3]
