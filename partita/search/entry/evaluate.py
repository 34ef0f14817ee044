"""Price one hand-written (Megatron-style) configuration with the planner's own cost path.

Used by ``partita evaluate``, the Megatron-grid baseline (``search/entry/baselines.py``) and the
cost-model accuracy benchmark (``bench/costmodel_accuracy.py``). Stages split the repeated blocks
evenly (Megatron's rule; when ``pp`` does not divide them, the end stages hold one block fewer first,
:func:`blocks_per_stage`); the first stage also holds the layers before the first block (embedding),
the last the layers after the last block (head). Every stage runs on the cluster's first device type.

A layout that cannot be built is refused with one :class:`~partita.errors.ConfigError` before
anything is priced (:func:`check_layout`): attention heads, key/value heads or block weight dims
not divisible by ``tp``; ``dp * tp * pp`` above the devices of the type that runs it; more stages than blocks,
or interleaved stages whose layers (blocks, plus the embedding on the first and the head on the last) do not cut
into ``num_virtual`` chunks keeping their kinds (``chunk_layout.check_ranges``, compile's rule); virtual stages without the interleaved schedule; a
zero-bubble schedule (``zb_h1``) with ZeRO-2/3 or recompute, which no runtime runs
(:func:`check_split_backward`). Under ``zb_h1`` each stage's deferred weight gradients are priced
with its own layers (``search/pipeline/zero_bubble.py``), as the planner prices them.
A ``tp`` wider than a node is priced over the network and said so in the notes (the planner
itself never searches it, rule R1). Sequence parallelism (``sequence_parallel=True``, Megatron's) is priced
as ``partita compile --sequence-parallel`` prices it (``search/program/sequence_parallel.py``): the same
step time (on a ring an all-reduce costs a reduce-scatter plus an all-gather), and each stage's saved
activations of the blocks' tp-replicated ops kept for ``s/t`` rows (``sequence_parallel.activation_delta``,
one function for both); the layouts the runtime does not build with it are refused with compile's words
(``sequence_parallel.check``). It is no dimension of the search. Priced as another stack's program
(``tp_style="megatron"``, the benches' published rows), sequence parallelism is Megatron-LM's, in the layers
(``tp_style="megatron_sp"``: norms and residual adds on s/tp rows, all-gathers and reduce-scatters where the
layout without it all-reduces, s/tp rows between layers and stages), with every schedule and with cp, as
Megatron-LM builds it; interleaved stages may hold uneven block counts where the chunks can be laid out
(``chunk_layout.check_ranges``: the end stages hold the embedding or the head as a chunk of their own).

The :class:`Evaluation` carries memory per device by category (parameters, gradients, optimizer
state, activations: the same terms ``search/stage_ranges.StageParts`` sums), whether it fits, the
devices left idle and the model FLOPs utilization against the peak of the devices used and of the
whole cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from partita.cluster import Cluster
from partita.device_reserve import tensor_cap
from partita.errors import ConfigError
from partita.ir import Graph, Prim, dim_size
from partita.plan import chunk_position, flat_sync_chunks
from partita.search.entry.layout_price import layout_candidate
from partita.search.entry.planner import Search
from partita.search.pipeline import schedule as sched
from partita.search.pipeline.cp_costs import ContextParallelCosts
from partita.search.pipeline.stage_cost import (
    SolverCosts,
    StageFactors,
    copies_deferred_gradients,
    held_weight,
    reduce_scatter_in_flight,
    static_memory,
)
from partita.search.pipeline.stage_ranges import grad_transient, sync_copy
from partita.search.pipeline.zero_bubble import RUNNABLE_ZERO, counts
from partita.search.pricing import context_parallel as cpx
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.pricing.precision import choose_precision, precision_note
from partita.search.program import chunk_layout, receive_buffers, v_layout
from partita.search.program.cp_layout import model_flops
from partita.search.program.plan_build import Candidate
from partita.search.program.records import NOT_BLOCKS
from partita.search.program.sequence_parallel import activation_delta, check_strategies
from partita.search.program.sequence_parallel import check as sequence_parallel_check

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")


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
    memory_by_category: tuple[dict[str, float], ...] = ()  # per stage, MEMORY_CATEGORIES -> bytes
    layout: dict[str, Any] = dataclasses.field(default_factory=dict)  # degrees, schedule, device, devices used
    mfu: float = 0.0  # model FLOPs / (step x peak of the devices used)
    mfu_cluster: float = 0.0  # model FLOPs / (step x peak of every device in the cluster)
    notes: tuple[str, ...] = ()  # what the prediction assumes that a reader may not expect
    # per stage: tp > 1 places nothing of the stage on tp (``plan.Stage.tp_shards_nothing``: the search does not
    # offer such a stage; a hand layout states it, and the baselines that compete with the search skip it)
    tp_shards_nothing: tuple[bool, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tp_style_of(graph: Graph) -> str:
    """The tensor parallelism the emitted program runs, so the style every entry prices a layout with
    (issue 32: ``partita evaluate`` and ``partita compile`` of one layout print one number): the torch
    program's module roles for a torch graph (``backends/torch/tp.py``), Megatron's for a JAX one.
    ``search/entry/hand_plan.py`` (compile) and ``driver.evaluate_model`` (evaluate) both call it;
    ``evaluate_config``'s ``tp_style`` argument stays for the benchmarks that price *another* stack's
    program (Megatron-LM's rows in ``bench/costmodel_accuracy.py`` and ``bench/published.py``)."""
    return "torch" if graph.meta.get("framework") != "jax" else "megatron"


def block_kind(graph: Graph) -> str:
    """The most repeated layer kind (the transformer block)."""
    kinds = [lay.kind for lay in graph.layers]
    return max(set(kinds), key=lambda k: (kinds.count(k), -kinds.index(k)))


def blocks_per_stage(n: int, pp: int) -> list[int]:
    """Blocks on each of ``pp`` stages: ``n / pp`` each when it divides; else ``ceil(n / pp)`` each,
    one block fewer on the end stages first (stage 0, stage pp-1, stage 1, stage pp-2, ...), which
    also hold the embedding and the head: Megatron-LM's uneven split (``--decoder-first-pipeline-num-layers``
    / ``--decoder-last-pipeline-num-layers``; Llama 3 405B ran 126 layers on 16 stages, 7 on the first and
    last). ConfigError when a stage would get none."""
    if pp > n:
        raise ConfigError(
            f"{n} blocks do not split into pp={pp} stages: every stage needs at least one block.",
            f"use pp <= {n}.",
        )
    per = -(-n // pp)
    counts = [per] * pp
    ends = [i // 2 if i % 2 == 0 else pp - 1 - i // 2 for i in range(pp)]  # 0, pp-1, 1, pp-2, ...
    for i in ends[: per * pp - n]:
        counts[i] -= 1
    return counts


def megatron_split(graph: Graph, pp: int) -> list[tuple[int, int]]:
    """Layer-index ranges of ``pp`` stages: blocks split by :func:`blocks_per_stage` (evenly when
    ``pp`` divides them), pre/post layers on the ends."""
    kinds = [lay.kind for lay in graph.layers]
    block = block_kind(graph)
    idx = [i for i, k in enumerate(kinds) if k == block]
    first, last = idx[0], idx[-1]
    counts = blocks_per_stage(len(idx), pp)
    bounds = [first + sum(counts[:i]) for i in range(pp)] + [last + 1]
    bounds[0], bounds[-1] = 0, len(kinds)
    return [(bounds[i], bounds[i + 1]) for i in range(pp)]


def tp_dims(graph: Graph) -> tuple[dict[str, set[int]], int | None]:
    """What tensor parallelism must divide, by name (attention heads, key/value heads, block weight
    dims), and the vocabulary size (rows of the embedding table) or None."""
    env = {"B": 1, "S": 1}
    block = block_kind(graph)
    names = {n for lay in graph.layers if lay.kind == block for n in lay.nodes}
    need: dict[str, set[int]] = {"attention heads": set(), "key/value heads": set(), "block weight dims": set()}
    vocab = None
    strided = graph.meta.get("strided_params") or {}
    for node in graph.nodes:
        if node.prim is Prim.ATTENTION and node.name in names and len(node.inputs) >= 2:
            q, k = (graph.tensors.get(x) for x in node.inputs[:2])
            if q is not None and len(q.shape) == 4:
                need["attention heads"].add(dim_size(q.shape[1], env))
            if k is not None and len(k.shape) == 4:
                need["key/value heads"].add(dim_size(k.shape[1], env))
        if node.prim is Prim.EMBEDDING:
            for x in node.inputs:
                t = graph.tensors.get(x)
                if t is not None and t.role.value == "parameter" and len(t.shape) == 2:
                    vocab = max(vocab or 0, dim_size(t.shape[0], env))
    for lay in graph.layers:
        if lay.kind != block:
            continue
        for p in lay.params:
            t = graph.tensors.get(p)
            if t is not None and len(t.shape) >= 2:
                dims = [dim_size(d, env) for d in t.shape]
                fused = strided.get(p)  # passes/fused_split: q|k|v chunk dim, never split by tp
                if isinstance(fused, (list, tuple)) and len(fused) == 2 and fused[1] in dims:
                    dims.remove(int(fused[1]))
                need["block weight dims"].update(dims)
    return {k: v for k, v in need.items() if v}, vocab


def check_layout(
    graph: Graph,
    cluster: Cluster,
    training: TrainingConfig,
    *,
    tp: int | Sequence[int],
    pp: int,
    dp: int,
    micro_batch: int,
    schedule: str = "1f1b",
    num_virtual: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dims: tuple[dict[str, set[int]], int | None] | None = None,
    cp: int = 1,
    program: str = "torch",
) -> list[str]:
    """Refuse a layout that cannot be built (module docstring); return notes on one that can.
    ``tp``: one degree for every stage, or one per stage (:func:`stage_tps`). ``dims``:
    ``tp_dims(graph)`` when the caller checks many layouts of one graph (computed once).
    ``sequence_parallel``: refused where the runtime does not build it (``sequence_parallel.check``; with
    ``program="megatron"``, where Megatron-LM does not: ``evaluate_config(tp_style="megatron")``). ``cp``:
    context parallelism (``search/pricing/context_parallel.py``), ``dp * cp * tp`` devices per stage."""
    for name, val in (("pp", pp), ("dp", dp), ("micro_batch", micro_batch), ("num_virtual", num_virtual), ("cp", cp)):
        if val < 1:
            raise ConfigError(f"{name}={val} must be >= 1.", f"pass a positive {name}.")
    tps = stage_tps(tp, pp)
    cpx.check(graph, training, cp)  # context parallelism: a sequence to split, attention to gather for
    why = graph.meta.get("no_pipeline")  # the runtime cannot cut this model (frontends/trace_torch.py)
    if pp > 1 and why:
        raise ConfigError(
            f"pp={pp} cannot be built for {graph.meta.get('model', graph.name)}: {why}.",
            "use pp=1 and split the model with dp, tp and ZeRO instead.",
        )
    dev = cluster.device_types()[0]
    have = cluster.count(dev.name)
    used = dp * cp * sum(tps)
    if used > have:
        fit = have // (cp * sum(tps))
        other = f" (every stage runs on the first device type, {dev.name}; the cluster has {cluster.num_devices})"
        degrees = f"tp={tps[0]}, pp={pp}" if len(set(tps)) == 1 else f"tp={','.join(map(str, tps))}"
        raise ConfigError(
            f"dp*{'cp*' if cp > 1 else ''}tp*pp = {used} exceeds the cluster's {have} devices"
            f"{other if have < cluster.num_devices else ''}.",
            f"lower a degree (dp={fit} fits with {degrees}{f', cp={cp}' if cp > 1 else ''})"
            + ", or use a larger cluster."
            if fit
            else "lower a degree or use a larger cluster.",
        )
    if sequence_parallel:
        sequence_parallel_check(
            tp=tps,
            dp=dp,
            zero_stage=0,
            recompute=recompute,
            schedule=schedule,
            num_virtual=num_virtual,
            cp=cp,
            program=program,
        )
    notes = [] if len(set(tps)) == 1 else [_hetero_tp_note(tps, dp)]
    need, vocab = dims if dims is not None else tp_dims(graph)
    for t in sorted(set(tps)):
        notes += _check_degree(graph, cluster, t, need)
    if training.global_batch % (micro_batch * dp):
        raise ConfigError(
            f"global batch {training.global_batch} is not a multiple of micro_batch*dp={micro_batch * dp}.",
            "pick degrees that divide the batch.",
        )
    if num_virtual > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(
            f"{num_virtual} virtual stages need the interleaved_1f1b schedule, not {schedule}.",
            "pass --schedule interleaved_1f1b, or --virtual-stages 1.",
        )
    if schedule == "interleaved_1f1b":
        if pp < 2 or num_virtual < 2:
            raise ConfigError(
                f"interleaved_1f1b needs pp >= 2 and at least 2 virtual stages (got pp={pp}, {num_virtual}).",
                "pass --pp 2 or more and --virtual-stages 2 or more, or use --schedule 1f1b.",
            )
        n = sum(lay.kind == block_kind(graph) for lay in graph.layers)
        try:  # the chunks compile lays out (chunk_layout.lay_out): uneven end stages included
            chunk_layout.check_ranges(graph, megatron_split(graph, pp), num_virtual)
        except ConfigError as e:
            raise ConfigError(
                f"{n} blocks do not split into pp={pp} stages of {num_virtual} virtual chunks each: {e.problem}",
                f"use pp * virtual stages dividing {n}, or stages whose blocks plus the embedding (first stage) or the "
                f"head (last stage) are a multiple of {num_virtual}, or --schedule 1f1b.",
            ) from None
    n_blocks = sum(lay.kind == block_kind(graph) for lay in graph.layers)
    counts = blocks_per_stage(n_blocks, pp)  # every stage holds at least one block
    if len(set(counts)) > 1:
        notes.append(
            f"{n_blocks} blocks on {pp} stages: {max(counts)} per stage, one fewer on stages "
            f"{', '.join(str(i) for i, c in enumerate(counts) if c < max(counts))} (the end stages first, which also "
            "hold the embedding and the head, as Megatron-LM's uneven split)."
        )
    for t in sorted({t for t in tps if vocab and vocab % t}):
        notes.append(
            f"vocabulary {vocab} is not divisible by tp={t}: the embedding and output layer stay replicated on the "
            "tp group, as priced (Megatron-LM pads the vocabulary instead)."
        )
    if used < cluster.num_devices:
        notes.append(f"{cluster.num_devices - used} of {cluster.num_devices} devices stay idle in this layout.")
    return notes


def stage_tps(tp: int | Sequence[int], pp: int) -> tuple[int, ...]:
    """Per stage, its tensor-parallel degree: ``tp`` for all ``pp`` stages, or one given per stage (a
    heterogeneous pipeline, as the search lays out across device types); ConfigError otherwise."""
    tps = (tp,) * pp if isinstance(tp, int) else tuple(tp)
    if len(tps) != pp:
        raise ConfigError(
            f"{len(tps)} tensor-parallel degrees ({','.join(map(str, tps))}) for pp={pp} stages.",
            f"give one degree for every stage (e.g. --tp {','.join(['2'] + ['1'] * (pp - 1))} with --pp {pp}), or one for all.",
        )
    for t in tps:
        if t < 1:
            raise ConfigError(f"tp={t} must be >= 1.", "pass a positive tp.")
    return tps


def _hetero_tp_note(tps: tuple[int, ...], dp: int) -> str:
    return (
        f"stages of different tensor parallelism ({', '.join(f'stage {i}: tp={t}' for i, t in enumerate(tps))}), "
        f"each on dp*tp = {', '.join(str(dp * t) for t in tps)} devices: boundary activations go from each "
        "replica's tp rank 0 to every tp rank of the next stage's replicas (backends/torch/schedule.P2PPipeline)."
    )


def _check_degree(graph: Graph, cluster: Cluster, tp: int, need: dict[str, set[int]]) -> list[str]:
    """What :func:`check_layout` asks of one tensor-parallel degree: it splits the blocks (``need``,
    from :func:`tp_dims`); a note when it spans nodes."""
    dev = cluster.device_types()[0]
    gpn = cluster.gpus_per_node(dev.name)
    notes = []
    if tp > gpn:
        notes.append(
            f"tp={tp} spans {-(-tp // gpn)} nodes of {gpn} {dev.name}: its per-layer collectives are priced over the "
            f"network ({cluster.network_for(dev.name).describe()}); the planner itself never searches tp beyond a node."
        )
    bad = {k: sorted(x for x in v if x % tp) for k, v in need.items()}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        ok = [t for t in range(1, gpn + 1) if all(x % t == 0 for v in need.values() for x in v)]
        what = "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in bad.items())
        raise ConfigError(
            f"tp={tp} cannot split {graph.meta.get('model', graph.name)}'s blocks: {what} not divisible by {tp}.",
            f"use a tp that divides them, up to the node size {gpn}: {', '.join(map(str, ok))}.",
        )
    return notes


def check_split_backward(schedule: str, pp: int, zero_stage: int, recompute: str) -> None:
    """Refuse a zero-bubble layout no runtime runs (``search/pipeline/zero_bubble.py`` says why): ZeRO-2/3 or
    activation recompute with a schedule that splits the backward into B and W."""
    if pp < 2 or not sched.splits_backward(schedule):
        return
    if zero_stage not in RUNNABLE_ZERO:
        raise ConfigError(
            f"schedule {schedule} runs the weight gradients (W) after the input gradients (B), but ZeRO-{zero_stage} "
            "reduce-scatters each micro-batch's gradients at B, before W has computed them.",
            f"use --zero 0 or 1 with {schedule}, or --schedule 1f1b with ZeRO-{zero_stage}.",
        )
    if recompute != "none":
        raise ConfigError(
            f"schedule {schedule} runs the weight gradients (W) in a second backward pass, which would recompute "
            f"each checkpointed block's forward again ({recompute} recompute): more work than one backward.",
            f"use --recompute none with {schedule}, or --schedule 1f1b with --recompute {recompute}.",
        )


def memory_by_category(cand: Candidate, i: int) -> dict[str, float]:
    """Stage ``i``'s memory per device split as ``stage_ranges.StageParts`` sums it."""
    p = cand.stages[i]
    search = cand.search
    dev, _, b = p.option.devices[0]
    z, r = p.option.combos[p.combo]
    tab = search.table(dev, p.option.tp, b).for_stage(cand.dp, z)  # the stage's precision mode (stage_cost)
    k, j = p.k, p.j
    sl = slice(k, j)
    if sched.splits_backward(cand.schedule):  # issue 19: a deferred W weighs the stage's own output gradients
        held = held_weight(float(tab.ranged("held")[k, j]), float(tab.ranged("act")[k, j]), search.units[k][0] == 0)
        in_flight = float(counts(cand.schedule, len(cand.stages), cand.m, cand.v, np.array([held]), i)[0])
    else:
        in_flight = sched.in_flight(cand.schedule, i, len(cand.stages), cand.m, cand.v)
    max_params = float(tab.max_layer_params[sl].max())
    # a deferred W's gradient copy (stage_cost.static_memory), not on the first stage
    deferred = bool(copies_deferred_gradients(sched.splits_backward(cand.schedule), search.units[k][0]))
    cats = static_memory(  # range sums: a parameter shared by the range's layers counts once (UnitTable.shared)
        float(tab.ranged("params")[k, j]),
        float(tab.ranged("grads")[k, j]),
        float(tab.ranged("opt")[k, j]),
        max_params,
        cand.dp,
        z,
        tab.gather_ratio,
        tab.fsdp_copies,
        deferred,
    )
    # the activations as stage_ranges.StageParts adds them: saved x in flight + the transient (one layer's
    # recomputed activations, the loss's backward buffers), a ZeRO-1/2/3 unit's gradients in flight to the
    # reduce-scatter where the backward runs beside other activations, and ZeRO-0's flat gradient copy
    if r == "none":
        act, transient = float(tab.act[sl].sum()) * in_flight, 0.0
    elif r == "selective":
        act, transient = float((tab.act[sl] - tab.sel_bytes[sl]).sum()) * in_flight, float(tab.max_layer_sel[sl].max())
    else:
        act, transient = float(tab.inputs[sl].sum()) * in_flight, float(tab.max_layer_act[sl].max())
    if tab.transient is not None:
        transient = max(transient, float(tab.transient[sl].max()))
    if tab.grad_transient is not None:  # parameter gradients beside .grad (stage_ranges.grad_transient)
        transient = max(transient, float(grad_transient(tab, sched.splits_backward(cand.schedule))[k, j]))
    act += transient
    rs = float(reduce_scatter_in_flight(max_params, cand.dp, z, tab.gather_ratio, tab.fsdp_copies, deferred))
    act += rs  # from the backward's start on (stage_ranges.StageParts.memory)
    copy, bucketed = sync_copy(
        search.costs, float(tab.ranged("grads")[k, j]), cand.dp, z, flat_sync_chunks(cand.schedule, cand.v)
    )
    if copy:  # the flat copy, or the buckets in flight (stage_ranges.sync_copy)
        act = max(act, copy)
    grads = cats["gradients"]
    if r == "none" and not sched.splits_backward(cand.schedule) and in_flight >= cand.m:
        # no forward after the first backward (stage_ranges.StageParts.memory): the largest of the last forward
        # (no gradients), a later micro-batch's backward beside the first's gradients, the gradients alone
        held = float(tab.act[sl].sum()) * in_flight + transient + rs  # the last forward, the first backward
        later = held - float(tab.act[sl].sum()) + grads if cand.m >= 2 else -1.0
        with_grads = max(later, grads + copy if bucketed else grads * (2.0 if copy else 1.0))
        act, grads = (held, 0.0) if held > with_grads else (with_grads - grads, grads)
    act += receive_buffers.stage_bytes(cand, i)  # torch pipelining's per micro-batch buffers (Candidate.memory)
    return {
        "parameters": cats["parameters"],
        "gradients": grads,
        "optimizer_state": cats["optimizer"],
        "activations": act,
    }


def sequence_parallel_saved(cand: Candidate, training: TrainingConfig) -> tuple[float, ...]:
    """Per stage, the bytes per device that Megatron sequence parallelism changes in the saved
    activations (negative: saved): ``sequence_parallel.activation_delta`` of the stage's blocks with
    the layer ILP's strategies, times the micro-batches in flight, as ``partita compile
    --sequence-parallel`` writes it into the Plan (Megatron-LM's program, ``tp_style="megatron"``, keeps
    the column inputs for ``s/t`` rows and gathers them again in the backward). Refused (ConfigError, compile's words) where a
    block's tp does not split it into column / row pairs."""
    from partita.ir import DTYPE_BYTES

    search = cand.search
    g = search.graph
    low = DTYPE_BYTES.get(training.dtype, 4)
    out = []
    for i, p in enumerate(cand.stages):
        dev, _, mb = p.option.devices[0]
        a0, b0 = search.units[p.k][0], search.units[p.j - 1][1]
        blocks = [lay.name for lay in g.layers[a0:b0] if lay.name not in NOT_BLOCKS]
        z, r = p.option.combos[p.combo]
        if p.option.tp < 2 or not blocks:
            out.append(0.0)
            continue
        strategy: dict[str, str] = {}
        for li in range(a0, b0):
            strategy.update(search.costs.solution(li, dev, p.option.tp, mb).op_strategies)
        check_strategies(g, blocks, strategy)
        fsdp = cand.dp > 1 and z >= 1
        if search.costs.tp_style == "megatron_sp":  # the layer ILP priced it: activations of s/tp rows
            out.append(0.0)
            continue
        regather = search.costs.tp_style == "megatron"  # Megatron-LM's program (activation_delta)
        delta = activation_delta(g, blocks, strategy, p.option.tp, r, low, fsdp, (mb, training.seq_len), regather)
        out.append(delta * sched.in_flight(cand.schedule, i, len(cand.stages), cand.m, cand.v))
    return tuple(out)


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
    sequence_parallel: bool = False,
    costs: SolverCosts | None = None,
    factors: StageFactors | None = None,
    tp_style: str | None = None,
    cp: int = 1,
    p2p_overlap: bool = False,
) -> Evaluation:
    """Predicted step time and memory of one configuration (module docstring), priced by
    ``layout_price.layout_candidate`` as ``partita compile`` and the search price it.

    ``tp_style`` None (the default) prices the program Partita emits for ``graph``
    (:func:`tp_style_of`; ``costs.tp_style`` when ``costs`` are given): what ``partita evaluate``,
    ``partita compile`` and the planner price, so all three print one number (issue 32 item 5).
    ``"megatron"`` prices ``tp`` as Megatron-LM's tensor parallelism and kernels (the benches' rows that
    ran Megatron-LM): the weights are split and activations stay whole on the tp group. ``"auto"`` lets
    the intra-op ILP pick any sharding on the tp axis. ``cp > 1``: context parallelism
    (``search/pricing/context_parallel.py``): layers priced at ``S / cp`` by ``ContextParallelCosts``,
    ``dp * cp`` replicas for the gradient sync and ZeRO, ``dp * cp * tp * pp`` devices. ``p2p_overlap``:
    the stage-to-stage sends run beside the compute (``SearchOptions.p2p_overlap``), as Megatron-LM's
    interleaved schedule runs them with ``--overlap-p2p-comm`` (Llama 3's asynchronous p2p): only with
    ``tp_style="megatron"`` and ``interleaved_1f1b``; Partita's torch pipeline waits for its receives.
    """
    # sequence parallelism where Megatron-LM builds it only when another stack's program is priced by name
    # (the benches' published rows); a Partita program (torch or JAX, tp_style None) keeps compile's refusals
    program = "megatron" if tp_style in ("megatron", "megatron_sp") else "torch"
    if tp_style == "megatron_sp" and not sequence_parallel:
        raise ConfigError(
            "tp_style='megatron_sp' prices Megatron-LM's program with sequence parallelism, and this call has none.",
            "pass sequence_parallel=True, or tp_style='megatron'.",
        )
    if tp_style == "megatron" and sequence_parallel:  # Megatron's program runs it: its layers priced with it
        tp_style = "megatron_sp"
    if tp_style is None:
        tp_style = costs.tp_style if costs is not None else tp_style_of(graph)
    notes = check_layout(
        graph,
        cluster,
        training,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=micro_batch,
        schedule=schedule,
        num_virtual=num_virtual,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        cp=cp,
        program=program,
    )
    if p2p_overlap and (program != "megatron" or schedule != "interleaved_1f1b"):
        raise ConfigError(
            "overlapped pipeline sends (p2p_overlap) are priced only for Megatron-LM's interleaved schedule "
            f"(tp_style='megatron', interleaved_1f1b; got {'a Partita program' if program != 'megatron' else schedule}): "
            "Partita's torch pipeline waits for each receive before the chunk that needs it.",
            "drop p2p_overlap, or price a Megatron-LM program with schedule='interleaved_1f1b'.",
        )
    if zero_stage and dp * cp == 1:
        notes.append(f"ZeRO-{zero_stage} with dp=1 shards nothing: priced as ZeRO-0.")
        zero_stage = 0
    check_split_backward(schedule, pp, zero_stage, recompute)
    if costs is None:  # the planner's precision rule (search/pricing/precision.py): fp16 where bf16 has no tensor cores
        chosen = choose_precision(cluster, training)
        if chosen.dtype != training.dtype:
            notes.append(precision_note(cluster, chosen.dtype) + f" (requested {training.dtype}).")
            training = chosen
        if training.fp8:  # search/pricing/fp8.py: the stages on FP8 types train their linears in FP8
            from partita.search.pricing import fp8

            notes.append(fp8.note(cluster, training.fp8))
    opts = SearchOptions(
        zero_stages=(zero_stage,), recompute=(recompute,), max_layer_units=0, max_tp=tp, p2p_overlap=p2p_overlap
    )
    if costs is None:
        costs = (
            ContextParallelCosts(graph, cluster, training, cp, tp_style=tp_style)
            if cp > 1
            else SolverCosts(graph, cluster, training, tp_style=tp_style)
        )
    elif cp != getattr(costs, "cp", 1):
        raise ConfigError(
            f"the shared SolverCosts price cp={getattr(costs, 'cp', 1)}, this call asks cp={cp}.",
            "build ContextParallelCosts(..., cp) for a context-parallel layout (search/pipeline/cp_costs.py).",
        )
    elif costs.tp_style != tp_style:
        raise ConfigError(
            f"the shared SolverCosts price tp_style={costs.tp_style!r}, this call asks {tp_style!r}.",
            "build SolverCosts(..., tp_style=...) with the style you evaluate.",
        )
    full = training
    training = costs.training  # the sequence each layer is solved at: S / cp (context_parallel.local_training)
    dp_all = dp * cp  # the replicas parameters are synchronized and sharded over
    search = Search(graph, cluster, training, opts, costs, factors)
    dev = cluster.device_types()[0]
    m = full.global_batch // (micro_batch * dp)
    v = num_virtual if schedule == "interleaved_1f1b" else 1
    cand = layout_candidate(  # the one pricing of a hand layout (compile's, the baselines', the benches')
        search,
        dev,
        tps=(tp,) * pp,
        ranges=megatron_split(graph, pp),
        dp=dp_all,
        micro_batch=micro_batch,
        num_micro_batches=m,
        schedule=schedule,
        num_virtual=v,
    )
    if isinstance(cand, v_layout.VCandidate):  # zbv: per rank group, its two chunks (v_layout.group_memory)
        groups = [v_layout.group_memory(cand, i) for i in range(pp)]
        mem = tuple(g["total"] for g in groups)
        by_category = tuple(
            {"parameters": g["parameters"], "gradients": g["gradients"]}
            | {"optimizer_state": g["optimizer"], "activations": g["activations"]}
            for g in groups
        )
        v = cand.v
    else:
        mem = tuple(cand.memory(i) for i in range(pp))
        by_category = tuple(memory_by_category(cand, i) for i in range(pp))
    nothing = tuple(False for _ in range(pp))
    if tp > 1:  # per stage: do its layers' solutions place anything on tp (issue 31)?
        on_tp = search.units_shard_on_tp(dev, tp, micro_batch)
        chunks = cand.chunks if isinstance(cand, v_layout.VCandidate) else cand.stages
        where = [
            chunk_position("zbv", i, pp) if isinstance(cand, v_layout.VCandidate) else i for i in range(len(chunks))
        ]
        nothing = tuple(not any(any(on_tp[p.k : p.j]) for p, r in zip(chunks, where) if r == s) for s in range(pp))
        if any(nothing):
            which = ", ".join(str(i) for i, x in enumerate(nothing) if x)
            notes.append(
                f"tp={tp} shards nothing in stage(s) {which}: every tp rank holds and computes the whole stage "
                "(the search does not offer such a stage; a smaller tp or a larger micro-batch or sequence may split it)."
            )
    if sequence_parallel and tp_style == "megatron_sp":
        notes.append(
            "sequence parallel (Megatron-LM's program): each block's norms, residual adds and dropout run on s/tp "
            "rows per rank between all-gathers before its column matmuls and reduce-scatters after its row matmuls, "
            "and layers hand s/tp rows to each other and to the next stage; priced by the layer ILP so "
            "(tp_style 'megatron_sp', search/layer/layer_strategies.py)."
        )
    elif sequence_parallel:
        saved = sequence_parallel_saved(cand, training)
        mem = tuple(x + d for x, d in zip(mem, saved))
        by_category = tuple(c | {"activations": c["activations"] + d} for c, d in zip(by_category, saved))
        notes.append(
            "sequence parallel (Megatron): the blocks' norms and residual stream keep s/tp rows per rank, "
            f"{-min(saved) / 2**30:.1f} GiB of activations less per device at most; the step time is the layout's "
            "without it (a ring all-reduce costs its reduce-scatter plus its all-gather)."
        )
    cap = tensor_cap(dev)  # device_reserve.py: less the context, NCCL buffers and allocator margin
    pt = cand.pipeline
    step = cand.step_time
    flops = model_flops(graph, full, costs.linear_batch)  # at the whole sequence: every query meets every key
    used = dp * cp * tp * pp
    if cp > 1:
        note, per_block = _cp_terms(graph, cluster, costs, dev, tp, micro_batch, cp)
        notes.append(note)
    layout = {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "micro_batch": micro_batch,
        "num_micro_batches": m,
        "zero_stage": zero_stage,
        "recompute": recompute,
        "schedule": schedule,
        "num_virtual_stages": v,
        "sequence_parallel": sequence_parallel,
        **({"p2p_overlap": True} if p2p_overlap else {}),
        "dtype": training.dtype,
        "device": dev.name,
        "devices_used": used,
        "devices_total": cluster.num_devices,
        "calibration": dev.profile or "none",
        "network": cluster.network_for(dev.name).describe(),
        **({"context_parallel": per_block} if cp > 1 else {}),
    }
    return Evaluation(
        step,
        pt.step_s,
        pt.bubble_s,
        max(cand.tails),
        tuple(cand.stage_times),
        mem,
        cap,
        all(x <= cap for x in mem),
        full.global_batch * full.seq_len / step,
        by_category,
        layout,
        flops / step / (used * dev.flops(training.dtype)),
        flops / step / cluster.peak_flops(training.dtype),
        tuple(notes),
        nothing,
    )


def _cp_terms(
    graph: Graph, cluster: Cluster, costs: Any, dev: Any, tp: int, micro_batch: int, cp: int
) -> tuple[str, dict[str, Any]]:
    """What a context-parallel layout's prediction assumes (``search/pricing/context_parallel.py``), as a
    note and as data (``layout["context_parallel"]``): the terms of one transformer block per micro-batch."""
    blk = next(i for i, lay in enumerate(graph.layers) if lay.kind == block_kind(graph))
    t = costs.terms(blk, dev, tp, micro_batch)
    base = SolverCosts.layer(costs, blk, dev, tp, micro_batch)
    block_s = (base[0].forward_s + base[0].backward_s) if base is not None else 0.0
    link = (
        "the network"
        if cpx.cp_link(dev, cp, tp, cluster.gpus_per_node(dev.name), cluster.network_for(dev.name)).crosses_nodes
        else "the node's links"
    )
    data = {
        "scheme": cpx.SCHEME,
        "tokens_per_rank": costs.training.seq_len,
        "gathered_bytes_per_block": t.gathered_bytes * t.num_attention,
        "all_gather_s_per_block": t.gather_s,
        "reduce_scatter_s_per_block": t.scatter_s,
        "extra_attention_s_per_block": t.extra_forward_s + t.extra_backward_s,
        "block_s_at_local_seq": block_s,
        "crosses_nodes": link == "the network",
    }
    return (
        f"context parallelism cp={cp} ({cpx.SCHEME}): each rank holds {costs.training.seq_len:,} of every sample's "
        f"{costs.full_training.seq_len:,} tokens; per block and micro-batch the attention gathers "
        f"{cpx.size_text(t.gathered_bytes)} of keys and values over {link} ({t.gather_s * 1e3:.2f} ms forward, "
        f"{t.scatter_s * 1e3:.2f} ms for their gradients' reduce-scatter, priced exposed) and computes "
        f"{(t.extra_forward_s + t.extra_backward_s) * 1e3:.2f} ms more attention against the whole sequence, "
        f"on a block of {block_s * 1e3:.2f} ms at {costs.training.seq_len:,} tokens; gradients are synchronized "
        "and ZeRO shards over dp x cp."
    ), data
