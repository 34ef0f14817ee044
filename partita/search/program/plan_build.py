"""Turn the planner's winning candidate (and its runners-up) into a :class:`~partita.plan.Plan`.

Used only by ``search/entry/planner.py``: assigns ranks (contiguous per stage in ``cluster.ranks()``
order, each device type consumed node by node so a stage spans as few nodes as possible), copies
placements / strategies / collectives from the LayerSolutions, and fills the predicted breakdown::

    step = m * t_busiest + bubble + tail      compute_s + communication_s + bubble_s = step_s

where ``communication_s`` is the busiest stage's per-micro-batch communication times ``m`` plus the
exposed gradient-sync / optimizer tail.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from partita import device_reserve
from partita.ir import dim_size
from partita.passes.annotate import HEAVY_PRIMS, layer_stats
from partita.plan import Collective, Plan, Stage, flat_sync_chunks, validate
from partita.search.pipeline import schedule as sched
from partita.search.pipeline import schedule_cost
from partita.search.pipeline.stage_cost import (
    copies_deferred_gradients,
    held_weight,
    static_memory_of,
)
from partita.search.pipeline.stage_ranges import sync_copy
from partita.search.pricing import fp8
from partita.search.program import receive_buffers, records
from partita.search.program.jax_records import jax_records
from partita.version import __version__


@dataclasses.dataclass(frozen=True)
class StagePick:
    k: int
    j: int
    option: Any  # planner.Option
    combo: int


@dataclasses.dataclass
class Candidate:
    dp: int
    b: int
    m: int
    schedule: str
    v: int
    stages: tuple[StagePick, ...]
    search: Any  # planner.Search

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its search (a worker sends candidates to the process that has it:
        ``loops.beside``), which the receiver sets back."""
        return {**self.__dict__, "search": None}

    def _arr(self, i: int) -> Any:
        p = self.stages[i]
        return p.option.arrays[p.combo]

    @property
    def stage_times(self) -> list[float]:
        return [float(self._arr(i).time[p.k, p.j]) for i, p in enumerate(self.stages)]

    @property
    def tails(self) -> list[float]:
        return [float(self._arr(i).tail[p.k, p.j]) for i, p in enumerate(self.stages)]

    def memory(self, i: int) -> float:
        p = self.stages[i]
        # in-flight counts are indexed by the stages left (index p - i); a zero-bubble pass prices
        # position i's own count there (search/zero_bubble.in_flight_table)
        # plus torch.distributed.pipelining's receive buffers, one per micro-batch (search/program/receive_buffers.py)
        return float(self._arr(i).memory[p.k, p.j, len(self.stages) - i]) + receive_buffers.stage_bytes(self, i)

    @functools.cached_property
    def pipeline(self) -> sched.PipelineTime:
        """Step, bubble, busiest period: the simulated action list (``search/pipeline/schedule_cost.py``); once
        per candidate (its fields never change after construction; the search compares a best with
        every new candidate, and the simulation dominated the 175B search's profile)."""
        return schedule_cost.pipeline_time(self.schedule, self.m, self.v, *self.action_times())

    def action_times(self) -> tuple[list[float], list[float], list[float]]:
        """Per stage ``(F, B, W)`` seconds per micro-batch, p2p included (``search/pipeline/schedule_cost.py``)."""
        s, splits = self.search, []
        for p in self.stages:
            env = {"B": 1 if s.costs.linear_batch else p.option.devices[0][2], "S": s.training.seq_len}
            rec = p.option.combos[p.combo][1]
            splits.append(schedule_cost.stage_split(s.graph, env, s.units[p.k][0], s.units[p.j - 1][1], rec))
        computes = [float(self._arr(i).compute[p.k, p.j]) for i, p in enumerate(self.stages)]
        return schedule_cost.action_times(self.stage_times, computes, splits)

    @functools.cached_property
    def step_time(self) -> float:
        return self.pipeline.step_s + max(self.tails)

    def breakdown(self) -> dict[str, float]:
        times = self.stage_times
        busiest = max(range(len(times)), key=lambda i: times[i])
        p = self.stages[busiest]
        comm = float(self._arr(busiest).comm[p.k, p.j])
        tail = max(self.tails)
        pt = self.pipeline
        return {
            "compute_s": self.m * (times[busiest] - comm),
            "communication_s": self.m * comm + tail,
            "bubble_s": pt.bubble_s,
            "tail_s": tail,
        }

    def summary(self) -> str:
        parts = []
        for p in self.stages:
            z, r = p.option.combos[p.combo]
            dev = (
                "+".join(f"{a}x{d.name}" for d, a, _ in p.option.devices)
                if len(p.option.devices) > 1
                else p.option.devices[0][0].name
            )
            parts.append(f"[{p.j - p.k}u {dev} {self.dp}x{p.option.tp} z{z} {r}]")
        v = f" v={self.v}" if self.v > 1 else ""
        return f"dp={self.dp} b={self.b} m={self.m} {self.schedule}{v} " + " ".join(parts)


