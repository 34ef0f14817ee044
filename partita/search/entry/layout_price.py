"""One hand layout, one price: the planner's Candidate of a Megatron-style layout (issue 32 item 5).

``partita evaluate`` (``evaluate.evaluate_config``), ``partita compile`` with a hand layout
(``hand_plan.hand_plan``), the baselines and the benches all price a layout through
:func:`layout_candidate`: the stage options of the layout's degrees are built by ``Search.arrays`` with the
arguments the planner's own ``Search.options_for`` passes (in-flight counts of the schedule, the
micro-batch count that says whether gradients live at the activation peak, the schedule's p2p
multiplier, a split backward's gradient copy), the blocks split by ``evaluate.megatron_split``, and the
step is the planner's ``Candidate.step_time``; under ``zbv`` it is the V layout the runtime runs
(``search/program/v_layout.v_candidate`` of that candidate, each rank group's range halved into its two
chunks), which ``partita compile --schedule zbv`` writes and ``partita evaluate --schedule zbv`` prices. So one layout prints one step time whichever command
asks, and the search ranks it at that same number (``tests/search/test_one_price.py``).

What the layout *is* priced as comes from the costs passed in: ``SolverCosts`` with the program's own
tensor parallelism (``evaluate.tp_style_of``, the default everywhere a Partita program is priced), or
another stack's (``tp_style="megatron"``: the benches' Megatron-LM rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from partita.cluster import DeviceType
from partita.errors import ConfigError
from partita.plan import flat_sync_chunks
from partita.search.entry.planner import Option, Search
from partita.search.pipeline import schedule as sched
from partita.search.pipeline.zero_bubble import HeldCounts, in_flight_table
from partita.search.program import v_layout
from partita.search.program.plan_build import Candidate, StagePick


def layout_candidate(
    search: Search,
    dev: DeviceType,
    *,
    tps: Sequence[int],
    ranges: Sequence[tuple[int, int]],
    dp: int,
    micro_batch: int,
    num_micro_batches: int,
    schedule: str,
    num_virtual: int = 1,
) -> Candidate:
    """The planner's Candidate of ``len(ranges)`` stages on ``dev``: stage ``i`` holds layers
    ``ranges[i]`` at tensor parallelism ``tps[i]`` over ``dp`` replicas of ``micro_batch`` samples,
    ``num_micro_batches`` per step under ``schedule`` (``num_virtual`` chunks per rank group when
    interleaved; a ``v_layout.VCandidate`` under ``zbv``). ``search.options`` names the one ZeRO stage
    and recompute asked for. ``search.units`` must be the graph's layers (``max_layer_units=0``).
    ConfigError, in compile's words, when the model cannot run at a degree on ``dev`` or cannot be cut
    into the model chunks the schedule needs."""
    pp, m = len(ranges), num_micro_batches
    v = num_virtual if schedule == "interleaved_1f1b" else 1
    why = search.graph.meta.get("no_chunks")
    if (schedule == "zbv" or v > 1) and why:
        raise ConfigError(
            f"{schedule} needs several model chunks per rank, and {why}.",
            "use --schedule 1f1b or zb_h1 for this model.",
        )
    split = sched.splits_backward(schedule)
    in_flight: Any
    if split:  # issue 19: each stage weighs its own deferred W (search/pipeline/zero_bubble.py)
        vv = sched.virtual_stages(schedule, v)
        in_flight = HeldCounts(lambda held: in_flight_table(held, schedule, m, vv, pp))
    else:
        in_flight = np.array(sched.in_flight_by_stages_left(schedule, pp, m, v))
    devs = ((dev, dp, micro_batch),)
    options: dict[int, Option] = {}  # per degree, its stage option (the arrays of every layer range)
    for t in sorted(set(tps)):
        got = search.arrays(  # the arguments Search.options_for passes for this schedule
            devs,
            dp,
            t,
            in_flight,
            sched.p2p_multiplier(schedule, v),
            None if split else m,
            split_backward=split,
            chunked=flat_sync_chunks(schedule, v),  # ZB-V keeps the flat sync (plan.flat_sync_chunks)
        )
        if got is None:
            raise ConfigError(f"the model cannot run with tp={t} on {dev.name}.", "use another tp.")
        per_combo, combos, stack = got
        options[t] = Option(0, t, t, devs, (), per_combo, combos, stack)
    picks = tuple(StagePick(a, b, options[t], 0) for (a, b), t in zip(ranges, tps))
    cand = Candidate(dp, micro_batch, m, schedule, v, picks, search)
    if schedule != "zbv":
        return cand
    if pp < 2:
        raise ConfigError(
            "zbv runs two model chunks per rank group in a V across the pipeline: it needs pp >= 2 (got pp=1).",
            "pass --pp 2 or more with --schedule zbv, or use --schedule 1f1b.",
        )
    vc = v_layout.v_candidate(cand, refine=False)  # issue 19: each stage's blocks halved into its two chunks
    if vc is None:
        raise ConfigError(
            f"zbv cannot lay out pp={pp} stages of this model as {2 * pp} chunks in a V.",
            "use fewer stages, or --schedule zb_h1.",
        )
    return vc
