"""Fused RMSNorm for a stage that computes in a low dtype (issue 32 item 4): what the norm keeps for backward.

Written into the program by ``backends/torch/emit.py`` (``norms.fuse_rms_norms(module)``) for every stage
whose plan dtype is bf16 / f16 (FSDP2's ``MixedPrecisionPolicy`` and ``torch.autocast`` alike), and
applied by ``parallel.reference_forward`` to the single-device reference. Priced by
``search/layer/saved.py`` (``fused_norm_groups``): the norm keeps its input as it arrives and one f32
statistic per row, nothing else.

Hugging Face's RMSNorm (Llama, Mistral, Mixtral, Qwen2/3) up-casts its input to f32 and multiplies in
eager ops, so autograd keeps the f32 input and a low copy of the normalized tensor (4 + 2 bytes an
element under FSDP2's bf16, 4 + 4 under autocast's f32 residual stream). Megatron's fused norm (Apex
``FusedRMSNorm``) keeps the input and the per-row inverse RMS. ``torch.nn.functional.rms_norm`` does that
only in its CUDA kernel (on CPU, and so in the rehearsal, it is a composite of eager ops that keeps f32
copies), so :class:`_RMSNorm` is an autograd function that does the same on every device: forward in
f32, output in the input's dtype; backward recomputes the normalized tensor from the kept input.
Numerics: HF rounds the normalized tensor to the input dtype before the weight product; this rounds
once, after it (the difference is one bf16 rounding, within the parity tolerance).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Hugging Face classes whose forward is ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``
# (the IR pattern saved.py matches). Gemma's ``1 + weight`` and others are left as written.
FUSED_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
    }
)


class _RMSNorm(torch.autograd.Function):
    """``y = (x * rsqrt(mean(x^2) + eps) * w).to(x.dtype)`` computed in f32; keeps ``x`` and ``rsqrt``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            xf = x.to(_wide(x))
            inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = (xf * inv * weight.to(xf.dtype)).to(x.dtype)
        ctx.save_for_backward(x, weight, inv)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight, inv = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            xhat = x.to(inv.dtype) * inv
            g = grad.to(inv.dtype)
            gw = (g * xhat).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
            gx = None
            if ctx.needs_input_grad[0]:
                gn = g * weight.to(inv.dtype)
                gx = (inv * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return gx, None if gw is None else gw.to(weight.dtype), None


def _wide(x: torch.Tensor) -> torch.dtype:
    """f32, or the input's dtype where wider (f64)."""
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused norm (module docstring)."""
    return _RMSNorm.apply(x, weight, eps)


def _fused_forward(mod: nn.Module) -> Any:
    eps = float(getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6)))

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, mod.weight, eps)

    return forward


def fuse_rms_norms(module: nn.Module) -> list[str]:
    """Run every RMSNorm of ``module`` whose class is in :data:`FUSED_CLASSES` as :func:`rms_norm` (its
    ``forward`` replaced on the instance: hooks, parameters and FSDP2 / tp wrapping are untouched).
    Returns the module paths swapped. Idempotent."""
    out = []
    for name, mod in module.named_modules():
        if type(mod).__name__ in FUSED_CLASSES and not getattr(mod, "_partita_fused", False):
            mod.forward = _fused_forward(mod)  # type: ignore[method-assign]
            mod._partita_fused = True  # type: ignore[assignment]
            out.append(name)
        elif getattr(mod, "_partita_fused", False):
            out.append(name)
    return out