def _why(c: Candidate, best: Candidate) -> str:
    """Why ``c`` lost to ``best``: the gap and every part of the step that moved, with signs, so the
    parts sum to the gap (compute + communication + bubble = step, ``Candidate.breakdown``)."""
    a, b = c.breakdown(), best.breakdown()
    slower = (c.step_time / best.step_time - 1) * 100
    deltas = {k: a[f"{k}_s"] - b[f"{k}_s"] for k in ("bubble", "communication", "compute")}
    gap = c.step_time - best.step_time
    moved = sorted((k for k in deltas if abs(deltas[k]) >= 5e-5), key=lambda k: -abs(deltas[k]))
    parts = ", ".join(f"{k} {deltas[k] * 1e3:+.1f} ms" for k in moved) or "no part moved"
    return f"slower by {slower:.1f}% (+{gap * 1e3:.1f} ms per step): {parts}"


def _assign_ranks(c: Candidate) -> tuple[list[list[int]], list[int]]:
    cl = c.search.cluster
    queues: dict[str, list[int]] = {}
    for rank, dev, _node in cl.ranks():
        queues.setdefault(dev, []).append(rank)
    per_stage = []
    for p in c.stages:
        ranks: list[int] = []
        for d, reps, _share in p.option.devices:
            for _ in range(reps):
                ranks.extend(queues[d.name][: p.option.tp])
                del queues[d.name][: p.option.tp]
        per_stage.append(ranks)
    used = sorted(r for rs in per_stage for r in rs)
    pos = {r: i for i, r in enumerate(used)}
    return [[pos[r] for r in rs] for rs in per_stage], used


