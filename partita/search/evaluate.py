"""Price one hand-written (Megatron-style) configuration with the planner's own cost path.

Used by ``partita evaluate``, the Megatron-grid baseline (``search/baselines.py``) and the
cost-model accuracy benchmark (``bench/costmodel_accuracy.py``). Stages split the repeated blocks
evenly (Megatron's rule); the first stage also holds the layers before the first block (embedding),
the last the layers after the last block (head). Every stage runs on the cluster's first device type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from partita.cluster import Cluster
from partita.errors import ConfigError
from partita.ir import Graph
from partita.search import schedule as sched
from partita.search.config import SearchOptions, TrainingConfig
from partita.search.plan_build import Candidate, StagePick
from partita.search.planner import Option, Search
from partita.search.stage_cost import SolverCosts, StageFactors


@dataclasses.dataclass(frozen=True)
class Evaluation:
    predicted_step_time_s: float
    pipeline_s: float
    bubble_s: float
    tail_s: float
    stage_times_s: tuple[float, ...]
    memory_per_device: tuple[float, ...]  # per stage, bytes
    memory_capacity: float
    fits: bool
    tokens_per_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def megatron_split(graph: Graph, pp: int) -> list[tuple[int, int]]:
    """Layer-index ranges of ``pp`` stages: blocks split evenly, pre/post layers on the ends."""
    kinds = [lay.kind for lay in graph.layers]
    block = max(set(kinds), key=lambda k: (kinds.count(k), -kinds.index(k)))
    idx = [i for i, k in enumerate(kinds) if k == block]
    first, last, n = idx[0], idx[-1], len(idx)
    if n % pp:
        raise ConfigError(f"{n} blocks do not split into pp={pp} stages.", f"use a divisor of {n}.")
    per = n // pp
    bounds = [first + i * per for i in range(pp)] + [last + 1]
    bounds[0], bounds[-1] = 0, len(kinds)
    return [(bounds[i], bounds[i + 1]) for i in range(pp)]


def evaluate_config(
    graph: Graph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    zero_stage: int = 0,
    recompute: str = "none",
    schedule: str = "1f1b",
    num_virtual: int = 1,
    costs: SolverCosts | None = None,
    factors: StageFactors | None = None,
    tp_style: str = "megatron",
) -> Evaluation:
    """Predicted step time and memory of one configuration (module docstring).

    ``tp_style="megatron"`` (the default) prices ``tp`` as Megatron-LM's tensor parallelism: the
    weights are split and activations stay whole on the tp group. ``"auto"`` lets the intra-op ILP
    pick any sharding on the tp axis (what ``partita compile`` does).
    """
    if dp * tp * pp > cluster.num_devices:
        raise ConfigError(
            f"dp*tp*pp = {dp * tp * pp} exceeds the cluster's {cluster.num_devices} devices.",
            "lower a degree or use a larger cluster.",
        )
    if training.global_batch % (micro_batch * dp):
        raise ConfigError(
            f"global batch {training.global_batch} is not a multiple of micro_batch*dp={micro_batch * dp}.",
            "pick degrees that divide the batch.",
        )
    opts = SearchOptions(zero_stages=(zero_stage,), recompute=(recompute,), max_layer_units=0, max_tp=tp)
    if costs is None:
        costs = SolverCosts(graph, cluster, training, tp_style=tp_style)
    elif costs.tp_style != tp_style:
        raise ConfigError(
            f"the shared SolverCosts price tp_style={costs.tp_style!r}, this call asks {tp_style!r}.",
            "build SolverCosts(..., tp_style=...) with the style you evaluate.",
        )
    search = Search(graph, cluster, training, opts, costs, factors)
    dev = cluster.device_types()[0]
    m = training.global_batch // (micro_batch * dp)
    v = num_virtual if schedule == "interleaved_1f1b" else 1
    in_flight = np.array([0.0] + [sched.in_flight(schedule, 0, s, m, v) for s in range(1, pp + 1)])
    got = search.arrays(((dev, dp, micro_batch),), dp, tp, in_flight, sched.p2p_multiplier(schedule, v))
    if got is None:
        raise ConfigError(f"the model cannot run with tp={tp} on {dev.name}.", "use another tp.")
    per_combo, combos, stack = got
    opt = Option(0, tp, tp, ((dev, dp, micro_batch),), (), per_combo, combos, stack)
    picks = tuple(StagePick(a, b, opt, 0) for a, b in megatron_split(graph, pp))
    cand = Candidate(dp, micro_batch, m, schedule, v, picks, search)
    mem = tuple(cand.memory(i) for i in range(pp))
    cap = dev.memory_bytes * search.factors.memory_usable
    pt = cand.pipeline
    step = cand.step_time
    return Evaluation(
        step,
        pt.step_s,
        pt.bubble_s,
        max(cand.tails),
        tuple(cand.stage_times),
        mem,
        cap,
        all(x <= cap for x in mem),
        training.global_batch * training.seq_len / step,
    )
