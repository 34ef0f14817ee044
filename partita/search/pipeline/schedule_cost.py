"""A candidate's pipeline priced by simulating its schedule: per-stage F / B / W times, then ``pipeline_sim``.

Sits in ``search/`` between the stage costs and the plan: ``plan_build.Candidate.pipeline`` calls
``simulate_stages`` for the final step time of a candidate (the stage DP only proposes partitions
with the closed form of ``schedule.coefficients``), and the report redraws the same simulation from
the plan's per-stage ``forward_s`` / ``backward_s`` / ``weight_s``.

The split of a stage's period ``t`` (one micro-batch, p2p included) into the three actions:

* the compute part ``c`` (``StageArrays.compute``) in proportion to the IR's FLOPs of the stage's
  layers: ``F`` the forward, ``W`` the weight gradients, ``B`` the rest of the backward (with the
  recomputed forward under full recompute). ``W`` is derived from the matmuls: for ``y = x w`` with
  ``w`` a parameter, the weight gradient ``x^T dy`` costs the forward matmul's FLOPs; everything else
  in the backward (``dy w^T``, attention, element-wise ops) is ``B`` (``weight_grad_flops``);
* the rest ``t - c`` (tensor-parallel collectives, the exposed ZeRO traffic, the p2p receive of the
  input activation and of the output gradient) half to ``F`` and half to ``B``: ``W`` communicates
  nothing.

A schedule that does not split the backward runs ``B + W`` as one action. With ``v`` chunks per rank
(interleaved 1F1B, ZB-V) each chunk gets ``1/v`` of its rank's times.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from partita.ir import Graph, Role, dim_size
from partita.passes.annotate import HEAVY_PRIMS, VIEW_PRIMS, layer_stats
from partita.search.pipeline.pipeline_sim import SimResult, simulate, step_time
from partita.search.pipeline.schedule import PipelineTime, stage_rank, virtual_stages

_WGRAD: dict[tuple, tuple[Graph, tuple[tuple[float, float, float], ...]]] = {}
_LAYER_BYTES: dict[tuple, tuple[Graph, np.ndarray, np.ndarray]] = {}


def weight_grad_flops(graph: Graph, env: Mapping[str, int]) -> list[float]:
    """Per layer, the FLOPs of the weight gradients: forward FLOPs of the heavy ops with a parameter operand."""
    producers = graph.producers()
    by_name = {n.name: n for n in graph.nodes}
    out = []
    for layer in graph.layers:
        w = 0.0
        for x in layer.nodes:
            n = by_name[x]
            if n.prim in HEAVY_PRIMS and any(
                graph.tensors[_base(i, producers)].role is Role.PARAMETER for i in n.inputs
            ):
                w += float(dim_size(n.flops, env))
        out.append(w)
    return out


def w_held(graph: Graph, seq_len: int) -> float:
    """What a micro-batch weighs between its B and its W, in units of its saved activations:
    ``1 + max over layers of (output-gradient bytes W needs / saved activation bytes)``
    (:func:`layer_held_bytes`). The largest layer ratio prices every stage (a bound; the planner's
    zero-bubble pass prices each stage by its own layers, ``zero_bubble.HeldCounts``)."""
    dy, act = layer_held_bytes(graph, seq_len)
    ratios = [d / a for d, a in zip(dy.tolist(), act.tolist()) if a > 0]
    return 1.0 + max(ratios, default=0.0)


def layer_held_bytes(graph: Graph, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer at batch 1: ``(output-gradient bytes W needs, saved activation bytes)``.

    W of a node with a parameter operand and an activation operand (a matmul, a norm's scale) needs
    the gradient of the node's output, which the torch runtime captures at B and keeps until W."""
    key = (id(graph), seq_len)
    hit = _LAYER_BYTES.get(key)
    if hit is not None and hit[0] is graph:
        return hit[1], hit[2]
    env = {"B": 1, "S": seq_len}
    producers = graph.producers()
    by_name = {n.name: n for n in graph.nodes}

    dys, acts = [], []
    for layer, st in zip(graph.layers, layer_stats(graph, env), strict=True):
        dy = 0.0
        for x in layer.nodes:
            n = by_name[x]
            if n.prim in VIEW_PRIMS:
                continue
            roles = {graph.tensors[_base(i, producers)].role for i in n.inputs}
            if Role.PARAMETER in roles and Role.ACTIVATION in roles:
                dy += sum(float(dim_size(graph.tensors[o].nbytes(), env)) for o in n.outputs)
        dys.append(dy)
        acts.append(float(st.activation_bytes))
    out = (np.array(dys), np.array(acts))
    _LAYER_BYTES[key] = (graph, *out)
    return out


def _base(name: str, producers: Mapping) -> str:
    while name in producers and producers[name].prim in VIEW_PRIMS and producers[name].inputs:
        name = producers[name].inputs[0]
    return name


