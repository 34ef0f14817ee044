"""Worker of test_checkpoint_strided.py: every (saved layout, loaded layout) pair of one [4, 12] weight."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from partita.backends.torch import checkpoint as ck
from partita.backends.torch.parallel import leave_process_group
from partita.frontends.torch_shim import strided_shard

dist.init_process_group("gloo")
r = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
W = torch.randn(4, 12)


def model(pl):  # noqa: ANN001, ANN201
    """One weight, placed ``pl`` on the 2-rank mesh (None: a plain tensor on every rank)."""
    m = nn.Module()
    if pl is None:
        m.w = nn.Parameter(W.clone())
    else:
        m.w = nn.Parameter(distribute_tensor(W.clone(), mesh, [pl]))
    return m


root = sys.argv[1]
layouts = {"strided": strided_shard(1, 3), "contig": Shard(1), "rep": Replicate(), "shard0": Shard(0), "plain": None}
for src in layouts:
    m = model(layouts[src])
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    (m.w.sum() if not isinstance(m.w, DTensor) else m.w.to_local().sum()).backward()
    opt.step()
    ref_w = (m.w.full_tensor() if isinstance(m.w, DTensor) else m.w.detach()).clone()
    ref_m = opt.state[m.w]["exp_avg"]
    ref_m = (ref_m.full_tensor() if isinstance(ref_m, DTensor) else ref_m).clone()
    path = ck.save(f"{root}/{src}", 1, m, opt)
    for dst in layouts:
        m2 = model(layouts[dst])
        opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
        (m2.w.sum() if not isinstance(m2.w, DTensor) else m2.w.to_local().sum()).backward()
        opt2.step()
        with torch.no_grad():
            (m2.w.to_local() if isinstance(m2.w, DTensor) else m2.w).zero_()
        ck.load(path, m2, opt2)
        got = m2.w.full_tensor() if isinstance(m2.w, DTensor) else m2.w.detach()
        gm = opt2.state[m2.w]["exp_avg"]
        gm = gm.full_tensor() if isinstance(gm, DTensor) else gm
        if r == 0:
            print(src, "->", dst, torch.equal(got, ref_w), torch.allclose(gm, ref_m))
leave_process_group()  # skips interpreter finalization, where gloo aborts now and then
