"""Achieved efficiency of one GEMM from its shape, per device type: tile and wave quantization (issue 32).

Used by ``search/pricing/cost_model.CostModel.compute_time`` for every MATMUL whose per-device shape the
caller knows (``search/layer/intra_op.py`` reads it off the op's signature and its strategy, :func:`local_shape`);
no framework imports.

A GEMM ``C[m, n] = A[m, k] B[k, n]`` (``batch`` of them for a batched matmul) runs as a grid of output
tiles ``tm x tn``, one thread block each, spread over the device's SMs in waves (NVIDIA, "Matrix
Multiplication Background User's Guide", DU-09799-001, sections 2.3 and 3). For one tile shape ``t`` and
split-K factor ``s`` (k cut into ``s`` slices, each its own thread block, when ``k / s`` stays long)::

    blocks   = batch * ceil(m / tm) * ceil(n / tn) * s
    tile_q   = m n / (ceil(m / tm) tm * ceil(n / tn) tn)     share of each tile's work that is useful
    wave_q   = blocks / (ceil(blocks / SMs) * SMs)            share of the SM-waves that hold a block
    rel      = min(1, I(t) / I(plateau)),  I(t) = tm tn / (tm + tn)
    shape    = max over (t, s) of tile_q * wave_q * rel

``I`` is the tile's arithmetic intensity (MACs per operand element loaded per k step): tiles at least as
large as the plateau tile (128 x 128) run at the device's GEMM plateau, smaller ones lose in proportion
(an assumption of this model; the guide says larger tiles are more efficient, without one number).
cuBLAS picks its tile by heuristics: the best pair is assumed. The cost model then prices
``flops / (peak * eff.matmul * shape)``, so ``eff.matmul`` stays the plateau a large, well-shaped GEMM
reaches (the calibrated factor), and the memory roofline of thin GEMMs stays the cost model's own
``max(t_flop, bytes / (hbm * eff.memory))``. A split-K GEMM's reduction of ``s`` partial outputs is not
priced (small beside the GEMM when ``k / s`` is long).

Per device: the SM count (public whitepapers and datasheets) in ``partita/data/gemm_tiles.json`` with its
sources; a device type not listed there (the CPU, a cluster file's own type) gets ``None`` and the cost
model keeps its FLOP curve. Results are cached by shape: a search prices a few hundred distinct GEMMs.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from partita.ir import DimSig

_DATA = Path(__file__).resolve().parents[2] / "data" / "gemm_tiles.json"


@functools.cache
def _table() -> dict:
    return json.loads(_DATA.read_text())


def sm_count(device_name: str) -> int | None:
    """SMs of a shipped device type, None when the table does not list it."""
    got = _table()["sms"].get(device_name)
    return int(got) if got else None


def _intensity(tm: int, tn: int) -> float:
    return tm * tn / (tm + tn)


@functools.lru_cache(maxsize=65536)
def shape_efficiency(sms: int, batch: int, m: int, n: int, k: int) -> float:
    """The module docstring's ``shape`` (0, 1] of one GEMM on a device with ``sms`` SMs."""
    if min(sms, batch, m, n, k) <= 0:
        return 1.0
    tab = _table()
    plateau = _intensity(*tab["plateau_tile"])
    best = 0.0
    for tm, tn in tab["tiles"]:
        rm, rn = -(-m // tm), -(-n // tn)
        tile_q = m * n / (rm * tm * rn * tn)
        rel = min(1.0, _intensity(tm, tn) / plateau)
        for s in tab["split_k"]:
            if s > 1 and k / s < tab["min_k_per_split"]:
                continue
            blocks = batch * rm * rn * s
            wave_q = blocks / (-(-blocks // sms) * sms)
            best = max(best, tile_q * wave_q * rel)
    return best


def local_shape(
    sig: DimSig, sizes: Mapping[str, int], axis_labels: Sequence[str], mesh_shape: Sequence[int]
) -> tuple[int, int, int, int] | None:
    """``(batch, m, n, k)`` of a two-operand contraction on one device: each label's size divided by the
    mesh axes that shard it (``axis_labels[i]`` shards mesh axis ``i``); batch labels are on both operands
    and the result, ``m`` on the first operand only, ``n`` on the second only, ``k`` reduced. None when the
    signature is not one GEMM."""
    if len(sig.inputs) != 2 or len(sig.outputs) != 1:
        return None
    div: dict[str, int] = {}
    for lab, size in zip(axis_labels, mesh_shape):
        if lab:
            div[lab] = div.get(lab, 1) * size
    loc = {c: max(1, sizes[c] // div.get(c, 1)) for c in sig.labels}
    a, b = sig.inputs
    out = sig.outputs[0]
    batch = math.prod(loc[c] for c in out if c in a and c in b)
    m = math.prod(loc[c] for c in out if c in a and c not in b)
    n = math.prod(loc[c] for c in out if c in b and c not in a)
    k = math.prod(loc[c] for c in sig.reduced if c in a and c in b)
    return batch, m, n, k


def backward_shapes(gemm: tuple[int, int, int, int]) -> tuple[tuple[int, int, int, int], ...]:
    """The two GEMMs of the backward of ``C = A B``: ``dA = dC B^T`` (m x k, reducing n) and
    ``dB = A^T dC`` (k x n, reducing m)."""
    b, m, n, k = gemm
    return (b, m, k, n), (b, k, n, m)
