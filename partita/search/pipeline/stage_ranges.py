"""The stage DP's arrays: every layer-unit range ``[k, j)`` of one stage option at once.

Part of the inter-op search, between ``search/pipeline/stage_cost.py`` (per-unit tables: :class:`UnitTable`,
the formulas in its module docstring, the static memory) and ``search/entry/planner.py`` (``Search.arrays``
stacks these per ZeRO / recompute combo for ``search/pipeline/inter_op.py``). :class:`StageArrays` holds
a range's period per micro-batch, its memory per number of stages left, its tail, and the compute and
communication parts of its period: :func:`stage_parts` makes the part no in-flight count changes, which
the zero-bubble passes of one configuration share (issue 20), and :meth:`StageParts.memory` the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from partita.plan import GRAD_BUCKET_BYTES, GRAD_BUCKETS_IN_FLIGHT
from partita.search.pipeline.stage_cost import (
    StageFactors,
    UnitTable,
    copies_deferred_gradients,
    reduce_scatter_in_flight,
    static_memory,
)

# a stage option's in-flight counts: one table for every option, or per option's unit table
# (zero_bubble.HeldCounts: a deferred W's held output gradients in the option's precision and layout)
InFlight = np.ndarray | Callable[[UnitTable], np.ndarray]


@dataclasses.dataclass(frozen=True)
class StageArrays:
    time: np.ndarray  # [U, U + 1] period per micro-batch, p2p included
    memory: np.ndarray  # [U, U + 1, S + 1] bytes per device
    tail: np.ndarray  # [U, U + 1] exposed sync + optimizer step, once per step
    compute: np.ndarray  # [U, U + 1] compute part of time
    comm: np.ndarray  # [U, U + 1] communication part of time


@dataclasses.dataclass(frozen=True)
class StageParts:
    """The terms of a stage option's :class:`StageArrays` that no in-flight count (nor ``m``) changes: the per
    micro-batch time, the tail and the static memory of every range ``[k, j)``, and what the
    activation memory is made of. A zero-bubble search prices one configuration's options once per
    pipeline depth with other counts only (``search/pipeline/zero_bubble.py``), so the planner keeps these
    per configuration (``Search.sharing_stage_parts``). Arrays are ``[U, U + 1]``, read-only."""

    time: np.ndarray  # period per micro-batch, p2p included; inf where k >= j
    tail: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    static: np.ndarray  # parameters + optimizer state; inf where k >= j
    base: np.ndarray  # static + gradients; inf where k >= j
    gradients: np.ndarray
    grads: np.ndarray  # the gradient copy's bytes: the range's gradients (flat), or the bucket copies in flight
    saved: np.ndarray  # saved activation bytes per micro-batch in flight
    transient: Any  # [U, U + 1] or 0.0
    rs_held: np.ndarray | None  # reduce_scatter_in_flight where any, else None
    recompute: str
    flat_copy: bool  # the gradient copy of the program's ZeRO-0 sync at dp > 1 (flat, or its buckets: ``grads``)
    table: UnitTable  # the option's table at its dp and ZeRO stage (what a zero_bubble.HeldCounts reads)
    bucketed: bool = False  # the copy is the torch program's buckets in flight (Stage.grad_buckets), not a flat one

    def arrays(self, in_flight: InFlight, num_micro_batches: int | None) -> StageArrays:
        return StageArrays(self.time, self.memory(in_flight, num_micro_batches), self.tail, self.compute, self.comm)

    def memory(self, in_flight: InFlight, num_micro_batches: int | None) -> np.ndarray:
        """``[U, U + 1, S + 1]`` bytes per device (``search/pipeline/stage_cost.py``'s module docstring for the
        formulas); inf where k >= j (``base`` and ``static`` are: every activation term is finite).

        ``num_micro_batches`` (``m``): where a stage runs no forward after its first backward (``m`` no
        more than its in-flight count: one micro-batch, GPipe), its gradients (freed by ``zero_grad``
        between steps) are not yet there at the activation peak: memory is then the largest of three
        moments, activations without gradients (the last forward; the first backward's start, with a
        ZeRO-1/2/3 unit's gradients in flight to its reduce-scatter), the backward of every micro-batch
        after the first (``m >= 2``: the gradients the first backward made, one micro-batch's saved
        activations fewer, the transient and a ZeRO-1/2/3 unit's gradients in flight to its
        reduce-scatter), and gradients (and the flat copy) without activations (after the last
        backward). The tiny Llama's first stage (dp 2 x pp 2, ZeRO-1, ``m = 2``) rehearsed its peak in
        its second backward: f32 gradients 180,736 B beside the second micro-batch's activations,
        priced as activations alone before (bf16 +24.6%, fp8 +20.0%;
        ``tests/runtime/test_fp8_multiprocess.py``). None: gradients always count (the stage-level
        callers that do not know ``m``)."""
        if callable(in_flight):  # a zero-bubble count per range weighed by the stage's own held gradients
            in_flight = in_flight(
                self.table
            )  # (zero_bubble.HeldCounts: the table of this option's precision and layout)
        flight = in_flight if in_flight.ndim == 3 else in_flight[None, None, :]  # [U, U+1, S+1]: per range (issue 19)
        last = flight >= num_micro_batches if num_micro_batches is not None and self.recompute == "none" else None
        if last is not None and not last.any():
            last = None
        # the sums below run in place on one new array (a+b and b+a are the same float)
        acts = self.saved[:, :, None] * flight
        acts += np.asarray(self.transient)[..., None]
        held = acts.copy() if last is not None else acts  # the activations without the gradients (read if last)
        # a ZeRO-1/2/3 unit's gradients (in flight to the reduce-scatter) (reduce_scatter_in_flight), held with
        # the activations the backward starts beside: its own micro-batch's too (the lean program's per-layer
        # activations are below a unit's gradients: llama-70b ZeRO-3, one micro-batch without recompute,
        # rehearsed +9.4% over its plan when that case was priced as peaking in its forward)
        if self.rs_held is not None:  # (all zero, as for ZeRO 0, adds nothing: skipped)
            acts += self.rs_held[..., None]
        if self.flat_copy:  # the flat gradient copy, made after the activations are freed
            np.maximum(acts, self.grads[:, :, None], out=acts)
        memory = np.add(acts, self.base[:, :, None], out=acts)
        if last is not None:  # gradients only after the last forward
            # (docstring); a recomputing backward re-runs blocks while earlier blocks' gradients exist
            after = self.gradients * (2.0 if self.flat_copy else 1.0)
            if self.flat_copy and self.bucketed:  # the buckets in flight beside the gradients, not a second copy
                after = self.gradients + self.grads
            first = held + self.rs_held[..., None] if self.rs_held is not None else held  # the first backward
            peak = np.maximum(first, after[:, :, None])
            if num_micro_batches is not None and num_micro_batches >= 2:  # a later micro-batch's backward
                later = held - self.saved[:, :, None]
                later += self.gradients[:, :, None]
                if self.rs_held is not None:
                    later += self.rs_held[..., None]
                np.maximum(peak, later, out=peak)
            memory = np.where(last, self.static[:, :, None] + peak, memory)
        return memory


def stage_parts(
    tab: UnitTable,
    *,
    dp: int,
    zero: int,
    recompute: str,
    allreduce: tuple[float, float],
    reduce_scatter: tuple[float, float],
    all_gather: tuple[float, float],
    p2p: tuple[float, float],
    p2p_mult: int,
    hbm_bandwidth: float,
    factors: StageFactors,
    flat_sync: bool = False,
    split_backward: bool = False,
    buckets: bool = False,
    terms: dict[tuple, Any] | None = None,
    p2p_overlap: bool = False,
) -> StageParts:
    """:class:`StageParts` of one stage option: everything but its in-flight counts.

    Its terms depend on the recompute mode alone (:func:`_recompute_terms`), on the ZeRO stage and
    the link prices alone (:func:`_zero_terms`), or on the p2p price alone; only the per micro-batch
    time and communication join them. ``terms``: a dict the caller keeps across the ZeRO / recompute
    combos of one option (``Search.arrays``), so that each is computed once, not once per combo
    (issue 20: 12 combos, a third of the arithmetic); keyed by every argument it depends on."""
    memo: dict[tuple, Any] = {} if terms is None else terms
    tab = tab.for_stage(dp, zero)
    rkey = (id(tab), recompute)
    rec = memo.get(rkey)
    if rec is None or rec[0] is not tab:
        rec = memo[rkey] = (tab, _recompute_terms(tab, recompute))
    zkey = (
        id(tab), dp, zero, allreduce, reduce_scatter, all_gather, hbm_bandwidth, factors, flat_sync, split_backward,
        buckets,
    )  # fmt: skip
    zt = memo.get(zkey)
    if zt is None or zt[0] is not tab:
        zt = memo[zkey] = (
            tab,
            _zero_terms(
                tab,
                dp,
                zero,
                allreduce,
                reduce_scatter,
                all_gather,
                hbm_bandwidth,
                factors,
                flat_sync,
                split_backward,
                buckets,
            ),  # fmt: skip
        )
    pkey = (id(tab), p2p, p2p_mult)
    rv = memo.get(pkey)
    if rv is None or rv[0] is not tab:
        recv = np.zeros(len(tab.fwd))
        recv[1:] = p2p_mult * 2 * (p2p[0] + p2p[1] * tab.boundary[:-1])  # activation in, its gradient out
        rv = memo[pkey] = (tab, recv[:, None])
    t, saved, transient, compute = rec[1]
    if tab.grad_transient is not None:  # parameter gradients beside .grad (LayerCost.grad_transient_bytes)
        gkey = (id(tab), "grad_transient", split_backward)
        gt = memo.get(gkey)
        if gt is None or gt[0] is not tab:
            gt = memo[gkey] = (tab, np.maximum(transient, grad_transient(tab, split_backward)))
        transient = gt[1]
    z, recv = zt[1], rv[1]
    r = tab.ranged
    valid = r("num_layers") > 0
    # ZeRO-2/3 traffic runs beside the micro-batch's compute, which loses overlap_interference of the time
    # they overlap (min(t, sync)) to the NCCL kernels (search/pricing/cost_model.py)
    slowed = tab.overlap_interference * np.minimum(t, z.sync_comm)
    t_mb = np.maximum(t, z.sync_comm) + slowed
    comm_total = r("comm") + np.maximum(0.0, z.sync_comm - t) + slowed
    if p2p_overlap:  # SearchOptions.p2p_overlap: the p2p runs beside the rest, only what outlasts it shows
        recv = np.maximum(0.0, recv - t_mb)
    t_mb = t_mb + recv
    comm_total = comm_total + recv
    inf = np.inf
    parts = StageParts(
        time=np.where(valid, t_mb, inf),
        tail=z.tail,
        compute=compute,
        comm=np.where(valid, comm_total, 0.0),
        static=z.static,
        base=z.base,
        gradients=z.gradients,
        grads=z.grads,
        saved=saved,
        transient=transient,
        rs_held=z.rs_held,
        recompute=recompute,
        flat_copy=z.flat_copy,
        bucketed=z.bucketed,
        table=tab,
    )
    parts.time.flags.writeable = False  # shared by the StageArrays of every pass that reuses the parts
    parts.comm.flags.writeable = False
    return parts


def _recompute_terms(tab: UnitTable, recompute: str) -> tuple[np.ndarray, np.ndarray, Any, np.ndarray]:
    """``(t, saved, transient, compute)`` of :func:`stage_parts`: compute time per micro-batch, saved
    activations per micro-batch in flight, the transient held once, and the compute part of ``t``
    (0 where k >= j). Read-only."""
    r = tab.ranged  # range sums / maxima, memoised per table across combos
    fwd, bwd, comm = r("fwd"), r("bwd"), r("comm")
    transient: Any = 0.0
    if recompute == "none":
        t, saved = fwd + bwd, r("act")
    elif recompute == "selective":  # the dropped activations come back one layer at a time in the backward
        t, saved = fwd + bwd + r("sel_s"), r("act-sel")
        transient = r("max_layer_sel")
    else:
        t, saved, transient = 2 * fwd + bwd, r("inputs"), r("max_layer_act")
    compute = t - comm * (2 if recompute == "full" else 1)
    if tab.transient is not None:  # the loss's backward buffers (LayerCost.transient_bytes), once
        transient = np.maximum(transient, r("transient"))
    compute = np.where(r("num_layers") > 0, compute, 0.0)
    for x in (t, compute, transient):
        if isinstance(x, np.ndarray):
            x.flags.writeable = False
    return t, saved, transient, compute


@dataclasses.dataclass(frozen=True)
class _ZeroTerms:
    """The terms of :func:`stage_parts` that the ZeRO stage and the link prices decide (read-only)."""

    sync_comm: np.ndarray  # ZeRO-2/3 gradient / parameter traffic overlapping each micro-batch
    tail: np.ndarray  # 0 where k >= j
    static: np.ndarray  # inf where k >= j
    base: np.ndarray  # inf where k >= j
    gradients: np.ndarray
    grads: np.ndarray
    rs_held: np.ndarray | None
    flat_copy: bool
    bucketed: bool


def _zero_terms(
    tab: UnitTable,
    dp: int,
    zero: int,
    allreduce: tuple[float, float],
    reduce_scatter: tuple[float, float],
    all_gather: tuple[float, float],
    hbm_bandwidth: float,
    factors: StageFactors,
    flat_sync: bool,
    split_backward: bool,
    buckets: bool = False,
) -> _ZeroTerms:
    """``flat_sync`` (the JAX program's ZeRO-0 sync): one all-reduce after the schedule, fully exposed, and a
    copy of all the gradients; ``buckets`` (the torch program's, ``Stage.grad_buckets``): the buckets overlap
    the last backward (``exposed = max(sync / n, sync - window)``, as for any overlapped sync; the latency
    term once per bucket, at least ``ceil(grads / GRAD_BUCKET_BYTES)`` of them) and the copy
    is the buckets in flight, at most ``GRAD_BUCKETS_IN_FLIGHT * GRAD_BUCKET_BYTES`` (``backends/torch/
    parallel.GradBuckets``; a parameter above the cap is a bucket alone, synced in place); neither: another engine's overlapped sync without a copy."""
    r = tab.ranged
    bwd = r("bwd")
    params, grads, opt = r("params"), r("grads"), r("opt")
    nlay = r("num_layers")
    valid = nlay > 0
    sync_comm = np.zeros_like(bwd)
    rs = reduce_scatter[0] + reduce_scatter[1] * grads if dp > 1 else 0.0 * grads
    ag = all_gather[0] + all_gather[1] * params * tab.gather_ratio if dp > 1 else 0.0 * params  # in param_dtype
    if zero == 2:
        sync_comm = rs
    elif zero == 3:
        sync_comm = 2 * ag + rs

    shard = float(dp)
    max_params = r("max_layer_params")
    # split_backward: a zero-bubble stage's deferred-W gradient copy (static_memory), not on the first stage
    copies = copies_deferred_gradients(split_backward, np.arange(len(tab.fwd))[:, None])
    cats = static_memory(params, grads, opt, max_params, dp, zero, tab.gather_ratio, tab.fsdp_copies, copies)
    mem_static = cats["parameters"] + cats["optimizer"]
    rs_held = reduce_scatter_in_flight(max_params, dp, zero, tab.gather_ratio, tab.fsdp_copies, copies)
    if dp > 1:
        # the torch program's buckets are one all-reduce each: the latency term once per bucket
        calls = np.maximum(np.ceil(grads / GRAD_BUCKET_BYTES), 1.0) if buckets and not flat_sync else 1.0
        sync = allreduce[0] * calls + allreduce[1] * grads if zero == 0 else rs
    else:
        sync = np.zeros_like(grads)
    window = factors.grad_overlap * tab.comm_overlap * bwd
    exposed = np.where(sync > 0, np.maximum(sync / np.maximum(nlay, 1), sync - window), 0.0)
    if flat_sync and zero == 0:
        exposed = sync  # one all-reduce after the schedule: nothing hides it
    if zero == 1 and dp > 1:
        # a pipelined ZeRO-1 stage reduce-scatters after the schedule on torch.distributed.pipelining (its
        # REDUCE_GRAD) and under a split backward or model chunks (P2PPipeline's reduce_at_end), a lone stage in
        # its last backward (records.zero1_reduces_after_schedule): every range but the whole model's is a
        # pipeline stage, priced after the schedule (P2PPipeline's 1F1B / GPipe on one chunk per rank syncs in
        # the last backward, which a range cannot tell apart: priced up to its hidden part slower)
        alone = np.zeros(sync.shape, dtype=bool)
        alone[0, -1] = True
        exposed = np.where(alone, exposed, sync)
    if zero in (1, 2) and dp > 1:
        exposed = exposed + ag
    exposed = exposed + r("tp_sync")
    touched = (params + grads + opt) / (shard if zero >= 1 else 1.0)
    tail = exposed + factors.optimizer_passes * touched / (hbm_bandwidth * 0.8) * tab.opt_stream_scale
    if tab.opt_fixed is not None:
        tail = tail + r("opt_fixed")
    inf = np.inf
    terms = _ZeroTerms(
        sync_comm=sync_comm,
        tail=np.where(valid, tail, 0.0),
        static=np.where(valid, mem_static, inf),
        base=np.where(valid, mem_static + cats["gradients"], inf),
        gradients=cats["gradients"],
        grads=np.minimum(grads, GRAD_BUCKETS_IN_FLIGHT * GRAD_BUCKET_BYTES) if buckets and not flat_sync else grads,
        rs_held=np.asarray(rs_held) if np.any(rs_held) else None,
        flat_copy=(flat_sync or buckets) and dp > 1 and zero == 0,
        bucketed=buckets and not flat_sync,
    )
    for x in (terms.sync_comm, terms.tail, terms.static, terms.base, terms.gradients):
        x.flags.writeable = False  # shared by every combo and pass that reuses them
    return terms


def grad_transient(tab: UnitTable, split_backward: bool) -> np.ndarray:
    """``[U, U + 1]``: the parameter gradients a range's backward makes beside ``.grad`` at once
    (``LayerCost.grad_transient_bytes``): one backward pass's, or under a split backward one deferred
    W's (``w_grad_transient_bytes``), except on the stage holding the model's first layer, whose W is
    the whole backward (:func:`copies_deferred_gradients`)."""
    whole = tab.ranged("grad_transient")
    if not split_backward or tab.w_grad_transient is None:
        return whole if not split_backward else np.where(_first_rows(len(tab.fwd)), whole, 0.0)
    return np.where(_first_rows(len(tab.fwd)), whole, tab.ranged("w_grad_transient"))


def _first_rows(n: int) -> np.ndarray:
    """``[U, 1]``: True on the ranges that start at unit 0 (the model's first layer)."""
    return (np.arange(n) == 0)[:, None]


def sync_mode(costs: Any, chunked: bool) -> tuple[bool, bool]:
    """``(flat_sync, buckets)`` for :func:`stage_parts`: the ZeRO-0 sync as the program runs it
    (``stage_cost.StageCosts.grad_sync``): the torch program's buckets inside the last backward, except
    where ``chunked`` (``plan.flat_sync_chunks``: ZB-V's model chunks keep one flat all-reduce after the
    schedule, as the JAX program's).

    Interleaved 1F1B's chunks each sync in buckets from their own last backward; the search prices an
    interleaved rank group as one range (its chunks' layers), so its sync is ``max(sync / n, sync - window)``
    with the window of the group's whole backward of one micro-batch (every chunk's last backward). That is
    the program's exposed time while the rank's one link stays busy from the first bucket on; it hides too
    much where the rank's lowest chunk makes many gradients in a short backward (an embedding): its
    buckets cannot start before that chunk's last backward, so they have ``window_0`` alone.
    """
    mode = getattr(costs, "grad_sync", "flat" if getattr(costs, "flat_sync", False) else "overlap")
    return mode == "flat" or (mode == "buckets" and chunked), mode == "buckets" and not chunked


def sync_copy(costs: Any, grads: float, dp: int, zero: int, chunked: bool) -> tuple[float, bool]:
    """``(bytes, bucketed)``: the gradient copy of a stage's ZeRO-0 sync at dp > 1 as :func:`stage_parts`
    prices it (``StageParts.grads`` / ``bucketed``), for the stage-level callers (``plan_build``,
    ``evaluate``, ``v_layout``) that sum one range: a flat sync copies all ``grads`` (the JAX program; the
    torch program of a ZB-V plan: ``chunked``, ``plan.flat_sync_chunks``), the torch program's buckets at most ``GRAD_BUCKETS_IN_FLIGHT`` of
    ``GRAD_BUCKET_BYTES`` (``Stage.grad_buckets``), another engine's overlapped sync nothing."""
    if dp <= 1 or zero != 0:
        return 0.0, False
    flat, buckets = sync_mode(costs, chunked)
    if flat:
        return float(grads), False
    if buckets:
        return min(float(grads), float(GRAD_BUCKETS_IN_FLIGHT * GRAD_BUCKET_BYTES)), True
    return 0.0, False
