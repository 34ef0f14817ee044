"""Expert parallelism (``backends/torch/moe.py``) on 2 gloo ranks, against the unsharded experts module.

The routing is skewed on purpose: every token of the micro-batch picks experts of rank 0 only, so rank
1's local experts receive no rows. The backward must still issue the same collectives in the same
order on both ranks. (It once did not: rank 1's combine all_to_all had no autograd node, rank 1 went
straight to the slice's all_gather while rank 0 waited in the all_to_all, and the step hung; found when
``torch.distributed.pipelining``'s backward shape inference routed uninitialised tensors that way.)
A short process-group timeout turns a hang into a failure.
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partita.backends.torch.moe import apply_expert_parallel
from partita.backends.torch.parallel import leave_process_group

HIDDEN, EXPERTS, TOKENS, TOP_K = 8, 4, 6, 2


def _experts() -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=12, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    mod = MixtralExperts(cfg)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.3)
    return mod


def _inputs(skewed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    if skewed:  # experts 0 and 1 only: both live on rank 0
        idx = torch.tensor([[0, 1], [1, 0]] * (TOKENS // 2))
    else:
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    w = torch.softmax(torch.randn(TOKENS, TOP_K, generator=g), dim=-1)
    return x, idx, w


def _worker(rank: int, port: int, out: str, skewed: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    from torch.distributed.device_mesh import init_device_mesh

    mod = _experts()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    per = EXPERTS // 2
    apply_expert_parallel(mod, mesh, [""])
    with torch.no_grad():  # each rank keeps its own experts (what the DTensor shard holds)
        for p in mod.parameters():
            p.data = p.data[rank * per : (rank + 1) * per].clone()
    x, idx, w = _inputs(skewed)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = mod(x, idx, w)
    (y * torch.arange(y.numel()).view_as(y).float()).sum().backward()
    grads = {n: p.grad for n, p in mod.named_parameters()}  # zeros, not None, where no row came (dp sync)
    torch.save({"y": y.detach(), "dx": x.grad, "dw": w.grad, "grads": grads}, f"{out}.{rank}")
    leave_process_group()  # gloo may abort in interpreter finalization (SIGABRT seen under load)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("skewed", [False, True], ids=["random", "all-to-rank0"])
def test_expert_parallel_matches_unsharded(tmp_path: Path, skewed: bool) -> None:
    out = str(tmp_path / "res")
    mp.start_processes(_worker, args=(_free_port(), out, skewed), nprocs=2, start_method="spawn")
    ref_mod = _experts()
    x, idx, w = _inputs(skewed)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = ref_mod(x, idx, w)
    (y * torch.arange(y.numel()).view_as(y).float()).sum().backward()
    res = [torch.load(f"{out}.{r}") for r in range(2)]
    per = EXPERTS // 2
    for r in range(2):
        torch.testing.assert_close(res[r]["y"], y.detach())
        torch.testing.assert_close(res[r]["dx"], x.grad)
        torch.testing.assert_close(res[r]["dw"], w.grad)
        for n, p in ref_mod.named_parameters():
            torch.testing.assert_close(res[r]["grads"][n], p.grad[r * per : (r + 1) * per], msg=f"rank {r} {n}")


def test_counted_step_compares_all_to_all_by_count_only() -> None:
    """A rank's all_to_all bytes follow the routing (the plan records the balanced share): the run's
    first-step check compares their count, and every other kind's bytes as before."""
    from partita.backends.torch.fidelity import compare

    plan = {"all_to_all@tp": {"count": 4, "bytes": 1000.0}, "all_gather@tp": {"count": 2, "bytes": 500.0}}
    routed = {"all_to_all@tp": {"count": 4, "bytes": 1700.0}, "all_gather@tp": {"count": 2, "bytes": 500.0}}
    assert compare(routed, plan) == []
    assert compare({**routed, "all_to_all@tp": {"count": 3, "bytes": 1000.0}}, plan) == [
        "all_to_all@tp: measured 3, predicted 4"
    ]
    assert compare({**routed, "all_gather@tp": {"count": 2, "bytes": 900.0}}, plan) != []
