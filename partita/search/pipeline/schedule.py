"""Pipeline schedules as data (per-rank action lists) and the closed forms the stage DP optimizes.

Sits in ``search/`` below the planner: ``pipeline_actions`` is the one definition of a schedule,
shared by the cost model (``pipeline_sim.py`` simulates the lists), the report's chart and the
runtimes (``backends/torch/schedule.py`` executes the same lists). A schedule is a pure function of
``(schedule, num_ranks, num_micro, num_virtual)``, so a Plan stores those and regenerates the list.

Actions are ``(stage, micro, kind)``: ``stage`` is the virtual stage in model order
(``0 .. num_ranks * num_virtual - 1``), ``kind`` is ``"F"``, ``"B"`` (the whole backward, or only the
input gradient when the schedule splits the backward) or ``"W"`` (the weight gradient). Orders:

* ``gpipe``: all forwards, then all backwards.
* ``1f1b``: rank ``r`` runs ``p - 1 - r`` warm-up forwards, then alternates F and B, then drains.
* ``interleaved_1f1b`` (Megatron): ``v`` chunks per rank, stage ``s`` on rank ``s % p``; micro-batches
  go through the chunks in rounds of ``g = m / floor(m / p)`` (``p`` when ``p`` divides ``m``; a count
  that does not split evenly is refused); warm-up ``2 (p - 1 - r) + (v - 1) g`` forwards.
* ``zb_h1`` (Qi et al. 2023, ZB-H1): 1F1B's order with B the input gradient only; rank ``r`` defers
  its weight gradients by ``r`` micro-batches, so W fills the cool-down bubble (bubble
  ``(p - 1)(F + B - W)`` instead of 1F1B's ``(p - 1)(F + B + W)``) and every rank holds at most ``p``
  micro-batches counted until their W (1F1B's peak, on rank 0).
* ``zbv`` (same paper, ZB-V): two chunks per rank in a V (stage ``s < p`` on rank ``s``, stage
  ``s >= p`` on rank ``2p - 1 - s``), so the first and the last stage share rank 0; warm-up
  ``2 (p - r) - 1`` chunk-0 forwards, then F/B/W per chunk; it needs ``2p - 1`` micro-batches for
  its shape, and with fewer the actions of the missing ones are dropped.

A Plan with model chunks lists one Stage per virtual stage, placed by ``stage_rank``
(``plan.chunk_position``); the torch runtime runs every chunk of a rank from its one action list.

The orders equal ``torch.distributed.pipelining``'s (``tests/search/test_schedule.py`` compares them)
and run without deadlock with buffered sends and blocking receives (``tests/search/test_pipeline_sim.py``).

The closed forms the stage DP uses to propose partitions (``t_s`` = stage ``s``'s period per
micro-batch: F + B (+ W) (+ recompute) plus its p2p; ``p`` stages, ``m`` micro-batches, ``v`` chunks)::

    GPipe, 1F1B, ZB-H1   T = sum_s t_s + (m - 1) * max_s t_s
    interleaved, ZB-V    T = sum_s t_s / v + (m - 1/v) * max_s t_s

A candidate's final step time comes from simulating its action list (``pipeline_sim``), where ZB-H1
and ZB-V gain from filling bubbles with W. In-flight activations (micro-batches whose forward ran and
whose backward has not, at the peak of pipeline position ``i``): GPipe ``m``; 1F1B ``min(p - i, m)``;
interleaved ``min(2 (p - i - 1) + (v - 1) p + 1, m v) / v`` (Megatron's warm-up count); ZB-H1, ZB-V:
counted on the action list, a micro-batch held until its W ran and weighing ``w_held`` between its B
and its W (``in_flight``), every position priced at the most loaded rank's count. Gradient
synchronization and the optimizer step come after the pipeline drains; the caller adds what it
cannot hide as a tail.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from partita.errors import ConfigError
from partita.plan import chunk_position, chunks_per_rank

SCHEDULE_FAMILIES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
KINDS = ("F", "B", "W")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    stage: int  # virtual stage index 0 .. num_ranks * num_virtual - 1 (model order)
    micro: int  # micro-batch index 0 .. num_micro - 1
    kind: str  # "F"; "B" the full backward, or the input gradient when the schedule splits it; "W"

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.micro}"


@dataclasses.dataclass(frozen=True)
class PipelineTime:
    step_s: float  # pipeline part of the step (no tail)
    bubble_s: float
    busiest_s: float  # max_s t_s


def splits_backward(schedule: str) -> bool:
    """True when the schedule runs the weight gradient (W) apart from the input gradient (B)."""
    return schedule in ("zb_h1", "zbv")


def virtual_stages(schedule: str, num_virtual: int = 1) -> int:
    """Chunks per rank the schedule actually uses (1 unless interleaved; 2 for ZB-V): the plan's rule."""
    return chunks_per_rank(schedule, num_virtual)


