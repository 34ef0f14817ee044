"""Step runners: one training step's forwards and backwards over micro-batches, per layout.

Called by ``torch_train.py``; built by the generated program (``backends/torch/emit.py``) through
:func:`make_runner`. Three runners, chosen from the plan's stage shapes:

* :class:`LocalSchedule` - one stage: gradient accumulation over the micro-batches;
* :class:`TorchPipeline` - every stage has the same ``(dp, tp)`` and batch shares: one
  ``torch.distributed.pipelining.PipelineStage`` per rank on a "pp" group joining the ranks at the
  same mesh coordinate, run by ``ScheduleGPipe`` / ``Schedule1F1B``;
* :class:`P2PPipeline` - stages of different shapes (stage 0 on 2 ranks with tp=2, stage 1 on 1
  rank): ``torch.distributed.pipelining`` assumes one stage per rank of a pp group with equal
  shapes, so this runner moves boundary activations with explicit ``dist.isend`` / ``dist.recv``,
  re-slicing samples between replicas of different data-parallel widths, in GPipe or 1F1B order.

Every runner takes ``loss_fn(output, target)`` already divided by the global token count, so the
sum over replicas and micro-batches is the global mean loss and gradient syncs are plain sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def zero_micro_batch(fsdp_modules: Sequence[Any], zero_stage: int, k: int, num_micro_batches: int) -> None:
    """Set FSDP2 up for micro-batch ``k``'s backward as the stage's ZeRO level says.

    * ZeRO-1: gradients accumulate unsharded; one reduce-scatter after the last micro-batch; the
      parameters stay gathered for the whole step (optimizer state is on the dp shard).
    * ZeRO-2: gradients are reduce-scattered every micro-batch (sharded gradients); parameters stay
      gathered for the whole step.
    * ZeRO-3: both every micro-batch (parameters re-gathered in forward and in backward).
    """
    last = k == num_micro_batches - 1
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
            zero_micro_batch(self.fsdp, self.zero, k, self.m)
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
    """Pipeline over stages of different ``(dp, tp)``, with explicit point-to-point transfers.

    Boundary tensors are full (tp-replicated) activations of a replica's samples. Forward: rank
    ``(i, 0)`` of each sending replica sends the samples each receiving replica needs to every tp
    rank of that replica. Backward mirrors it: rank ``(k, 0)`` of each receiving replica returns the
    input gradient to every tp rank of the sending replica (all of them run the SPMD backward).
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
    ) -> None:
        self.module, self.loss_fn, self.m, self.fsdp = module, loss_fn, num_micro_batches, fsdp_modules
        self.zero = zero_stage
        self.s, self.n, self.schedule, self.device = stage_index, len(stages), schedule, device
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

    def _order(self) -> list[tuple[str, int]]:
        m = self.m
        if self.schedule == "gpipe":
            return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
        warm = min(self.n - self.s - 1, m)
        order = [("F", k) for k in range(warm)]
        for k in range(m - warm):
            order += [("F", warm + k), ("B", k)]
        return order + [("B", k) for k in range(m - warm, m)]

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        losses, handles = [], []
        first, last = self.s == 0, self.s == self.n - 1
        for action, k in self._order():
            if action == "F":
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
            else:
                x, out = saved.pop(k)
                zero_micro_batch(self.fsdp, self.zero, k, self.m)
                if last:
                    out.backward()
                else:
                    torch.autograd.backward(out, self._recv(self.bwd_recv, self.out_meta, 2 * k + 1))
                if not first:
                    handles += self._send(x.grad, self.bwd_send, 2 * k + 1)
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
