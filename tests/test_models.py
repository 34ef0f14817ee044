"""Model zoo: names resolve, parameter counts are exact, tiny models build and run on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from partita.errors import ModelError
from partita.models import ModelInfo, list_models, register_model, resolve_model
from partita.models.zoo import MLP

ZOO = [
    "gpt2",
    "gpt3-1.3b",
    "gpt3-2.7b",
    "gpt3-6.7b",
    "gpt3-13b",
    "gpt3-39b",
    "gpt3-175b",
    "llama-7b",
    "llama-70b",
    "mixtral-8x7b",
    "bert-large",
    "vit-huge",
    "resnet-50",
    "gpt2-tiny",
    "llama-tiny",
    "mixtral-tiny",
    "mlp",
]


def _gpt2_arch_params(v: int, p: int, h: int, l: int) -> int:
    return v * h + p * h + l * (12 * h * h + 13 * h) + 2 * h  # tied lm head counted once


@pytest.mark.parametrize(
    "name,h,l,heads",
    [
        ("gpt3-1.3b", 2048, 24, 16),
        ("gpt3-2.7b", 2560, 32, 32),
        ("gpt3-6.7b", 4096, 32, 32),
        ("gpt3-13b", 5120, 40, 40),
        ("gpt3-39b", 8192, 48, 64),
        ("gpt3-175b", 12288, 96, 96),
    ],
)
def test_gpt3_shapes_and_counts(name: str, h: int, l: int, heads: int) -> None:
    handle = resolve_model(name)
    c = handle.config
    assert (c["hidden"], c["num_layers"], c["heads"], c["seq_len"], c["kind"]) == (h, l, heads, 2048, "gpt")
    assert handle.num_params() == _gpt2_arch_params(c["vocab"], 2048, h, l)


def test_known_parameter_counts() -> None:
    assert resolve_model("gpt2").num_params() == 124_439_808
    assert resolve_model("llama-7b").num_params() == 6_738_415_616
    assert resolve_model("resnet-50").num_params() == 25_557_032


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "mixtral-tiny", "mlp"])
def test_tiny_models_build_on_cpu_with_seed(name: str) -> None:
    handle = resolve_model(name)
    a, b = handle.build("cpu", seed=3), handle.build("cpu", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    inputs = handle.example_inputs(2, 8, device="cpu")
    loss = a(**inputs)
    loss = getattr(loss, "loss", loss)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in a.parameters() if p.requires_grad)


def test_unknown_name_lists_close_matches() -> None:
    with pytest.raises(ModelError, match="gpt2-tiny"):
        resolve_model("gpt2-tin")


def test_config_json_and_factory_specs(tmp_path) -> None:
    cfg = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 64, "n_positions": 16}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))
    handle = resolve_model(str(path))
    assert handle.num_params() == _gpt2_arch_params(64, 16, 32, 1)
    fac = resolve_model("partita.models.zoo:mlp_factory")
    assert fac.num_params() == sum(p.numel() for p in MLP().parameters())
    assert set(fac.example_inputs(2, 0, "cpu")) == {"x", "labels"}
    with pytest.raises(ModelError, match="example inputs"):
        resolve_model("partita.models.zoo:MLP")
    with pytest.raises(ModelError, match="cannot load"):
        resolve_model("no_such_pkg.mod:fn")


def test_register_model_hook() -> None:
    info = ModelInfo("test-extra", "torch", 2632, "registered by a test")
    register_model("test-extra", lambda: resolve_model("mlp"), info)
    assert resolve_model("test-extra").num_params() == 2632
    assert info in list_models()
    names = {i.name for i in list_models()}
    assert set(ZOO) <= names
