"""Per-stage cost and memory from per-layer LayerSolutions, with ZeRO, recompute and grad-sync overlap.

Sits between the intra-op search (``search/layer/intra_op.py`` via ``search/layer/memo.py``, one
:class:`LayerSolution` per (layer kind, device type, ``(1, tp)`` mesh, per-replica micro-batch))
and the inter-op DP (``search/pipeline/inter_op.py``), which needs ``times[k, j, s]`` and memory for every
layer-unit range ``[k, j)``. Data parallelism is applied here analytically: layer solutions are
per replica, and the ``dp`` replicas add the gradient sync and the ZeRO sharding. This module holds
the per-unit tables and the formulas below; ``search/pipeline/stage_ranges.py`` evaluates them for every
range of a stage option at once.

Per micro-batch period of a stage (one replica)::

    t = fwd + bwd  (+ fwd of the attention core: selective)  (+ fwd: full recompute)
    ZeRO-2/3: t = max(t, RS(grads))  ZeRO-3: t = max(t, 2 AG(params) + RS(grads))  (prefetch overlaps)
    + p2p receive of the input activation and send of its gradient (``p2p_s``)

Memory per device: ``params + grads / dp^[z>=2] + optimizer / dp^[z>=1] + in_flight(s) * saved
+ transient`` where ``saved`` is all saved activations (none), minus the attention core
(selective), or only the layer inputs (full, with one layer's activations as the transient). It
must stay under the device's tensor capacity (``device_reserve.tensor_cap``: its memory less the CUDA
context, NCCL buffers and allocator margin, each a documented item). What the torch program holds (issue 15,
checked by ``partita rehearse``): f32 parameters, f32 gradients and the optimizer's f32 moments
(``LayerCost``); under FSDP2 (ZeRO >= 1, dp > 1) ``params`` is the f32 shard plus the copies
gathered in the compute dtype (:func:`static_memory`); activations as ``search/layer/saved.py`` says the
stage's precision mode keeps them (``UnitTable.for_stage``: FSDP2's MixedPrecisionPolicy or
``torch.autocast``). Where no forward follows the stage's first backward (``num_micro_batches``),
the gradients are not there at the activation peak: the peak is the largest of that peak, a later
micro-batch's backward (the first's gradients beside one micro-batch's activations fewer) and the
gradients alone (``stage_ranges.StageParts.memory``).

Tail after the pipeline drains (bucketed wait-free backprop): the dp gradient all-reduce (ZeRO-0)
or reduce-scatter (ZeRO-1..3) overlaps the last backward, ``exposed = max(sync / n, sync -
overlap * bwd)`` for a stage of ``n`` layers (``overlap`` = ``StageFactors.grad_overlap`` times the
device's ``Efficiency.comm_overlap``). The torch program runs exactly that at ZeRO-0 (issue 32 item 1):
``Stage.grad_buckets``, each bucket all-reduced inside the stage's last backward once its gradients are
made (``backends/torch/parallel.GradBuckets``), with the buckets in flight as the copy in memory
(``stage_ranges.StageParts.grads``); plans with model chunks keep the flat sync below.
``flat_sync=True`` prices what the JAX program runs at ZeRO-0 (one flattened ``psum`` per dtype in
its update, ``backends/jax/train._flat_psum``), and the torch program of a chunked plan
(``backends/torch/parallel.all_reduce_grads``): one all-reduce of the flattened gradients after the
whole schedule, fully exposed, and its copy of the stage's gradients in memory (peak: static +
max(activations, gradients), since the copy is made once the activations are freed). ZeRO-1/2 then all-gather the updated parameters; the
optimizer step streams its states through HBM (at ``Efficiency.optimizer_memory`` of it) and pays
``Efficiency.optimizer_tensor_s`` per parameter tensor (eager per-tensor Adam kernels; 0 on GPUs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from partita.cluster import DeviceType, Network
from partita.ir import Role, dim_size
from partita.passes import boundaries
from partita.search.pricing import fp8
from partita.search.pricing.cost_model import CostModel, program_state_bytes
from partita.search.pricing.mesh import AxisLink, LogicalMesh


@dataclasses.dataclass(frozen=True)
class StageFactors:
    """Stage-level calibration (the ``"stage"`` section of a calibration profile)."""

    grad_overlap: float = 1.0  # fraction of the last backward that hides the gradient sync
    p2p_efficiency: float = 0.85  # achieved / link bandwidth for stage-to-stage sends
    optimizer_passes: float = 2.0  # read + write of every optimizer byte per step


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer on one replica (a ``(1, tp)`` mesh), per micro-batch, per device."""

    forward_s: float
    backward_s: float
    comm_s: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    boundary_bytes: float  # output activation (p2p size if a stage ends here)
    input_bytes: float  # input activation (kept under full recompute)
    tp_sync_s: float = 0.0  # gradient sync on the tp axis itself (partial grads), once per step
    selective_bytes: float = 0.0  # saved bytes selective recompute drops (all but matmul/collective outputs)
    selective_s: float = 0.0  # forward time it redoes (the non-matmul ops)
    optimizer_fixed_s: float = 0.0  # per-tensor optimizer cost of the layer's parameter tensors
    optimizer_stream_scale: float = 1.0  # 0.8 / Efficiency.optimizer_memory of the device
    comm_overlap: float = 1.0  # Efficiency.comm_overlap of the device
    overlap_interference: float = 0.0  # Efficiency.overlap_interference of the device
    # the torch program's other precision mode (search/layer/saved.py): activation_bytes, input_bytes and
    # selective_bytes above are FSDP2's MixedPrecisionPolicy program (ZeRO >= 1, dp > 1), these the
    # torch.autocast one (every other stage); None: one mode only (f32, JAX)
    activation_bytes_alt: float | None = None
    input_bytes_alt: float | None = None
    selective_bytes_alt: float | None = None
    gather_ratio: float = 1.0  # bytes of a parameter as FSDP2 gathers it (param_dtype) over its stored bytes
    fsdp_copies: bool = False  # priced as the torch program holds parameters (static_memory); else ZeRO's
    transient_bytes: float = 0.0  # allocated by the backward beside the saved activations, once (the loss)
    # a split backward's output gradients from B to W, per micro-batch, net of the loss's saved tensors that
    # die at B (saved.freed_at_b: the head's can be negative) (LayerSolution.w_held_bytes), in the
    # default precision mode; _alt: the autocast program's (as activation_bytes_alt)
    held_bytes: float = 0.0
    held_bytes_alt: float | None = None
    # parameter gradients made beside .grad (LayerSolution.grad_transient_bytes): by one backward pass,
    # by one deferred W (zero bubble); parameter-sized, so never scaled with the micro-batch
    grad_transient_bytes: float = 0.0
    w_grad_transient_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class UnitTable:
    """Per layer-unit arrays (a unit is a run of consecutive layers), one device type, tp, micro-batch."""

    fwd: np.ndarray
    bwd: np.ndarray
    comm: np.ndarray
    params: np.ndarray
    grads: np.ndarray
    opt: np.ndarray
    act: np.ndarray
    inputs: np.ndarray
    sel_bytes: np.ndarray
    sel_s: np.ndarray
    tp_sync: np.ndarray
    max_layer_act: np.ndarray
    max_layer_sel: np.ndarray  # largest recomputed (dropped) activations of one layer, selective
    max_layer_params: np.ndarray
    boundary: np.ndarray  # bytes leaving the unit
    num_layers: np.ndarray
    opt_fixed: np.ndarray | None = None  # per-tensor optimizer seconds per unit (None = 0)
    opt_stream_scale: float = 1.0
    comm_overlap: float = 1.0
    alt: UnitTable | None = None  # the same units in the autocast program (LayerCost.activation_bytes_alt)
    gather_ratio: float = 1.0
    fsdp_copies: bool = False
    transient: np.ndarray | None = None  # per unit, the largest LayerCost.transient_bytes
    # [3, U, U + 1]: (parameter, gradient, optimizer) bytes a range's layer sums count more than once,
    # a parameter read by several of its layers (a tied embedding and LM head: SolverCosts.shared_copies)
    shared: np.ndarray | None = None
    held: np.ndarray | None = None  # per unit, LayerCost.held_bytes summed (zero_bubble.range_held_of)
    grad_transient: np.ndarray | None = None  # per unit, the largest LayerCost.grad_transient_bytes
    w_grad_transient: np.ndarray | None = None  # ... and w_grad_transient_bytes
    overlap_interference: float = 0.0  # the largest LayerCost.overlap_interference

    @staticmethod
    def build(
        costs: Sequence[LayerCost],
        units: Sequence[tuple[int, int]],
        shared: Sequence[tuple[Sequence[int], tuple[float, float, float]]] = (),
    ) -> UnitTable:
        """The table of ``costs`` (one per layer) over ``units``; ``shared``: per parameter read by
        several layers, those layers and its ``(parameter, gradient, optimizer)`` bytes per copy
        (``SolverCosts.shared_copies``), held once by a stage holding several of them."""

        def agg(f: str, red=sum) -> np.ndarray:  # noqa: ANN001
            vals = [getattr(c, f) for c in costs]  # (summed slice by slice: the same floats, in the same order)
            return np.array([red(vals[a:b]) for a, b in units], dtype=np.float64)

        extra = _shared_excess(shared, units)

        return UnitTable(
            agg("forward_s"),
            agg("backward_s"),
            agg("comm_s"),
            agg("param_bytes"),
            agg("grad_bytes"),
            agg("optimizer_bytes"),
            agg("activation_bytes"),
            agg("input_bytes"),
            agg("selective_bytes"),
            agg("selective_s"),
            agg("tp_sync_s"),
            agg("activation_bytes", max),
            agg("selective_bytes", max),
            agg("param_bytes", max),
            np.array([costs[b - 1].boundary_bytes for a, b in units], dtype=np.float64),
            np.array([b - a for a, b in units], dtype=np.float64),
            agg("optimizer_fixed_s") if any(c.optimizer_fixed_s for c in costs) else None,
            max((c.optimizer_stream_scale for c in costs), default=1.0),
            min((c.comm_overlap for c in costs), default=1.0),
            UnitTable.build(_autocast_all(costs), units, shared)
            if any(c.activation_bytes_alt is not None for c in costs)
            else None,
            max((c.gather_ratio for c in costs), default=1.0),
            any(c.fsdp_copies for c in costs),
            agg("transient_bytes", max) if any(c.transient_bytes for c in costs) else None,
            extra,
            agg("held_bytes"),
            agg("grad_transient_bytes", max) if any(c.grad_transient_bytes for c in costs) else None,
            agg("w_grad_transient_bytes", max) if any(c.w_grad_transient_bytes for c in costs) else None,
            max((c.overlap_interference for c in costs), default=0.0),
        )

    def for_stage(self, dp: int, zero: int) -> UnitTable:
        """The table of the program a stage runs: FSDP2's MixedPrecisionPolicy (ZeRO >= 1 with dp > 1),
        else ``torch.autocast`` (``backends/torch/parallel.precision_of``; one table when they agree)."""
        return self.alt if self.alt is not None and not (dp > 1 and zero >= 1) else self

    @functools.cached_property
    def _ranges(self) -> dict[str, np.ndarray]:
        return {}

    def ranged(self, name: str) -> np.ndarray:
        """``_range_sum`` (``max_*`` and ``transient`` fields: ``_range_max``) of a field, or of
        ``act - sel_bytes`` for ``"act-sel"``; once per table (``stage_ranges.StageParts`` runs once per ZeRO /
        recompute combo on the same table). Read-only: callers build new arrays from it."""
        got = self._ranges.get(name)
        if got is None:
            if name == "act-sel":
                got = _range_sum(self.act - self.sel_bytes)
            elif name.startswith("max_") or name.endswith("transient"):
                got = _range_max(getattr(self, name))
            else:
                got = _range_sum(getattr(self, name))
                if self.shared is not None and name in _SHARED_FIELDS:  # a tied parameter is held once
                    got = got - self.shared[_SHARED_FIELDS.index(name)]
            got.flags.writeable = False
            self._ranges[name] = got
        return got


