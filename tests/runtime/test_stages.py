"""Stages of any module tree (``backends/torch/stages.py``), in one process: cut a model into stages,
run them in a chain (each on the previous one's output) and back, and compare the logits and every
gradient with the whole model. T5's cuts carry several tensors (decoder state, encoder output,
position bias: ``backends/torch/boundary.py``), one of them through a middle stage that also reads it.
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


def _chained_stages(spec: str, *cuts: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict]:
    """The model cut before plan layers ``cuts`` (two stages for one cut), each stage built from its own
    copy, run forward in a chain and backward in reverse, as the pipeline runners do."""
    handle = resolve_model(spec)
    layers = ["embed", *stages.guess_blocks(handle.build("meta")), "head"]
    inputs = handle.example_inputs(2, 8, "cpu")
    inputs.pop("labels")
    # several inputs (T5: input_ids, decoder_input_ids) travel as the runtime's one batch tensor (hf.pack)
    x = next(iter(inputs.values())) if len(inputs) == 1 else torch.stack(list(inputs.values()), dim=1)
    ref = handle.build("cpu", seed=0)
    want = stages._logits(ref(**inputs))
    want.square().sum().backward()
    bounds = [0, *cuts, len(layers)]
    groups = [layers[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    parts = []
    for keep in groups:
        model = handle.build("cpu", seed=0)
        tpar.boundary_shapes(model, groups, x[:1])
        parts.append(tpar.split_stage(model, keep, layers, CPU))
    sent, received, h = [], [], x
    for k, part in enumerate(parts):
        if k:
            h = h.detach().requires_grad_(True)
            received.append(h)
        h = part(h)
        sent.append(h)
    got = sent[-1]
    got.square().sum().backward()
    for out, inp in reversed(list(zip(sent[:-1], received))):
        out.backward(inp.grad)
    grads = {n: p.grad for part in parts for n, p in part.named_parameters() if p.grad is not None}
    for names in tpar.tied_groups(ref):  # a tied weight's gradient is the sum over the stages holding it
        total = sum(grads[n] for n in names if n in grads)
        grads.update({n: total for n in names})
    return want, {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}, got, grads


@pytest.mark.parametrize(
    "name, cut",
    [
        ("qwen2", 2),
        ("bloom", 1),
        ("vit", 3),
        ("mixer", 3),
        ("convnet", 1),
        ("t5", 1),
        ("t5", 2),
        ("t5", 4),
        ("t5", 6),
        ("t5", (1, 4)),
    ],
)
def test_two_stages_equal_the_whole_model(tmp_path: Path, name: str, cut: int | tuple[int, ...]) -> None:
    want, ref_grads, got, grads = _chained_stages(_spec(tmp_path, name), *(cut if isinstance(cut, tuple) else (cut,)))
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
    # two stages cut as the model matrix cuts (after decoder block 0): the boundary carries three tensors
    half = len(layers) // 2
    model = handle.build("cpu", seed=0)
    shapes = tpar.boundary_shapes(model, [layers[:half], layers[half:]], packed[:1])
    stage = tpar.split_stage(model, layers[half:], layers, CPU)
    got, sent = stage.boundary_layout()
    assert not sent and [c.key for c in got] == [
        ("decoder.block.0.layer.2", 0, 0),  # the decoder's hidden state
        ("encoder", 0, 0),  # the encoder output every decoder block's cross-attention reads
        ("decoder.block.0.layer.0", 0, 1),  # block 0's relative position bias, reused by every block
    ]
    assert [(c.shape, c.batched) for c in got] == [((8, 64), True), ((8, 64), True), ((1, 4, 8, 8), False)]
    assert shapes[0] == (torch.Size([2 * 8 * 64 + 4 * 8 * 8]), torch.float32)  # packed: the bias once per sample
    with pytest.raises(PlanError, match="received a boundary tensor of shape"):
        stage(torch.zeros(2, 8, 64))  # an unpacked activation: not what the cut carries


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(h) * (ids[..., None] > 0)


class _ReadsInputLate(torch.nn.Module):
    """A head module that reads a model input itself (a later stage sees inputs only as zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)) for _ in range(2)]
        )
        self.head = _Head()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h, ids)


def test_boundary_checks_refuse_what_a_cut_cannot_carry() -> None:
    """A later stage whose module reads a model input is refused (it would read zeros); what a stage
    returns is checked against the cut's layout (name, shape, dtype)."""
    from partita.backends.torch import boundary

    layers = ["embed", "blocks.0", "blocks.1", "head"]

    def probed() -> torch.nn.Module:
        model = _ReadsInputLate()
        stages.attach_inputs(model, lambda b, s, d: {"ids": torch.ones(b, s, dtype=torch.long, device=d)}, 4)
        got = tpar.boundary_shapes(model, [layers[:2], layers[2:]], torch.ones(1, 4, dtype=torch.long))
        assert got[0] == (torch.Size([4, 16]), torch.float32)  # one tensor crosses: sent as it is
        return model

    tpar.split_stage(probed(), layers[:2], layers, CPU)  # the first stage reads its inputs: fine
    with pytest.raises(PlanError, match=r"reads model input\(s\) \{'ids': \['head'\]\}"):
        tpar.split_stage(probed(), layers[2:], layers, CPU)
    hidden = boundary.Carried(("blocks.0", 0, 0), (4, 16), torch.float32, True)
    bias = boundary.Carried(("blocks.0", 0, 1), (1, 2, 4, 4), torch.float32, False)
    h, b = torch.randn(3, 4, 16, requires_grad=True), torch.randn(1, 2, 4, 4, requires_grad=True)
    x = boundary.pack([h, b], [hidden, bias], "test")
    assert x.shape == (3, 4 * 16 + 2 * 4 * 4)
    got = boundary.unpack(x, [hidden, bias], "test")
    torch.testing.assert_close(got[hidden.key], h)
    torch.testing.assert_close(got[bias.key], b)
    (got[hidden.key].sum() + 3 * got[bias.key].sum()).backward()
    torch.testing.assert_close(b.grad, torch.full_like(b, 3.0))  # the shared tensor's gradient, once
    with pytest.raises(PlanError, match=r"blocks.0 \(call 0\) output 1 has shape \(2, 2, 4, 4\)"):
        boundary.pack([h, torch.zeros(2, 2, 4, 4)], [hidden, bias], "test")
