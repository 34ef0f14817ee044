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


# ---- any Hugging Face config.json (issue 16) ---------------------------------------------------------
from partita.models import families, hf  # noqa: E402


@pytest.mark.parametrize("family", families.FAMILIES)
def test_config_json_of_every_family_builds_by_its_architecture(tmp_path, family: str) -> None:
    cfg = families.tiny(family)
    handle = resolve_model(str(families.write_config(tmp_path / family, cfg)))
    model = handle.build("meta")
    assert type(model).__name__ == cfg["architectures"][0] == handle.name  # named from the config, not "config"
    inputs = handle.example_inputs(2, 16, "meta")
    want = {"t5": "seq2seq-lm", "bert": "masked-lm", "vit": "image-classification"}.get(family, "causal-lm")
    assert handle.config["task"] == want and handle.config["shift_labels"] == (want == "causal-lm")
    assert "labels" in inputs and ("decoder_input_ids" in inputs) == (family == "t5")
    # dropout is off, whatever the config says (every layout must equal the seeded reference)
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]


def test_config_task_choice_and_names(tmp_path) -> None:
    raw = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 64, "vocab_size": 64}  # fmt: skip
    d = families.write_config(tmp_path / "my-bert", raw)
    with pytest.raises(ModelError, match="--task"):  # bert is a masked LM and a causal LM: ambiguous
        resolve_model(str(d))
    masked = resolve_model(f"{d}#masked-lm")
    assert type(masked.build("meta")).__name__ == "BertForMaskedLM" and masked.name == "my-bert"
    assert type(resolve_model(f"{d / 'config.json'}#causal-lm").build("meta")).__name__ == "BertLMHeadModel"
    with pytest.raises(ModelError, match="no image-classification model"):
        resolve_model(f"{d}#image-classification")
    named = families.write_config(tmp_path / "x", {**raw, "_name_or_path": "acme/bert-mini"})
    assert resolve_model(f"{named}#masked-lm").name == "acme/bert-mini"
    typo = families.write_config(tmp_path / "typo", {"model_type": "qwen3x"})
    with pytest.raises(ModelError, match="did you mean"):
        resolve_model(str(typo))
    assert hf.split_spec("a/config.json#masked-lm") == ("a/config.json", "masked-lm")


def test_cli_task_flag(tmp_path, capsys) -> None:
    from partita.cli import main

    raw = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 16}  # fmt: skip
    d = families.write_config(tmp_path / "b", raw)
    assert main(["trace", str(d), "--task", "masked-lm", "--batch", "2", "--seq", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "b" and out["num_params"] == resolve_model(f"{d}#masked-lm").num_params()


@pytest.mark.slow
@pytest.mark.parametrize("family", families.FAMILIES)
def test_traced_layers_and_parameter_count(tmp_path, family: str) -> None:
    """The tracer counts every parameter once and names the layers the module tree has (the model
    matrix builds its plans from ``stages.guess_blocks``)."""
    from partita.backends.torch import stages
    from partita.driver import trace_model

    spec = str(families.write_config(tmp_path / family, families.tiny(family)))
    traced = trace_model(spec, batch=2, seq=16)
    handle = resolve_model(spec)
    assert traced.graph.num_params() == handle.num_params()
    blocks = stages.guess_blocks(handle.build("meta"))
    assert [layer.name for layer in traced.graph.layers] == ["embed", *blocks, "head"]


def test_live_encoder_decoder_gets_decoder_inputs() -> None:
    """``partita.parallelize(t5_model)`` with no example inputs: the decoder's inputs come from the config."""
    import transformers

    from partita.frontends.trace import trace_handle
    from partita.models.zoo import module_handle

    cfg = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=64)
    model = transformers.T5ForConditionalGeneration(cfg)
    handle = module_handle(model)
    assert set(handle.example_inputs(2, 8, "meta")) == {"input_ids", "decoder_input_ids", "labels"}
    assert trace_handle(handle, batch=2, seq=8).num_params() == sum(p.numel() for p in model.parameters())
