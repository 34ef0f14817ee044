"""Pipeline schedule formulas: step latency, bubble and in-flight activations per stage.

Used by ``inter_op.py`` (the DP's objective), ``stage_cost.py`` (activation memory) and
``evaluate.py``. ``t_s`` is stage ``s``'s period per micro-batch: forward + backward (+ recompute)
of its layers on one replica, plus the p2p receive of its input activation and output gradient.
With ``p`` stages, ``m`` micro-batches and ``v`` model chunks per stage (interleaved 1F1B)::

    GPipe, 1F1B        T = sum_s t_s + (m - 1) * max_s t_s
    interleaved 1F1B   T = sum_s t_s / v + (m - 1/v) * max_s t_s       (= m t + (p - 1) t / v, uniform)

The bubble is ``T - m * max_s t_s`` (the time the busiest stage waits). In-flight activations
(micro-batches whose forward ran and whose backward has not, held at the peak by stage ``i``):

    GPipe              m
    1F1B               min(p - i, m)
    interleaved 1F1B   min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) / v   (Megatron's warm-up count)

Gradient synchronization and the optimizer step come after the pipeline drains; what bucketed
wait-free backprop cannot hide behind the backward is added by the caller as a tail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from partita.errors import ConfigError
from partita.plan import SCHEDULES


@dataclasses.dataclass(frozen=True)
class PipelineTime:
    step_s: float  # pipeline part of the step (no tail)
    bubble_s: float
    busiest_s: float  # max_s t_s


def coefficients(schedule: str, num_micro_batches: int, num_virtual: int = 1) -> tuple[float, float]:
    """``(alpha, beta)`` with ``T = alpha * sum_s t_s + beta * max_s t_s``."""
    check(schedule, num_micro_batches, num_virtual)
    m = num_micro_batches
    if schedule == "interleaved_1f1b":
        return 1.0 / num_virtual, m - 1.0 / num_virtual
    return 1.0, m - 1.0


def check(schedule: str, num_micro_batches: int, num_virtual: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule {schedule!r} is unknown.", f"use one of {SCHEDULES}.")
    if num_micro_batches < 1 or num_virtual < 1:
        raise ConfigError(f"num_micro_batches={num_micro_batches}, num_virtual={num_virtual} must be >= 1.", "")
    if num_virtual > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(f"{num_virtual} virtual stages need the interleaved_1f1b schedule.", "set v=1.")
    if schedule == "interleaved_1f1b" and num_virtual < 2:
        raise ConfigError("interleaved_1f1b needs at least 2 virtual stages.", "set num_virtual >= 2.")


def pipeline_time(
    stage_times: Sequence[float], schedule: str, num_micro_batches: int, num_virtual: int = 1
) -> PipelineTime:
    """Latency of the pipeline part of one step from the per-micro-batch stage periods."""
    if not stage_times:
        raise ConfigError("a pipeline needs at least one stage.", "")
    alpha, beta = coefficients(schedule, num_micro_batches, num_virtual)
    busiest = max(stage_times)
    step = alpha * sum(stage_times) + beta * busiest
    return PipelineTime(step, max(0.0, step - num_micro_batches * busiest), busiest)


def in_flight(schedule: str, stage_index: int, num_stages: int, num_micro_batches: int, num_virtual: int = 1) -> float:
    """Micro-batches of stage ``stage_index``'s saved activations alive at its peak."""
    m, p, i, v = num_micro_batches, num_stages, stage_index, num_virtual
    if not 0 <= i < p:
        raise ConfigError(f"stage index {i} outside 0..{p - 1}.", "")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - i, m))
    check(schedule, m, v)
    return min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) / v


def p2p_multiplier(schedule: str, num_virtual: int = 1) -> int:
    """Interleaving sends every activation ``v`` times as often (once per model chunk)."""
    return num_virtual if schedule == "interleaved_1f1b" else 1
