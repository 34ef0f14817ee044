"""The Plan's collective records, complete and in bytes: what the emitted torch program issues per step.

Used by ``search/program/plan_build.py`` (and through it ``search/entry/hand_plan.py``) after the stages are laid out:
the tensor-parallel collectives come from the layer ILP (``Stage.collectives`` of phase forward /
backward, per micro-batch), everything else is added here from the plan's structure and the graph's
parameters. These records are the single prediction: the emitted program carries them as
``PROGRAM["predicted_collectives"]``, its first counted step compares them (``backends/torch/fidelity``),
and ``partita rehearse`` compares a full-size fake step with them. Each record below says which line of
the program issues it (``backends/torch/emit.py``, ``parallel.py``, ``train.py``, ``optim.py``); all
counts and bytes are per step on the stage's first rank (``Stage.ranks[0]``), bytes of the full tensor
a collective moves (all-gather output, reduce-scatter input):

* tensor parallel (ILP): ``count * m``; activations travel in the training dtype (autocast / FSDP2's
  ``param_dtype``; an embedding's output in f32 under autocast, which does not cast a lookup), the
  ILP prices them in the traced dtype, so bytes are rescaled; a linear-batch
  solve (batch 1) is scaled to the micro-batch. Under full recompute each block's forward
  collectives run again, except its last all-reduce (the row-parallel output feeds only the
  residual add, which ``torch.utils.checkpoint`` never needs to rebuild).
* data parallel, ZeRO-0: one all-reduce over ``dp`` of all the stage's gradients, flattened (f32:
  the program keeps f32 master parameters and gradients under autocast) (``parallel.all_reduce_grads``),
  after the schedule (phase ``optimizer``); with ``Stage.grad_buckets`` (:func:`grad_buckets`) one per
  bucket, issued inside the stage's last backward (phase ``backward``; ``parallel.GradBuckets``), which
  ``partita rehearse`` checks (``rehearse.compare_stage``: the dp all-reduces issued in the backward).
* data parallel, ZeRO-1/2/3 (FSDP2, one unit per block holding parameters + the stage root when it
  holds any): per unit, all-gathers of its parameters in the compute dtype (``MixedPrecisionPolicy
  .param_dtype``) and reduce-scatters of its gradients in f32 (``reduce_dtype``): ZeRO-1 one of each
  per step, ZeRO-2 one all-gather and ``m`` reduce-scatters, ZeRO-3 ``2m`` all-gathers (forward and
  the backward re-gather) and ``m`` reduce-scatters, plus one of the last block where FSDP2's first
  backward prefetches it again (:func:`_prefetches_again`).
* pipeline: both directions per neighbour and micro-batch (activation forward, its gradient back) in
  the compute dtype; with ``torch.distributed.pipelining`` (equal-shape stages) one message each way,
  with ``P2PPipeline`` (other shapes) tp rank 0 of a replica sends to every tp rank of each
  overlapping replica of the next stage and receives gradients from its tp rank 0.
* a parameter tied across stages (GPT-2's ``wte`` / ``lm_head``): one all-reduce of its full f32
  gradient over the holders (``parallel.sync_tied_grads``), after one all-gather per mesh axis it is
  sharded on here (``full_tensor``).
* gradient clipping and f16 loss scaling: one float64 all-reduce each over every rank (``optim``), on
  the axis :func:`world_axis` names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from partita.ir import DTYPE_BYTES, Graph, Role, dim_size
from partita.passes import boundaries
from partita.plan import (
    GRAD_BUCKET_BYTES,
    Collective,
    Plan,
    Stage,
    chunk_position,
    flat_sync_chunks,
    shares,
)
from partita.search.layer.saved import FLOAT_DTYPES
from partita.search.pipeline.schedule import pipeline_actions, splits_backward

F32 = 4
NOT_BLOCKS = ("embed", "head")


def runner_kind(plan: Plan) -> str:
    """Which pipeline runner the torch emitter picks (``backends/torch/emit._runner_kind``; a test
    checks they agree): ``local`` (one stage), ``torch_pipeline`` (equal-shape stages without ZeRO-2/3)
    or ``p2p``. Model chunks (``Plan.chunked``: interleaved 1F1B, ZB-V) run on ``p2p``."""
    if plan.chunked:
        return "p2p"
    if plan.num_stages == 1:
        return "local"
    if plan.schedule not in ("gpipe", "1f1b", "interleaved_1f1b"):
        return "p2p"  # zero-bubble schedules run their action list on P2PPipeline
    if any(s.dp > 1 and s.zero_stage >= 2 for s in plan.stages):
        return "p2p"
    first = plan.stages[0]
    key = lambda s: (s.dp, s.tp, shares(s, plan.micro_batch_size))  # noqa: E731
    return "torch_pipeline" if all(key(s) == key(first) for s in plan.stages) else "p2p"


def zero1_reduces_after_schedule(plan: Plan) -> bool:
    """Does a ZeRO-1 stage of ``plan`` reduce-scatter after the schedule, outside any backward? On
    ``torch.distributed.pipelining`` (its REDUCE_GRAD after the last micro-batch) and on ``P2PPipeline``
    under a split backward or with model chunks (its ``reduce_at_end``: the last W, the rank's last chunk);
    not alone (``LocalSchedule``) nor on ``P2PPipeline`` running 1F1B / GPipe on one chunk per rank, which
    syncs in the last backward (rehearsed: gpt3-13b-search's stages of different shapes, every reduce-scatter
    inside the backward). The search prices every pipelined ZeRO-1 stage's reduce-scatter as after the
    schedule (``stage_ranges._zero_terms``: a layer range does not know its plan's runner), so the last case
    is priced up to its hidden part slower than it runs."""
    kind = runner_kind(plan)
    if kind == "local":
        return False
    return kind == "torch_pipeline" or plan.chunked or splits_backward(plan.schedule)


def world_axis(plan: Plan) -> str:
    """The axis name of the all-ranks group: ``world``, except in a one-stage plan whose ``dp`` (else
    ``tp``) axis spans every rank, where DeviceMesh reuses the default group for that axis
    (``backends/torch/fidelity.axis_names``)."""
    if plan.num_stages == 1:
        s = plan.stages[0]
        if s.dp == len(s.ranks):
            return "dp"
        if s.tp == len(s.ranks):
            return "tp"
    return "world"


def compute_bytes(training: Mapping[str, Any]) -> int:
    """Bytes of an activation (and of a parameter as FSDP2 gathers it) in the program: the plan's dtype."""
    return int(DTYPE_BYTES.get(str(training.get("dtype", "f32")), F32))


def _layer_params(graph: Graph, layer: Any) -> list[str]:
    """Every parameter tensor a layer reads (a tied one in each layer that uses it)."""
    seen: dict[str, None] = {}
    for name in layer.nodes:
        for t in graph.node(name).inputs:
            if graph.tensors[t].role is Role.PARAMETER:
                seen.setdefault(t, None)
    return list(seen)


def _numel(graph: Graph, t: str) -> int:
    return math.prod(dim_size(d) for d in graph.tensors[t].shape)


def _tp_factor(stage: Stage, names: Sequence[str]) -> int:
    """``tp`` when the parameter (under any of its ``names``: a tied one is placed under the name its
    stage holds, ``plan_build._held_names``) is sharded on the tp axis, else 1."""
    pl = next((stage.param_placements[n] for n in names if n in stage.param_placements), None)
    return stage.tp if stage.tp > 1 and pl is not None and str(pl[-1]) != "R" else 1


class GraphFacts:
    """Per layer name: its parameters; per parameter: the layers using it (read once per plan)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.index = {lay.name: i for i, lay in enumerate(graph.layers)}
        self.params = {lay.name: _layer_params(graph, lay) for lay in graph.layers}
        self.users: dict[str, list[str]] = {}
        for name, ps in self.params.items():
            for t in ps:
                self.users.setdefault(t, []).append(name)

    def fqn(self, t: str) -> str:
        return self.graph.tensors[t].fqn or t

    def names(self, t: str) -> tuple[str, ...]:
        return (self.fqn(t), *self.graph.tensors[t].aliases)

    def boundary_elems(self, layer: str, seq_len: int) -> int:
        """Elements per sample crossing the stage boundary after ``layer``: every live tensor there that
        needs a gradient (``passes/boundaries.py``; T5: decoder state, encoder output, position bias)."""
        return boundaries.cut_elems(self.graph, self.index[layer], seq_len)

    def traced_item(self, layer: str) -> int:
        """Bytes per element the layer's activations were traced in: its first floating-point output's
        (an embedding layer's first output can be a boolean mask, which made a stage of only the
        embedding record its tensor-parallel bytes 4x)."""
        lay = self.graph.layers[self.index[layer]]
        outs = [self.graph.tensors[t] for t in lay.outputs if t in self.graph.tensors]
        items = [t.itemsize for t in outs if t.dtype in FLOAT_DTYPES]
        return int(items[0]) if items else F32


def _add(out: dict[tuple, int], kind: str, axis: str, nbytes: float, n: int, phase: str, why: str) -> None:
    if n > 0:
        key = (kind, axis, float(nbytes), phase, why)
        out[key] = out.get(key, 0) + n


def _units(facts: GraphFacts, stage: Stage) -> list[list[str]]:
    """FSDP units holding parameters: one per block, then the stage root (embed/head and the rest)."""
    placed: set[str] = set()
    units = []
    for name in stage.layers:
        if name in NOT_BLOCKS:
            continue
        mine = [t for t in facts.params.get(name, []) if t not in placed]
        placed.update(mine)
        if mine:
            units.append(mine)
    root = [t for name in stage.layers if name in NOT_BLOCKS for t in facts.params.get(name, []) if t not in placed]
    root = list(dict.fromkeys(root))
    return units + ([root] if root else [])


def stage_collectives(facts: GraphFacts, plan: Plan, i: int, batch_scale: float = 1.0) -> tuple[Collective, ...]:
    """The complete records of stage ``i`` (module docstring). ``plan.stages[i].collectives`` holds the
    ILP's per-micro-batch tensor-parallel records; ``batch_scale``: micro-batch over the batch they
    were solved at."""
    s, m, tr = plan.stages[i], plan.num_micro_batches, plan.training
    item = compute_bytes(tr)
    out: dict[tuple, int] = {}
    traced = facts.traced_item(s.layers[-1]) if s.layers else F32
    blocks = sum(1 for name in s.layers if name not in NOT_BLOCKS)
    for c in s.collectives:
        if c.phase == "optimizer":
            _add(out, c.kind, c.axis, c.bytes * F32 / traced, c.count, c.phase, c.reason)
            continue
        emb = c.reason.split(" ")[0] in ("embed_dim", "vocab") and not (s.dp > 1 and s.zero_stage >= 1)
        # an embedding's output collectives: torch.autocast leaves the lookup in its f32 weights' dtype
        # (FSDP2's MixedPrecisionPolicy stores the weights, hence the output, in the compute dtype)
        nbytes = c.bytes * batch_scale * (F32 if emb else item) / traced
        _add(out, c.kind, c.axis, nbytes, c.count * m, c.phase, c.reason)
        if s.recompute == "full" and c.phase == "forward":
            _add(out, c.kind, c.axis, nbytes, c.count * m, "forward", "recomputed: " + c.reason)
    if s.recompute == "full" and s.tp > 1 and blocks:
        _drop_last_all_reduces(out, m * blocks)
    if s.dp > 1 and s.zero_stage == 0 and s.grad_buckets:  # one per bucket, inside the last backward
        sizes = _held_sizes(facts, plan, i)
        for k, bucket in enumerate(s.grad_buckets):
            nbytes = F32 * sum(sizes[n] for n in bucket)
            _add(out, "all_reduce", "dp", nbytes, 1, "backward", f"gradient bucket {k} (dp, f32)")
    elif s.dp > 1 and s.zero_stage == 0 and _first_chunk(plan, i):  # one all-reduce per rank group, all its chunks
        held = {
            t: _numel(facts.graph, t) // _tp_factor(c, facts.names(t))
            for c in _chunks(plan, i)
            for u in _units(facts, c)
            for t in u
        }
        _add(out, "all_reduce", "dp", F32 * sum(held.values()), 1, "optimizer", "gradient sync (dp, f32)")
    elif s.dp > 1 and s.zero_stage > 0:
        ag, rs = {1: (1, 1), 2: (1, m), 3: (2 * m, m)}[s.zero_stage]
        held_here = _group_stage(plan, i)  # placements of every chunk on these ranks (the root unit's)
        rs_phase = "optimizer" if s.zero_stage == 1 and zero1_reduces_after_schedule(plan) else "backward"
        for k, unit in enumerate(_chunk_units(facts, plan, i)):
            n = sum(_numel(facts.graph, t) // _tp_factor(held_here, facts.names(t)) for t in unit)
            _add(out, "all_gather", "dp", item * n, ag, "forward", f"FSDP unit {k}: parameters")
            _add(out, "reduce_scatter", "dp", F32 * n, rs, rs_phase, f"FSDP unit {k}: gradients (f32)")
        if s.zero_stage == 3 and _prefetches_again(facts, plan, i):
            last = _chunk_units(facts, plan, i)[-1]
            n = sum(_numel(facts.graph, t) // _tp_factor(held_here, facts.names(t)) for t in last)
            _add(out, "all_gather", "dp", item * n, 1, "backward", "FSDP last block: prefetched by the first backward")
    _p2p(out, facts, plan, i, item)
    _tied(out, facts, plan, i)
    world = world_axis(plan)
    once = _first_chunk(plan, i)  # once per step on each rank: on the first chunk of a rank group
    if tr.get("grad_clip") and once:
        _add(out, "all_reduce", world, 8.0, 1, "optimizer", "gradient clipping (global norm)")
    if tr.get("dtype") == "f16" and once:
        _add(out, "all_reduce", world, 8.0, 1, "optimizer", "loss-scale overflow check")
    return tuple(Collective(k, a, b, n, p, r) for (k, a, b, p, r), n in out.items())


def _held_sizes(facts: GraphFacts, plan: Plan, i: int) -> dict[str, int]:
    """Elements of each parameter stage ``i``'s rank holds (its tp shard), in the order the backward finishes
    their gradients (the stage's last layer first, each layer's parameters last first; a parameter several
    layers use at the layer using it first), under the name the stage's module holds it (a tied parameter
    first used by another stage under its alias, ``plan_build._held_names``)."""
    s = plan.stages[i]
    order: dict[str, str] = {}  # tensor -> name
    for layer in reversed(s.layers):
        for t in reversed(facts.params.get(layer, [])):
            first = facts.users.get(t, [layer])[0]
            aliases = facts.graph.tensors[t].aliases
            order.pop(t, None)  # an earlier layer uses it too: its gradient is final there
            order[t] = aliases[0] if aliases and first not in s.layers else facts.fqn(t)
    return {name: _numel(facts.graph, t) // _tp_factor(s, facts.names(t)) for t, name in order.items()}


def grad_buckets(graph: Graph, plan: Plan, i: int, cap: float = GRAD_BUCKET_BYTES) -> tuple[tuple[str, ...], ...]:
    """``Stage.grad_buckets`` of stage ``i`` (``plan.py``): its parameters in the order the backward finishes
    their gradients, cut into buckets of at most ``cap`` f32 bytes, a parameter larger than ``cap`` in a
    bucket of its own (all-reduced in place, no copy: ``GradBuckets``), so the copies in flight stay within
    ``GRAD_BUCKETS_IN_FLIGHT * cap`` as priced (``stage_ranges.sync_copy``); ``()`` where the program syncs
    flat (dp = 1, ZeRO > 0, ZB-V's model chunks: ``plan.flat_sync_chunks``). Under interleaved 1F1B each chunk
    (virtual stage) has its own buckets, issued from its own last backward; the program's one module per rank
    group lists them chunk after chunk, the last chunk's first (``backends/torch/chunks.physical_plan``)."""
    s = plan.stages[i]
    if s.dp * s.cp < 2 or s.zero_stage != 0 or flat_sync_chunks(plan.schedule, plan.num_virtual_stages):
        return ()  # the flat sync after the schedule (stage_ranges.sync_copy)
    if plan.chunked and _shares_with_chunk(GraphFacts(graph), plan, i):
        # a parameter two chunks of one rank read accumulates once per chunk and micro-batch: GradBuckets counts
        # to num_micro_batches per parameter, so such a group keeps the flat sync
        return ()
    out: list[tuple[str, ...]] = []
    bucket: list[str] = []
    nbytes = 0
    for name, n in _held_sizes(GraphFacts(graph), plan, i).items():
        if bucket and nbytes + F32 * n > cap:  # full: this parameter starts the next one
            out.append(tuple(bucket))
            bucket, nbytes = [], 0
        bucket.append(name)
        nbytes += F32 * n
    if bucket:
        out.append(tuple(bucket))
    return tuple(out)


def _shares_with_chunk(facts: GraphFacts, plan: Plan, i: int) -> bool:
    """Does a parameter of chunk ``i`` belong to another chunk of its rank group too?"""
    group = _chunks(plan, i)

    def held(s: Stage) -> set[str]:
        return {t for layer in s.layers for t in facts.params.get(layer, [])}

    mine = held(plan.stages[i])
    return any(mine & held(c) for c in group if c is not plan.stages[i])


def with_grad_buckets(plan: Plan, graph: Graph, cap: float = GRAD_BUCKET_BYTES) -> Plan:
    """``plan`` with :func:`grad_buckets` on every stage: the torch program's ZeRO-0 sync overlapped with the
    last backward, as the search prices it (``stage_ranges.StageParts``, ``buckets``)."""
    stages = tuple(
        dataclasses.replace(s, grad_buckets=grad_buckets(graph, plan, i, cap)) for i, s in enumerate(plan.stages)
    )
    return dataclasses.replace(plan, stages=stages)


def _prefetches_again(facts: GraphFacts, plan: Plan, i: int) -> bool:
    """Does a ZeRO-3 stage's first backward all-gather its last block once more? FSDP2's implicit backward
    prefetch gathers, from each unit's pre-backward, the unit before it in the post-forward order of
    every forward since the last backward. The first block's predecessor there is the previous
    micro-batch's last block (resharded after its forward) wherever more than one forward precedes
    the stage's first backward (its position's action list, ``schedule.pipeline_actions``) and no
    root unit with parameters sits between them (the root runs its post-forward last and stays
    unsharded after forward, so prefetching it gathers nothing): gathered, then resharded unused. The
    order and every unit's indices are cleared after each backward (FSDP2's ``is_last_backward``, which
    the runner leaves True), so only the first backward does it, under 1F1B and GPipe alike (the
    gpt3-175b plan's middle stages rehearsed 481 all-gathers against 480 recorded before this record)."""
    s = plan.stages[i]
    if runner_kind(plan) != "p2p" or plan.chunked or not _blocks(s):  # p2p: the runner of the action lists
        return False
    if len(_units(facts, s)) > len(_units(facts, dataclasses.replace(s, layers=_blocks(s)))):
        return False  # a root unit with parameters
    acts = pipeline_actions(plan.schedule, plan.num_stages, plan.num_micro_batches)[i]
    first_b = next((k for k, a in enumerate(acts) if a.kind == "B"), len(acts))
    return sum(1 for a in acts[:first_b] if a.kind == "F") > 1


def _blocks(s: Stage) -> tuple[str, ...]:
    return tuple(name for name in s.layers if name not in NOT_BLOCKS)


def _group_stage(plan: Plan, i: int) -> Stage:
    """Stage ``i`` with the parameter placements of every chunk on its ranks (itself when unchunked)."""
    group = _chunks(plan, i)
    if len(group) == 1:
        return plan.stages[i]
    merged = {k: v for c in group for k, v in c.param_placements.items()}
    return dataclasses.replace(plan.stages[i], param_placements=merged)


def _chunk_units(facts: GraphFacts, plan: Plan, i: int) -> list[list[str]]:
    """Stage ``i``'s FSDP units; in a chunked plan its rank group has one module: the blocks' units of
    this chunk, and the one root unit (every chunk's embed / head parameters) on the group's first chunk."""
    s = plan.stages[i]
    if not plan.chunked:
        return _units(facts, s)
    group = _chunks(plan, i)
    blocks = [name for name in s.layers if name not in NOT_BLOCKS]
    units = _units(facts, dataclasses.replace(s, layers=tuple(blocks)))
    if group[0] is s:
        root = [t for c in group for name in c.layers if name in NOT_BLOCKS for t in facts.params.get(name, [])]
        placed = {t for c in group for name in c.layers if name not in NOT_BLOCKS for t in facts.params.get(name, [])}
        root = [t for t in dict.fromkeys(root) if t not in placed]
        units += [root] if root else []
    return units


def _position(plan: Plan, i: int) -> int:
    """Pipeline position (rank group) of stage ``i``: ``i`` unless the plan is chunked."""
    return chunk_position(plan.schedule, i, plan.num_positions) if plan.chunked else i


def _chunks(plan: Plan, i: int) -> list[Stage]:
    """The stages on stage ``i``'s ranks (its model chunks), in model order."""
    return [s for k, s in enumerate(plan.stages) if _position(plan, k) == _position(plan, i)]


def _first_chunk(plan: Plan, i: int) -> bool:
    return _chunks(plan, i)[0] is plan.stages[i]


def _drop_last_all_reduces(out: dict[tuple, int], n: int) -> None:
    """Under full recompute a block's last forward all-reduce is not repeated (module docstring)."""
    for key in [k for k in out if k[4].startswith("recomputed: ") and k[0] == "all_reduce"]:
        take = min(n, out[key])
        out[key] -= take
        n -= take
        if not out[key]:
            del out[key]
        if not n:
            return


def _p2p(out: dict[tuple, int], facts: GraphFacts, plan: Plan, i: int, item: int) -> None:
    stages, m = plan.stages, plan.num_micro_batches
    s = stages[i]
    seq = int(plan.training.get("seq_len", 1))
    runner = runner_kind(plan)
    mine = _ranges(plan, s)[0]
    for j, direction in ((i - 1, "from"), (i + 1, "to")):
        if not 0 <= j < len(stages) or _position(plan, j) == _position(plan, i):  # a chunk hand-off is local
            continue
        per_sample = facts.boundary_elems(stages[min(i, j)].layers[-1], seq) * item
        if runner == "torch_pipeline":
            n = mine[1] - mine[0]
            _add(out, "p2p", "pp", per_sample * n, m, "forward", f"activation {direction} stage {j}")
            _add(out, "p2p", "pp", per_sample * n, m, "backward", f"activation gradient {direction} stage {j}")
            continue
        other = stages[j]
        for lo, hi in _ranges(plan, other):
            rows = min(hi, mine[1]) - max(lo, mine[0])
            if rows > 0:  # tp rank 0 receives from / sends to tp rank 0; the sender side sends to every tp rank
                fan = int(other.tp)
                fwd, bwd = (1, fan) if direction == "from" else (fan, 1)
                _add(out, "p2p", "pp", per_sample * rows, m * fwd, "forward", f"activation {direction} stage {j}")
                _add(out, "p2p", "pp", per_sample * rows, m * bwd, "backward", f"gradient {direction} stage {j}")


def _ranges(plan: Plan, s: Stage) -> list[tuple[int, int]]:
    out, lo = [], 0
    for n in shares(s, plan.micro_batch_size):
        out.append((lo, lo + n))
        lo += n
    return out


def _tied(out: dict[tuple, int], facts: GraphFacts, plan: Plan, i: int) -> None:
    """A parameter read by layers of more than one stage (module docstring)."""
    where = {name: k for k, st in enumerate(plan.stages) for name in st.layers}
    s = plan.stages[i]
    for t, users in facts.users.items():
        ks = sorted({where[u] for u in users if u in where})
        holders = {_position(plan, k) for k in ks}  # chunks of one rank share the parameter itself
        if len(holders) < 2 or i not in ks or any(_position(plan, k) == _position(plan, i) for k in ks if k < i):
            continue
        full = F32 * _numel(facts.graph, t)
        tp = _tp_factor(s, facts.names(t))
        if s.dp > 1 and s.zero_stage > 0:
            _add(out, "all_gather", "dp", full / tp, 1, "optimizer", f"tied {facts.fqn(t)}: full gradient (dp)")
        if tp > 1:
            _add(out, "all_gather", "tp", full, 1, "optimizer", f"tied {facts.fqn(t)}: full gradient (tp)")
        _add(out, "all_reduce", "tied", full, 1, "optimizer", f"tied {facts.fqn(t)}: gradient sum over its stages")


def complete(plan: Plan, graph: Graph, batch_scale: float = 1.0) -> Plan:
    """``plan`` with every stage's records completed by :func:`stage_collectives`."""
    import dataclasses

    facts = GraphFacts(graph)
    stages = tuple(
        dataclasses.replace(s, collectives=stage_collectives(facts, plan, i, batch_scale))
        for i, s in enumerate(plan.stages)
    )
    return dataclasses.replace(plan, stages=stages)


def summary(collectives: Sequence[Collective]) -> dict[str, dict[str, float]]:
    """Records folded to ``kind@axis`` -> {count, bytes (total per step)}: what a run and a rehearsal
    are compared with."""
    out: dict[str, dict[str, float]] = {}
    for c in collectives:
        e = out.setdefault(f"{c.kind}@{c.axis}", {"count": 0, "bytes": 0.0})
        e["count"] += int(c.count)
        e["bytes"] += float(c.bytes) * int(c.count)
    return dict(sorted(out.items()))


# ---- memory beyond tensors and host memory (issue 33 item 4) ----------------------------------------
# The stage's process on the host, before any parameter is filled: the interpreter, torch, the model's
# library, the program, the meta model and the set-up stage's structures (the rehearsal's roles of a gpt2
# tp2 x pp2 plan measured 0.47-0.49 GiB; a GPU process also maps the CUDA libraries, not measured here).
# The stated constant of the host-peak bound.
HOST_BASE_BYTES = 2 * 2**30


def communicators(stage: Stage) -> int:
    """Process groups the stage's rank issues collectives on, as its records name them: one per axis
    (``tp``, ``dp``, ``world``, ``tied``), and one per pipeline neighbour (torch keeps a communicator per
    send/receive pair)."""
    axes = {c.axis for c in stage.collectives if c.axis != "pp"}
    peers = {c.reason.rsplit("stage ", 1)[-1] for c in stage.collectives if c.axis == "pp"}
    return len(axes) + len(peers)


def _device(plan: Plan, name: str) -> Any:
    """The plan's device type ``name`` (its cluster spec), as ``device_reserve`` reads it."""
    import types

    for g in plan.cluster.get("spec", {}).get("groups", []):
        d = g["device"]
        if d["name"] == name:
            return types.SimpleNamespace(name=name, kind=d.get("kind", "gpu"), memory_bytes=float(d["memory_bytes"]))
    return None


def host_memory(facts: GraphFacts, plan: Plan, i: int) -> dict[str, float]:
    """The host peak of a rank of stage ``i`` under the one setup path (``backends/torch/materialize``):
    one parameter's full f32 value at a time, cut to this rank's shard; the largest parameter and its
    shard bound it, above :data:`HOST_BASE_BYTES`. A CPU rank's shards live on the host too (``to_empty``
    on the CPU): all of them are added there."""
    s = _group_stage(plan, i)  # a rank group holds every chunk of its position
    held = {t for c in _chunks(plan, i) for name in c.layers for t in facts.params.get(name, [])}
    fsdp = s.dp if s.dp > 1 and s.zero_stage >= 1 else 1
    full, shard, total = 0.0, 0.0, 0.0
    for t in held:
        b = float(F32 * _numel(facts.graph, t))
        sh = b / (_tp_factor(s, facts.names(t)) * fsdp)
        total += sh
        if b + sh > full + shard:
            full, shard = b, sh
    devs = [_device(plan, n) for n in dict.fromkeys(s.replica_device_types or (s.device_type,))]
    on_host = total if any(d is not None and d.kind == "cpu" for d in devs) else 0.0
    return {
        "base": float(HOST_BASE_BYTES),
        "largest_parameter": full,
        "its_shard": shard,
        "shards_on_host": on_host,
        "bytes": HOST_BASE_BYTES + full + shard + on_host,
    }


def memory_items(plan: Plan, graph: Graph | None = None) -> Plan:
    """``plan`` with each stage's memory beyond tensors (``device_reserve.items``: CUDA context, NCCL
    buffers of :func:`communicators`, allocator margin on its ``memory_bytes``) per device type it runs
    on, as ``predicted["memory_beyond_tensors"]``, and (torch plans, given the graph) the host peak a
    rank of it may reach while it is set up (:func:`host_memory`) as ``predicted["host_memory"]``."""
    from partita import device_reserve

    facts = GraphFacts(graph) if graph is not None and plan.model.get("framework", "torch") == "torch" else None
    stages = []
    for i, s in enumerate(plan.stages):
        pred: dict[str, Any] = dict(s.predicted)
        beyond: dict[str, dict[str, float]] = {}
        for name in dict.fromkeys(s.replica_device_types or (s.device_type,)):
            dev = _device(plan, name)
            if dev is not None:
                beyond[name] = device_reserve.items(dev, float(pred.get("memory_bytes", 0.0)), communicators(s))
        pred["memory_beyond_tensors"] = beyond
        if facts is not None:
            pred["host_memory"] = host_memory(facts, plan, i)
        stages.append(dataclasses.replace(s, predicted=pred))
    return dataclasses.replace(plan, stages=tuple(stages))