_SHARED_FIELDS = ("params", "grads", "opt")


def _shared_excess(
    shared: Sequence[tuple[Sequence[int], tuple[float, float, float]]], units: Sequence[tuple[int, int]]
) -> np.ndarray | None:
    """``[3, U, U + 1]``: for each unit range ``[k, j)``, the bytes its layer sums count beyond one copy
    of each shared parameter (``(n - 1)`` copies where ``n`` of its readers lie in the range)."""
    if not shared:
        return None
    unit_of = {li: u for u, (a, b) in enumerate(units) for li in range(a, b)}
    out = np.zeros((3, len(units), len(units) + 1))
    for layers, per_copy in shared:
        readers = np.zeros(len(units))
        for li in layers:
            readers[unit_of[li]] += 1
        extra = np.maximum(_range_sum(readers) - 1.0, 0.0)
        out += np.asarray(per_copy, dtype=np.float64)[:, None, None] * extra[None]
    return out


def _autocast_all(costs: Sequence[LayerCost]) -> list[LayerCost]:
    """:func:`_autocast` of each cost, once per distinct object: the layers of one kind share their
    ``LayerCost`` (``SolverCosts.layer``), 96 of the 98 of gpt3-175b."""
    seen: dict[int, LayerCost] = {}
    out = []
    for c in costs:
        got = seen.get(id(c))
        if got is None:
            got = seen[id(c)] = _autocast(c)
        out.append(got)
    return out


