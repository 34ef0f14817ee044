"""The MoE load-balancing (auxiliary) loss of a Hugging Face model, kept in training (issue 16).

Sits beside ``models/hf.py``; called by ``backends/torch/train.py`` for the program's loss and for
the single-device reference alike. A config with ``output_router_logits: true`` and a positive
``router_aux_loss_coef`` (Mixtral, Qwen2-MoE, ...) asks for ``coef * aux`` on top of the language
loss, ``aux`` being the model's own ``load_balancing_loss_func`` (from the model's modeling module)
over the router logits of every MoE layer.

That function is a product of two means over all the tokens it is given, so its value depends on
which tokens share a call: a micro-batch, a data-parallel replica and the whole batch each give
another number. To make it independent of the layout, it is applied **per sequence** (the HF
function on one sample's router logits of every layer) and averaged over the global batch: any
micro-batching and any data-parallel split sum to the same loss, so a parallel run equals the
single-device run. A forward hook on each router (the ``gate`` beside an ``experts`` module) keeps
its latest logits (one entry per router, overwritten: a recomputed forward in backward replaces
them before the next micro-batch reads them).

The function couples every MoE layer of a sample, so the layers must run in one pipeline stage:
``hf.summary`` marks such a model ``no_pipeline`` (the search keeps one stage) and
:func:`router_aux` refuses a plan of several stages.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partita.errors import PlanError

NO_PIPELINE = (
    "the MoE load-balancing loss (output_router_logits) couples the router logits of every layer of a "
    "sample, so all MoE layers run in one pipeline stage"
)


def aux_coef(config: Any) -> float:
    """``router_aux_loss_coef`` when the config asks for the auxiliary loss, else 0."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


class RouterAux:
    """Hooks on a model's routers and the per-sequence load-balancing loss of their latest logits."""

    def __init__(self, model: nn.Module, coef: float, global_batch: int) -> None:
        cfg: Any = model.config
        self.coef, self.global_batch = coef, global_batch
        self.num_experts = int(getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0))
        self.top_k = int(cfg.num_experts_per_tok)
        self.fn = sys.modules[type(model).__module__].load_balancing_loss_func
        self.latest: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        for path, mod in model.named_modules():
            gate, experts = getattr(mod, "gate", None), getattr(mod, "experts", None)
            if isinstance(gate, nn.Module) and isinstance(experts, nn.Module):
                self.order.append(path)
                gate.register_forward_hook(self._hook(path))

    def _hook(self, path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            self.latest[path] = out[0] if isinstance(out, (tuple, list)) else out

        return hook

    def loss(self, num_samples: int) -> torch.Tensor | None:
        """``coef * sum over the micro-batch's samples of aux(sample) / global batch`` from the logits
        the routers produced in the last forward (None when no router of this model ran)."""
        logits = [self.latest.pop(p) for p in self.order if p in self.latest]
        if not logits:
            return None
        per_sample = [lg.reshape(num_samples, -1, lg.shape[-1]) for lg in logits]
        total = sum(
            self.fn(tuple(x[b] for x in per_sample), self.num_experts, self.top_k, None) for b in range(num_samples)
        )
        return total * (self.coef / self.global_batch)


def router_aux(
    model: nn.Module, global_batch: int, num_stages: int = 1
) -> Callable[[Callable[[Any, torch.Tensor], torch.Tensor]], Callable[[Any, torch.Tensor], torch.Tensor]]:
    """A wrapper adding the model's load-balancing loss to a loss function when its config asks for it
    (module docstring; hooks are put on the routers once, here), the identity otherwise. PlanError for
    a plan of several stages."""
    coef = aux_coef(getattr(model, "config", None))
    if coef <= 0:
        return lambda loss_fn: loss_fn
    if num_stages > 1:
        raise PlanError(
            f"this plan has {num_stages} pipeline stages, but {NO_PIPELINE}.",
            "recompile the plan (the search keeps such a model in one stage), or set output_router_logits "
            "to false in config.json to train without the auxiliary loss.",
        )
    aux = RouterAux(model, coef, global_batch)

    def wrap(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        def loss_with_aux(out: Any, labels: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(out, labels)
            extra = aux.loss(int(labels.shape[0]))
            return loss if extra is None else loss + extra

        return loss_with_aux

    return wrap
