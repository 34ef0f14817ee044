"""Collective counting: what a training step really communicated, next to what the program predicts.

Used by ``torch_train.py`` around each step (:class:`CollectiveCounter`) and by
``backends/torch/emit.py``, which writes :func:`predict_stage` into the program as
``PROGRAM["predicted_collectives"]``; ``torch_train`` reports :func:`compare` of the two.

Measured: :class:`CollectiveCounter` is a ``TorchDispatchMode`` (through ``frontends/torch_shim.py``;
``CommDebugMode`` cannot be used: it counts no send/recv, and FACTS.md records it crashing in
FSDP2 hooks) recording every op of the ``c10d`` (eager ``dist.*``, FSDP2, pipelining) and
``_c10d_functional`` (DTensor) namespaces: kind and bytes of the full tensor (all-gather output,
reduce-scatter input). On an op with DTensor arguments it steps aside (``NotImplemented``) so that
DTensor runs first and the mode then sees the collectives DTensor's redistributions issue; without
that, the mode would see the DTensor op and none of its communication.

Predicted, per stage and step, as *this runtime* issues the plan's layout (per kind, the rank
``ranks[0]`` of the stage is the one reported):

* dp, ZeRO-0: one all-reduce of the flattened gradients (``torch_parallel.all_reduce_grads``),
  as the plan prices it;
* dp, ZeRO-1/2/3 (FSDP2, one unit per block + the stage root, ``U`` units; ``m`` micro-batches):
  ZeRO-1 all-gathers ``U`` and reduce-scatters ``U`` (parameters stay gathered and gradients
  accumulate unsharded over the step); ZeRO-2 all-gathers ``U``, reduce-scatters ``m U``;
  ZeRO-3 all-gathers ``2 m U`` (forward and backward) and reduce-scatters ``m U``. The plan's
  ``Stage.collectives`` has one bucketed reduce-scatter (ZeRO-1: 1, ZeRO-2/3: ``m``) and prices
  the parameter gathers elsewhere; FSDP2 issues them per unit;
* tp: per micro-batch, from the module roles (``torch_tp.tp_collectives``); the forward ones
  twice for blocks under full recompute (selective recompute saves the collectives' outputs);
* pipeline: every send and receive of this rank (activations forward, their gradients back);
* a parameter tied across stages (GPT-2's ``wte``/``lm_head``): one all-reduce, plus one
  all-gather per mesh axis it is sharded on in this stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from partita.backends.torch.schedule import replica_ranges
from partita.frontends.torch_shim import TorchDispatchMode

KINDS = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "p2p",
    "recv_": "p2p",
    "recv_any_source_": "p2p",
}
_NOT_COMM = ""
_KIND_OF: dict[Any, str] = {}  # OpOverload -> kind ("" for every other op): one dict lookup per op


def _kind(func: Any) -> str:
    kind = _KIND_OF.get(func)
    if kind is None:
        ns = func.namespace
        kind = KINDS.get(_opname(func), _NOT_COMM) if ns in ("c10d", "_c10d_functional") else _NOT_COMM
        _KIND_OF[func] = kind
    return kind


def _opname(func: Any) -> str:
    return str(func.overloadpacket.__name__)  # "allreduce_" for c10d.allreduce_.default


def tensor_bytes(t: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors; 0 for anything else."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: step()`` then ``c.summary()`` -> {kind: {count, bytes}}."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled
        self.events: list[tuple[str, int]] = []

    def __enter__(self) -> CollectiveCounter:
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if DTensor in types:
            return NotImplemented  # let DTensor run; its collectives come back through this mode
        kind = _KIND_OF.get(func)
        if kind is None:
            kind = _kind(func)
        if kind:
            self.events.append((kind, op_bytes(_opname(func), args)))
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for kind, nbytes in self.events:
            e = out.setdefault(kind, {"count": 0, "bytes": 0})
            e["count"] += 1
            e["bytes"] += nbytes
        return dict(sorted(out.items()))


def op_bytes(op: str, args: Sequence[Any]) -> int:
    """Bytes of the full tensor a collective moves: all-gather output, reduce-scatter input (also used by
    ``rehearse.py``, so the run and the rehearsal count bytes alike)."""
    if not args:
        return 0
    if op in ("_reduce_scatter_base_", "reduce_scatter_"):
        return tensor_bytes(args[1])
    if op in ("all_gather_into_tensor",):
        return tensor_bytes(args[0]) * int(args[1])
    return tensor_bytes(args[0])


def predicted_summary(collectives: Sequence[Any]) -> dict[str, dict[str, float]]:
    """A plan stage's ``Collective`` records folded to {kind: {count, bytes}} per step (as planned)."""
    out: dict[str, dict[str, float]] = {}
    for c in collectives:
        e = out.setdefault(c.kind, {"count": 0, "bytes": 0.0})
        e["count"] += int(c.count)
        e["bytes"] += float(c.bytes) * int(c.count)
    return dict(sorted(out.items()))


