"""The training configuration the generated program and the single-device reference both follow.

Read by ``backends/torch/train.py`` (the distributed loop and :func:`~partita.backends.torch.train.reference_run`)
from ``PROGRAM["training"]``, which is the plan's ``training`` record written out literally. Keys
(all optional except the batch ones; defaults keep plans without them as they were):

* ``optimizer``: ``adamw`` (default) / ``adam`` / ``sgd``; ``lr`` (1e-3); ``weight_decay``
  (AdamW 0.01, Adam and SGD 0.0); ``betas`` ([0.9, 0.999]); ``momentum`` (SGD, 0.9);
* ``warmup_steps`` (0): the learning rate rises linearly, ``lr * (t + 1) / warmup_steps``;
* ``lr_decay``: ``constant`` (default) or ``cosine``: after warm-up the rate follows a half cosine from
  ``lr`` down to ``min_lr`` (default ``lr / 10``) at ``decay_steps`` (default: the run's steps);
* ``grad_clip`` (0 = off): clip gradients to this global L2 norm. In a parallel program the norm is one
  float64 all-reduce over every rank (:func:`global_grad_norm`): each rank adds the squares of its
  local gradient shards, divided by the number of ranks that hold the same values, so every
  gradient element counts once. That all-reduce is a collective of the step: the plan records it
  (``search/program/records.py``), and the program's first counted step is compared with that record.
* ``dtype == "f16"``: dynamic loss scaling (:class:`LossScaler`, ``torch.amp.GradScaler`` semantics done
  by hand, since gradients are DTensors / FSDP2 shards): ``init_loss_scale`` (2**16) and
  ``loss_scale_growth_interval`` (2000). The overflow check is one float64 all-reduce over every rank,
  recorded by the plan like the clipping norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from partita.errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "sgd")
DECAYS = ("constant", "cosine")


def check_training(training: Mapping[str, Any]) -> None:
    """Refuse a training record this runtime cannot follow (ConfigError, exit 2)."""
    name = str(training.get("optimizer", "adamw")).lower()
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer {name!r} is not one the torch runtime runs.", f"use one of {OPTIMIZERS}.")
    decay = str(training.get("lr_decay", "constant"))
    if decay not in DECAYS:
        raise ConfigError(f"lr_decay {decay!r} is unknown.", f"use one of {DECAYS}.")
    for key in ("lr", "weight_decay", "grad_clip", "warmup_steps", "min_lr", "init_loss_scale"):
        v = training.get(key)
        if v is not None and (not isinstance(v, (int, float)) or v < 0):
            raise ConfigError(f"training {key}={v!r} must be a non-negative number.", f"set {key} to a number >= 0.")


def make_optimizer(params: Iterable[Any], training: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The plan's optimizer with its learning rate and weight decay (the schedule multiplies ``lr``)."""
    check_training(training)
    name = str(training.get("optimizer", "adamw")).lower()
    lr = float(training.get("lr", 1e-3))
    if name == "sgd":
        momentum = float(training.get("momentum", 0.9))
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=float(training.get("weight_decay", 0.0)))
    betas = tuple(float(b) for b in training.get("betas", (0.9, 0.999)))
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=float(training.get("weight_decay", 0.0)))  # type: ignore[arg-type]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=float(training.get("weight_decay", 0.01)))  # type: ignore[arg-type]