def _autocast(c: LayerCost) -> LayerCost:
    """``c`` with its autocast activations in the default fields (no further alternative)."""
    return dataclasses.replace(
        c,
        activation_bytes=c.activation_bytes if c.activation_bytes_alt is None else c.activation_bytes_alt,
        input_bytes=c.input_bytes if c.input_bytes_alt is None else c.input_bytes_alt,
        selective_bytes=c.selective_bytes if c.selective_bytes_alt is None else c.selective_bytes_alt,
        held_bytes=c.held_bytes if c.held_bytes_alt is None else c.held_bytes_alt,
        activation_bytes_alt=None,
        input_bytes_alt=None,
        selective_bytes_alt=None,
        held_bytes_alt=None,
    )


def _range_sum(x: np.ndarray) -> np.ndarray:
    """``R[k, j] = sum(x[k:j])`` for k < j (0 elsewhere), shape [U, U + 1]."""
    c = np.concatenate([[0.0], np.cumsum(x)])
    r = c[None, :] - c[:-1, None]
    return np.where(_upper(len(x)), r, 0.0)


@functools.lru_cache(maxsize=64)
def _upper(n: int) -> np.ndarray:
    """The ``k < j`` mask of :func:`_range_sum` for ``n`` units (built once per size; read-only)."""
    mask = np.triu(np.ones((n, n + 1), dtype=bool), 1)
    mask.flags.writeable = False
    return mask


def _range_max(x: np.ndarray) -> np.ndarray:
    n = len(x)
    r = np.zeros((n, n + 1))
    for k in range(n):
        r[k, k + 1 :] = np.maximum.accumulate(x[k:])
    return r


def affine(cm: CostModel, kind: str, link: AxisLink) -> tuple[float, float]:
    """``(intercept, slope)`` of ``cm.collective_time(kind, bytes, link)`` (affine in bytes)."""
    if link.size <= 1:
        return 0.0, 0.0
    t1, t2 = cm.collective_time(kind, 1e6, link), cm.collective_time(kind, 2e6, link)
    return 2 * t1 - t2, (t2 - t1) / 1e6


def dp_link(device: DeviceType, dp: int, tp: int, gpus_per_node: int, network: Network) -> AxisLink:
    return LogicalMesh((dp, tp), ("dp", "tp"), device, gpus_per_node, network).link(0)


def p2p_time_fn(
    device: DeviceType, cm: CostModel, network: Network, intra_node: bool, factors: StageFactors, gpus_per_node: int
) -> tuple[float, float]:
    """``(latency, seconds per byte)`` of one stage-to-stage send from one device."""
    if intra_node:
        bw = device.intra_node_bandwidth * cm.efficiency.collective_bandwidth
        return device.intra_node_latency, 1.0 / bw
    return network.latency, 1.0 / (network.nic_bandwidth / gpus_per_node * factors.p2p_efficiency)


