"""What the priced program does to pointwise traffic and activation widths, by the stack it runs (issue 32).

Read by ``search/layer/intra_op.py`` when it prices a layer's ops; no framework imports. ``tp_style`` names
the program: ``"torch"`` is Partita's own torch program (eager PyTorch under autocast or FSDP2's mixed
precision policy), ``"megatron"`` another stack's (Megatron-LM's rows in ``bench/costmodel_accuracy.py`` and
``bench/published.py``; a JAX graph's program), ``"auto"`` a what-if.
"""

from __future__ import annotations

from partita.ir import DTYPE_BYTES, Graph
from partita.search.pricing.cost_model import CostModel


def program_fusion(graph: Graph, tp_style: str, cm: CostModel) -> float:
    """Share of the fusable pointwise traffic (``passes/fusion.py``) the priced program removes: a property
    of the program, not of the device (issue 32). XLA always fuses (JAX graphs: 1); Partita's torch program
    (``tp_style="torch"``) runs eager PyTorch, which fuses nothing (0), whatever the device's profile says;
    another stack's program (``"megatron"``: Megatron-LM's hand-fused bias-GeLU, scale-mask-softmax and
    bias-dropout-add; ``"auto"``: a what-if) takes the profile's ``Efficiency.pointwise_fusion``, which the
    shipped A100 profile fitted on Megatron-LM runs (``partita/data/a100_megatron_calibration.json``)."""
    if graph.meta.get("framework") == "jax":
        return 1.0
    if tp_style == "torch":
        return 0.0
    return cm.efficiency.pointwise_fusion


def program_width(graph: Graph, tp_style: str, dtype: str) -> float | None:
    """Bytes per element at which the priced program moves a tensor the torch tracer recorded as f32, or
    None for the traced width. Megatron-LM runs the whole model in the training dtype (its ``Float16Module``
    casts parameters and the embedding output to fp16 / bf16; the fused scale-mask-softmax, dropout and
    bias-GeLU kernels read and write that dtype, and the tensor-parallel all-reduces carry it), so a torch
    graph priced as Megatron's program (``"megatron"``, ``"megatron_sp"``) with a 2-byte ``dtype`` moves 2 bytes per element of
    every f32 activation and parameter it reads, writes or communicates. Partita's own torch program keeps the
    traced width here (autocast runs softmax, norms and the loss in f32; ``search/layer/saved.py`` prices what it
    holds); a JAX graph is traced in its own dtypes."""
    if (
        graph.meta.get("framework") == "torch"
        and tp_style in ("megatron", "megatron_sp")
        and DTYPE_BYTES.get(dtype, 4) < 4
    ):
        return float(DTYPE_BYTES[dtype])
    return None
