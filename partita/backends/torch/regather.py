"""Sequence parallelism's column input kept as this rank's rows and all-gathered again in the backward (issue 32).

Used by ``backends/torch/tp.py`` (``_gather_rows``: the forward pre-hook of a ``colwise_sp`` parent, which
all-gathers the block's hidden states once for its column modules). Autograd would keep that gathered
tensor, ``b*s*h`` of the training dtype per column parent, in every saved ``mm``; Megatron-LM's column
layer keeps its input's ``s/t`` rows instead and all-gathers them again in the backward, before the
weight gradient GEMM (Korthikanti et al. 2022, sec. 4.2.3). :class:`Regather` does the same with a
``saved_tensors_hooks`` context around the parent's forward: each saved tensor that is (a view of) the
gathered one is packed as the rows this rank already has, and the first unpack in the backward
all-gathers them once (the tensor is shared by the parent's column siblings until the last of them has
unpacked it): one more all-gather per column parent and micro-batch in the backward, which the plan
records (``search/program/sequence_parallel.py``) and prices memory for (``activation_delta``).

Only where no other saved-tensor hooks run: under selective recompute the checkpoint's policy keeps the
all-gather's output (a collective output) and re-runs nothing, as priced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from partita.frontends import torch_shim


class _Gathered:
    """The rows one parent call gathered: all-gathered again at the first unpack, dropped after the last."""

    def __init__(self, mesh: DeviceMesh, rows: torch.Tensor, dim: int) -> None:
        self.mesh, self.rows, self.dim = mesh, rows, dim
        self.packs, self.full = 0, None

    def take(self) -> torch.Tensor:
        if self.full is None:
            with torch.no_grad():
                dt = DTensor.from_local(self.rows.detach(), self.mesh, [Shard(self.dim)], run_check=False)
                self.full = dt.redistribute(self.mesh, [Replicate()]).to_local()
        full = self.full
        self.packs -= 1
        if self.packs <= 0:
            self.full = None
        return full


class Regather:
    """``saved_tensors_hooks`` for one call of a ``colwise_sp`` parent (module docstring). ``rows``: this
    rank's rows as gathered (cast), ``full``: the gathered Replicate DTensor the column modules read."""

    def __init__(self, mesh: DeviceMesh, rows: torch.Tensor, full: DTensor, dim: int) -> None:
        local = full.to_local()
        # the gathered storage by weak reference: autograd keeps these hooks with every tensor they packed
        self.storage, self.dtype = torch_shim.storage_ref(local), local.dtype
        self.gathered = _Gathered(mesh, rows, dim)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @staticmethod
    def wanted(mesh: DeviceMesh) -> bool:
        """Whether to keep rows only: a tp group, a forward that saves, no other saved-tensor hooks."""
        return mesh.size() > 1 and torch.is_grad_enabled() and not torch_shim.saved_tensor_hooks_active()

    def __enter__(self) -> Regather:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.dtype != self.dtype or torch_shim.storage_ref(local) != self.storage:
            return t
        self.gathered.packs += 1
        view = (local.size(), local.stride(), local.storage_offset())
        spec = (t.device_mesh, t.placements, t.size(), t.stride()) if isinstance(t, DTensor) else None
        return _Packed(self.gathered, view, spec, t.requires_grad)

    @staticmethod
    def _unpack(p: Any) -> torch.Tensor:
        if not isinstance(p, _Packed):
            return p
        local = p.gathered.take().as_strided(*p.view)
        if p.spec is None:
            return local
        mesh, placements, shape, stride = p.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _Packed:
    __slots__ = ("gathered", "view", "spec", "requires_grad")

    def __init__(self, gathered: _Gathered, view: tuple[Any, ...], spec: Any, requires_grad: bool) -> None:
        self.gathered, self.view, self.spec, self.requires_grad = gathered, view, spec, requires_grad