def scatter_gather_p2p(p2p: tuple[float, float], tp: int, device: DeviceType, cm: CostModel) -> tuple[float, float]:
    """Megatron-LM's scatter-gather send: each of the ``tp`` ranks sends ``1/tp`` of the (replicated)
    boundary activation over the network, and the receiving stage all-gathers it over the node's
    link. Returns the per-byte-of-activation price in ``p2p_time_fn``'s form."""
    gather = (tp - 1) / tp / (device.intra_node_bandwidth * cm.efficiency.collective_bandwidth)
    return p2p[0] + (tp - 1) * device.intra_node_latency, p2p[1] / tp + gather


# a layer's input and output under Megatron sequence parallelism (tp_style "megatron_sp"): batch over dp,
# sequence over tp (dim 1 of a (B, S, h) hidden state; intra_op.boundary_layout keeps R where it cannot)
SP_BOUNDARY = ("S(0)", "S(1)")

GATHERED_UNITS = 2  # ZeRO-3: FSDP2 holds the running block's gathered parameters and prefetches the next


def copies_deferred_gradients(split_backward: bool, first_layer: Any) -> Any:
    """Does a stage starting at ``first_layer`` (a number or an array) hold a deferred W's gradient
    copy (:func:`static_memory`)? Under a split backward, except the stage holding the model's first
    layer: its input needs no gradient, so its B computes nothing and its W runs the whole backward,
    with FSDP2's per-unit fold (``partita rehearse`` of gpt3-6.7b's ZB-H1 plan: its A100 stage held no
    copy and was priced 17.7% over; the V100 stage after it holds one)."""
    return np.asarray(first_layer) > 0 if split_backward else np.zeros_like(np.asarray(first_layer), dtype=bool)


