"""The receive buffers ``torch.distributed.pipelining`` allocates for every micro-batch of a step: device memory.

Read by ``search/program/plan_build.Candidate.memory`` (so the plan's ``memory_bytes``, its activations
category, ``partita evaluate`` and the candidates' final fit all carry it). When the torch program runs
its pipeline on ``torch.distributed.pipelining`` (``records.runner_kind`` is ``torch_pipeline``: GPipe or
1F1B over equal-shape stages), ``PipelineStage`` allocates, once, before the first step and for the
whole run, one receive buffer *per micro-batch*: the input activation of every micro-batch on each
stage but the first (``_prepare_forward_infra``), and the gradient of the output of every micro-batch
on each stage but the last (``_setup_backward_recv_info``), each in the dtype the boundary travels in
(the plan's dtype: ``backends/torch/train``'s static boundary metadata). These live beside the saved
activations of the micro-batches in flight, so a stage holds ``m`` boundaries per direction, not its
in-flight count: gpt3-13b (GPT-2 shape, 40 layers) tp8 x pp2 x dp2 at sequence 2048 and ``m = 32``
held 32 bf16 ``[1, 2048, 5120]`` buffers (0.62 GiB) on each stage in ``partita rehearse``, which the
plan had not priced. ``P2PPipeline`` (every other pipeline) allocates a boundary when it receives it:
nothing here. JAX programs: nothing here.

The bytes per sample are the p2p records' (``records.GraphFacts.boundary_elems`` times the plan
dtype's bytes), so the buffers and the transfers the rehearsal compares are one number. The
inter-op DP's range arrays do not carry the term (a range does not know the runner its plan will
take): the candidate does, so a candidate that no longer fits with its buffers is priced as it runs.
"""

from __future__ import annotations

from typing import Any

from partita.ir import DTYPE_BYTES
from partita.passes import boundaries

TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # records.runner_kind: the schedules it may run


def torch_pipeline(cand: Any) -> bool:
    """Does ``cand``'s torch program run on ``torch.distributed.pipelining`` (``records.runner_kind`` of its
    plan, read from the candidate: several stages, no model chunks, GPipe / 1F1B, no ZeRO-2/3 with
    ``dp > 1``, every stage the same ``(dp, tp, shares)``)?"""
    if len(cand.stages) < 2 or cand.v > 1 or cand.schedule not in TORCH_SCHEDULES:
        return False
    if cand.search.graph.meta.get("framework", "torch") != "torch":
        return False
    keys = set()
    for p in cand.stages:
        z = p.option.combos[p.combo][0]
        if cand.dp > 1 and z >= 2:
            return False
        keys.add((p.option.tp, _shares(cand, p)))
    return len(keys) == 1


def _shares(cand: Any, p: Any) -> tuple[int, ...]:
    """Samples per micro-batch of each replica (``plan.shares`` of the stage ``build_plan`` writes)."""
    return tuple(p.option.shares) if len(p.option.devices) > 1 else (cand.b,) * cand.dp


def stage_bytes(cand: Any, i: int) -> float:
    """Bytes per device of stage ``i``'s receive buffers (module docstring); 0 unless the program runs on
    ``torch.distributed.pipelining``. The largest replica's share: the memory of a stage is its busiest
    device's."""
    if not torch_pipeline(cand):
        return 0.0
    search = cand.search
    seq = int(search.training.seq_len)
    item = float(DTYPE_BYTES.get(str(search.training.dtype), 4))
    rows = max(_shares(cand, cand.stages[i]))
    cuts = []  # the boundaries stage i receives on: before it (forward) and after it (backward)
    if i > 0:
        cuts.append(search.units[cand.stages[i - 1].j - 1][1] - 1)
    if i < len(cand.stages) - 1:
        cuts.append(search.units[cand.stages[i].j - 1][1] - 1)
    per_sample = sum(_cut_elems(search, layer, seq) for layer in cuts)
    return float(cand.m * rows * per_sample * item)


def _cut_elems(search: Any, layer: int, seq: int) -> int:
    """``boundaries.cut_elems`` after graph layer ``layer``, kept on the search (every candidate asks)."""
    cache = search.__dict__.setdefault("_receive_cut_elems", {})
    if (layer, seq) not in cache:
        cache[layer, seq] = boundaries.cut_elems(search.graph, layer, seq)
    return cache[layer, seq]


def fit(cand: Any) -> bool:
    """Does every stage of ``cand`` still fit with the receive buffers of its runner
    (``search/program/receive_buffers.py``: the DP's range arrays cannot know the runner)? A stage of one
    device class only (a mixed class's memory is its worst device's, each priced against its own cap)."""
    if not torch_pipeline(cand):
        return True
    from partita.device_reserve import tensor_cap

    return all(
        cand.memory(i) <= tensor_cap(p.option.devices[0][0])
        for i, p in enumerate(cand.stages)
        if len(p.option.devices) == 1
    )


def range_bytes(search: Any, m: int, rows: int) -> Any:
    """``[k, j]``: the receive buffers per device of a stage of units ``[k, j)`` run on
    ``torch.distributed.pipelining`` with ``m`` micro-batches of ``rows`` samples (:func:`stage_bytes`'s
    terms for every range at once; 0 for the whole model, one stage). For ``search/entry/infeasible.py``."""
    import numpy as np

    seq = int(search.training.seq_len)
    item = float(DTYPE_BYTES.get(str(search.training.dtype), 4))
    n = len(search.units)
    cut = np.array([_cut_elems(search, search.units[u][1] - 1, seq) for u in range(n - 1)] + [0], dtype=float)
    out = np.zeros((n, n + 1))
    for k in range(n):
        for j in range(k + 1, n + 1):
            out[k, j] = (cut[k - 1] if k > 0 else 0.0) + (cut[j - 1] if j < n else 0.0)
    return out * m * rows * item