def lr_factor(training: Mapping[str, Any], steps: int) -> Callable[[int], float]:
    """Multiplier of ``lr`` at 0-based step ``t``: linear warm-up, then constant or cosine to ``min_lr``."""
    lr = float(training.get("lr", 1e-3))
    warm = int(training.get("warmup_steps", 0) or 0)
    cosine = str(training.get("lr_decay", "constant")) == "cosine"
    floor = float(training.get("min_lr", lr / 10)) / lr if lr else 0.0
    total = int(training.get("decay_steps", 0) or training.get("steps", 0) or steps)

    def factor(t: int) -> float:
        if t < warm:
            return (t + 1) / warm
        if not cosine:
            return 1.0
        span = max(total - warm, 1)
        frac = min(max(t - warm, 0) / span, 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return factor


def make_scheduler(
    opt: torch.optim.Optimizer, training: Mapping[str, Any], steps: int, extra: Callable[[int], float] | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR of :func:`lr_factor` times the program's own ``lr_lambda`` (1.0 unless edited)."""
    base = lr_factor(training, steps)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: base(t) * (extra(t) if extra else 1.0))


def grad_clip(training: Mapping[str, Any]) -> float:
    return float(training.get("grad_clip", 0.0) or 0.0)


def _replication(p: nn.Parameter, stage_size: int) -> int:
    """How many ranks of the stage hold the same values as this rank's gradient of ``p``."""
    if not isinstance(p, DTensor):
        return stage_size
    mesh = p.device_mesh
    n = stage_size // mesh.size()
    for d, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            n *= mesh.size(d)
    return n


def local_sq_sum(module: nn.Module, stage_size: int, num_holders: Mapping[str, int] | None = None) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (float64, on the CPU)."""
    total = torch.zeros((), dtype=torch.float64)
    holders = num_holders or {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        sq = local.detach().double().pow(2).sum().cpu()
        total += sq / (_replication(p, stage_size) * holders.get(name, 1))
    return total


def global_grad_norm(
    module: nn.Module, stage_size: int, num_holders: Mapping[str, int] | None = None, group: Any = None
) -> float:
    """The L2 norm of all gradients of the model, every element once: one all-reduce over ``group`` (world)."""
    t = local_sq_sum(module, stage_size, num_holders)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return float(t.sqrt())


def clip_(module: nn.Module, max_norm: float, total_norm: float) -> float:
    """Scale every local gradient shard as ``torch.nn.utils.clip_grad_norm_`` does; return the factor."""
    coef = min(max_norm / (total_norm + 1e-6), 1.0)
    if coef < 1.0:
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
    return coef


# torch.amp.GradScaler's defaults: init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0**16, 2.0, 0.5, 2000


def loss_scaling(training: Mapping[str, Any]) -> bool:
    """Whether the plan's training needs dynamic loss scaling (fp16 gradients underflow without it)."""
    return str(training.get("dtype", "f32")) == "f16"


class LossScaler:
    """Dynamic loss scaling as ``torch.amp.GradScaler`` does it, on local gradient shards.

    The loss is multiplied by ``scale`` (a power of two, so scaling and unscaling are exact in
    floating point barring overflow and subnormals); after backward :meth:`unscale_` divides every
    local gradient shard by it and returns this rank's non-finite flag; the caller sums the flags of
    all ranks (one float64 all-reduce) and hands the verdict to :meth:`update`, which skips the
    optimizer step and backs the scale off on overflow, else steps and grows the scale after
    ``growth_interval`` clean steps in a row.
    """

    def __init__(
        self,
        init_scale: float = INIT_SCALE,
        growth_factor: float = GROWTH_FACTOR,
        backoff_factor: float = BACKOFF_FACTOR,
        growth_interval: int = GROWTH_INTERVAL,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ConfigError(
                f"loss scaling init_scale={init_scale}, growth={growth_factor}, backoff={backoff_factor}, "
                f"interval={growth_interval} is not a valid dynamic scale.",
                "use init_loss_scale > 0 and loss_scale_growth_interval >= 1.",
            )
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.num_clean = 0  # clean steps since the last change of scale (GradScaler's growth tracker)

    @staticmethod
    def from_training(training: Mapping[str, Any]) -> LossScaler:
        return LossScaler(
            float(training.get("init_loss_scale", INIT_SCALE) or INIT_SCALE),
            growth_interval=int(training.get("loss_scale_growth_interval", GROWTH_INTERVAL) or GROWTH_INTERVAL),
        )

    def wrap(self, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """``loss_fn`` times the scale current when it is called (f32, so the product does not overflow)."""

        def scaled(out: Any, labels: torch.Tensor) -> torch.Tensor:
            return loss_fn(out, labels).float() * self.scale

        return scaled

    def unscale_(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide every local gradient shard by the scale; this rank's flag: float64 1.0 if any
        gradient element is inf or NaN, else 0.0 (on the CPU, ready for the host all-reduce)."""
        found = False
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    continue
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.div_(self.scale)
                found = found or not bool(torch.isfinite(local).all())
        return torch.tensor(float(found), dtype=torch.float64)

    def update(self, found_inf: bool, opt: torch.optim.Optimizer) -> bool:
        """Step ``opt`` unless some rank found an overflow (then its gradients are dropped); adjust
        the scale as GradScaler.update does. Returns whether the optimizer stepped."""
        if found_inf:
            opt.zero_grad()
            self.scale *= self.backoff_factor
            self.num_clean = 0
            return False
        opt.step()
        self.num_clean += 1
        if self.num_clean == self.growth_interval:
            self.scale *= self.growth_factor
            self.num_clean = 0
        return True