def static_memory_of(
    costs: Sequence[Any],
    dp: int,
    zero: int,
    split_backward: bool = False,
    shared: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> dict:
    """:func:`static_memory` of a stage made of ``costs`` (its layers' ``LayerCost``): the sums and
    maxima ``stage_ranges.StageParts`` takes from its unit tables, for one stage or chunk at a time. ``shared``:
    the bytes those sums count twice (``SolverCosts.shared_excess`` of the same layers)."""
    return static_memory(
        sum(c.param_bytes for c in costs) - shared[0],
        sum(c.grad_bytes for c in costs) - shared[1],
        sum(c.optimizer_bytes for c in costs) - shared[2],
        max((c.param_bytes for c in costs), default=0.0),
        dp,
        zero,
        max((c.gather_ratio for c in costs), default=1.0),
        any(c.fsdp_copies for c in costs),
        split_backward,
    )


def static_memory(
    params: Any,
    grads: Any,
    opt: Any,
    max_params: Any,
    dp: int,
    zero: int,
    gather_ratio: float,
    fsdp_copies: bool,
    split_backward: bool = False,
) -> dict:
    """Parameters, gradients and optimizer state per device as the torch program holds them (arrays or
    numbers; the stored bytes of ``LayerCost``: f32 parameters, gradients, moments). Under FSDP2
    (ZeRO >= 1, dp > 1) the parameters are the f32 dp shard plus the copies gathered in ``param_dtype``
    (``gather_ratio`` of the stored bytes) for the step: ZeRO-3 the running and the prefetched block
    (``GATHERED_UNITS``), ZeRO-1/2 every block (``reshard_after_forward=False``: gathered for the whole
    step). Gradients are sharded from ZeRO-2 on, the optimizer state from ZeRO-1 on. Without
    ``fsdp_copies`` (JAX and test graphs) ZeRO's own accounting: parameters sharded from ZeRO-3 on,
    plus one gathered layer.

    ``split_backward`` (a zero-bubble stage, ``search/pipeline/zero_bubble.py``): under FSDP2 in a low
    ``param_dtype`` each deferred W writes the stage's whole unsharded gradients in that dtype
    (``gather_ratio`` of the f32 bytes) into the gathered parameters' ``.grad``, where they stay
    until FSDP2 folds them into its f32 accumulator during the next B (``backends/torch/wsplit.py``):
    one such copy is held beside the f32 gradients (measured by ``partita rehearse``). A bool, or an
    array of 0/1 per layer range (``stage_ranges.StageParts``): the stage that starts at the model's first layer
    holds no copy, since its B computes no input gradient and its W is the whole backward, during
    which FSDP2 folds each unit's gradients (:func:`copies_deferred_gradients`)."""
    fsdp = dp > 1 and zero >= 1
    gathered = GATHERED_UNITS * max_params if zero >= 3 else params
    if not fsdp_copies:
        fsdp, gathered, gather_ratio = zero >= 3, max_params, 1.0
    w_copy = fsdp and fsdp_copies and gather_ratio < 1.0
    copy = grads * gather_ratio * np.asarray(split_backward, dtype=np.float64) if w_copy else 0.0 * grads
    return {
        "parameters": params / (dp if fsdp else 1) + (gathered * gather_ratio if fsdp else 0.0 * params),
        "gradients": grads / (dp if zero >= 2 else 1) + copy,
        "optimizer": opt / (dp if zero >= 1 else 1),
    }


def reduce_scatter_in_flight(
    max_params: Any, dp: int, zero: int, gather_ratio: float, fsdp_copies: bool, deferred_copy: Any = False
) -> Any:
    """Bytes a ZeRO-2/3 backward holds for FSDP2's per-unit reduce-scatter (``stage_ranges.StageParts`` adds them
    to the activations where the backward runs beside them): a unit's unsharded gradients in
    ``param_dtype`` (``gather_ratio`` of its f32 bytes ``max_params``) are copied into an f32
    reduce-scatter input (``reduce_dtype``), which FSDP2 keeps until the next unit's reduce-scatter
    (``ReduceScatterState``) while that unit makes its own unsharded gradients: ``max_params * (1 +
    gather_ratio)`` for the largest unit. The gpt3-175b ZeRO-3 plan (selective recompute) rehearsed
    16.9% above its plan without them. ZeRO-1 (no gradient sync before the last micro-batch): the unit's
    unsharded gradients in ``param_dtype`` alone (``max_params * gather_ratio``), held until FSDP2's
    post-backward folds them into its f32 accumulator; the tiny Llama's first stage (dp 2 x pp 2, ZeRO-1,
    bf16, ``m = 2``) rehearsed its peak at the end of its block's second backward with exactly those
    (73,856 B of 'gradients' beside the accumulator), +13.2% over its plan without them once the fused
    norm and SwiGLU (``backends/torch/fused.py``) made the activations priced no more than held
    (``tests/runtime/test_fp8_multiprocess.py``). In f32 (``gather_ratio`` 1) FSDP2 keeps no separate
    accumulator: autograd adds each gradient into ``.grad`` in place. A zero-bubble stage's deferred W
    holds the whole stage's such gradients already (``deferred_copy``, :func:`static_memory`'s copy; a
    bool or 0/1 per layer range): nothing more there. 0 without FSDP2 (``fsdp_copies``), dp 1 or ZeRO 0."""
    if dp > 1 and zero >= 2 and fsdp_copies:
        return max_params * (1.0 + gather_ratio)
    if dp > 1 and zero == 1 and fsdp_copies and gather_ratio < 1.0:
        return max_params * gather_ratio * (1.0 - np.asarray(deferred_copy, dtype=np.float64))
    return 0.0 * max_params


class SolverCosts:
    """Adapter from ``IntraOpMemo.solve`` to :class:`LayerCost`: one ILP per (kind, device, tp, batch).

    Layers are solved on a ``(1, tp)`` mesh with ``env = {"B": micro_batch, "S": seq}``. A graph
    traced with static shapes (no ``B`` symbol) is solved at its own batch and scaled linearly
    (times, activations; parameters unchanged), which :attr:`linear_batch` records.

    ``tp_style=None`` (the default) picks the style the graph's runtime realizes (issue 15 item 1):
    a torch graph is solved ``"torch"`` (the ``tp`` axis takes only the module roles
    ``backends/torch/tp.py`` builds: column/row linears, heads, never the batch or the sequence;
    ``strategies.torch_tp_strategies``), a JAX graph ``"auto"`` (its program pins every activation
    layout the ILP chose). ``scatter_gather`` (Megatron-LM's split p2p send) is priced only when ``"megatron"`` is
    asked explicitly (``partita evaluate``, baselines): the torch runtime sends whole activations.
    ``"megatron_sp"``: Megatron-LM's program with sequence parallelism (``evaluate_config`` with
    ``sequence_parallel=True`` on a ``"megatron"`` layout): layers hand each other s/tp rows (``SP_BOUNDARY``)
    and their non-matmul ops run on them (``layer_strategies.node_strategies``); its sends are already split.
    ``grad_sync``: the program's ZeRO-0 gradient sync (``stage_ranges.StageParts``): ``"flat"`` for every JAX
    graph (``backends/jax/train._flat_psum`` in the update, after the schedule; ``flat_sync`` is True),
    ``"buckets"`` for the torch program (``Stage.grad_buckets``, overlapped with the last backward; the
    planner prices a chunked candidate ``"flat"``, as its program runs), ``"overlap"`` for a torch graph
    priced ``"megatron"`` / ``"auto"`` asked explicitly, which price another engine (``"torch"`` asked
    explicitly, as ``search/entry/hand_plan.py`` does, is the torch program).
    """

    def __init__(self, graph, cluster, training, memo=None, tp_style: str | None = None) -> None:  # noqa: ANN001
        from partita.search.layer.memo import IntraOpMemo

        self.graph, self.cluster, self.training = graph, cluster, training
        self.scatter_gather = tp_style == "megatron"  # megatron_sp: its boundary is already s/tp rows per rank
        # the JAX program's ZeRO-0 sync runs after the schedule (stage_ranges.StageParts' flat_sync), the torch
        # program's in buckets inside the last backward; an explicit style on a torch graph prices another
        # engine (Megatron-LM's overlapped DDP: evaluate)
        if graph.meta.get("framework") == "jax":
            self.grad_sync = "flat"
        else:
            self.grad_sync = "buckets" if tp_style in (None, "torch") else "overlap"
        self.flat_sync = self.grad_sync == "flat"
        if tp_style is None:
            tp_style = "auto" if graph.meta.get("framework") == "jax" else "torch"
        self.tp_style = tp_style  # "megatron" / "torch": the tp axis shards weights only (intra_op.solve_layer)
        self.memo = memo or IntraOpMemo()
        self.linear_batch = "B" not in graph.symbols and not any(
            "B" in {str(x) for d in t.shape for x in getattr(d, "free_symbols", ())} for t in graph.tensors.values()
        )
        self._cm: dict[str, CostModel] = {}
        self._nodes: dict[int, tuple[int, int]] = {}
        self._cache: dict[tuple, tuple[LayerCost, object] | None] = {}
        self._shared: dict[tuple, list] = {}  # shared_copies per (device, tp, micro-batch)
        self._solved_for: dict[tuple, int] = {}  # cache key -> index of the layer the ILP ran on
        self.solve_time_s = 0.0
        self.num_solves = 0

    def cost_model(self, device: DeviceType) -> CostModel:
        if device.name not in self._cm:
            cm = CostModel.for_device(device)
            if getattr(self.training, "fp8", None) and fp8.peak(device) > 0:  # linears' GEMMs in FP8 (pricing/fp8.py);
                cm = dataclasses.replace(cm, fp8=self.training.fp8)  # a type without FP8 prices bf16 (Stage.fp8 unset)
            self._cm[device.name] = cm
        return self._cm[device.name]

    @functools.cached_property
    def _shared_params(self) -> dict[str, tuple[int, ...]]:
        """Parameter tensors read by more than one layer (a tied embedding and LM head), with those layers."""
        readers: dict[str, set[int]] = {}
        g = self.graph
        for li, lay in enumerate(g.layers):
            for name in lay.nodes:
                for t in g.node(name).inputs:
                    if g.tensors[t].role is Role.PARAMETER:
                        readers.setdefault(t, set()).add(li)
        return {t: tuple(sorted(ls)) for t, ls in readers.items() if len(ls) > 1}

    def shared_copies(
        self, device: DeviceType, tp: int, micro_batch: int
    ) -> list[tuple[tuple[int, ...], tuple[float, float, float]]]:
        """Per parameter read by several layers: those layers and its ``(parameter, gradient, optimizer)``
        bytes per device per copy, as each reader's ``LayerCost`` counts it (its tp shard under the first
        reader's placement). A stage holding several readers holds one tensor (the runtime re-ties it,
        ``backends/torch/materialize.retie``); a pipeline's stages each hold their own."""
        key = (device.name, tp, micro_batch)
        if not self._shared_params or key in self._shared:
            return self._shared.get(key, [])
        g = self.graph
        item = program_state_bytes(g, self.training.dtype, self.training.optimizer)  # as each LayerCost has it
        out = []
        for t, layers in self._shared_params.items():
            got = self.layer(layers[0], device, tp, micro_batch)
            if got is None:
                continue
            ten = g.tensors[t]
            placement = got[1].param_placements.get(ten.fqn or t, ())
            pieces = tp if any(str(x).startswith("S") for x in placement[1:]) else 1
            numel = math.prod(dim_size(d) for d in ten.shape) / pieces
            out.append((layers, (numel * item[0], numel * item[1], numel * item[2])))
        self._shared[key] = out  # asked per stage and per ZB-V layout tried (shared_excess)
        return out

    def shared_excess(
        self, layers: Sequence[int], device: DeviceType, tp: int, micro_batch: int
    ) -> tuple[float, float, float]:
        """The bytes the ``LayerCost`` sums of ``layers`` count beyond one copy of each shared parameter."""
        held = set(layers)
        out = [0.0, 0.0, 0.0]
        for readers, per_copy in self.shared_copies(device, tp, micro_batch):
            extra = max(0, sum(li in held for li in readers) - 1)
            for i in range(3):
                out[i] += extra * per_copy[i]
        return out[0], out[1], out[2]

    def layer(self, index: int, device: DeviceType, tp: int, micro_batch: int):  # noqa: ANN201
        """``(LayerCost, LayerSolution)`` for layer ``index`` or None if the layer cannot run on tp."""
        import time

        from partita.errors import InfeasibleError

        lay = self.graph.layers[index]
        b = 1 if self.linear_batch else micro_batch
        key = self._key(index, device, tp, micro_batch)
        if key not in self._cache:
            mesh = LogicalMesh(
                (1, tp),
                ("dp", "tp"),
                device,
                self.cluster.gpus_per_node(device.name),  # tp beyond a node crosses the network
                self.cluster.network_for(device.name),
            )
            t0 = time.perf_counter()
            sol = None
            for budget in (None, 1e18):  # the device's memory first; unbounded lets the stage check report it
                try:
                    sol = self.memo.solve(
                        self.graph,
                        lay,
                        mesh,
                        env={"B": b, "S": self.training.seq_len},
                        dtype=self.training.dtype,
                        optimizer=_opt(self.training.optimizer),
                        cost_model=self.cost_model(device),
                        memory_budget=budget,
                        tp_style=self.tp_style,
                        boundary=SP_BOUNDARY if self.tp_style == "megatron_sp" else None,
                    )
                    break
                except InfeasibleError:  # over the memory budget: retry unbounded; other errors surface
                    continue  # (an abnormal solver end or a NaN cost is ilp's InternalError, exit 70: never "no plan fits")
            self.solve_time_s += time.perf_counter() - t0
            self.num_solves += 1
            self._solved_for[key] = index
            self._cache[key] = (
                None if sol is None else (self._step_terms(self._from_solution(sol, index, b), index, device), sol)
            )
        hit = self._cache[key]
        if hit is None:
            return None
        cost, sol = hit
        scale = micro_batch / b
        if scale != 1:
            # Per kernel t = (F + H) / (peak * e) + overhead (cost_model's saturating curve): the
            # intercept does not grow with the batch, the rest does.
            icpt = self._intercept(index, device)
            fi = min(icpt, 0.9 * (cost.forward_s - cost.comm_s / 2))
            bi = min(icpt, 0.9 * (cost.backward_s - cost.comm_s / 2))
            cost = dataclasses.replace(
                cost,
                forward_s=(cost.forward_s - fi) * scale + fi,
                backward_s=(cost.backward_s - bi) * scale + bi,
                comm_s=cost.comm_s * scale,
                activation_bytes=cost.activation_bytes * scale,
                boundary_bytes=cost.boundary_bytes * scale,
                input_bytes=cost.input_bytes * scale,
                selective_bytes=cost.selective_bytes * scale,
                **{
                    f: getattr(cost, f) * scale
                    for f in ("activation_bytes_alt", "input_bytes_alt", "selective_bytes_alt", "held_bytes_alt")
                    if getattr(cost, f) is not None
                },
                selective_s=cost.selective_s * scale,
                transient_bytes=cost.transient_bytes * scale,
                held_bytes=cost.held_bytes * scale,
            )
        carry = boundaries.cut_scale(self.graph, index, self.training.seq_len)  # every live tensor at the cut (T5)
        if carry != 1.0:
            cost = dataclasses.replace(cost, boundary_bytes=cost.boundary_bytes * carry)
        return cost, sol

    def _key(self, index: int, device: DeviceType, tp: int, micro_batch: int) -> tuple:
        """Layers of one kind share a solve (the first layer apart: it may read graph inputs)."""
        b = 1 if self.linear_batch else micro_batch
        return (self.graph.layers[index].kind, index == 0, device.name, tp, b)

    def solution(self, index: int, device: DeviceType, tp: int, micro_batch: int):  # noqa: ANN201
        """The layer's ``LayerSolution`` in layer ``index``'s own names (parameter FQNs, nodes).

        :meth:`layer` shares one solution between all layers of a kind; the plan needs each layer's
        placements and strategies under its own names, so the shared one is renamed here."""
        from partita.search.layer.memo import rename_solution

        hit = self.layer(index, device, tp, micro_batch)
        if hit is None:
            return None
        src = self._solved_for[self._key(index, device, tp, micro_batch)]
        if src == index:
            return hit[1]
        g = self.graph
        return rename_solution(hit[1], g, g.layers[src], g, g.layers[index])

    def _intercept(self, index: int, device: DeviceType) -> float:
        """Batch-independent seconds of one layer's forward (or backward) on ``device``."""
        from partita.ir import Prim

        if index not in self._nodes:
            nodes = [self.graph.node(n) for n in self.graph.layers[index].nodes]
            self._nodes[index] = (sum(n.prim in (Prim.MATMUL, Prim.CONV) for n in nodes), len(nodes))
        eff = self.cost_model(device).efficiency
        num_mm, num_nodes = self._nodes[index]
        per_mm = eff.matmul_half_flops / (device.flops(self.training.dtype) * eff.matmul)
        return num_mm * per_mm + num_nodes * eff.kernel_overhead_s

    def _step_terms(self, cost: LayerCost, index: int, device: DeviceType) -> LayerCost:
        """The device's optimizer and overlap terms (``Efficiency``; defaults leave ``cost`` as is)."""
        eff = self.cost_model(device).efficiency
        return dataclasses.replace(
            cost,
            optimizer_fixed_s=eff.optimizer_tensor_s * len(self.graph.layers[index].params),
            optimizer_stream_scale=0.8 / eff.optimizer_memory,
            comm_overlap=eff.comm_overlap,
            overlap_interference=eff.overlap_interference,
        )

    def _from_solution(self, sol, index: int, b: int) -> LayerCost:  # noqa: ANN001
        from partita.ir import DTYPE_BYTES

        modes = getattr(sol, "modes", ())
        prev = self._cache_prev_boundary(index, sol)
        alt: dict[str, Any] = {}
        if len(modes) > 1:  # torch bf16/f16: FSDP2 casts a block's input to param_dtype; autocast keeps it f32
            low = self._cache_prev_boundary(index, sol, float(DTYPE_BYTES[self.training.dtype]))
            sel_alt, _ = self._selective(sol, index, prev, alt=True)
            alt = dict(activation_bytes_alt=sol.activation_bytes_alt, input_bytes_alt=prev, selective_bytes_alt=sel_alt)
            alt["held_bytes_alt"] = getattr(sol, "w_held_bytes_alt", None)
            alt["gather_ratio"] = DTYPE_BYTES[self.training.dtype] / 4
            prev = low
        if modes:  # a torch program (search/layer/saved.py): f32 parameters and FSDP2's gathered copies
            alt["fsdp_copies"] = True
        sel_bytes, sel_s = self._selective(sol, index, prev)
        if modes and self.graph.layers[index].name in _NOT_CHECKPOINTED:  # full recompute keeps all of it
            prev = sol.activation_bytes
            if "input_bytes_alt" in alt:
                alt["input_bytes_alt"] = sol.activation_bytes_alt
        return LayerCost(
            **alt,
            forward_s=sol.forward_time_s,
            backward_s=sol.backward_time_s,
            comm_s=sol.comm_time_s,
            param_bytes=sol.param_bytes,
            grad_bytes=sol.grad_bytes,
            optimizer_bytes=sol.optimizer_bytes,
            activation_bytes=sol.activation_bytes,
            boundary_bytes=sol.boundary_bytes,
            input_bytes=prev,
            tp_sync_s=sol.grad_sync_time_s,
            selective_bytes=sel_bytes,
            selective_s=sel_s,
            transient_bytes=getattr(sol, "transient_bytes", 0.0),
            held_bytes=getattr(sol, "w_held_bytes", 0.0),
            grad_transient_bytes=getattr(sol, "grad_transient_bytes", 0.0),
            w_grad_transient_bytes=getattr(sol, "w_grad_transient_bytes", 0.0),
        )

    def _selective(self, sol, index: int, inputs: float, alt: bool = False) -> tuple[float, float]:  # noqa: ANN001
        """``(saved bytes dropped, forward seconds redone)`` of layer ``index`` under selective recompute,
        as the runtime realizes it. Torch (``backends/torch/parallel._save_matmuls``): a block runs under
        ``checkpoint`` with a policy that keeps the outputs of matmuls and of tp collectives and
        recomputes every other op; the block input is the checkpoint's input; the layers outside the
        blocks (``embed``, ``head``) are never checkpointed. JAX (``backends/jax/parallel``): any
        recompute is ``jax.checkpoint`` of the stage's layers, priced here as full recompute.
        ``alt``: in the solution's second precision mode (``LayerSolution.activation_bytes_alt``).

        Torch's dropped bytes may be negative: the policy keeps every matmul's output, which no-recompute
        autograd does not keep (a row linear's partial sum and its reduced copy), so once the norms and the
        attention core are lean (``backends/torch/fused.py``, flash attention) a selective layer holds more
        than without recompute (tp 8 bf16: 11.75 vs 11.01 sbh GPT, 12.09 vs 11.15 Llama,
        ``tests/runtime/test_megatron_forms.py``). Priced as held; the search then prefers no recompute
        there, as it should (it was clamped at 0 and priced 6-8% under the program)."""
        act = sol.activation_bytes_alt if alt else sol.activation_bytes
        keep = sol.selective_keep_bytes_alt if alt else sol.selective_keep_bytes
        if self.graph.meta.get("framework") == "jax":
            return max(0.0, act - inputs), sol.forward_time_s
        if self.graph.layers[index].name in _NOT_CHECKPOINTED:
            return 0.0, 0.0
        return act - inputs - keep, sol.selective_forward_s

    @functools.cached_property
    def _num_readers(self) -> dict[str, int]:
        """Tensor -> how many layers take it as an input."""
        out: dict[str, int] = {}
        for lay in self.graph.layers:
            for t in set(lay.inputs):
                out[t] = out.get(t, 0) + 1
        return out

    def _cache_prev_boundary(self, index: int, sol, item: float | None = None) -> float:  # noqa: ANN001
        """Bytes of the layer's input activations per device (replicated over tp at the boundary); ``item``:
        bytes per floating-point element as the program holds them (default: the traced dtype). An input
        other layers read too (Llama's rotary cos / sin and mask, made once before the blocks) is one
        tensor held by the stage, not a checkpointed layer's own: not counted (issue 15, selective
        recompute's closed form in ``tests/runtime/test_closed_forms.py``)."""
        from partita.ir import dim_size

        lay = self.graph.layers[index]
        env = {"B": 1 if self.linear_batch else int(sol.env.get("B", 1)), "S": self.training.seq_len}
        total = 0.0
        for t in lay.inputs:
            ten = self.graph.tensors.get(t)
            if ten is not None and ten.role.value == "activation" and self._num_readers[t] < 2:
                floating = item is not None and ten.dtype in ("f64", "f32", "bf16", "f16")
                total += float(dim_size(ten.nbytes(), env)) * (item / ten.itemsize if floating else 1.0)
        return total


_NOT_CHECKPOINTED = ("embed", "head")  # backends/torch/stages.GROUPS: layers the runtime never checkpoints


def _opt(name: str) -> str:
    return "adam" if name in ("adam", "adamw") else name


def held_weight(held_bytes: float, saved_bytes: float, first: bool) -> float:
    """What a micro-batch of a stage weighs between its B and its W, in units of its saved activations:
    ``1 + held_bytes / saved_bytes``, the stage's output gradients W reads (``LayerCost.held_bytes``)
    over its saved activations, both as its option prices them (precision mode, tp layout).

    1 for the stage (or ZB-V chunk) holding the model's first layer (``first``): its input needs no
    gradient, so its B computes nothing (``backends/torch/wsplit.backward_input`` defers the whole
    backward) and its W is the whole backward, which makes and frees the output gradients as any
    backward does; between its B and its W a micro-batch holds its activations only (``partita
    rehearse`` of gpt3-6.7b's ZB-H1 plan: the A100 stage held 2 micro-batches' activations, priced 2.22
    before)."""
    return 1.0 if first or saved_bytes <= 0 else 1.0 + held_bytes / saved_bytes


def costs_held(costs: Sequence[Any], first: bool, autocast: bool) -> float:
    """:func:`held_weight` of a stage made of ``costs`` (its layers' ``stage_cost.LayerCost``), in the
    torch.autocast program's fields where ``autocast`` (``UnitTable.for_stage``), else the default ones."""

    def pick(x: Any, name: str) -> float:
        alt = getattr(x, f"{name}_alt")
        return float(alt if autocast and alt is not None else getattr(x, name))

    saved = sum(pick(x, "activation_bytes") for x in costs)
    return held_weight(sum(pick(x, "held_bytes") for x in costs), saved, first)