def check(schedule: str, num_micro_batches: int, num_virtual: int = 1) -> None:
    if schedule not in SCHEDULE_FAMILIES:
        raise ConfigError(f"schedule {schedule!r} is unknown.", f"use one of {SCHEDULE_FAMILIES}.")
    if num_micro_batches < 1 or num_virtual < 1:
        raise ConfigError(f"num_micro_batches={num_micro_batches}, num_virtual={num_virtual} must be >= 1.", "")
    if schedule == "zbv":
        if num_virtual != 2:
            raise ConfigError(f"zbv places exactly 2 stages per rank, not {num_virtual}.", "set num_virtual=2.")
        return
    if num_virtual > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(f"{num_virtual} virtual stages need the interleaved_1f1b schedule.", "set v=1.")
    if schedule == "interleaved_1f1b" and num_virtual < 2:
        raise ConfigError("interleaved_1f1b needs at least 2 virtual stages.", "set num_virtual >= 2.")


def coefficients(schedule: str, num_micro_batches: int, num_virtual: int = 1) -> tuple[float, float]:
    """``(alpha, beta)`` with ``T = alpha * sum_s t_s + beta * max_s t_s`` (the DP's objective)."""
    check(schedule, num_micro_batches, num_virtual)
    m = num_micro_batches
    if schedule in ("interleaved_1f1b", "zbv"):
        return 1.0 / num_virtual, m - 1.0 / num_virtual
    return 1.0, m - 1.0


def pipeline_time(
    stage_times: Sequence[float], schedule: str, num_micro_batches: int, num_virtual: int = 1
) -> PipelineTime:
    """Closed-form latency of the pipeline part of one step from the per-micro-batch stage periods."""
    if not stage_times:
        raise ConfigError("a pipeline needs at least one stage.", "")
    alpha, beta = coefficients(schedule, num_micro_batches, num_virtual)
    busiest = max(stage_times)
    step = alpha * sum(stage_times) + beta * busiest
    return PipelineTime(step, max(0.0, step - num_micro_batches * busiest), busiest)


W_HELD_BOUND = 2.0  # a micro-batch between its B and its W: at most its activations twice over


def in_flight(
    schedule: str,
    stage_index: int,
    num_stages: int,
    num_micro_batches: int,
    num_virtual: int = 1,
    *,
    w_held: float = W_HELD_BOUND,
) -> float:
    """Micro-batches of pipeline position ``stage_index``'s saved activations alive at its peak.

    Under a schedule that splits the backward, a micro-batch whose B ran and whose W has not counts
    ``w_held`` times (its activations plus the output gradients W needs: ``schedule_cost.w_held``
    of the graph; the default bounds it). ZB-H1: position ``i``'s own peak (rank ``i`` holds ``p - i``
    forwards and defers ``i`` W's: ``search/zero_bubble.per_position``); ZB-V: the largest rank's peak
    (its ranks hold about the same).
    """
    m, p, i, v = num_micro_batches, num_stages, stage_index, num_virtual
    if not 0 <= i < p:
        raise ConfigError(f"stage index {i} outside 0..{p - 1}.", "")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - i, m))
    check(schedule, m, v)
    if splits_backward(schedule):
        peaks = peak_in_flight(schedule, p, m, v, w_held)
        return peaks[i] if schedule == "zb_h1" else max(peaks)
    try:
        return rank_peak_in_flight(schedule, i, p, m, v)
    except ConfigError:  # a micro-batch count the interleaved order cannot split: Megatron's count
        return min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) / v


def in_flight_by_stages_left(
    schedule: str, num_stages: int, num_micro_batches: int, num_virtual: int = 1
) -> list[float]:
    """``[0, count of the stage with s stages left...]`` for a pipeline of exactly ``num_stages`` stages:
    position ``num_stages - s``'s :func:`in_flight`, as the stage DP and ``Candidate.memory`` index
    counts. Under 1F1B and GPipe the same as the first stage of an ``s``-stage pipeline; interleaved
    1F1B's count depends on the depth as well (position 1 of 3 holds 3.5 stages' worth at v = 2, the
    first stage of 2 holds 2.5: ``partita rehearse`` of a 3-stage interleaved plan measured it)."""
    p, m, v = num_stages, num_micro_batches, num_virtual
    return [0.0] + [in_flight(schedule, p - s, p, m, v) for s in range(1, p + 1)]