def _stage_records(
    search: Any, best: Candidate, i: int, p: StagePick, a0: int, b0: int, z: int, r: str, strategies: dict[str, str]
) -> dict:
    """Per device and step, what ``partita rehearse`` compares the program with (issue 15).

    ``memory_by_category``: the stage's ``memory_bytes`` split as ``search/stage_ranges.StageParts``
    builds it (parameters, gradients, optimizer state after ZeRO sharding; activations: the rest,
    i.e. saved activations of the in-flight micro-batches plus the transient). ``flops``: the
    layers' forward + backward FLOPs (``passes/annotate.layer_stats``, the numbers the cost model
    prices) for this replica's ``m`` micro-batches, each op's over ``tp`` ranks only where its ILP
    strategy shards it on ``tp`` (a replicated op, e.g. an LM head left whole, runs in full on every
    rank), plus the forward again under full recompute (selective recompute re-runs only ops that
    FLOP counters count as 0). A torch program's FLOPs are what torch's FLOP counter
    (``torch.utils.flop_counter``, which ``partita rehearse`` runs) counts: matmuls, attention and
    convolutions (``HEAVY_PRIMS``); norms, softmax, the loss and element-wise ops count 0 there and
    here (a stage of only the LM head and its norm was 5.4% over the counted program otherwise). A
    JAX program's count (XLA's ``cost_analysis``) includes them.
    """
    dev0, tp, mb = p.option.devices[0][0], p.option.tp, p.option.devices[0][2]
    costs = [search.costs.layer(li, dev0, tp, mb)[0] for li in range(a0, b0)]
    # the terms stage_ranges.StageParts sums (issue 15: what the program holds)
    shared = search.costs.shared_excess(range(a0, b0), dev0, tp, mb)  # a tied weight held once
    copies = bool(copies_deferred_gradients(sched.splits_backward(best.schedule), a0))  # W's gradient copy
    cats = static_memory_of(costs, best.dp, z, copies, shared)
    params, grads, opt = cats["parameters"], cats["gradients"], cats["optimizer"]
    total = best.memory(i)
    split = sched.splits_backward(best.schedule)
    if not split and r == "none" and sched.in_flight(best.schedule, i, len(best.stages), best.m, best.v) >= best.m:
        # no forward after the first backward: the peak is the activations before any gradient, a later
        # micro-batch's backward beside the first's gradients (one micro-batch's saved activations fewer,
        # a ZeRO-1/2/3 unit's gradients in flight added), or the gradients (and the flat copy) after the last
        # backward (stage_ranges.StageParts, num_micro_batches); the receive buffers are beside all three
        copy, bucketed = sync_copy(search.costs, grads, best.dp, z, flat_sync_chunks(best.schedule, best.v))
        with_copy = grads + copy if bucketed else grads * (2.0 if copy else 1.0)  # stage_ranges.StageParts.memory
        tab = search.table(dev0, tp, mb).for_stage(best.dp, z)
        # the first backward and a later one both hold a unit's gradients in flight (reduce_scatter_in_flight):
        # the later one is the larger where the first's gradients outweigh one micro-batch's activations
        later = best.m >= 2 and grads >= float(tab.ranged("act")[p.k, p.j])
        after = total - params - opt - receive_buffers.stage_bytes(best, i) <= with_copy * (1 + 1e-9)
        grads = grads if later or after else 0.0
    env = {"B": 1 if search.costs.linear_batch else mb, "S": search.training.seq_len}
    fwd = bwd = 0.0
    g = search.graph
    by_name: dict[str, Any] = {}
    for n in g.nodes:
        by_name.setdefault(n.name, n)  # the first of a name, as Graph.node finds it
    counted_only = g.meta.get("framework") == "torch"  # what the program's FLOP counter counts (docstring)
    for lay in g.layers[a0:b0]:
        for name in lay.nodes:
            n = by_name[name]
            if counted_only and n.prim not in HEAVY_PRIMS:
                continue
            f = float(dim_size(n.flops, env)) / (tp if "@tp" in strategies.get(name, "R") else 1)
            fwd += f
            bwd += 2 * f if n.prim in HEAVY_PRIMS else f
    scale = (mb if search.costs.linear_batch else 1) * best.m
    return {
        "memory_by_category": {
            "parameters": params,
            "gradients": grads,
            "optimizer": opt,
            "activations": total - params - grads - opt,
        },
        "flops": (fwd + bwd + (fwd if r == "full" else 0.0)) * scale,
    }


