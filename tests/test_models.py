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


# ---- the catalogue `partita models` lists (issue 35 item 10) ------------------------------------------
def test_partita_models_builds_no_model() -> None:
    """Listing the zoo reads the shipped catalogue: no torch, transformers or jax imported (it built
    all 19 models before, ~20 s on a loaded machine)."""
    import subprocess
    import sys

    code = (
        "import sys, io, contextlib\n"
        "from partita.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out): rc = main(['models', '--json'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules)\n"
        "print(rc, heavy, len(__import__('json').loads(out.getvalue())))\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.stdout.split("\n")[0] == f"0 [] {len(ZOO) + 2}", got.stderr[-2000:]


def test_shipped_catalogue_is_current_and_counts_as_the_builds() -> None:
    """The file is current (else: ``python -m partita.models.catalog``) and its counts are the built
    models' (the cheap ones built here; the generator builds every one)."""
    from partita.models import catalog

    shipped = catalog.load_catalog()
    assert shipped is not None, "stale: run python -m partita.models.catalog"
    by_name = {m["name"]: m for m in shipped}
    assert set(ZOO) | {"jax-gpt-tiny", "jax-mlp"} == set(by_name)
    for name in ("mlp", "gpt2-tiny", "llama-tiny", "gpt2"):
        h = resolve_model(name)
        assert by_name[name] == {
            "name": name,
            "framework": "torch",
            "num_params": h.num_params(),
            "description": h.description,
        }


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


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5", "vit"])
def test_loss_per_task_is_the_models_own(tmp_path, family: str) -> None:
    """The runtime's loss (``train.make_loss`` on ``train.make_batch``) equals the loss transformers
    computes itself from the labels: next-token for causal LMs, the masked positions only for BERT, the
    decoder targets for T5 (whose decoder reads the labels shifted right by ``_shift_right``), class
    labels for ViT. The reference run and every layout use this loss, so the matrix compares like with like."""
    from partita.backends.torch import train
    from partita.backends.torch.parallelize import local_step

    handle = resolve_model(str(families.write_config(tmp_path / family, families.tiny(family))))
    model = handle.build("cpu", seed=0)
    training = {"global_batch": 4, "seq_len": 20}
    x, y = train.make_batch(handle, training, 0, 3)
    shift = train.shift_labels(handle)
    assert shift == (family == "gpt2")
    ours = train.make_loss(train.num_targets(y, shift), shift)(model(x), y)
    key = "pixel_values" if family == "vit" else "input_ids"
    theirs = model(**{key: x[:, 0] if family == "t5" else x}, labels=y).loss  # T5: decoder inputs from labels
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # partita.step outside torchrun (a live module: its task from its transformers class)
    torch.testing.assert_close(local_step(model, x, y), theirs.detach(), rtol=1e-5, atol=1e-6)
    if family == "bert":  # hf.masked_count positions per row, replaced by the mask id, the only targets
        k = hf.masked_count(20)
        assert k == 3 and ((y != hf.IGNORE_INDEX).sum(dim=1) == k).all()
        mask_id = handle.config["mask_token_id"]
        assert mask_id == 127 and (x[y != hf.IGNORE_INDEX] == mask_id).all() and (x[y == hf.IGNORE_INDEX] < 127).all()
        _, y1 = train.make_batch(handle, {**training, "global_batch": 1}, 0, 0)  # what the runner counts
        assert training["global_batch"] * train.num_targets(y1, shift) == train.num_targets(y, shift) == 4 * k
        x2, y2 = train.make_batch(handle, training, 0, 3)
        assert torch.equal(x2, x) and torch.equal(y2, y)  # masked from the seed: every rank draws the same
        assert not torch.equal(train.make_batch(handle, training, 0, 4)[1], y)
    if family == "t5":  # one batch tensor: input_ids and decoder_input_ids stacked on dim 1
        assert x.shape == (4, 2, 20) and torch.equal(x[:, 1], model._shift_right(y))
    if family == "vit":
        assert y.shape == (4,) and model(x).logits.shape == (4, 10)


class _MaskedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.relu(self.fc1(self.norm(h))))


