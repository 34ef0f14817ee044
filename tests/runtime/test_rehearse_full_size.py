"""`partita rehearse` at full size (split out of ``test_rehearse.py`` so that the test run's workers share it out).

The slow tests rehearse llama-7b at full size on 64 ranks (dp8 x tp8, Megatron placements written
by hand, a bf16 plan) and check the tensor-parallel traffic per layer against Megatron's closed
form: counts and bytes (the column-parallel input is cast to bf16 before its DTensor boundary, so the
backward all-reduces move bf16 as Megatron's do, ``backends/torch/tp.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partita.backends.torch import rehearse
from partita.models.zoo import resolve_model

_DONE: dict[tuple[str, str], dict] = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rehearse")


# ---- full size -----------------------------------------------------------------------------------------
def _llama_7b(work: Path) -> dict:
    """llama-7b on 64 ranks (dp8 x tp8, Megatron placements by hand, bf16 plan), rehearsed once."""
    import sys

    if ("llama-7b", "megatron") not in _DONE:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
        from rehearse import megatron_llama_plan, write_plan  # bench/rehearse.py

        plan = megatron_llama_plan("llama-7b", "64xH100-80G", 8, 2048, tp=8, dp=8, micro_batch=1)
        _DONE["llama-7b", "megatron"] = rehearse.rehearse_dir(write_plan(work / "llama7b", plan, "llama-7b"))
    return _DONE["llama-7b", "megatron"]


B, S, H, V, L, TP = 1, 2048, 4096, 32000, 32, 8  # llama-7b, micro-batch 1, one micro-batch per step


@pytest.mark.slow
def test_llama_7b_full_size_tp_counts_and_gradient_sync(work: Path) -> None:
    """Megatron: 4 all-reduces per block and micro-batch (2 forward, 2 backward), + the LM head's
    input-gradient all-reduce and its logits all-gather; one flat dp all-reduce of this rank's
    gradients (f32 master gradients: 4 bytes per local parameter)."""
    st = _llama_7b(work)["stages"][0]
    assert st["collectives"]["all_reduce@tp"]["count"] == 4 * L + 1
    assert st["collectives"]["all_gather@tp"] == {"count": 1, "bytes": B * S * V * 2}  # bf16 logits
    model = resolve_model("llama-7b").build("meta")
    col_row = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
    local = sum(p.numel() // (TP if any(k in n for k in col_row) else 1) for n, p in model.named_parameters())
    assert st["collectives"]["all_reduce@dp"] == {"count": 1, "bytes": 4 * local}
    # peak: f32 parameters and Adam's two f32 moments, and either no gradients yet (the end of the only
    # micro-batch's forward; zero_grad frees them between steps) or every f32 gradient (the step's end): with
    # the fused norms and SwiGLU (backends/torch/fused.py, issue 32) the forward keeps less than before
    mem = st["memory_by_category"]
    assert 4 * local <= mem["parameters"] <= 4 * local + 2**20 and mem["gradients"] in (0, 4 * local)
    assert 8 * local <= mem["optimizer"] <= 8 * local + 2**20


@pytest.mark.slow
def test_llama_7b_full_size_tp_bytes_are_megatron_bf16(work: Path) -> None:
    """Megatron-LM in bf16: each of the 4L+1 tensor-parallel all-reduces moves b*s*h bf16 values."""
    st = _llama_7b(work)["stages"][0]
    assert st["collectives"]["all_reduce@tp"]["bytes"] == (4 * L + 1) * B * S * H * 2
