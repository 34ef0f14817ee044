"""Step runners: one training step's forwards and backwards over micro-batches, per layout.

Called by ``torch_train.py``; built by the generated program (``backends/torch/emit.py``) through
:func:`make_runner`. Three runners, chosen from the plan's stage shapes:

* :class:`LocalSchedule` - one stage: gradient accumulation over the micro-batches;
* :class:`TorchPipeline` - every stage has the same ``(dp, tp)`` and batch shares: one
  ``torch.distributed.pipelining.PipelineStage`` per rank on a "pp" group joining the ranks at the
  same mesh coordinate, run by ``ScheduleGPipe`` / ``Schedule1F1B``;
* :class:`P2PPipeline` - stages of different shapes (stage 0 on 2 ranks with tp=2, stage 1 on 1
  rank), ZeRO-2/3 stages, and every schedule beyond GPipe / 1F1B: ``torch.distributed.pipelining``
  assumes one stage per rank of a pp group with equal shapes, so this runner moves boundary
  activations with explicit ``dist.isend`` / ``dist.recv``, re-slicing samples between replicas of
  different data-parallel widths, and executes the rank's action list (``search/schedule.py``'s
  ``pipeline_actions``, printed in the program): the same list the cost model simulates. A
  schedule that splits the backward (``zb_h1``) runs B and W apart (``wsplit.py``).

Every runner takes ``loss_fn(output, target)`` already divided by the global token count, so the
sum over replicas and micro-batches is the global mean loss and gradient syncs are plain sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.backends.torch import wsplit
from partita.errors import PlanError
from partita.frontends import torch_shim

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def zero_micro_batch(fsdp_modules: Sequence[Any], zero_stage: int, last: bool) -> None:
    """Set FSDP2 up for a micro-batch's backward as the stage's ZeRO level says (``last``: the
    stage's last backward of the step).

    * ZeRO-1: gradients accumulate unsharded; one reduce-scatter after the last micro-batch; the
      parameters stay gathered for the whole step (optimizer state is on the dp shard).
    * ZeRO-2: gradients are reduce-scattered every micro-batch (sharded gradients); parameters stay
      gathered for the whole step.
    * ZeRO-3: both every micro-batch (parameters re-gathered in forward and in backward).
    """
    for m in fsdp_modules:
        m.set_requires_gradient_sync(last or zero_stage >= 2)
        m.set_reshard_after_backward(last or zero_stage >= 3)


def replica_ranges(shares: Sequence[int]) -> list[tuple[int, int]]:
    """Sample range ``[lo, hi)`` of each dp replica inside one micro-batch."""
    out, lo = [], 0
    for n in shares:
        out.append((lo, lo + n))
        lo += n
    return out


class LocalSchedule:
    """A single-stage plan: forward + backward per micro-batch, grads accumulate."""

    def __init__(
        self,
        module: nn.Module,
        num_micro_batches: int,
        loss_fn: LossFn,
        fsdp_modules: Sequence[Any],
        zero_stage: int = 0,
    ) -> None:
        self.module, self.m, self.loss_fn, self.fsdp = module, num_micro_batches, loss_fn, fsdp_modules
        self.zero = zero_stage

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        losses = []
        for k, (x, y) in enumerate(zip(inputs, targets)):
            zero_micro_batch(self.fsdp, self.zero, k == self.m - 1)
            loss = self.loss_fn(self.module(x), y)
            loss.backward()
            losses.append(loss.detach())
        return losses


class TorchPipeline:
    """Equal-shape stages on torch.distributed.pipelining (PipelineStage + ScheduleGPipe/1F1B)."""

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        schedule: str,
        num_micro_batches: int,
        loss_fn: LossFn,
        input_example: torch.Tensor,
        output_example: torch.Tensor,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        # Shapes are inferred at the first step: static input_args/output_args metadata is built before
        # the schedule sets has_backward (torch 2.13), so output grads would never be sent back.
        del input_example, output_example
        stage = PipelineStage(module, stage_index, num_stages, device, group=group)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        # scale_grads=False: loss_fn is already normalised by the global token count.
        self.schedule = cls(stage, n_microbatches=num_micro_batches, loss_fn=loss_fn, scale_grads=False)
        self.first, self.last = stage_index == 0, stage_index == num_stages - 1

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(torch.cat(list(inputs)))
        elif self.last:
            self.schedule.step(target=torch.cat(list(targets)), losses=losses)
        else:
            self.schedule.step()
        return [x.detach() for x in losses]


class P2PPipeline:
    """Pipeline with explicit point-to-point transfers over stages of any ``(dp, tp)``, executing this
    rank position's action list (``search/schedule.pipeline_actions``).

    Boundary tensors are full (tp-replicated) activations of a replica's samples. Forward: rank
    ``(i, 0)`` of each sending replica sends the samples each receiving replica needs to every tp
    rank of that replica. Backward mirrors it: rank ``(k, 0)`` of each receiving replica returns the
    input gradient to every tp rank of the sending replica (all of them run the SPMD backward).

    ``actions`` is the list the program prints (``"F0.0 F0.1 B0.0 W0.0 ..."``: kind, stage,
    micro-batch). ``F`` runs the forward and sends the output; ``B`` receives the output gradient,
    runs the backward and sends the input gradient; when the schedule splits the backward
    (``zb_h1``), ``B`` computes only the input gradient and ``W`` later the weight gradients of that
    micro-batch (``backends/torch/wsplit.py``: one backward's FLOPs in all). The gradient syncs
    (``train.forward_backward``) run after :meth:`step`, so after the stage's last ``W``.
    """

    def __init__(
        self,
        module: nn.Module,
        stages: Sequence[dict[str, Any]],
        stage_index: int,
        rank: int,
        schedule: str,
        num_micro_batches: int,
        loss_fn: LossFn,
        boundary: Sequence[tuple[torch.Size, torch.dtype]],
        device: torch.device,
        fsdp_modules: Sequence[Any] = (),
        zero_stage: int = 0,
        actions: str | None = None,
    ) -> None:
        self.module, self.loss_fn, self.m, self.fsdp = module, loss_fn, num_micro_batches, fsdp_modules
        self.zero = zero_stage
        self.s, self.n, self.schedule, self.device = stage_index, len(stages), schedule, device
        if actions is None:
            from partita.search.schedule import pipeline_actions

            actions = " ".join(map(str, pipeline_actions(schedule, self.n, num_micro_batches)[stage_index]))
        self.actions = parse_actions(actions, stage_index, num_micro_batches)
        self.split = any(kind == "W" for kind, _ in self.actions)
        if self.split and fsdp_modules and zero_stage >= 2:
            raise PlanError(
                f"stage {stage_index}: schedule {schedule!r} splits the backward, and ZeRO-{zero_stage} would sync "
                "(and reshard) a unit's gradients after every micro-batch's B, before its W has computed them.",
                "recompile with ZeRO-0 or ZeRO-1 for this stage, or with the 1f1b schedule.",
            )
        me = stages[stage_index]
        pos = list(me["ranks"]).index(rank)
        self.i, self.j = pos // me["tp"], pos % me["tp"]
        self.range = replica_ranges(me["shares"])[self.i]
        prev = stages[stage_index - 1] if stage_index > 0 else None
        nxt = stages[stage_index + 1] if stage_index < self.n - 1 else None
        # (peer rank, lo, hi) with lo/hi relative to my replica's sample range.
        self.fwd_recv = _overlaps(prev, self.range, tp0_only=True) if prev else []
        self.fwd_send = _overlaps(nxt, self.range, tp0_only=False) if nxt and self.j == 0 else []
        self.bwd_recv = _overlaps(nxt, self.range, tp0_only=True) if nxt else []
        self.bwd_send = _overlaps(prev, self.range, tp0_only=False) if prev and self.j == 0 else []
        self.in_meta = boundary[stage_index - 1] if prev else None
        self.out_meta = boundary[stage_index] if nxt else None

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        deferred: dict[int, wsplit.Deferred] = {}
        losses, handles = [], []
        first, last = self.s == 0, self.s == self.n - 1
        last_b = [k for kind, k in self.actions if kind == "B"][-1]  # the stage's last backward
        for kind, k in self.actions:
            if kind == "F":
                if first:
                    x = inputs[k]
                else:
                    x = self._recv(self.fwd_recv, self.in_meta, 2 * k)
                    x.requires_grad_(x.is_floating_point())
                out = self.module(x)
                if last:
                    out = self.loss_fn(out, targets[k])
                    losses.append(out.detach())
                else:
                    handles += self._send(out.detach(), self.fwd_send, 2 * k)
                saved[k] = (x, out)
            elif kind == "B":
                x, out = saved.pop(k)
                grad = None if last else self._recv(self.bwd_recv, self.out_meta, 2 * k + 1)
                if self.split:
                    zero_micro_batch(self.fsdp, self.zero, False)  # FSDP2 reduces after the last W (below)
                    dx, deferred[k] = wsplit.backward_input(out, grad, None if first else x)
                else:
                    zero_micro_batch(self.fsdp, self.zero, k == last_b)
                    torch.autograd.backward(out, grad)
                    dx = x.grad
                if not first:  # an output that ignores the input still owes the previous stage a gradient
                    handles += self._send(dx if dx is not None else torch.zeros_like(x), self.bwd_send, 2 * k + 1)
            else:
                deferred.pop(k).run()
        if self.split and self.fsdp:  # ZeRO-1: one reduce-scatter per unit, after the stage's last W
            torch_shim.fsdp_reduce_grads(self.fsdp[-1])  # the stage root, appended last by setup_stage
        for h in handles:
            h.wait()
        return losses

    def _recv(self, peers: list[tuple[int, int, int]], meta: Any, tag: int) -> torch.Tensor:
        shape, dtype = meta
        lo0, hi0 = self.range
        buf = torch.empty((hi0 - lo0, *shape), dtype=dtype, device=self.device)
        for peer, lo, hi in peers:
            piece = torch.empty((hi - lo, *shape), dtype=dtype, device=self.device)
            dist.recv(piece, src=peer, tag=tag)
            buf[lo:hi] = piece
        return buf

    def _send(self, t: torch.Tensor, peers: list[tuple[int, int, int]], tag: int) -> list[Any]:
        return [dist.isend(t[lo:hi].contiguous(), dst=peer, tag=tag) for peer, lo, hi in peers]


def parse_actions(text: str, stage_index: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """``"F0.0 F0.1 B0.0 W0.0 ..."`` (kind, stage, micro-batch) -> ``[(kind, micro-batch)]``, checked:
    every action is this rank's stage, every micro-batch runs F, B and (all or none) W once, in order."""
    out: list[tuple[str, int]] = []
    for word in text.split():
        kind, rest = word[:1], word[1:].split(".")
        ok = len(rest) == 2 and all(v.isdigit() for v in rest)
        stage, micro = (int(rest[0]), int(rest[1])) if ok else (-1, -1)
        if kind not in ("F", "B", "W") or stage != stage_index or not 0 <= micro < num_micro_batches:
            raise PlanError(
                f"pipeline action {word!r} is not one of stage {stage_index}'s F/B/W over {num_micro_batches} "
                "micro-batches.",
                "regenerate the program from its plan (`partita compile`).",
            )
        out.append((kind, micro))
    seen = [tuple(kind for kind, k in out if k == micro) for micro in range(num_micro_batches)]
    if set(seen) - {("F", "B"), ("F", "B", "W")} or len(set(seen)) != 1:
        raise PlanError(
            f"the action list of stage {stage_index} does not run each micro-batch's F, then B (then W) once: {seen}.",
            "regenerate the program from its plan (`partita compile`).",
        )
    return out


def _overlaps(other: dict[str, Any], mine: tuple[int, int], tp0_only: bool) -> list[tuple[int, int, int]]:
    """Ranks of stage ``other`` whose replicas share samples with ``mine``: (rank, lo, hi) local to mine.

    ``tp0_only``: just tp rank 0 of each overlapping replica (the one that sends); otherwise every
    tp rank of it (all of them need the tensor for their SPMD forward/backward).
    """
    out = []
    for r, (lo, hi) in enumerate(replica_ranges(other["shares"])):
        a, b = max(lo, mine[0]), min(hi, mine[1])
        if a >= b:
            continue
        tps = [0] if tp0_only else range(other["tp"])
        for j in tps:
            out.append((other["ranks"][r * other["tp"] + j], a - mine[0], b - mine[0]))
    return out
