"""FP8 pricing (issue 36 part 2, ``search/pricing/fp8.py``): peaks from the datasheets, the GEMM with its
casting traffic, and the refusals (device types without FP8 tensor cores, bad recipes)."""

from __future__ import annotations

import dataclasses

import pytest

from partita.cluster import DEVICE_PRESETS, parse_cluster
from partita.errors import ConfigError
from partita.ir import Prim
from partita.search.pricing import fp8
from partita.search.pricing.config import TrainingConfig
from partita.search.pricing.cost_model import CostModel


def test_fp8_peaks_are_the_datasheets_dense_numbers_and_ampere_volta_have_none() -> None:
    assert fp8.peak(DEVICE_PRESETS["H100-80G"]) == pytest.approx(3958e12 / 2)  # "with sparsity" / 2
    assert fp8.peak(DEVICE_PRESETS["H200"]) == pytest.approx(3958e12 / 2)
    assert fp8.peak(DEVICE_PRESETS["L4"]) == pytest.approx(485e12 / 2)
    for name in ("A100-80G", "A100-40G", "V100-32G", "T4"):
        assert fp8.peak(DEVICE_PRESETS[name]) == 0.0
    with pytest.raises(ConfigError, match="A100-80G has no FP8 tensor cores") as err:
        fp8.check(parse_cluster("8xA100-80G").device_types())
    assert "--precision bf16" in str(err.value)
    fp8.check(parse_cluster("8xH100").device_types())  # no error


def _gemm(cm: CostModel, tokens: int, k: int, n: int) -> float:
    flops = 2.0 * tokens * k * n
    nbytes = 4.0 * (tokens * k + k * n + tokens * n)  # inputs + output at the traced width, as intra_op counts
    return cm.compute_time(Prim.MATMUL, flops, nbytes, "bf16")


def test_fp8_wins_on_large_gemms_and_loses_on_small_ones_where_the_casts_dominate() -> None:
    bf = CostModel.for_device(DEVICE_PRESETS["H100-80G"])
    f8 = dataclasses.replace(bf, fp8="tensorwise")
    big = _gemm(bf, 8192, 16384, 16384) / _gemm(f8, 8192, 16384, 16384)  # a 405B-sized linear
    assert 1.3 < big < 2.0  # at most the 2x peak ratio, less the casts
    assert _gemm(f8, 512, 512, 512) > _gemm(bf, 512, 512, 512)  # memory-bound: casting traffic costs more
    # only MATMUL moves: attention and pointwise kernels price as bf16
    assert f8.compute_time(Prim.ATTENTION, 1e12, 1e9, "bf16") == bf.compute_time(Prim.ATTENTION, 1e12, 1e9, "bf16")
    assert f8.fingerprint() != bf.fingerprint()  # the layer memo keys on it


def test_training_config_checks_the_recipe_and_the_dtype() -> None:
    assert TrainingConfig(global_batch=8, seq_len=16, fp8="rowwise").to_dict()["fp8"] == "rowwise"
    assert "fp8" not in TrainingConfig(global_batch=8, seq_len=16).to_dict()  # bf16 plans unchanged
    with pytest.raises(ConfigError, match="recipe 'delayed' is unknown"):
        TrainingConfig(global_batch=8, seq_len=16, fp8="delayed")
    with pytest.raises(ConfigError, match="dtype 'f32'"):
        TrainingConfig(global_batch=8, seq_len=16, dtype="f32", fp8="tensorwise")
