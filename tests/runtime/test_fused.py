"""The fused ops of a low-dtype stage (``backends/torch/fused.py``, issue 32 item 4): the same functions as Hugging
Face's RMSNorm and SwiGLU MLP, keeping for the backward only what Megatron-LM's fused kernels keep (the norm its
input and a per-row statistic; the SwiGLU gate's and up's outputs). CPU, in-process."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from partita.backends.torch import fused


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
    assert torch.autograd.gradcheck(lambda x, w: fused.rms_norm(x, w, 1e-6), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_rmsnorm_and_keeps_only_input_and_row_statistic(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ref, mine = LlamaRMSNorm(64), LlamaRMSNorm(64)
    ref.weight.data = torch.randn(64)
    mine.weight.data = ref.weight.data.clone()
    assert fused.fuse_rms_norms(mine) == [""] and fused.fuse_rms_norms(mine) == [""]  # idempotent
    x = torch.randn(2, 8, 64).to(dtype)
    g = torch.randn(2, 8, 64).to(dtype)
    grads = []
    for mod in (ref, mine):
        xi = x.clone().requires_grad_()
        y = functional_call(mod, {"weight": mod.weight.to(dtype)}, (xi,))  # FSDP2's low parameter copy
        assert y.dtype == dtype
        y.backward(g)
        grads.append((y.detach().float(), xi.grad.float(), mod.weight.grad))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.07, "rtol": 0.02}
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)
    xi = x.clone().requires_grad_()
    kept = _saved(lambda t: functional_call(mine, {"weight": mine.weight.to(dtype)}, (t,)), xi)
    # its input in its own dtype, the (low) weight copy and one f32 value per row: no f32 copy of x
    assert sorted(kept, key=str) == sorted([((2, 8, 64), dtype), ((64,), dtype), ((2, 8, 1), torch.float32)], key=str)
    hf = _saved(lambda t: functional_call(ref, {"weight": ref.weight.to(dtype)}, (t,)), xi)
    assert sum(s[-1] == 64 and len(s) == 3 for s, _ in hf) > 1  # HF keeps more than one full-size tensor


def test_leaves_other_norms_as_written() -> None:
    ln = torch.nn.Sequential(torch.nn.LayerNorm(8), LlamaRMSNorm(8))
    assert fused.fuse_rms_norms(ln) == ["1"]
    assert "forward" not in vars(ln[0])


def test_swiglu_gradients_are_exact_in_f64() -> None:
    g, u = (torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(fused.swiglu, (g, u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_mlp_matches_hf_and_keeps_gate_and_up_only(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, hidden_act="silu")
    ref, mine = LlamaMLP(cfg).to(dtype), LlamaMLP(cfg).to(dtype)
    mine.load_state_dict(ref.state_dict())
    assert fused.fuse_ops(mine) == [""]
    x = torch.randn(2, 4, 16).to(dtype)
    outs = []
    for mod in (ref, mine):
        xi = x.clone().requires_grad_()
        kept = _saved(mod, xi)
        xi = x.clone().requires_grad_()
        y = mod(xi)
        y.sum().backward()
        outs.append((kept, y.detach().float(), xi.grad.float(), mod.gate_proj.weight.grad.float()))
    for a, b in zip(outs[0][1:], outs[1][1:]):  # the same ops in the same order (fused.py): bitwise
        assert torch.equal(a, b)
    wide = [s for s, _ in outs[0][0] if s == (2, 4, 32)]
    assert len(wide) == 3 and len([s for s, _ in outs[1][0] if s == (2, 4, 32)]) == 2  # SiLU's output dropped


def test_swiglu_backward_makes_no_wide_temporaries() -> None:
    """The backward's transient tensors are ``[b, s, f]`` in the input dtype, as autograd's for HF's form:
    an f32 chain (the first version) held ~8 f32 copies at once, and a pipelined bf16 stage rehearsed
    +25.6% over its plan (``tests/runtime/test_fp8_multiprocess.py``). Every op the backward dispatches
    returns bf16 for bf16 inputs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dtypes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[torch.dtype] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            self.seen |= {t.dtype for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
            return out

    g, u = (torch.randn(2, 4, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    y = fused.swiglu(g, u)
    with Dtypes() as mode:
        y.backward(torch.ones_like(y))
    assert mode.seen == {torch.bfloat16}
