"""Device memory beyond tensors: what a rank's process holds on its device besides the tensors it allocates.

Bottom layer, no framework imports. The search prices tensors (parameters, gradients, optimizer state,
activations: ``search/pipeline/stage_cost.py``) and ``partita rehearse`` measures them on fake tensors,
which see nothing else. A real GPU process also holds, per device:

* ``cuda_context``: the CUDA context (driver state and the kernels loaded into it; lazy module loading
  since CUDA 11.7) and the math libraries' workspaces (cuBLAS, cuDNN), created at the first CUDA call;
* ``nccl_buffers``: NCCL's per-communicator buffers, one communicator per process group the rank issues
  NCCL collectives on (``nccl_per_communicator`` each: channels x 2 ring connections x ``NCCL_BUFFSIZE``
  x 2 protocol buffers, Simple and LL128);
* ``allocator_margin``: the caching allocator's rounding and fragmentation, a fraction of the tensor
  peak (blocks rounded to 512 B, 2 MiB and 20 MiB segments; freed blocks split and unusable for larger
  requests).

The numbers, per device type, and their public sources are in ``partita/data/README.md`` ("Device memory
beyond tensors"); they are estimates, not measurements of this project. The search holds every stage's
tensor peak under :func:`tensor_cap` (the device's memory less the context and
``SEARCH_COMMUNICATORS`` communicators' buffers, over ``1 + allocator_margin``); the plan records, per
stage and device type, the items for the communicators its own records name
(``search/program/records.memory_items``), and the report's memory tables show them.
A CPU "device" (one gloo rank) has no CUDA context and no NCCL buffers; its allocator margin stays. A
device type a cluster file declares gets the allocator margin only: its context and buffers are unknown
here (the plan's ``memory_reserve`` marks it ``known: 0``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

MiB = 2**20
GiB = 2**30
NCCL_BUFFSIZE = 4 * MiB  # NCCL's default (NCCL_BUFFSIZE, NCCL environment variables documentation)
# The most process groups a stage's rank issues NCCL collectives on: world, tp, dp and the two pipeline
# neighbours (a stage holding a tied parameter has one neighbour: its tied group takes the other's place).
SEARCH_COMMUNICATORS = 5


@dataclasses.dataclass(frozen=True)
class Reserve:
    """One device type's memory beyond tensors (module docstring)."""

    cuda_context: float  # bytes, once per process
    nccl_channels: int  # channels NCCL opens per communicator (assumed, see partita/data/README.md)
    allocator_margin: float  # fraction of the tensor peak

    @property
    def nccl_per_communicator(self) -> float:
        """Channels x 2 ring connections (send, receive) x NCCL_BUFFSIZE x 2 protocol buffers (Simple, LL128)."""
        return float(self.nccl_channels * 2 * NCCL_BUFFSIZE * 2)


ALLOCATOR_MARGIN = 0.05
CONTEXT = 512 * MiB  # ~400 MB context with lazy loading (pytorch#109888, pytorch#86509) + library workspaces
NVLINK_CHANNELS = 32  # NCCL's channels per communicator on an NVLink node (nccl#1685: 32 on 8 x H100)
PCIE_CHANNELS = 4  # assumed for PCIe-only GPUs (L4, T4): fewer, slower links, fewer channels

RESERVES: dict[str, Reserve] = {
    "H200": Reserve(CONTEXT, NVLINK_CHANNELS, ALLOCATOR_MARGIN),
    "H100-80G": Reserve(CONTEXT, NVLINK_CHANNELS, ALLOCATOR_MARGIN),
    "A100-80G": Reserve(CONTEXT, NVLINK_CHANNELS, ALLOCATOR_MARGIN),
    "A100-40G": Reserve(CONTEXT, NVLINK_CHANNELS, ALLOCATOR_MARGIN),
    "V100-32G": Reserve(CONTEXT, NVLINK_CHANNELS, ALLOCATOR_MARGIN),
    "V100-16G": Reserve(CONTEXT, NVLINK_CHANNELS, ALLOCATOR_MARGIN),
    "L4": Reserve(CONTEXT, PCIE_CHANNELS, ALLOCATOR_MARGIN),
    "T4": Reserve(CONTEXT, PCIE_CHANNELS, ALLOCATOR_MARGIN),
    "CPU": Reserve(0.0, 0, ALLOCATOR_MARGIN),  # gloo: no CUDA context, no NCCL buffers
}
# A device type a cluster file declares (outside the presets): its context and communication library's
# buffers are not known here, so only the allocator margin is reserved (``describe`` says ``known: 0``).
UNKNOWN = Reserve(0.0, 0, ALLOCATOR_MARGIN)


def reserve_for(name: str, kind: str = "gpu") -> Reserve:
    """The reserve of device type ``name``; :data:`UNKNOWN` for a type outside :data:`RESERVES`."""
    return RESERVES.get(name, UNKNOWN)


def _of(dev: Any) -> Reserve:
    return reserve_for(str(dev.name), str(getattr(dev, "kind", "gpu")))


def fixed_bytes(dev: Any, communicators: int) -> float:
    """CUDA context + NCCL buffers of ``communicators`` communicators on one device of ``dev``'s type."""
    r = _of(dev)
    return r.cuda_context + communicators * r.nccl_per_communicator


def tensor_cap(dev: Any, communicators: int = SEARCH_COMMUNICATORS) -> float:
    """Bytes of tensors a stage may hold per device of type ``dev`` (a ``cluster.DeviceType``): what is
    left of its memory after the context and NCCL buffers, over ``1 + allocator_margin``."""
    r = _of(dev)
    return max(0.0, float(dev.memory_bytes) - fixed_bytes(dev, communicators)) / (1.0 + r.allocator_margin)


def items(dev: Any, tensor_bytes: float, communicators: int) -> dict[str, float]:
    """The plan's per-device items beyond a tensor peak of ``tensor_bytes`` (module docstring), and
    ``total``: the tensors plus them, what the device must hold."""
    r = _of(dev)
    out = {
        "cuda_context": r.cuda_context,
        "nccl_buffers": communicators * r.nccl_per_communicator,
        "nccl_communicators": float(communicators),
        "allocator_margin": r.allocator_margin * tensor_bytes,
    }
    out["total"] = tensor_bytes + out["cuda_context"] + out["nccl_buffers"] + out["allocator_margin"]
    return out


def describe(dev: Any) -> dict[str, float]:
    """What the plan records per device type (``predicted["memory_reserve"]``): the reserve's numbers and
    the tensor capacity the search held every stage of that type under."""
    r = _of(dev)
    return {
        "memory_bytes": float(dev.memory_bytes),
        "cuda_context": r.cuda_context,
        "nccl_per_communicator": r.nccl_per_communicator,
        "communicators_assumed": float(SEARCH_COMMUNICATORS),
        "allocator_margin": r.allocator_margin,
        "tensor_cap": tensor_cap(dev),
        "known": float(str(dev.name) in RESERVES),
    }