def _held_names(g: Any, a0: int, b0: int, placements: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Placements under the names the stage's module holds: a tied parameter first used by a layer of
    another stage (GPT-2's ``transformer.wte.weight`` read by the head) is held here under its alias
    (``lm_head.weight``); the program finds no ``transformer.wte`` in a stage without the embedding."""
    here = {g.tensors[t].fqn for lay in g.layers[a0:b0] for t in lay.params}
    by_fqn = {t.fqn: t for t in g.tensors.values() if t.aliases}
    out = {}
    for fqn, pl in placements.items():
        ten = by_fqn.get(fqn)
        out[ten.aliases[0] if ten is not None and fqn not in here else fqn] = pl
    return out


def _precision(search: Any, cl: Any, dtype: str) -> dict[str, Any]:
    """What every stage trains in and why: fp8 (``search/pricing/fp8.py``) or the dtype rule (``precision.py``)."""
    from partita.search.pricing import fp8
    from partita.search.pricing.precision import precision_note

    recipe = getattr(search.training, "fp8", None)
    if recipe:
        return {"dtype": dtype, "fp8": recipe, "why": fp8.note(cl, recipe)}
    return {"dtype": dtype, "why": precision_note(cl, dtype)}


def _sanity(search: Any, used_devs: list[str], flops: float, step: float) -> dict[str, Any]:
    """MFU against the physical bound (every device of the cluster), idle devices and why, and the
    precision the plan trains in (issue 18; ``search/pricing/precision.py``)."""
    from partita.search.pricing.precision import idle_reasons

    cl, dtype = search.cluster, search.training.dtype
    bound = cl.peak_flops(dtype)
    used: dict[str, int] = {}
    for name in used_devs:
        used[name] = used.get(name, 0) + 1
    return {
        "mfu_cluster": flops / step / bound if bound else 0.0,
        "devices_used": len(used_devs),
        "devices_total": cl.num_devices,
        "mostly_idle": 2 * len(used_devs) < cl.num_devices,
        "idle_reasons": idle_reasons(cl, used, dtype),
        "precision": _precision(search, cl, dtype),
        "network": cl.describe_network(),
    }


def option_held(search: Any, cand: Candidate, p: Any) -> float:
    """``stage_cost.held_weight`` of stage pick ``p`` as its option priced it (``HeldCounts``): its own
    held gradients over its saved activations, in its precision mode and tp layout."""
    (dev, _, b), (z, _) = p.option.devices[0], p.option.combos[p.combo]
    tab = search.table(dev, p.option.tp, b).for_stage(cand.dp, z)
    first = search.units[p.k][0] == 0
    return held_weight(float(tab.ranged("held")[p.k, p.j]), float(tab.ranged("act")[p.k, p.j]), first)


def build_plan(search: Any, cands: list[Candidate], elapsed_s: float, graph_hash: str | None = None) -> Plan:
    """The Plan of the fastest of ``cands`` (ties: by summary), with its runners-up; ``graph_hash``:
    ``search.graph.hash()`` where the caller has it already (``planner.plan_graph`` computes it beside
    its search)."""
    order = sorted(cands, key=lambda c: (round(c.step_time, 12), c.summary()))
    best = order[0]
    g, tr = search.graph, search.training
    stage_ranks, used = _assign_ranks(best)
    fbw = best.action_times()  # what Candidate.pipeline simulated; the report redraws it
    stages = []
    for i, (p, ranks) in enumerate(zip(best.stages, stage_ranks)):
        z, r = p.option.combos[p.combo]
        a0, b0 = search.units[p.k][0], search.units[p.j - 1][1]
        layers = tuple(lay.name for lay in g.layers[a0:b0])
        dev0 = p.option.devices[0][0]
        placements: dict[str, tuple[str, ...]] = {}
        strategies: dict[str, str] = {}
        tp_plan: dict[str, str] = {}
        colls: list[Collective] = []
        # the ILP's tensor-parallel records per micro-batch (a linear-batch solve at batch 1 scaled to the
        # micro-batch); search/program/records.py completes them per step after the plan is laid out
        mb = p.option.devices[0][2]
        scale = float(mb) if search.costs.linear_batch else 1.0
        for li in range(a0, b0):
            sol = search.costs.solution(li, dev0, p.option.tp, mb)
            placements.update({k: tuple(v) for k, v in sol.param_placements.items()})
            strategies.update(sol.op_strategies)
            tp_plan.update(getattr(sol, "tp_plan", {}))  # torch tp module roles (search/layer/strategies.py)
            for cc in sol.collectives:
                colls.append(cc if cc.phase == "optimizer" else dataclasses.replace(cc, bytes=cc.bytes * scale))
        placements = _held_names(g, a0, b0, placements)
        if g.meta.get("framework") == "jax":
            colls = jax_records(search, best, i, p, a0, b0, z, colls, placements)  # search/program/jax_records.py
        arr = p.option.arrays[p.combo]
        mixed = len(p.option.devices) > 1
        recipe = getattr(tr, "fp8", None)  # per stage: its types all have FP8 (stage_cost priced it so)
        stage_fp8 = recipe if recipe and all(fp8.peak(d) > 0 for d, _, _ in p.option.devices) else None
        t = float(arr.time[p.k, p.j])
        comm = float(arr.comm[p.k, p.j])
        stages.append(
            Stage(
                index=i,
                layers=layers,
                device_type="mixed" if mixed else dev0.name,
                ranks=tuple(ranks),
                dp=best.dp,
                tp=p.option.tp,
                zero_stage=z,
                recompute=r,
                batch_shares=tuple(p.option.shares) if mixed else (),
                replica_device_types=tuple(d.name for d, a, _ in p.option.devices for _ in range(a)) if mixed else (),
                param_placements=placements,
                op_strategies=strategies,
                tp_plan=tp_plan if p.option.tp > 1 else {},
                collectives=tuple(colls),
                fp8=stage_fp8,
                predicted={
                    "time_s": t,
                    "compute_s": t - comm,
                    "comm_s": comm,
                    "forward_s": (t - comm) / 3,
                    "tail_s": float(arr.tail[p.k, p.j]),
                    "memory_bytes": best.memory(i),
                    # a deferred W's micro-batch weighs the stage's own output gradients (issue 19)
                    "in_flight": sched.in_flight(
                        best.schedule, i, len(best.stages), best.m, best.v, w_held=option_held(search, best, p)
                    ),
                    **{f"{k}_action_s": x[i] for k, x in zip("fbw", fbw)},  # the simulated F, B, W (issue 19)
                    **_stage_records(search, best, i, p, a0, b0, z, r, strategies),
                },
            )
        )
    br = best.breakdown()
    step = best.step_time
    stats = layer_stats(g, {"B": tr.global_batch, "S": tr.seq_len})
    flops = float(sum(s.forward_flops + s.backward_flops for s in stats))
    if search.costs.linear_batch:
        flops *= tr.global_batch
    rank_devs = search.cluster.ranks()  # once: it lists every rank (16384 at the largest scale)
    used_devs = [rank_devs[r][1] for r in used]
    peak = sum(next(d for d in search.types if d.name == n).flops(tr.dtype) for n in used_devs)
    mem = {}
    for i, s in enumerate(stages):
        mem[f"stage{i}:{s.device_type}"] = best.memory(i)
    alts = []
    seen = {best.summary()}
    for c in order[1:]:
        if c.summary() in seen:
            continue
        seen.add(c.summary())
        a, b = c.breakdown(), best.breakdown()  # the parts the report renders (they sum to the gap)
        parts = {k: a[f"{k}_s"] - b[f"{k}_s"] for k in ("compute", "communication", "bubble")}
        alts.append({"summary": c.summary(), "step_time_s": c.step_time, "why": _why(c, best), "parts_s": parts})
        if len(alts) >= search.options.num_alternatives:
            break
    sst = search.stats
    ilp = {
        "num_solves": search.costs.num_solves,
        "memo_entries": len(search.costs.memo),
        "memo_hits": search.costs.memo.hits,
    }
    search_d: dict[str, Any] = {
        "num_candidates": sst.stage_candidates,
        "dp_runs": sst.dp_runs,
        "t_max_tried": sst.t_max_tried,
        "t_max_candidates": sst.t_max_candidates,
        "t_max_thinned_R2": sst.t_max_thinned,
        "t_max_cut_R1": sst.t_max_cut,
        "tail_caps_R7": sst.tail_caps,
        "num_configs": search.num_configs,
        "num_plans_compared": len(cands),
        "layer_units": len(search.units),
        "ilp": ilp,
        "alternatives": alts,
        "schedules": schedule_cost.best_per_schedule(cands),  # each schedule's best step (issue 19)
    }
    if getattr(search.options, "record_time", False):
        search_d["time_s"] = elapsed_s
    if g.meta.get("no_pipeline"):  # one stage only was searched, and why (frontends/trace_torch.py)
        search_d["not_pipelined"] = g.meta["no_pipeline"]
    plan = Plan(
        model={
            "name": g.meta.get("model", g.name),
            "framework": g.meta.get("framework", ""),
            "graph_hash": graph_hash or g.hash(),
            "num_params": g.num_params(),
            "layers": [lay.name for lay in g.layers],
        },
        cluster={
            "name": search.cluster.name,
            "fingerprint": search.cluster.fingerprint(),
            "spec": search.cluster.to_dict(),
            "rank_map": used,
        },
        training=tr.to_dict(),
        stages=tuple(stages),
        schedule=best.schedule,
        micro_batch_size=best.b,
        num_micro_batches=best.m,
        num_virtual_stages=best.v,
        predicted={
            "step_time_s": step,
            **br,
            "memory_per_device": mem,
            # per device type: its memory beyond tensors and the tensor capacity every stage was held under
            "memory_reserve": {d.name: device_reserve.describe(d) for d in search.types},
            "tokens_per_s": tr.global_batch * tr.seq_len / step,
            "mfu": flops / step / peak if peak else 0.0,
            **_sanity(search, used_devs, flops, step),
        },
        search=search_d,
        partita_version=__version__,
    )
    if g.meta.get("framework") != "jax":  # the torch program's complete records (search/program/records.py)
        if getattr(search.costs, "grad_sync", None) == "buckets":  # ZeRO-0 sync in buckets, as priced (stage_ranges)
            plan = records.with_grad_buckets(plan, g)
        plan = records.complete(plan, g)
    validate(plan)
    return plan
