"""ZB-V priced on the layout the runtime runs: the model cut into ``2p`` chunks in a V (issue 19).

Sits in ``search/`` after the zero-bubble search (``zero_bubble.solve_zero_bubble``) and before
``plan_build.build_plan``: the planner hands :func:`v_candidates` its best ZB-H1 candidates (stages
with ZeRO-0/1 and no recompute, the ones the torch runtime splits the backward on) and gets back
ZB-V candidates priced chunk by chunk; :func:`lay_out` turns the winner into the chunked plan
(one Stage per virtual stage, ``plan.py``) that ``backends/torch/schedule.P2PPipeline`` runs.

The layout: a ``p``-stage candidate keeps its ``p`` rank groups (device type, tp, ZeRO stage,
micro-batch: each group's ``Option`` and combo); the model's layer units are cut into ``2p`` chunks
and chunk ``s`` runs on rank group ``s`` for ``s < p`` and on ``2p - 1 - s`` otherwise
(``plan.chunk_position``), so rank group 0 holds the model's first and last chunk. The cuts start
from halving each group's priced range and move one unit at a time while the priced step drops.

The price of a layout, from the group's stage arrays at each chunk's own unit range:

* per chunk, its period ``time[k, j]`` (its compute, tp collectives and the p2p receive of its
  input, which every chunk but the first has), split into F / B / W by ``schedule_cost.action_times``
  on the chunk's own layers; the ZB-V action list is simulated on these ``2p`` chunk times
  (``pipeline_sim.step_time``). The turn of the V (chunk ``p - 1`` to ``p``, on one rank group)
  passes its tensor without p2p, which the chunk's period still counts (an over-estimate of one
  boundary);
* per rank group, the tail (gradient sync and optimizer step) of its two chunks, summed;
* per rank group, the memory on each device: parameters and optimizer state of both chunks
  (``stage_cost.static_memory``), plus the peak over the group's own action list of ``sum over its
  chunks of saved bytes x (micro-batches held whole + w_held x micro-batches between B and W)``
  (``stage_cost.held_weight`` of the chunk's layers; 1 for the first chunk, whose B computes nothing)
  and the gradients held at that moment, plus the largest transient. The moments are after each
  action and, for a W, while it writes its chunk's gradients beside the held part it is about to
  free (the group's peak when the W follows the head's B: the logits gradient is large). Gradients
  follow the program: a W writes them straight into the accumulator (ZeRO-0, or the first chunk,
  whose W is the whole backward, after which FSDP2 folds every copy), or under FSDP2 in a low
  ``param_dtype`` as a copy in that dtype (``stage_cost.static_memory``), which FSDP2 folds into
  its f32 accumulator at the rank's next backward from a chunk's output (a B): with one micro-batch
  a chunk's gradients stay a copy to the step's end. The step's end holds the gradients then held
  (and the torch program's flat copy of them for a ZeRO-0 sync over dp > 1, made once the
  activations are gone, ``stage_ranges.StageParts``). ``partita rehearse`` of llama-7b's ZB-V plan
  (one micro-batch, bf16, ZeRO-1): -4.3% / +7.3% per rank group (-1.6% / +15.7% before, with every
  gradient priced as an f32 accumulator plus a copy at the step's end). A layout that does not fit
  the device's tensor capacity (``device_reserve.tensor_cap``) is dropped.

Two things the group holds that a plain stage's pricing does not meet: the tied embedding / LM head
weight of its first and last chunk is one tensor (``SolverCosts.shared_excess``), and each chunk's
output is kept from its F to its B (the embedding chunk saves nothing else). ``partita rehearse``
matches V plans (``tests/runtime/test_rehearse_schedules.py``): on a 4-block GPT-2 of width 256 within 0.1% per
rank group; on gpt2-tiny +1.5% and +6.5%, as a 1F1B plan there is 10-11% over (one block's backward
buffers, which no schedule prices, weigh a lot beside so small a model).

What the runtime cannot run never enters: JAX models (no JAX program runs chunks), rank groups
mixing device types, ZeRO-2/3, recompute (none of these reaches a ZB-H1 candidate but the first).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from partita.device_reserve import tensor_cap
from partita.plan import Plan, chunk_position, validate
from partita.search.pipeline import schedule as sched
from partita.search.pipeline import schedule_cost
from partita.search.pipeline.pipeline_sim import step_time
from partita.search.pipeline.stage_cost import costs_held, static_memory_of
from partita.search.pipeline.stage_ranges import sync_copy
from partita.search.program import records
from partita.search.program.chunk_layout import _chunk
from partita.search.program.plan_build import Candidate, StagePick, _stage_records

MAX_PASSES = 8  # rounds of one-unit boundary moves per candidate


def groups_of(p: int) -> list[int]:
    """Rank group of each of the ``2p`` chunks (V placement)."""
    return [chunk_position("zbv", s, p) for s in range(2 * p)]


@dataclasses.dataclass
class VCandidate(Candidate):
    """A ZB-V candidate: ``stages`` are the ``p`` rank groups (their option / combo; ``k, j`` of the
    group's first chunk), ``chunks`` the ``2p`` chunks in model order with their group's option."""

    chunks: tuple[StagePick, ...] = ()

    def _chunk_arr(self, s: int) -> Any:
        c = self.chunks[s]
        return c.option.arrays[c.combo]

    @property
    def chunk_times(self) -> list[float]:
        return [float(self._chunk_arr(s).time[c.k, c.j]) for s, c in enumerate(self.chunks)]

    @property
    def stage_times(self) -> list[float]:
        """Per rank group, its two chunks' periods."""
        t, out = self.chunk_times, [0.0] * len(self.stages)
        for s, r in enumerate(groups_of(len(self.stages))):
            out[r] += t[s]
        return out

    @property
    def tails(self) -> list[float]:
        out = [0.0] * len(self.stages)
        for s, r in enumerate(groups_of(len(self.stages))):
            c = self.chunks[s]
            out[r] += float(self._chunk_arr(s).tail[c.k, c.j])
        return out

    def action_times(self) -> tuple[list[float], list[float], list[float]]:
        """Per chunk (model order) ``(F, B, W)`` seconds per micro-batch."""
        s, splits = self.search, []
        for c in self.chunks:
            env = {"B": 1 if s.costs.linear_batch else c.option.devices[0][2], "S": s.training.seq_len}
            splits.append(schedule_cost.stage_split(s.graph, env, s.units[c.k][0], s.units[c.j - 1][1], "none"))
        computes = [float(self._chunk_arr(i).compute[c.k, c.j]) for i, c in enumerate(self.chunks)]
        return schedule_cost.action_times(self.chunk_times, computes, splits)

    @property
    def pipeline(self) -> sched.PipelineTime:
        f, b, w = self.action_times()
        step = step_time("zbv", len(self.stages), self.m, f, b, w, num_virtual=2)
        busiest = max(self.stage_times)
        return sched.PipelineTime(step, max(0.0, step - self.m * busiest), busiest)

    def memory(self, i: int) -> float:
        return group_memory(self, i)["total"]

    def breakdown(self) -> dict[str, float]:
        times = self.stage_times
        r = max(range(len(times)), key=lambda i: times[i])
        comm = sum(
            float(self._chunk_arr(s).comm[c.k, c.j])
            for s, c in enumerate(self.chunks)
            if groups_of(len(self.stages))[s] == r
        )
        tail = max(self.tails)
        return {
            "compute_s": self.m * (times[r] - comm),
            "communication_s": self.m * comm + tail,
            "bubble_s": self.pipeline.bubble_s,
            "tail_s": tail,
        }

    def summary(self) -> str:
        parts = []
        for r, p in enumerate(self.stages):
            z, rec = p.option.combos[p.combo]
            units = "+".join(str(c.j - c.k) for s, c in enumerate(self.chunks) if groups_of(len(self.stages))[s] == r)
            parts.append(f"[{units}u {p.option.devices[0][0].name} {self.dp}x{p.option.tp} z{z} {rec}]")
        return f"dp={self.dp} b={self.b} m={self.m} zbv V " + " ".join(parts)


def group_memory(c: VCandidate, r: int) -> dict[str, float]:
    """Per device of rank group ``r``: ``total`` and the categories (module docstring)."""
    s = c.search
    p = len(c.stages)
    pick = c.stages[r]
    z = pick.option.combos[pick.combo][0]
    dev, tp, mb = pick.option.devices[0][0], pick.option.tp, pick.option.devices[0][2]
    mine = [i for i, g in enumerate(groups_of(p)) if g == r]
    costs, saved, held, out, grads = [], {}, {}, {}, {}
    layers: list[int] = []
    alt = not (c.dp > 1 and z >= 1)  # the torch.autocast program (stage_cost.UnitTable.for_stage)
    for i in mine:
        a0, b0 = s.units[c.chunks[i].k][0], s.units[c.chunks[i].j - 1][1]
        lc = [s.costs.layer(li, dev, tp, mb)[0] for li in range(a0, b0)]
        costs += lc
        layers += range(a0, b0)
        saved[i] = sum(
            (x.activation_bytes_alt if alt and x.activation_bytes_alt is not None else x.activation_bytes) for x in lc
        )
        held[i] = costs_held(lc, a0 == 0, alt)  # as the option's HeldCounts weighs it
        # the chunk's output, which the runtime keeps from F to B to run the backward from it
        # (backends/torch/schedule.P2PPipeline: nothing inside the chunk saves it); the last chunk's is the loss
        out[i] = lc[-1].boundary_bytes if i < 2 * p - 1 else 0.0
        grads[i] = sum(x.grad_bytes for x in lc)
    # the first and last chunk share the tied embedding / LM head weight (one tensor on the rank)
    shared = s.costs.shared_excess(layers, dev, tp, mb)
    cats = static_memory_of(costs, c.dp, z, False, shared)
    # a chunk's gradients as the program keeps them (docstring): ``kept`` in the accumulator's dtype,
    # ``copy`` the low-precision copy a W writes under FSDP2 (stage_cost.static_memory), per chunk
    share = cats["gradients"] / (sum(grads.values()) or 1.0)
    copy_ratio = static_memory_of(costs, c.dp, z, True, shared)["gradients"] / (cats["gradients"] or 1.0) - 1.0
    first = {i: s.units[c.chunks[i].k][0] == 0 for i in mine}  # the model's first layer: no B, W is the backward
    kept: set[int] = set()
    copied: set[int] = set()

    def grads_now() -> float:
        return sum(share * grads[i] for i in kept) + sum(copy_ratio * share * grads[i] for i in copied)

    fwd = dict.fromkeys(mine, 0)
    dfr = dict.fromkeys(mine, 0)

    def acts_now() -> float:
        return sum(saved[i] * (fwd[i] + held[i] * dfr[i]) + out[i] * fwd[i] for i in mine)

    peak, peak_acts, peak_grads, at = -1.0, 0.0, 0.0, dict.fromkeys(mine, 0.0)
    after = acts_now()  # before an action: the moment after the previous one (the same sum of the same state)
    for a in sched.pipeline_actions("zbv", p, c.m, 2)[r]:
        here = after
        writing = 0.0  # a W writes its chunk's gradients while the micro-batch's held part is still there
        if a.kind == "F":
            fwd[a.stage] += 1
        elif a.kind == "B":
            fwd[a.stage] -= 1
            dfr[a.stage] += 1
            if not first[a.stage]:  # a backward from the chunk's output: FSDP2 folds every copy
                kept |= copied
                copied = set()
        else:
            dfr[a.stage] -= 1
            if first[a.stage] or copy_ratio <= 0.0:  # gradients straight into the accumulator
                writing = 0.0 if a.stage in kept else share * grads[a.stage]
                kept |= {a.stage} | copied if first[a.stage] else {a.stage}
                copied = set() if first[a.stage] else copied
            else:
                writing = copy_ratio * share * grads[a.stage]
                copied.add(a.stage)
        after = acts_now()
        now = grads_now()  # (once per action: both moments below read the gradients after it)
        # the moment after the action; and a W's own: its held part still there beside the new gradients
        for acts_m, grads_m in ((after, now),) + (((here, now),) if writing else ()):
            if acts_m + grads_m > peak:
                peak, peak_acts, peak_grads = acts_m + grads_m, acts_m, grads_m
                at = {i: fwd[i] + held[i] * dfr[i] for i in mine}
    # the loss's backward buffers, and the parameter gradients a W makes beside .grad: the whole backward's
    # on the chunk holding the model's first layer, one deferred W's elsewhere (stage_ranges.grad_transient)
    whole = set(range(s.units[c.chunks[0].j - 1][1])) if 0 in mine else set()
    transient = max(
        (
            max(x.transient_bytes, x.grad_transient_bytes if li in whole else x.w_grad_transient_bytes)
            for li, x in zip(layers, costs)
        ),
        default=0.0,
    )
    acts, held_grads = peak_acts + transient, peak_grads
    # the step's end: every gradient and no activation; with the torch program's ZeRO-0 sync over dp > 1
    # also its flat copy of them, made once the activations are gone (stage_ranges.StageParts)
    flat = sync_copy(s.costs, 1.0, c.dp, z, chunked=True)[0] > 0  # chunks: the torch program's sync is flat too
    end = grads_now() * (2.0 if flat else 1.0)
    if end > acts + held_grads:
        acts, held_grads = end - grads_now(), grads_now()
    total = cats["parameters"] + held_grads + cats["optimizer"] + acts
    # per chunk, micro-batches held at the group's peak (a deferred W's weighing held[i])
    return {
        **cats,
        "gradients": held_grads,
        "activations": acts,
        "total": total,
        **{f"in_flight_{i}": at[i] for i in mine},
    }


def _fits(c: VCandidate) -> bool:
    return all(c.memory(r) <= tensor_cap(p.option.devices[0][0]) for r, p in enumerate(c.stages))


def _make(base: Candidate, cuts: list[int]) -> VCandidate:
    p = len(base.stages)
    g = groups_of(p)
    chunks = tuple(
        StagePick(cuts[s], cuts[s + 1], base.stages[g[s]].option, base.stages[g[s]].combo) for s in range(2 * p)
    )
    # build_plan needs p stages covering the model in order: group r's first chunk, the last group
    # from its first chunk to the end (lay_out replaces them with the 2p chunks)
    stages = tuple(dataclasses.replace(chunks[r], j=cuts[r + 1] if r < p - 1 else cuts[-1]) for r in range(p))
    return VCandidate(base.dp, base.b, base.m, "zbv", 2, stages, base.search, chunks)


def _price(c: VCandidate) -> float:
    if any(c.j <= c.k for c in c.chunks) or not all(x < float("inf") for x in c.chunk_times):
        return float("inf")
    return c.step_time if _fits(c) else float("inf")


def v_candidate(base: Candidate, refine: bool = True) -> VCandidate | None:
    """The best V layout found from ``base`` (a multi-stage ZB-H1 candidate), or None when the runtime
    could not run it or no layout tried fits (module docstring). ``refine=False`` (a hand layout,
    ``search/entry/hand_plan.py``): each rank group's range halved, priced whether it fits or not."""
    s, p = base.search, len(base.stages)
    if p < 2 or s.graph.meta.get("framework") == "jax":
        return None
    for pick in base.stages:
        z, rec = pick.option.combos[pick.combo]
        if len(pick.option.devices) > 1 or z >= 2 or rec != "none":
            return None
    num_units = len(s.units)
    if num_units < 2 * p:
        return None
    g = groups_of(p)
    sizes = [base.stages[r].j - base.stages[r].k for r in range(p)]
    want = [sizes[g[i]] // 2 if i < p else sizes[g[i]] - sizes[g[i]] // 2 for i in range(2 * p)]
    if min(want) < 1:
        want = [num_units // (2 * p)] * (2 * p)
        want[-1] += num_units - sum(want)
    cuts = [0]
    for n in want:
        cuts.append(cuts[-1] + n)
    best = _make(base, cuts)
    if not refine:
        return best if all(c.j > c.k for c in best.chunks) else None
    best_t = _price(best)
    for _ in range(MAX_PASSES):
        improved = False
        for i in range(1, 2 * p):
            for d in (-1, 1):
                trial = list(cuts)
                trial[i] += d
                if not trial[i - 1] < trial[i] < trial[i + 1]:
                    continue
                cand = _make(base, trial)
                t = _price(cand)
                if t < best_t * (1 - 1e-9):
                    best, best_t, cuts, improved = cand, t, trial, True
        if not improved:
            break
    return best if best_t < float("inf") else None


def v_candidates(bases: list[Candidate]) -> list[VCandidate]:
    """:func:`v_candidate` of each base, those that exist."""
    out = [v_candidate(c) for c in bases]
    return [c for c in out if c is not None]


def lay_out(search: Any, plan: Plan, best: VCandidate) -> Plan:
    """``plan`` (built by ``build_plan`` from ``best``: one Stage per rank group) as the chunked ZB-V plan."""
    g = search.graph
    p = len(best.stages)
    f, b, w = best.action_times()
    times = best.chunk_times
    stages = []
    for vs, c in enumerate(best.chunks):
        r = chunk_position("zbv", vs, p)
        head = plan.stages[r]
        a0, b0 = search.units[c.k][0], search.units[c.j - 1][1]
        st = _chunk(search, head, vs, a0, b0, 1, plan.micro_batch_size)
        arr = c.option.arrays[c.combo]
        comm = float(arr.comm[c.k, c.j])
        mem = group_memory(best, r)
        flops = 0.0
        for i, x in enumerate(best.chunks):
            if chunk_position("zbv", i, p) == r:
                x0, x1 = search.units[x.k][0], search.units[x.j - 1][1]
                strategies = {}
                for li in range(x0, x1):
                    strategies.update(
                        search.costs.solution(
                            li, x.option.devices[0][0], x.option.tp, x.option.devices[0][2]
                        ).op_strategies
                    )
                flops += _stage_records(search, best, r, x, x0, x1, head.zero_stage, head.recompute, strategies)[
                    "flops"
                ]
        predicted: dict[str, Any] = {
            **head.predicted,
            "time_s": times[vs],
            "compute_s": times[vs] - comm,
            "comm_s": comm,
            "forward_s": f[vs],
            "f_action_s": f[vs],
            "b_action_s": b[vs],
            "w_action_s": w[vs],
            "tail_s": best.tails[r],
            "memory_bytes": mem["total"],
            "memory_by_category": {k: mem[k] for k in ("parameters", "gradients", "optimizer", "activations")},
            "in_flight": mem[f"in_flight_{vs}"],  # this chunk's micro-batches at its rank group's peak
            "flops": flops,
        }
        stages.append(dataclasses.replace(st, predicted=predicted))
    chunked = records.complete(dataclasses.replace(plan, stages=tuple(stages), num_virtual_stages=2), g)
    validate(chunked)
    return chunked
