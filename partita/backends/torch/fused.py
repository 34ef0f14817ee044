"""Fused ops for a stage that computes in a low dtype (issue 32 item 4): what they keep for the backward.

Written into the program by ``backends/torch/emit.py`` (``fused.fuse_ops(module)``) for every stage whose
plan dtype is bf16 / f16 (FSDP2's ``MixedPrecisionPolicy`` and ``torch.autocast`` alike), and applied by
``parallel.reference_forward`` to the single-device reference. Priced by ``search/layer/saved.py``
(``fused_norm_groups``, ``fused_swiglu_muls``). Each replaces a module's ``forward`` on the instance
(hooks, parameters, tp and FSDP2 wrapping untouched) with the same function, kept as Megatron-LM keeps it:

* **RMSNorm** (:func:`rms_norm`). Hugging Face's (Llama, Mistral, Mixtral, Qwen2/3) up-casts its input to
  f32 and multiplies in eager ops, so autograd keeps the f32 input and a copy of the normalized tensor
  (4 + 2 bytes an element under FSDP2's bf16, 4 + 4 under autocast's f32 residual stream). Megatron's
  fused norm (Apex ``FusedRMSNorm``) keeps the input and the per-row inverse RMS.
  ``torch.nn.functional.rms_norm`` does that only in its CUDA kernel (on CPU, and so in the rehearsal,
  it is a composite of eager ops that keeps f32 copies), so this is an autograd function that does the
  same on every device: forward in f32, output in the input's dtype; backward recomputes the normalized
  tensor from the kept input. HF rounds the normalized tensor to the input dtype before the weight
  product; this rounds once, after it (one bf16 rounding apart, within the parity tolerance).
* **SwiGLU** (:func:`swiglu`). HF's ``down(act(gate(x)) * up(x))`` keeps gate's output (SiLU's input),
  SiLU's output and up's output (the product's operands): three ``[b, s, f/t]`` tensors. Megatron's
  ``bias_swiglu`` keeps gate's and up's outputs and recomputes SiLU in the backward: two. Its backward runs
  the very ops autograd runs for HF's form, so its gradients are bitwise HF's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Hugging Face classes whose forward is ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``
# (the IR pattern saved.py matches). Gemma's ``1 + weight`` and others are left as written.
RMSNORM_CLASSES = frozenset(
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
    """Run every RMSNorm of ``module`` whose class is in :data:`RMSNORM_CLASSES` as :func:`rms_norm`.
    Returns the module paths swapped. Idempotent."""
    return _swap(module, lambda m: type(m).__name__ in RMSNORM_CLASSES, _fused_forward)


def _swap(module: nn.Module, wanted: Any, make: Any) -> list[str]:
    """Replace the ``forward`` of each submodule ``wanted`` says, on the instance, by ``make(submodule)``
    (hooks, parameters, tp and FSDP2 wrapping untouched; once per submodule); the paths, in order."""
    out = []
    for name, mod in module.named_modules():
        if not wanted(mod):
            continue
        if not getattr(mod, "_partita_fused", False):
            mod.forward = make(mod)
            mod._partita_fused = True
        out.append(name)
    return out


# Hugging Face MLPs whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (with SiLU: the IR pattern
# saved.py matches)
SWIGLU_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_SILU = frozenset({"SiLU", "SiLUActivation"})


class _SwiGLU(torch.autograd.Function):
    """``silu(g) * u``; keeps ``g`` and ``u``, recomputes ``silu(g)`` in the backward."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return torch.nn.functional.silu(g) * u

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # The ops autograd runs for HF's unfused ``act_fn(g) * u`` (mul's backward, then SiLU's one-kernel
        # backward), in the same dtype and order: bitwise the same gradients, and the same transient
        # ``[b, s, f/t]`` tensors in the input dtype (an f32 chain here held ~8 of them at once).
        g, u = ctx.saved_tensors
        gg = torch.ops.aten.silu_backward(grad * u, g) if ctx.needs_input_grad[0] else None
        gu = grad * torch.nn.functional.silu(g) if ctx.needs_input_grad[1] else None
        return gg, gu


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The fused SwiGLU product (module docstring)."""
    return _SwiGLU.apply(g, u)


def _swiglu_forward(mod: nn.Module) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return mod.down_proj(swiglu(mod.gate_proj(x), mod.up_proj(x)))

    return forward


def fuse_swiglus(module: nn.Module) -> list[str]:
    """Run every MLP of ``module`` whose class is in :data:`SWIGLU_CLASSES` and whose ``act_fn`` is SiLU with
    :func:`swiglu`. Returns the module paths swapped. Idempotent."""

    def wanted(m: nn.Module) -> bool:
        return type(m).__name__ in SWIGLU_CLASSES and type(getattr(m, "act_fn", None)).__name__ in _SILU

    return _swap(module, wanted, _swiglu_forward)


def fuse_ops(module: nn.Module) -> list[str]:
    """:func:`fuse_rms_norms` and :func:`fuse_swiglus` on ``module``: the module paths swapped, in order."""
    got = set(fuse_rms_norms(module)) | set(fuse_swiglus(module))
    return [name for name, _ in module.named_modules() if name in got]
