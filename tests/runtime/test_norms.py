"""The fused RMSNorm of a low-dtype stage (``backends/torch/norms.py``, issue 32 item 4): the same function as
Hugging Face's RMSNorm, and it keeps only its input and a per-row statistic for the backward. CPU, in-process."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from partita.backends.torch import norms


def _saved(fn: object, *args: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    out: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        out.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)  # type: ignore[operator]
    return out


def test_gradients_are_exact_in_f64() -> None:
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: norms.rms_norm(x, w, 1e-6), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_rmsnorm_and_keeps_only_input_and_row_statistic(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ref, fused = LlamaRMSNorm(64), LlamaRMSNorm(64)
    ref.weight.data = torch.randn(64)
    fused.weight.data = ref.weight.data.clone()
    assert norms.fuse_rms_norms(fused) == [""] and norms.fuse_rms_norms(fused) == [""]  # idempotent
    x = torch.randn(2, 8, 64).to(dtype)
    g = torch.randn(2, 8, 64).to(dtype)
    grads = []
    for mod in (ref, fused):
        xi = x.clone().requires_grad_()
        y = functional_call(mod, {"weight": mod.weight.to(dtype)}, (xi,))  # FSDP2's low parameter copy
        assert y.dtype == dtype
        y.backward(g)
        grads.append((y.detach().float(), xi.grad.float(), mod.weight.grad))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.07, "rtol": 0.02}
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)
    xi = x.clone().requires_grad_()
    kept = _saved(lambda t: functional_call(fused, {"weight": fused.weight.to(dtype)}, (t,)), xi)
    # its input in its own dtype, the (low) weight copy and one f32 value per row: no f32 copy of x
    assert sorted(kept, key=str) == sorted([((2, 8, 64), dtype), ((64,), dtype), ((2, 8, 1), torch.float32)], key=str)
    hf = _saved(lambda t: functional_call(ref, {"weight": ref.weight.to(dtype)}, (t,)), xi)
    assert sum(s[-1] == 64 and len(s) == 3 for s, _ in hf) > 1  # HF keeps more than one full-size tensor


def test_leaves_other_norms_as_written() -> None:
    ln = torch.nn.Sequential(torch.nn.LayerNorm(8), LlamaRMSNorm(8))
    assert norms.fuse_rms_norms(ln) == ["1"]
    assert "forward" not in vars(ln[0])
