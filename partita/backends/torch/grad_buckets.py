"""The ZeRO-0 data-parallel gradient sync in buckets, overlapped with the stage's last backward (issue 32 item 1).

Where it sits: the generated program's ``setup_stage_<i>`` writes the plan's ``Stage.grad_buckets`` literally
into a :class:`GradBuckets` (``backends/torch/emit.py``); ``torch_train.forward_backward`` attaches it to the
stage's module before the schedule and calls :meth:`GradBuckets.finish` after it, before the tied-weight
sync, gradient clipping and the optimizer step. The search prices this sync as overlapped
(``search/pipeline/stage_ranges.py``: ``exposed = max(sync / n, sync - window)``, the buckets in flight as
the copy in memory), the plan's records list one all-reduce per bucket in phase ``backward``
(``search/program/records.py``), and ``partita rehearse`` checks that each was issued inside the backward.

How, as DDP does it: a post-accumulate-grad hook on every parameter counts the gradient accumulations of
the step. Every micro-batch's backward on the stage (a plain backward, or the B and W of a split one,
``wsplit.py``) accumulates each parameter it reaches exactly once (autograd sums the uses of a parameter
read twice, GPT-2's tied ``wte`` / ``lm_head``, before its one accumulation), so a parameter's gradient is
final at its ``num_micro_batches``-th accumulation: in the stage's last backward action, whichever runner
runs the schedule (``LocalSchedule``, ``TorchPipeline``, ``P2PPipeline``). When every parameter of a
bucket is final, its gradients are flattened (one copy per dtype; a bucket of one parameter, one larger than
the cap, is synced in place), and ``dist.all_reduce(SUM,
async_op=True)`` is issued over the stage's replicas, buckets strictly in plan order on every rank (a
collective's order must agree across ranks). At most ``GRAD_BUCKETS_IN_FLIGHT`` copies are held: issuing
one more first waits for the oldest and copies it back (on CUDA ``wait`` only orders the compute stream
after the NCCL kernel: the backward stalls only when the sync falls behind it). :meth:`finish` issues
a bucket the backward never completed (a parameter without a gradient this step: that bucket is then
exposed, and the rehearsal reports it), waits for all and copies back.

The sum semantics of ``parallel.all_reduce_grads`` are kept (a sum, not a mean: each replica's loss is
pre-weighted by its batch share). A tensor-parallel (DTensor) gradient is first given its parameter's
placements (``parallel.align_grads``: R -> S(d) is a local slice) and its local shard is synced.

Model chunks under interleaved 1F1B (one module for the rank group's chunks, ``chunks.py``): every
parameter belongs to one chunk, whose backward actions accumulate it once per micro-batch, so the same
count makes it final in its chunk's last backward. The rank's buckets are its chunks' buckets, the last
chunk's first (``chunks.physical_plan``): the last micro-batch's backward runs the chunks from the model's
end down, so each chunk's buckets are issued from its own last backward while the lower chunks' backward
runs on (the order every rank issues them in agrees). A rank group whose chunks share a parameter (one
accumulation per chunk and micro-batch) and ZB-V's chunks (whose gradients are made in the deferred W
actions, a window the stage prices do not hold: ``plan.flat_sync_chunks``) keep the flat sync after the
schedule (``parallel.all_reduce_grads``), and so does the JAX program (one flattened ``psum`` in its
update, ``backends/jax/train._flat_psum``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from partita.errors import PlanError
from partita.plan import GRAD_BUCKETS_IN_FLIGHT


def _local(p: nn.Parameter) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    if isinstance(g, DTensor):
        with torch.no_grad():
            return g.to_local()  # the local shard itself: the copy back reaches the gradient
    return g


class GradBuckets:
    """``Stage.grad_buckets`` (parameter names, the order the backward finishes them) all-reduced (SUM) over
    the stage's replicas inside its last backward (module docstring)."""

    def __init__(self, buckets: Sequence[Sequence[str]], num_micro_batches: int, stage_index: int = 0) -> None:
        self.names = [tuple(b) for b in buckets]
        self.m = int(num_micro_batches)
        self.stage = stage_index
        self.group: Any = None
        self.params: list[list[nn.Parameter]] | None = None
        self._of: dict[int, int] = {}  # id(parameter) -> its bucket
        self._count: dict[int, int] = {}
        self._left: list[int] = []
        self._next = 0  # the next bucket to issue (plan order)
        self._flight: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self.issued_in_backward = 0  # buckets of the last step issued from the hooks (the rest at finish)

    def attach(self, module: nn.Module, group: Any) -> None:
        """Before each step: the group to sync over; the first time, hook the stage's parameters (they exist by
        now: after ``to_empty``)."""
        self.group = group
        self.issued_in_backward = 0
        if self.params is not None:
            return
        named = dict(module.named_parameters(remove_duplicate=False))
        missing = [n for b in self.names for n in b if n not in named]
        if missing:
            raise PlanError(
                f"stage {self.stage}: the plan's gradient buckets name {missing[:3]} ({len(missing)} in all), which the "
                "stage's module does not hold.",
                "recompile the plan for this model (partita compile), then emit the program again.",
            )
        self.params = []
        for k, b in enumerate(self.names):
            ps: list[nn.Parameter] = []
            for n in b:
                p = named[n]
                if id(p) not in self._of:  # a tied parameter named twice is synced once
                    self._of[id(p)] = k
                    ps.append(p)
            self.params.append(ps)
        left = sorted({n for n, p in module.named_parameters() if p.requires_grad and id(p) not in self._of})
        if left:
            raise PlanError(
                f"stage {self.stage}: parameters {left[:3]} ({len(left)} in all) are in no gradient bucket of the plan, "
                "so their gradients would never be synced over the replicas.",
                "recompile the plan for this model (partita compile), then emit the program again.",
            )
        for ps in self.params:
            for p in ps:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._accumulated)
        self._reset()

    def _reset(self) -> None:
        assert self.params is not None
        self._count = {}
        self._left = [sum(1 for p in ps if p.requires_grad) for ps in self.params]
        self._next = 0

    def _accumulated(self, p: torch.Tensor) -> None:
        n = self._count.get(id(p), 0) + 1
        self._count[id(p)] = n
        if n != self.m:
            return
        self._left[self._of[id(p)]] -= 1
        while self._next < len(self._left) and self._left[self._next] == 0:  # in plan order, as every rank does
            self._issue(self._next)
            self.issued_in_backward += 1
            self._next += 1

    def _issue(self, k: int) -> None:
        assert self.params is not None
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params[k]:
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)  # parallel.align_grads, for this parameter
            local = _local(p)
            if local is not None:
                by_dtype.setdefault(local.dtype, []).append(local)
        for grads in by_dtype.values():
            while len(self._flight) >= GRAD_BUCKETS_IN_FLIGHT:
                self._complete(self._flight.pop(0))
            if len(grads) == 1 and grads[0].is_contiguous():  # one parameter (above the cap): in place, no copy
                work = dist.all_reduce(grads[0], group=self.group, async_op=True)
                self._flight.append((work, grads[0], []))
                continue
            with torch.no_grad():
                flat = torch.cat([g.reshape(-1) for g in grads])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._flight.append((work, flat, grads))

    @staticmethod
    def _complete(entry: tuple[Any, torch.Tensor, list[torch.Tensor]]) -> None:
        work, flat, grads = entry
        work.wait()
        offset = 0
        with torch.no_grad():
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def finish(self) -> None:
        """After the schedule: issue what the backward left (exposed), wait for every bucket, copy back."""
        if self.params is None:
            raise PlanError(
                f"stage {self.stage}: the gradient buckets were never attached to the stage's module.",
                "call attach(module, group) before the step (torch_train.forward_backward does).",
            )
        while self._next < len(self.names):
            self._issue(self._next)
            self._next += 1
        while self._flight:
            self._complete(self._flight.pop(0))
        self._reset()
