"""Any model a user brings trains: 15 Hugging Face families by config.json, a ConvNet and an MLP-Mixer.

Each architecture is a tiny config written to ``DIR/config.json`` (``partita/models/families.py``),
resolved by ``resolve_model(DIR)`` in the program exactly as ``partita compile DIR`` would; the torch
models are ``tests.runtime.test_model_matrix:convnet`` / ``:mixer``. Plan layers are the module
paths of the model's repeated container (``stages.guess_blocks``; ``tests/test_models.py`` checks
that the tracer names the same layers). Layouts on 4 CPU ranks, 3 steps, global batch 8:

* ``dp4z3``: one stage, dp=4, ZeRO-3 (every architecture);
* ``pp2``: two stages of dp=2 cut in the middle, 1F1B, ZeRO-0 / ZeRO-2 alternating;
* ``dp2tp2``: one stage, Megatron tp=2 x dp=2, for Mistral, Qwen2 and Gemma (``TENSOR_PARALLEL``);
* ``dp4z1``: one stage, dp=4, ZeRO-1, in place of ``pp2`` for the models the runtime does not pipeline
  (``NOT_PIPELINED``: T5 takes two inputs, and a later stage would see only the boundary activation;
  the tracer marks its graph so the search never pipelines it, ``tests/test_models.py``).

Each task trains on its own loss (``train.make_loss``): next-token for causal LMs, the masked positions
for BERT (``hf.mask_tokens``), the decoder targets for T5 (its inputs packed on dim 1, ``hf.pack``),
class labels for ViT, the ConvNet and the Mixer. Losses equal the seeded single-device run within 1e-4. Seven models (``THROUGH_API``) also train through
``partita.parallelize(model, plan=...)`` and ``partita.step`` with the same plans. All jobs run in ONE torchrun launch
(``model_matrix_worker.py``), so CI pays for 4 torch imports once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partita.backends.torch import stages
from partita.cluster import parse_shorthand
from partita.models import families, resolve_model
from partita.plan import Plan, Stage

ROOT = Path(__file__).resolve().parents[2]
# T5 takes input_ids and decoder_input_ids: pipeline stages after the first would see only the boundary
# activation (stages.GenericStage refuses it; the traced graph's meta["no_pipeline"] keeps it out of the search).
NOT_PIPELINED = {"t5"}


# ---- a user's plain torch models ----------------------------------------------------------------
class ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c)
        self.conv2, self.norm2 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(h)))


class ConvNet(nn.Module):
    def __init__(self, c: int = 16, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.body = nn.Sequential(*[ConvBlock(c) for _ in range(depth)])
        self.fc = nn.Linear(c, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(torch.relu(self.stem(images))).mean(dim=(2, 3)))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    """MLP-Mixer with its blocks in a list called ``blocks`` (the name the old runtime tripped on)."""

    def __init__(self, size: int = 16, patch: int = 4, dim: int = 32, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(3 * patch * patch, dim)
        self.blocks = nn.ModuleList([MixerBlock((size // patch) ** 2, dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, _, _ = images.shape
        p = images.unfold(2, self.patch, self.patch).unfold(3, self.patch, self.patch)
        x = self.embed(p.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * self.patch * self.patch))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def _images(batch: int, seq: int, device: str) -> dict[str, Any]:
    if device == "meta":
        return {"images": torch.zeros(batch, 3, 16, 16, device=device), "labels": torch.zeros(batch, dtype=torch.long)}
    return {"images": torch.randn(batch, 3, 16, 16), "labels": torch.randint(0, 10, (batch,))}


def convnet() -> tuple[nn.Module, Any]:
    return ConvNet(), _images


def mixer() -> tuple[nn.Module, Any]:
    return Mixer(), _images


TENSOR_PARALLEL = {"mistral", "qwen2", "gemma"}
THROUGH_API = {"qwen2", "mistral", "gemma", "bert", "t5", "vit", "mixer"}  # also via partita.parallelize(model)
TORCH_MODELS = {"convnet": "tests.runtime.test_model_matrix:convnet", "mixer": "tests.runtime.test_model_matrix:mixer"}


# ---- plans ------------------------------------------------------------------------------------------
def plan_layers(spec: str) -> list[str]:
    model = resolve_model(spec).build("meta")
    blocks = stages.guess_blocks(model)
    return ["embed", *blocks, "head"]


def megatron(layers: list[str], bias: bool) -> dict[str, tuple[str, str]]:
    """Column-parallel q/k/v/gate/up, row-parallel o/down on the tp axis (Llama-style module names)."""
    out: dict[str, tuple[str, str]] = {}
    for b in layers[1:-1]:
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            out[f"{b}.{p}.weight"] = ("R", "S(0)")
            if bias and "attn" in p:
                out[f"{b}.{p}.bias"] = ("R", "S(0)")
        out[f"{b}.self_attn.o_proj.weight"] = out[f"{b}.mlp.down_proj.weight"] = ("R", "S(1)")
    return out


def make_plan(layers: list[str], layout: str, zero: int = 0, placements: dict | None = None) -> Plan:
    cluster = parse_shorthand("4xCPU")
    if layout in ("dp4z3", "dp4z1"):
        groups, mb = [(layers, (0, 1, 2, 3), 4, int(layout[-1]))], 1
    elif layout == "dp2tp2":
        groups, mb = [(layers, (0, 1, 2, 3), 2, 0)], 2
    else:
        half = len(layers) // 2
        groups, mb = [(layers[:half], (0, 1), 2, zero), (layers[half:], (2, 3), 2, zero)], 2
    tp = 2 if layout == "dp2tp2" else 1
    out = [
        Stage(index=i, layers=tuple(ls), device_type="CPU", ranks=ranks, dp=dp, tp=tp, zero_stage=z)
        for i, (ls, ranks, dp, z) in enumerate(groups)
    ]
    if placements:
        out = [dataclasses.replace(out[0], param_placements=placements)]
    return Plan(
        model={"name": "matrix", "framework": "torch", "layers": layers},
        cluster={"name": cluster.name, "fingerprint": cluster.fingerprint(), "spec": cluster.to_dict()},
        training={"global_batch": 8, "seq_len": 16, "dtype": "f32", "optimizer": "adamw", "lr": 0.01},
        stages=tuple(out),
        schedule="1f1b",
        micro_batch_size=mb,
        num_micro_batches=2,
        predicted={"step_time_s": 0.05},
        partita_version="0.1.0",
    )


def jobs(tmp: Path) -> list[dict[str, Any]]:
    specs = {f: str(families.write_config(tmp / f, families.tiny(f))) for f in families.FAMILIES}
    specs.update(TORCH_MODELS)
    only = os.environ.get("PARTITA_MATRIX_ONLY")  # a comma-separated subset, to debug a few models
    if only:
        specs = {k: v for k, v in specs.items() if k in only.split(",")}
    out = []
    for i, (name, spec) in enumerate(specs.items()):
        layers = plan_layers(spec)
        layouts = [("dp4z3", 3), ("dp4z1", 1) if name in NOT_PIPELINED else ("pp2", 2 * (i % 2))]
        for layout, zero in layouts:
            plan = make_plan(layers, layout, zero)
            out.append({"id": f"{name}-{layout}", "spec": spec, "plan": plan.to_json(), "steps": 3})
            if name in THROUGH_API:
                out.append({**out[-1], "id": f"{name}-{layout}-api", "api": True})
        if name in TENSOR_PARALLEL:  # Megatron tp=2 x dp=2 on the model's own attention (local heads)
            plan = make_plan(layers, "dp2tp2", placements=megatron(layers, bias=name == "qwen2"))
            out.append({"id": f"{name}-dp2tp2", "spec": spec, "plan": plan.to_json(), "steps": 3})
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_architecture_trains_like_one_device(tmp_path: Path) -> None:
    todo = jobs(tmp_path)
    (tmp_path / "jobs.json").write_text(json.dumps(todo))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(ROOT / "tests/runtime/model_matrix_worker.py"), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")]
    t0 = time.perf_counter()
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    text = (tmp_path / "log.txt").read_text()
    first_error = text.find("Traceback")
    assert proc.returncode == 0, text[first_error : first_error + 6000] if first_error >= 0 else text[-6000:]
    got = json.loads((tmp_path / "out.json").read_text())
    print(f"model matrix: {len(todo)} jobs in one launch, {time.perf_counter() - t0:.1f}s")
    assert set(got) == {j["id"] for j in todo}
    for job_id, r in got.items():
        assert len(r["losses"]) == 3, job_id
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(r["reference"]), rtol=1e-4, atol=1e-4, msg=job_id
        )
    names = {j.split("-")[0] for j in got}
    assert names == (set(families.FAMILIES) | set(TORCH_MODELS) if not os.environ.get("PARTITA_MATRIX_ONLY") else names)
    assert {j.split("-")[0] for j in got if j.endswith("-api")} == THROUGH_API & names
    assert {j.split("-")[0] for j, r in got.items() if j.endswith("-dp2tp2")} == TENSOR_PARALLEL & names
    pipelined = {j.split("-")[0] for j, r in got.items() if r["num_stages"] > 1}
    assert pipelined == names - NOT_PIPELINED
