"""MoE experts as the program runs them (``backends/torch/moe.py``), in-process on fake tensors (seconds).

* Expert parallelism under a split backward (``backends/torch/wsplit.py``). The plan prices ZB-H1's W with every weight gradient deferred, the experts' included. An expert-parallel
module once anchored its expert weights on its combine node (``moe._Join``), which made each weight
reachable from that node both directly and through the experts' matmuls: ``wsplit.split_nodes`` then
had to compute the experts' weight gradients in B, and B freed the experts' saved tensors (``partita
rehearse`` of mixtral-8x7b: later stages held 10-32% less than their plan; issue 15). In-process, on a
fake process group and fake tensors (balanced routing, ``moe._balanced_routing``), one rank of two.
* Transformers' grouped experts (a tp = 1 stage) under ``torch.autocast``: ``torch._grouped_mm`` is no
  autocast op, so on f32 master weights it got f32 operands, which its CUDA kernel and its meta function
  (``partita rehearse``) refuse: the tp = 1 mixtral-8x7b plan did not rehearse. The program runs them
  in the autocast dtype (``moe.experts_in_autocast_dtype``), and the rehearsal counts their FLOPs
  (``torch_shim.flop_formula``: the flop counter has no ``_grouped_mm`` formula).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.backends.torch import wsplit
from partita.backends.torch.moe import apply_expert_parallel, experts_in_autocast_dtype
from partita.frontends import torch_shim

HIDDEN, EXPERTS, TOKENS, TOP_K = 8, 4, 8, 2


def test_expert_weight_gradients_wait_for_w() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch_shim.fake_process_group(0, 2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        cfg = MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=12, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
        )
        with torch_shim.fake_tensor_mode():
            mod = MixtralExperts(cfg)
            apply_expert_parallel(mod, mesh, [""])
            with torch.no_grad():  # rank 0's experts (what the DTensor shard holds)
                for p in mod.parameters():
                    p.data = p.data[: EXPERTS // 2].clone()
            x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
            idx = torch.zeros(TOKENS, TOP_K, dtype=torch.long)
            w = torch.rand(TOKENS, TOP_K, requires_grad=True)
            inp = torch.randn(TOKENS, HIDDEN, requires_grad=True)  # the stage input B differentiates
            box = wsplit.SavedTensors()
            with box.hooks():
                out = mod(x * inp, idx, w)
            dx, deferred = wsplit.backward_input(out, torch.ones_like(out), inp, box)
            weights = dict(mod.named_parameters())
            assert dx is not None and dx.shape == inp.shape
            assert {n: p.grad is None for n, p in weights.items()} == dict.fromkeys(weights, True), "W's work in B"
            deferred.run()
            assert all(p.grad is not None and p.grad.shape == p.shape for p in weights.values())
    finally:
        dist.destroy_process_group()


def test_grouped_experts_run_in_the_autocast_dtype_and_count_their_flops() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    hidden, inter, tokens, k = 16, 16, 8, 2  # bf16 rows of 16 bytes: _grouped_mm's stride rule
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=EXPERTS, num_experts_per_tok=k)
    cfg._experts_implementation = "grouped_mm"  # what models/zoo's mixtral-8x7b builds with
    counted: list[int] = []

    class Flops(torch_shim.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if "_grouped_mm" in str(func):
                counted.append(int(torch_shim.flop_formula(func)(*args, **(kwargs or {}), out_val=out)))
            return out

    with torch_shim.fake_tensor_mode():
        mod = MixtralExperts(cfg)
        experts_in_autocast_dtype(mod)
        x = torch.randn(tokens, hidden, requires_grad=True)
        idx = torch.zeros(tokens, k, dtype=torch.long)
        w = torch.rand(tokens, k)
        with Flops(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(x, idx, w)
        assert y.dtype == torch.float32 and y.shape == x.shape
        with Flops():
            y.backward(torch.randn_like(y))
        assert x.grad is not None and all(
            p.grad is not None and p.grad.dtype == torch.float32 for p in mod.parameters()
        )
    rows = tokens * k  # every (token, choice) pair once; forward, input gradient, weight gradient: 2 x rows x in x out
    assert sorted(counted) == sorted([2 * rows * hidden * 2 * inter] * 3 + [2 * rows * inter * hidden] * 3)
