"""``stage_ranges.StageParts.memory`` where a stage runs no forward after its first backward (GPipe, or 1F1B
with ``m`` no more than its in-flight count): the peak is the largest of its three moments, the last forward
(activations without gradients), the backward of every micro-batch after the first (the gradients the first
backward made beside one micro-batch's activations fewer) and the end of the last backward (gradients,
ZeRO-0's flat copy). The middle moment was missing: the tiny Llama's first stage (dp 2 x pp 2, ZeRO-1,
``m = 2``) was priced as activations alone and rehearsed +20.0% (fp8) / +24.6% (bf16) over its plan, its
peak in its second backward (``tests/runtime/test_fp8_multiprocess.py``, which checks the real program).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from partita.search.pipeline.stage_ranges import StageParts

STATIC, GRADS, SAVED, TRANSIENT, RS = 1000.0, 150.0, 100.0, 10.0, 7.0


def _parts(*, flat_copy: bool = False, rs_held: float | None = None) -> StageParts:
    """One layer-unit range ``[0, 1)`` with hand-set terms (bytes)."""

    def a(x: float, empty: float = 0.0) -> np.ndarray:  # [U, U + 1]: the range [0, 1) and the empty [0, 0)
        return np.array([[empty, x]])

    return StageParts(
        time=np.array([[np.inf, 1.0]]),
        tail=np.zeros((1, 2)),
        compute=np.zeros((1, 2)),
        comm=np.zeros((1, 2)),
        static=a(STATIC, np.inf),
        base=a(STATIC + GRADS, np.inf),
        gradients=a(GRADS),
        grads=a(GRADS),
        saved=a(SAVED),
        transient=a(TRANSIENT),
        rs_held=None if rs_held is None else a(rs_held),
        recompute="none",
        flat_copy=flat_copy,
        table=None,  # type: ignore[arg-type]  # read only by a zero-bubble count
    )


def _memory(parts: StageParts, flight: float, m: int) -> float:
    return float(parts.memory(np.array([0.0, flight]), m)[0, 1, 1])


def test_a_later_backward_holds_the_first_backwards_gradients_beside_the_activations_left() -> None:
    # two micro-batches, both in flight: the second's backward runs beside the first's gradients
    later = STATIC + GRADS + SAVED + TRANSIENT
    assert later > STATIC + 2 * SAVED + TRANSIENT  # the moment the old price took (activations alone)
    assert _memory(_parts(), 2.0, 2) == pytest.approx(later)
    # a ZeRO-2/3 unit's gradients in flight to the reduce-scatter are there too
    assert _memory(_parts(rs_held=RS), 2.0, 2) == pytest.approx(later + RS)
    # ZeRO-0's flat copy of the gradients, after the last backward, when it is the larger
    assert _memory(_parts(flat_copy=True), 2.0, 2) == pytest.approx(max(later, STATIC + 2 * GRADS))
    # the torch program's buckets in flight (Stage.grad_buckets) instead: the gradients plus the bucket copies
    big = STATIC + 2 * SAVED + TRANSIENT + 2 * GRADS  # activations larger than the later backward's moment
    buckets = dataclasses.replace(_parts(flat_copy=True), bucketed=True, grads=np.array([[0.0, big - STATIC - GRADS]]))
    assert _memory(buckets, 2.0, 2) == pytest.approx(big)
    assert _memory(dataclasses.replace(buckets, bucketed=False), 2.0, 2) == pytest.approx(STATIC + 2 * GRADS)


def test_one_micro_batch_has_no_later_backward_and_more_in_flight_keep_gradients() -> None:
    # m = 1: the activations or the gradients, never both (llama-7b dp8 x tp8 rehearsed no gradients at its peak)
    assert _memory(_parts(), 1.0, 1) == pytest.approx(STATIC + max(SAVED + TRANSIENT, GRADS))
    # a forward after the first backward (m > in flight): the gradients at every activation peak, as before
    assert _memory(_parts(), 2.0, 4) == pytest.approx(STATIC + GRADS + 2 * SAVED + TRANSIENT)
    # the activation moment where it is the largest (saved activations over the gradients)
    big = dataclasses.replace(_parts(), saved=np.array([[0.0, 4 * GRADS]]))
    assert _memory(big, 2.0, 2) == pytest.approx(STATIC + 2 * 4 * GRADS + TRANSIENT)