def _num_peers(other: Mapping[str, Any], mine: tuple[int, int], all_tp: bool) -> int:
    """Ranks of ``other`` that exchange samples with replica range ``mine`` (P2PPipeline's rule)."""
    n = 0
    for lo, hi in replica_ranges(other["shares"]):
        if max(lo, mine[0]) < min(hi, mine[1]):
            n += int(other["tp"]) if all_tp else 1
    return n


def predict_stage(
    stages: Sequence[Mapping[str, Any]],
    index: int,
    *,
    runner: str,
    num_micro_batches: int,
    tp: Mapping[str, Mapping[str, int]] | None,
    tp_block: Mapping[str, Mapping[str, int]] | None = None,
    num_units: int = 1,
    tied_sharded_axes: int | None = None,
    clip_norm: bool = False,
    loss_scale: bool = False,
) -> dict[str, dict[str, int]]:
    """Collectives per step on rank ``stages[index]["ranks"][0]`` (module docstring).

    ``stages``: the program's stage dicts (dp, tp, zero_stage, recompute, shares, ranks). ``tp`` /
    ``tp_block``: ``torch_tp.tp_collectives`` of all of the stage's tp modules / of those inside
    blocks (None: roles unknown, tp collectives not predicted). ``num_units``: FSDP units (blocks +
    root). ``tied_sharded_axes``: None when the stage holds no parameter tied to another stage,
    else the number of mesh axes that parameter is sharded on here.
    """
    s, m = stages[index], num_micro_batches
    out: dict[str, int] = {}

    def add(kind: str, n: int) -> None:
        if n:
            out[kind] = out.get(kind, 0) + n

    dp, zero = int(s["dp"]), int(s["zero_stage"])
    if dp > 1 and zero == 0:
        add("all_reduce", 1)
    elif dp > 1:
        u = num_units
        add("all_gather", {1: u, 2: u, 3: 2 * m * u}[zero])
        add("reduce_scatter", u if zero == 1 else m * u)
    if int(s["tp"]) > 1 and tp is not None:
        again = tp_block if (s["recompute"] == "full" and tp_block) else {}
        for kind, n in tp.get("forward", {}).items():
            add(kind, m * (n + again.get("forward", {}).get(kind, 0)))
        for kind, n in tp.get("backward", {}).items():
            add(kind, m * n)
    n = len(stages)
    if n > 1 and runner == "torch_pipeline":
        add("p2p", 2 * m * ((index > 0) + (index < n - 1)))
    elif n > 1:
        mine = replica_ranges(s["shares"])[0]
        prev = stages[index - 1] if index > 0 else None
        nxt = stages[index + 1] if index < n - 1 else None
        if prev is not None:  # receive activations from tp0 of each replica, send gradients to all tp ranks
            add("p2p", m * (_num_peers(prev, mine, False) + _num_peers(prev, mine, True)))
        if nxt is not None:  # send activations to all tp ranks, receive gradients from tp0
            add("p2p", m * (_num_peers(nxt, mine, True) + _num_peers(nxt, mine, False)))
    if tied_sharded_axes is not None:
        add("all_reduce", 1)
        add("all_gather", tied_sharded_axes)
    if clip_norm:  # gradient clipping: one all-reduce of the squared norm over every rank (torch/optim.py)
        add("all_reduce", 1)
    if loss_scale:  # f16 loss scaling: one all-reduce of the overflow flags over every rank (torch/optim.py)
        add("all_reduce", 1)
    return {k: {"count": v} for k, v in sorted(out.items())}


def counted_step(step: int, start: int, steps: int) -> bool:
    """Whether the training loop should count collectives at ``step`` (0-based; run covers [start, steps)).

    The first and the last step of a run: counting puts a Python dispatch mode under every op
    (``bench/runtime_overhead.py`` measured 10-60% slower steps on CPU), and the collectives of a
    step do not change from step to step once the first one has run (pipelining infers shapes at
    its first step, so the last step is the one compared with the prediction).
    """
    return step == start or step == steps - 1


def compare(measured: Mapping[str, Mapping[str, float]], predicted: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Human-readable mismatches in collective counts per kind ([] when they agree)."""
    problems = []
    for kind in sorted(set(measured) | set(predicted)):
        got = int(measured.get(kind, {}).get("count", 0))
        want = int(predicted.get(kind, {}).get("count", 0))
        if got != want:
            problems.append(f"{kind}: measured {got}, predicted {want}")
    return problems