def p2p_multiplier(schedule: str, num_virtual: int = 1) -> int:
    """Interleaving sends every activation ``v`` times as often (once per model chunk)."""
    return num_virtual if schedule in ("interleaved_1f1b", "zbv") else 1


def stage_rank(schedule: str, stage: int, num_ranks: int, num_virtual: int) -> int:
    """The pipeline position (rank) that runs virtual stage ``stage``."""
    p = num_ranks
    if not 0 <= stage < p * num_virtual:
        raise ConfigError(f"stage {stage} outside 0..{p * num_virtual - 1}.", "")
    if schedule in ("zbv", "interleaved_1f1b"):  # the placement a chunked Plan records (plan.chunk_position)
        return chunk_position(schedule, stage, p)
    return stage


def pipeline_actions(schedule: str, num_ranks: int, num_micro: int, num_virtual: int = 1) -> list[list[Action]]:
    """Per pipeline rank, that rank's actions in execution order (a fresh list; cached underneath)."""
    return [list(r) for r in _actions(schedule, num_ranks, num_micro, num_virtual)]


def rank_orders(
    schedule: str, num_ranks: int, num_micro: int, num_virtual: int = 1
) -> list[list[tuple[int, int, str]]]:
    """:func:`pipeline_actions` as ``(stage, micro, kind)`` tuples; 1F1B and ZB-H1 without building
    their Action objects (the simulator's table of a 1536-micro-batch pipeline: a fifth of its time)."""
    if schedule in ("1f1b", "zb_h1"):
        check(schedule, num_micro, num_virtual)
        if num_ranks < 1:
            raise ConfigError(f"num_ranks={num_ranks} must be >= 1.", "")
        return [
            [(r, i, k) for i, k in _one_f_one_b_steps(r, num_ranks, num_micro, r if schedule == "zb_h1" else None)]
            for r in range(num_ranks)
        ]
    return [
        [(a.stage, a.micro, a.kind) for a in acts] for acts in _actions(schedule, num_ranks, num_micro, num_virtual)
    ]


