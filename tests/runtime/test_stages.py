"""Stages of any module tree (``backends/torch/stages.py``), in one process: cut a model into two stages,
run stage 0 then stage 1 on its output, and compare the logits and every gradient with the whole model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partita.backends.torch import parallel as tpar
from partita.backends.torch import stages
from partita.errors import PlanError
from partita.models import families, resolve_model
from tests.runtime.test_model_matrix import TORCH_MODELS

CPU = torch.device("cpu")


def _spec(tmp: Path, name: str) -> str:
    if name in TORCH_MODELS:
        return TORCH_MODELS[name]
    return str(families.write_config(tmp / name, families.tiny(name)))


def _two_stages(spec: str, cut: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict]:
    handle = resolve_model(spec)
    layers = ["embed", *stages.guess_blocks(handle.build("meta")), "head"]
    inputs = handle.example_inputs(2, 8, "cpu")
    inputs.pop("labels")
    x = next(iter(inputs.values()))
    ref = handle.build("cpu", seed=0)
    want = stages._logits(ref(**inputs))
    want.square().sum().backward()
    a, b = layers[:cut], layers[cut:]
    parts = []
    for keep in (a, b):
        model = handle.build("cpu", seed=0)
        tpar.boundary_shapes(model, [a, b], x[:1])
        parts.append(tpar.split_stage(model, keep, layers, CPU))
    h = parts[0](x)
    h_in = h.detach().requires_grad_(True)
    got = parts[1](h_in)
    got.square().sum().backward()
    h.backward(h_in.grad)
    grads = {n: p.grad for part in parts for n, p in part.named_parameters() if p.grad is not None}
    for names in tpar.tied_groups(ref):  # a tied weight's gradient is the sum over the stages holding it
        total = sum(grads[n] for n in names if n in grads)
        grads.update({n: total for n in names})
    return want, {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}, got, grads


@pytest.mark.parametrize("name, cut", [("qwen2", 2), ("bloom", 1), ("vit", 3), ("mixer", 3), ("convnet", 1)])
def test_two_stages_equal_the_whole_model(tmp_path: Path, name: str, cut: int) -> None:
    want, ref_grads, got, grads = _two_stages(_spec(tmp_path, name), cut)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_a_child_called_blocks_and_what_a_stage_owns() -> None:
    handle = resolve_model(TORCH_MODELS["mixer"])
    model = handle.build("cpu", seed=0)
    layers = ["embed", *stages.guess_blocks(model), "head"]
    assert layers[1:3] == ["blocks.0", "blocks.1"]
    x = handle.example_inputs(1, 0, "cpu")["images"]
    tpar.boundary_shapes(model, [layers[:3], layers[3:]], x)
    assert tpar.layer_paths(model, "embed") == ("embed",) and tpar.layer_paths(model, "head") == ("norm", "head")
    stage = tpar.split_stage(model, layers[:3], layers, CPU)
    assert stage.blocks() == [model.blocks[0], model.blocks[1]]  # the program's call, not the model's list
    assert isinstance(stage.blocks, torch.nn.ModuleList)  # attribute walkers (DCP) still find the child
    own = {n.split(".")[0] for n, _ in stage.named_parameters()}
    assert own == {"embed", "blocks"} and not any(
        n.startswith(("blocks.2", "blocks.3")) for n, _ in stage.named_parameters()
    )


def test_encoder_decoder_single_stage_and_refused_pipeline(tmp_path: Path) -> None:
    handle = resolve_model(_spec(tmp_path, "t5"))
    inputs = handle.example_inputs(2, 8, "cpu")
    inputs.pop("labels")
    layers = ["embed", *stages.guess_blocks(handle.build("meta")), "head"]
    ref = handle.build("cpu", seed=0)
    want = ref(**inputs).logits
    model = handle.build("cpu", seed=0)
    x = inputs["input_ids"]
    tpar.boundary_shapes(model, [layers], x[:1])
    one = tpar.split_stage(model, layers, layers, CPU)
    one.feed([{"decoder_input_ids": inputs["decoder_input_ids"]}])
    torch.testing.assert_close(one(x), want)
    # the runtime's batch tensor: both inputs stacked on dim 1 (hf.pack), unpacked by the model's pre-hook
    packed = torch.stack([x, inputs["decoder_input_ids"]], dim=1)
    model = handle.build("cpu", seed=0)
    tpar.boundary_shapes(model, [layers], packed[:1])
    torch.testing.assert_close(tpar.split_stage(model, layers, layers, CPU)(packed), want)
    model = handle.build("cpu", seed=0)
    tpar.boundary_shapes(model, [layers[:3], layers[3:]], x[:1])
    with pytest.raises(PlanError, match="takes 2 inputs"):
        tpar.split_stage(model, layers[3:], layers, CPU)