class _Masked(torch.nn.Module):
    """Every block's output is multiplied by a mask built from the ``attention_mask`` input without
    parameters: a later pipeline stage (which sees the inputs only as zeros) could not rebuild it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList([_MaskedBlock() for _ in range(4)])
        self.head = torch.nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        keep = attention_mask[:, :, None].float()
        h = self.embed(input_ids)
        for b in self.blocks:
            h = b(h) * keep
        return self.head(h)


def test_search_never_pipelines_a_model_the_runtime_refuses(tmp_path) -> None:
    """T5 (two inputs, several tensors crossing a decoder cut) pipelines; a model whose cuts carry a
    tensor computed from an input without parameters does not (``passes/boundaries.pipeline_refusal``:
    a later stage sees the inputs only as zeros): the pass marks the graph and the search keeps to one
    stage; where only a pipeline would fit, the infeasible message says why none was searched."""
    import dataclasses

    from partita.cluster import cluster_from_dict
    from partita.errors import ConfigError, InfeasibleError
    from partita.frontends.trace import trace_handle
    from partita.frontends.trace_torch import trace_module
    from partita.passes.pipeline import run_passes
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.entry.planner import plan_graph
    from partita.search.pricing.config import TrainingConfig

    graph = trace_handle(resolve_model(str(families.write_config(tmp_path / "t5", families.tiny("t5")))), seq=16)
    assert "no_pipeline" not in graph.meta
    ids = torch.zeros(2, 8, dtype=torch.long)
    toy = run_passes(trace_module(_Masked(), {"input_ids": ids, "attention_mask": ids + 1}, name="masked"))
    why = toy.meta["no_pipeline"]
    assert "computed from the model input(s) attention_mask without parameters" in why
    marked = dataclasses.replace(graph, meta={**graph.meta, "no_pipeline": why})

    def tiny(memory_gb: float) -> object:
        return cluster_from_dict(
            {
                "nodes": [{"device": "Tiny", "num_nodes": 1, "gpus_per_node": 4}],
                "device_types": [
                    {"name": "Tiny", "peak_tflops": {"bf16": 10, "f32": 10}, "memory_GB": memory_gb, "hbm_GBps": 100}
                ],
            }
        )

    training = TrainingConfig(global_batch=2, seq_len=16)  # 1.4 MB: two stages fit, one stage (1.7 MB) does not
    assert plan_graph(graph, tiny(0.0014), training).num_stages >= 2  # T5 pipelines where it must
    with pytest.raises(InfeasibleError, match="pipeline stages are not searched for this model: _Masked: tensor"):
        plan_graph(marked, tiny(0.0014), training)
    one = plan_graph(marked, tiny(1.0), training)
    assert one.num_stages == 1 and one.search["not_pipelined"] == why  # the report says why
    with pytest.raises(ConfigError, match="pp=2 cannot be built"):  # a hand layout (compile --pp 2) neither
        hand_plan(marked, tiny(1.0), training, tp=1, pp=2, dp=2, micro_batch=1)
    assert hand_plan(graph, tiny(1.0), training, tp=1, pp=2, dp=2, micro_batch=1).num_stages == 2
    gpt = trace_handle(resolve_model(str(families.write_config(tmp_path / "g", families.tiny("gpt2")))), seq=16)
    assert "no_pipeline" not in gpt.meta


def test_token_file_for_masked_and_seq2seq_models(tmp_path) -> None:
    """A token file trains a masked LM on masked windows (each row masked from its own seed, so a rank
    reading rows 2-3 masks them as the reference reading rows 0-3 does, with the per-row target count
    the runner divides by); a seq2seq model needs (source, target) pairs and is refused."""
    import numpy as np

    from partita.backends.torch import data as tdata
    from partita.backends.torch import train

    tokens = tmp_path / "train.bin"
    (np.arange(4000) % 120).astype(np.uint16).tofile(tokens)
    training = {"global_batch": 4, "seq_len": 20}
    bert = resolve_model(str(families.write_config(tmp_path / "bert", families.tiny("bert"))))
    source = train.make_data(bert, training, 5, str(tokens), "uint16")
    x, y = source.rows(1, [0, 1, 2, 3])
    x2, y2 = source.rows(1, [2, 3])
    assert torch.equal(x[2:], x2) and torch.equal(y[2:], y2)
    plain = tdata.TokenFile(str(tokens), "uint16", 20, 4).rows(1, [0, 1, 2, 3])[0]
    masked = y != hf.IGNORE_INDEX
    assert (masked.sum(dim=1) == hf.masked_count(20)).all() and torch.equal(y[masked], plain[masked])
    assert (x[masked] == bert.config["mask_token_id"]).all() and torch.equal(x[~masked], plain[~masked])
    assert not torch.equal(masked, source.rows(2, [0, 1, 2, 3])[1] != hf.IGNORE_INDEX)  # new positions each step
    _, y1 = train.make_batch(bert, {**training, "global_batch": 1}, 5, 0)
    assert 4 * train.num_targets(y1, False) == train.num_targets(y, False)
    t5 = resolve_model(str(families.write_config(tmp_path / "t5", families.tiny("t5"))))
    with pytest.raises(tdata.DataError, match="pairs"):
        train.make_data(t5, training, 0, str(tokens), "uint16")