@functools.lru_cache(maxsize=256)
def _actions(schedule: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    check(schedule, m, v)
    if p < 1:
        raise ConfigError(f"num_ranks={p} must be >= 1.", "")
    gen = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb_h1": _zb_h1, "interleaved_1f1b": _interleaved, "zbv": _zbv}
    return tuple(tuple(gen[schedule](r, p, m, v)) for r in range(p))


def _gpipe(r: int, p: int, m: int, v: int) -> list[Action]:
    return [Action(r, i, "F") for i in range(m)] + [Action(r, i, "B") for i in range(m)]


def _one_f_one_b(r: int, p: int, m: int, v: int, *, defer: int | None = None) -> list[Action]:
    """1F1B; with ``defer`` set, B is the input gradient and W runs ``defer`` micro-batches late."""
    return [Action(r, i, k) for i, k in _one_f_one_b_steps(r, p, m, defer)]


def _one_f_one_b_steps(r: int, p: int, m: int, defer: int | None) -> list[tuple[int, str]]:
    """Rank ``r``'s 1F1B order as ``(micro, kind)`` pairs (the Actions without their objects)."""
    warm = min(p - 1 - r, m)
    out = [(i, "F") for i in range(warm)]
    nxt_f, nxt_b, nxt_w = warm, 0, 0
    while nxt_b < m:
        if nxt_f < m:
            out.append((nxt_f, "F"))
            nxt_f += 1
        out.append((nxt_b, "B"))
        nxt_b += 1
        if defer is not None and nxt_b - nxt_w > defer:
            out.append((nxt_w, "W"))
            nxt_w += 1
    if defer is not None:
        out += [(i, "W") for i in range(nxt_w, m)]
    return out


def _zb_h1(r: int, p: int, m: int, v: int) -> list[Action]:
    return _one_f_one_b(r, p, m, v, defer=r)


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: rounds of ``p`` micro-batches (or ``m`` when fewer) through the chunks."""
    g = interleave_round(p, m)

    def unit(k: int, backward: bool) -> tuple[int, int]:  # k-th (chunk, micro) of this rank
        group, within = divmod(k, g * v)
        chunk, off = divmod(within, g)
        return (v - 1 - chunk if backward else chunk), group * g + off

    total = m * v
    warm = min(2 * (p - 1 - r) + (v - 1) * g, total)
    out: list[Action] = []
    nxt_f = nxt_b = 0
    for _ in range(warm):
        c, i = unit(nxt_f, False)
        out.append(Action(c * p + r, i, "F"))
        nxt_f += 1
    while nxt_b < total:
        if nxt_f < total:
            c, i = unit(nxt_f, False)
            out.append(Action(c * p + r, i, "F"))
            nxt_f += 1
        c, i = unit(nxt_b, True)
        out.append(Action(c * p + r, i, "B"))
        nxt_b += 1
    return out


def interleave_round(num_ranks: int, num_micro: int) -> int:
    """Micro-batches per round of interleaved 1F1B: ``m / floor(m / p)`` (``m`` when fewer than ``2p``)."""
    rounds = max(1, num_micro // num_ranks)
    if num_micro % rounds:
        raise ConfigError(
            f"interleaved_1f1b splits {num_micro} micro-batches into {rounds} rounds of at least {num_ranks} "
            "(one per rank): they do not divide evenly.",
            f"use a number of micro-batches below {2 * num_ranks} or divisible by {rounds}.",
        )
    return num_micro // rounds


def _zbv(r: int, p: int, m: int, v: int) -> list[Action]:
    """ZB-V: warm up chunk 0 down the V, then chunk 1 back up, steady (F B W) per chunk, drain W."""
    n = max(m, 2 * p - 1)  # the schedule's shape needs 2p - 1 micro-batches; extra ones are dropped
    s0, s1 = r, 2 * p - 1 - r
    cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0, "w0": 0, "w1": 0}
    out: list[Action] = []

    def do(kind: str, chunk: int) -> None:
        key = f"{kind.lower()}{chunk}"
        out.append(Action(s0 if chunk == 0 else s1, cnt[key], kind))
        cnt[key] += 1

    for _ in range(2 * (p - r) - 1):
        do("F", 0)
    for _ in range(r):
        do("F", 1)
        do("F", 0)
    for _ in range(p - r):
        do("F", 1)
        do("B", 1)
        do("W", 1)
    while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
        if cnt["f0"] < n:
            do("F", 0)
        do("B", 0)
        do("W", 0)
        do("F", 1)
        do("B", 1)
        do("W", 1)
    for _ in range(r):
        do("B", 0)
        do("B", 1)
    for _ in range(p - r):
        do("B", 0)
        do("W", 0)
    while cnt["w1"] < cnt["b1"]:
        do("W", 1)
    while cnt["w0"] < cnt["b0"]:
        do("W", 0)
    return [a for a in out if a.micro < m]


@functools.lru_cache(maxsize=1024)
def peak_in_flight(
    schedule: str, num_ranks: int, num_micro: int, num_virtual: int = 1, w_held: float = 1.0
) -> tuple[float, ...]:
    """Per rank, the peak of micro-batches held (forward ran, last backward part not), over its chunks / v.

    A micro-batch is held until its W when the schedule splits the backward (the torch runtime keeps
    its autograd graph, hence its activations, from B to W, and the output gradients W needs); from
    its B to its W it counts ``w_held``. Counted on the order alone.
    """
    return tuple(rank_peak_in_flight(schedule, r, num_ranks, num_micro, num_virtual, w_held) for r in range(num_ranks))


@functools.lru_cache(maxsize=4096)
def rank_peak_in_flight(
    schedule: str, rank: int, num_ranks: int, num_micro: int, num_virtual: int = 1, w_held: float = 1.0
) -> float:
    """``peak_in_flight(...)[rank]`` from that rank's own list alone (the planner asks for the first
    rank's count per pipeline depth: building every rank's list cost the 175B search 5% of its time)."""
    v = virtual_stages(schedule, num_virtual)
    split = splits_backward(schedule)
    check(schedule, num_micro, v)
    if num_ranks < 1:
        raise ConfigError(f"num_ranks={num_ranks} must be >= 1.", "")
    if schedule == "zb_h1":  # the same order as _actions, without building Action objects
        kinds = [k for _, k in _one_f_one_b_steps(rank, num_ranks, num_micro, rank)]
    else:
        gen = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved_1f1b": _interleaved, "zbv": _zbv}
        kinds = [a.kind for a in gen[schedule](rank, num_ranks, num_micro, v)]
    fwd = deferred = 0
    peak = 0.0
    for kind in kinds:
        if kind == "F":
            fwd += 1
        elif kind == "B":
            fwd -= 1
            deferred += split
        else:
            deferred -= 1
        peak = max(peak, fwd + w_held * deferred)
    return peak / v
