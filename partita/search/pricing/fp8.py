"""FP8 training as a precision choice (issue 36 item 2): peaks per device type, casting overhead, refusals.

Read by ``search/pricing/cost_model.py`` (a :class:`~partita.search.pricing.cost_model.CostModel` with
``fp8`` set prices its matmuls here), ``search/pipeline/stage_cost.py`` (which builds those cost
models when ``TrainingConfig.fp8`` names a recipe), ``driver.py`` (:func:`check` before tracing) and
the plan builder / ``evaluate`` notes (:func:`note`). The program side is ``backends/torch/fp8.py``.

What the program runs: torchao's float8 training (``convert_to_float8_training`` with
``Float8LinearConfig.from_recipe_name(recipe)``) swaps every ``nn.Linear`` whose dimensions are
multiples of 16 for a ``Float8Linear``: master weights, gradients and optimizer state stay as the
plan's ``dtype`` says (f32 master, bf16 compute), and the three GEMMs of each linear (forward,
input gradient, weight gradient) run in FP8 with dynamic scales. Everything else (attention,
norms, embeddings, the optimizer) runs as in a bf16 plan.

Pricing, per MATMUL kernel of ``F`` FLOPs moving ``M`` bytes as the roofline counts them (the graph's
traced width: 4 bytes per element of the inputs and the output, ``search/layer/intra_op.py``)::

    t = max(F / (peak_fp8 * eff_flops), M / (hbm * eff.memory))       # the FP8 GEMM
      + CAST_TRAFFIC * M / (hbm * eff.memory) + (CAST_KERNELS + 1) * eff.kernel_overhead_s   # amax + casts

``CAST_TRAFFIC = 1.25``: each bf16 operand element is read once for its amax (per tensor or per row)
and once to cast (2 + 2 bytes) and written as FP8 (1 byte): 5 bytes per element, 1.25 of the 4 the
roofline counts. ``M`` counts the output as well, which forward does not cast but backward does (the
output gradient), so one kernel's casting traffic is taken as ``1.25 M`` in forward and backward
alike. That is the fused cost (amax and cast each one pass); the program runs torchao eagerly (no
``torch.compile``), whose casts take more passes, so this pricing is, if anything, FP8's best case.
``CAST_KERNELS = 4``: amax and cast of the two operands. The rowwise recipe moves the same bytes (a
scale per row instead of one per tensor). Every MATMUL that reads a parameter (a linear's GEMM) is priced this way
(``search/layer/intra_op.py`` hands the others, an eager attention's batched GEMMs, a cost model without
fp8: torchao converts ``nn.Linear`` only); the program keeps the linears whose sizes are not multiples of
16 in bf16 (``runs_in_fp8``), which this pricing does not model (tiny models only).

Memory (:func:`backward_transient`): torchao 0.18's ``matmul_with_hp_or_float8_args`` saves the
high-precision input and weight for the backward, as ``nn.Linear`` does, so an fp8 stage keeps the
saved activations of a bf16 one. What it adds is allocated in each linear's backward, on top of what the
stage holds then: five casts to FP8 (output gradient, weight, output gradient again, input), each an f32
scaled copy, its clamped copy and the 1-byte result alive at once (9 bytes per element; the amax pass's
``abs`` is smaller), the FP8 results kept until the backward returns, and the two GEMM outputs in the
low dtype. Its peak over those six moments is priced as the layer's backward transient (the largest of
its linears: one backward runs at a time), the way the loss's buffers are (``search/layer/intra_op.py``).
Per-row scales (rowwise: 4 bytes per row of each cast) are left out, under 1% of these bytes.
Under ``torch.autocast`` (f32 master weights, no FSDP2) a ``Float8Linear`` keeps no low copy of its
weight (``weight_hp_t`` is the f32 parameter's transpose) and casts its input to the autocast dtype only
where ``torch.is_autocast_enabled()`` (CUDA's autocast) says so: on CPU ranks it saves the f32 input
itself. :func:`saved_copies` says which of autocast's copies a converted linear keeps
(``search/layer/saved.py`` counts the input itself where it keeps no copy).

Peaks: ``partita/data/fp8_peaks.json`` (vendor datasheets, dense). A device type without an entry
(A100, V100, T4, CPU) has no FP8 tensor cores: :func:`check` refuses an fp8 request on it, except
the CPU, whose "fp8" is torchao's emulation on the ranks of a test (priced at its bf16 rate).

Precision per stage (``Stage.fp8``): a stage trains in fp8 only where every device type it runs on
has FP8 tensor cores (``search/pipeline/stage_cost.SolverCosts.cost_model`` prices the others in bf16,
``search/program/plan_build.py`` writes it, the program converts exactly those stages), so a mixed
cluster keeps bf16 on its A100s. The search chooses fp8 only when allowed (``--precision fp8`` without a
layout: an fp8 plan searched beside the bf16 one on every device type, tp 1 on the FP8 ones, the faster
kept, ``search/entry/choices.py``); a hand layout (every stage on the cluster's first device type)
trains every stage in fp8, refused where that type has no FP8. Left out: FP8 with tensor parallelism (torchao's
``Float8ColwiseParallel`` styles) and FP8 all-gathers under FSDP2 are not emitted, so
:func:`check_layout` refuses tp > 1 (and the search keeps fp8 plans at tp 1,
``search/program/realizable.FP8_MAX_TP``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from partita.cluster import Cluster, DeviceType
from partita.errors import ConfigError

RECIPES = ("tensorwise", "rowwise")  # torchao.float8.Float8LinearRecipeName values the program runs
CAST_TRAFFIC = 1.25
CAST_KERNELS = 4
_DATA = Path(__file__).resolve().parents[2] / "data" / "fp8_peaks.json"


@functools.cache
def _peaks() -> dict[str, float]:
    raw = json.loads(_DATA.read_text())
    return {str(k): float(v) * 1e12 for k, v in raw["peaks_tflops"].items()}


def peak(dev: DeviceType) -> float:
    """Dense FP8 FLOP/s of ``dev``: its own ``peak_flops["fp8"]`` (a cluster spec's), the shipped
    datasheet number, the bf16 rate on a CPU (torchao's emulation), else 0 (no FP8 tensor cores)."""
    if "fp8" in dev.peak_flops:
        return float(dev.peak_flops["fp8"])
    if dev.kind == "cpu":
        return dev.flops("bf16")
    return _peaks().get(dev.name, 0.0)


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ConfigError(f"fp8 recipe {recipe!r} is unknown.", f"use one of {', '.join(RECIPES)}.")


def check(device_types: Iterable[DeviceType]) -> None:
    """Refuse fp8 on a device type without FP8 tensor cores (A100, V100, T4), naming the ones that have them."""
    missing = [d.name for d in device_types if peak(d) <= 0]
    if missing:
        have = ", ".join(sorted(_peaks()))
        raise ConfigError(
            f"--precision fp8: {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no FP8 tensor cores "
            f"(FP8 matmuls need Hopper or Ada: {have}).",
            "train in bf16 on these devices (--precision bf16), or give the device type an fp8 peak in the "
            "cluster spec (peak_tflops: {bf16: ..., fp8: ...}) if it has one.",
        )


def check_layout(tp: int) -> None:
    """What the program does not build with fp8 (module docstring): tensor parallelism."""
    if tp > 1:
        raise ConfigError(
            f"--precision fp8 with --tp {tp}: the program converts linears with torchao's float8 training but "
            "does not emit its tensor-parallel styles (Float8ColwiseParallel / Float8RowwiseParallel).",
            "use --tp 1 with fp8 (data and pipeline parallelism run it), or --precision bf16 with tensor parallelism.",
        )


def gemm_time(
    flops: float, bytes_moved: float, dev: DeviceType, eff_flops: float, memory_eff: float, kernel_s: float
) -> float:
    """One FP8 matmul and its casts (module docstring)."""
    hbm = dev.hbm_bandwidth * memory_eff
    t = max(flops / (peak(dev) * eff_flops) if flops > 0 else 0.0, bytes_moved / hbm)
    return t + CAST_TRAFFIC * bytes_moved / hbm + (CAST_KERNELS + 1) * kernel_s


def note(cluster: Cluster, recipe: str) -> str:
    """Why the stages run FP8: each device type's bf16 and FP8 peaks and the casting traffic priced."""
    types = [d for d in cluster.device_types() if d.kind != "cpu"]
    peaks = ", ".join(
        f"{d.name} {d.flops('bf16') / 1e12:g} -> {peak(d) / 1e12:g} TFLOP/s"
        if peak(d) > 0
        else f"{d.name} has no FP8 tensor cores: its stages train in bf16"
        for d in types
    )
    cpu = (
        " CPU ranks run torchao's emulation (priced at their bf16 rate)."
        if len(types) < len(cluster.device_types())
        else ""
    )
    return (
        f"fp8 ({recipe}) as requested, on the stages of the device types with FP8 tensor cores (Stage.fp8): "
        "linear layers' GEMMs in FP8 via torchao, the rest in bf16 with f32 master "
        f"weights and optimizer state; {peaks or 'no GPU types'}; each linear's GEMM also pays {CAST_TRAFFIC:g}x "
        f"the bytes it moves in amax + cast traffic.{cpu}"
    )


CAST_BYTES_PER_ELEMENT = 9.0  # the f32 scaled copy, its clamped copy and the FP8 result, alive together


def backward_transient(grad_out: float, weight: float, inp: float, low: float) -> float:
    """Peak bytes one ``Float8Linear`` backward allocates (module docstring, "Memory"), from the element
    counts of its output gradient, weight and input; ``low``: bytes of the low dtype (the GEMM outputs)."""
    cast = CAST_BYTES_PER_ELEMENT
    g8, w8, x8, grad_in = grad_out, weight, inp, low * inp  # kept FP8 copies (1 byte) and the input gradient
    return max(
        cast * grad_out,  # the output gradient cast for the input gradient's GEMM
        g8 + cast * weight,  # the weight cast (its transpose for that GEMM)
        g8 + w8 + grad_in,  # the input gradient
        g8 + w8 + grad_in + cast * grad_out,  # the output gradient cast again, for the weight gradient's GEMM
        2 * g8 + w8 + grad_in + cast * inp,  # the saved input cast
        2 * g8 + w8 + grad_in + x8 + low * weight,  # the weight gradient
    )


def linear_transient(node: Any, tensors: Any, numel: dict[str, float], low: float) -> float:
    """:func:`backward_transient` of a matmul node whose inputs are a weight (a parameter of rank >= 2) and
    an activation, from ``numel`` (each tensor's local element count); 0 for any other matmul."""
    from partita.ir import Role

    w = [t for t in node.inputs if tensors[t].role is Role.PARAMETER and tensors[t].rank >= 2]
    x = [t for t in node.inputs if tensors[t].role is not Role.PARAMETER]
    if not (w and x):
        return 0.0
    return backward_transient(numel[node.outputs[0]], numel[w[0]], numel[x[0]], low)


def saved_copies(device_kind: str) -> tuple[bool, bool]:
    """``(input copy, weight copy)``: which low copies of autocast's (``search/layer/saved.py``) a
    ``Float8Linear`` keeps for its backward on a device of ``device_kind`` (module docstring, "Memory")."""
    return device_kind != "cpu", False