def layer_flops(graph: Graph, env: Mapping[str, int]) -> tuple[tuple[float, float, float], ...]:
    """(forward, backward, weight-gradient) FLOPs per layer, memoised per graph object."""
    key = (id(graph), tuple(sorted(env.items())))
    hit = _WGRAD.get(key)
    if hit is not None and hit[0] is graph:
        return hit[1]
    stats = layer_stats(graph, env)
    wg = weight_grad_flops(graph, env)
    got = tuple(
        (float(s.forward_flops), float(s.backward_flops), min(w, float(s.backward_flops))) for s, w in zip(stats, wg)
    )
    _WGRAD[key] = (graph, got)
    return got


def action_shares(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(rho, omega)`` over layers of (forward, backward, weight-gradient) FLOPs ``rows``: a share of
    any stage's period its forward action F takes at least, and one its W takes at most
    (:func:`action_times`: ``F = c f + (t - c) / 2`` and ``W = c w`` with ``f``, ``w`` the stage's
    :func:`stage_split` shares, a FLOP-weighted mean of its layers', under full recompute too; a stage
    without FLOPs: 1/3 and 0)."""
    rho, omega = [1.0 / 3.0, 0.5], [0.0]
    for f, b, w in rows:
        if f + b > 0:
            rho.append(f / (2 * f + b))
            omega.append(w / (f + b))
    return min(rho), max(omega)


def stage_split(graph: Graph, env: Mapping[str, int], first: int, last: int, recompute: str) -> tuple[float, float]:
    """``(f, w)``: the forward's and the weight gradients' shares of the compute of layers ``[first, last)``."""
    rows = layer_flops(graph, env)[first:last]
    fwd = sum(r[0] for r in rows)
    bwd = sum(r[1] for r in rows)
    wg = sum(r[2] for r in rows)
    total = fwd + bwd + (fwd if recompute == "full" else 0.0)
    if total <= 0:
        return 1.0 / 3.0, 0.0
    return fwd / total, wg / total


def action_times(
    times: Sequence[float], computes: Sequence[float], splits: Sequence[tuple[float, float]]
) -> tuple[list[float], list[float], list[float]]:
    """Per pipeline stage ``(F, B, W)`` seconds from its period, compute part and ``stage_split``."""
    f_s, b_s, w_s = [], [], []
    for t, c, (fr, wr) in zip(times, computes, splits, strict=True):
        c = min(max(c, 0.0), t)
        f, w = c * fr + (t - c) / 2, c * wr
        f_s.append(f)
        w_s.append(w)
        b_s.append(max(t - f - w, 0.0))
    return f_s, b_s, w_s


def simulate_stages(
    schedule: str,
    num_micro: int,
    num_virtual: int,
    f_s: Sequence[float],
    b_s: Sequence[float],
    w_s: Sequence[float],
) -> SimResult:
    """Simulate ``schedule`` over pipeline stages with per-micro-batch F, B, W seconds (p2p included)."""
    return _simulate(schedule, num_micro, num_virtual, tuple(f_s), tuple(b_s), tuple(w_s))


def _chunks(schedule: str, v: int, stage_s: Sequence[tuple[float, ...]]) -> tuple[int, int, list[list[float]]]:
    """Pipeline stages' per-micro-batch F, B, W seconds spread over their ``v`` chunks (virtual stages)."""
    p = len(stage_s[0])
    v = virtual_stages(schedule, v)
    on = [stage_rank(schedule, s, p, v) for s in range(p * v)]
    return p, v, [[x[r] / v for r in on] for x in stage_s]


@functools.lru_cache(maxsize=4096)
def _simulate(
    schedule: str, m: int, v: int, f_s: tuple[float, ...], b_s: tuple[float, ...], w_s: tuple[float, ...]
) -> SimResult:
    p, v, (f, b, w) = _chunks(schedule, v, (f_s, b_s, w_s))
    return simulate(schedule, p, m, f, b, w, num_virtual=v)


def pipeline_time(
    schedule: str, num_micro: int, num_virtual: int, f_s: Sequence[float], b_s: Sequence[float], w_s: Sequence[float]
) -> PipelineTime:
    """The simulated counterpart of ``schedule.pipeline_time`` (step, bubble, busiest period)."""
    step = _step(schedule, num_micro, num_virtual, tuple(f_s), tuple(b_s), tuple(w_s))
    busiest = max(f + b + w for f, b, w in zip(f_s, b_s, w_s))
    return PipelineTime(step, max(0.0, step - num_micro * busiest), busiest)


@functools.lru_cache(maxsize=8192)
def _step(
    schedule: str, m: int, v: int, f_s: tuple[float, ...], b_s: tuple[float, ...], w_s: tuple[float, ...]
) -> float:
    """``_simulate(...).step_s`` through ``pipeline_sim.step_time`` (no timeline; same floats)."""
    p, v, (f, b, w) = _chunks(schedule, v, (f_s, b_s, w_s))
    return step_time(schedule, p, m, f, b, w, num_virtual=v)


def best_per_schedule(candidates: Sequence[Any]) -> dict[str, float]:
    """The fastest step each schedule reached among the planner's candidates (``"zbv v2"`` with chunks)."""
    out: dict[str, float] = {}
    for c in candidates:
        key = c.schedule + (f" v{c.v}" if c.v > 1 else "")
        out[key] = min(out.get(key, float("inf")), float(c.step_time))
    return dict(sorted(out.items(), key=lambda kv: (kv[1], kv[0])))
