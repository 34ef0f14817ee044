"""Per-parameter parity: every parameter's gradient at step 1 and its value after the last step, name
by name, equal the seeded single-device run's (``backends/torch/parity.py``, f32 tolerance), for the
families the model matrix does not train and a user CNN with a root-level parameter.

Families (``families.MORE_FAMILIES``, tiny configs) x layouts on 4 CPU ranks, 2 steps of SGD (:data:`SGD`),
global batch 8:

* ``dp4z3``: one stage, dp=4, ZeRO-3;
* ``tp2pp2``: two stages (1F1B) of tp=2, dp=1;
* ``dp2tp2``: one stage, tp=2 x dp=2;
* ``dp4z1``: dp=4, ZeRO-1, for the CNN in place of ``tp2pp2`` (its root-level parameter belongs to no stage,
  so it is not pipelined: ``stages.GenericStage`` refuses that cut with one paragraph).

The tp layouts shard, Megatron-style (:func:`megatron`), the ``nn.Linear`` modules of each block with
Llama-style names (q/k/v, DeepSeek's q_b/kv_b, gate/up columns; o/down rows) and experts modules by
expert (``S(0)``, role ``expert``) where the runtime runs them expert-parallel. The nearest legal
layout where a family's weights cannot be split that way, said here: ModernBERT (``Wqkv`` and ``Wi`` are
fused column pairs), Mamba (``in_proj`` holds x|z) and gpt-oss (its attention holds per-head ``sinks``
of its own, which ``tp.py`` refuses to leave unplaced; its experts carry biases) run tp=2 with nothing
sharded: every tp rank computes the whole block, which must still match one device.

Issue 31's faults, each a job that fails on the old code: ``qwen3-dp2tp2``, ``qwen3_moe-dp2tp2`` and
``gemma3_text-dp2tp2`` (per-head ``q_norm``/``k_norm`` held partial gradients over tp),
``rootcnn-dp4z3`` (a parameter on the model's root got no dp gradient sync under ZeRO-3) and
``deepseek_v3-dp2tp2`` / ``-tp2pp2`` (the rope key's gradient was partial over tp). BatchNorm and
Whisper are refused before anything runs (``tests/runtime/test_parity_refusals.py``).
All jobs run in ONE torchrun launch (``model_matrix_worker.py``).
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

from partita.models import families, resolve_model
from partita.plan import Plan
from tests.runtime.plans import image_inputs
from tests.runtime.test_model_matrix import make_plan, plan_layers

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
LAYOUTS = ("dp4z3", "tp2pp2", "dp2tp2")
COLUMNS = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROWS = ("o_proj", "down_proj")
# SGD with momentum: a parameter's update is proportional to its gradient, so the parameters after the last
# step compare like the gradients (measured: within 4e-7 relative; the model matrix covers AdamW, where
# parity.adam_noise leaves out the elements whose gradient is float noise). DeepSeek-V3's tp jobs were 0.2
# apart after two AdamW steps: not Adam's noise but a missing tp reduction (the rope key's gradient, tp.py's
# _Hooks.sum_whole_edges), 1e-3..8e-3 relative in the step-1 gradients, now judged at 1e-4.
SGD = {"optimizer": "sgd", "momentum": 0.9, "lr": 0.05}
NOTHING_SHARDED = {"modernbert", "mamba", "gpt_oss"}  # nearest legal layout: tp=2, replicated blocks
FAULTS = {  # issue 31: the jobs that reproduce each fault
    "per-head norm partial gradient over tp": ("qwen3-dp2tp2", "qwen3_moe-dp2tp2", "gemma3_text-dp2tp2"),
    "root-level parameter without dp sync": ("rootcnn-dp4z3",),
    # the rope key k_pe, broadcast over this rank's heads, held a partial gradient: every step-1 gradient of the
    # tp ranks off by 1e-3..8e-3 relative (within the old 1e-2 tolerance; GRAD_TOLERANCE's f32 is 1e-4)
    "DeepSeek-V3 rope key partial gradient over tp": ("deepseek_v3-dp2tp2", "deepseek_v3-tp2pp2"),
}


# ---- a user's CNN with a parameter on its root module -------------------------------------------
class RootCNN(nn.Module):
    """A small CNN whose output scale is a parameter of the root module itself (no submodule owns it)."""

    def __init__(self, c: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(2, c)) for _ in range(2)])
        self.fc = nn.Linear(c, classes)
        self.scale = nn.Parameter(torch.ones(classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(images))
        for block in self.body:
            h = torch.relu(h + block(h))
        return self.fc(h.mean(dim=(2, 3))) * self.scale


_images = image_inputs(8)  # 8 x 8 RGB images, 10 classes


def rootcnn() -> tuple[nn.Module, Any]:
    return RootCNN(), _images


# ---- plans --------------------------------------------------------------------------------------
def megatron(spec: str, blocks: list[str]) -> dict[str, tuple[str, str]]:
    """Column / row placements of the blocks' Llama-named ``nn.Linear`` modules; experts by expert."""
    from partita.backends.torch import moe

    if any(f"/{name}" in spec for name in NOTHING_SHARDED):
        return {}
    model = resolve_model(spec).build("meta")
    out: dict[str, tuple[str, str]] = {}
    for path, mod in model.named_modules():
        if not any(path.startswith(b + ".") for b in blocks):
            continue
        leaf = path.rpartition(".")[2]
        if isinstance(mod, nn.Linear) and leaf in COLUMNS:
            out[f"{path}.weight"] = ("R", "S(0)")
            if mod.bias is not None:
                out[f"{path}.bias"] = ("R", "S(0)")
        elif isinstance(mod, nn.Linear) and leaf in ROWS:
            out[f"{path}.weight"] = ("R", "S(1)")
        elif moe.is_experts_module(mod) and not getattr(mod, "has_bias", False):
            for a in moe.WEIGHTS:
                if isinstance(getattr(mod, a, None), torch.Tensor):
                    out[f"{path}.{a}"] = ("R", "S(0)")
    return out


def layout_plan(layers: list[str], layout: str, placements: dict[str, tuple[str, str]]) -> Plan:
    if layout in ("dp4z3", "dp4z1"):
        return make_plan(layers, layout, int(layout[-1]))
    if layout == "dp2tp2":
        return make_plan(layers, "dp2tp2", placements=placements or None)
    plan = make_plan(layers, "pp2", 0)  # two stages of dp=2 -> of tp=2, dp=1
    stages = []
    for s in plan.stages:
        prefixes = tuple(f"{n}." for n in s.layers)
        mine = {k: v for k, v in placements.items() if k.startswith(prefixes)}
        stages.append(dataclasses.replace(s, dp=1, tp=2, param_placements=mine))
    return dataclasses.replace(plan, stages=tuple(stages), micro_batch_size=4)


def jobs(tmp: Path) -> list[dict[str, Any]]:
    specs = {f: str(families.write_config(tmp / f, families.tiny(f))) for f in families.MORE_FAMILIES}
    specs["rootcnn"] = "tests.runtime.test_parity_matrix:rootcnn"
    only = os.environ.get("PARTITA_PARITY_ONLY")  # a comma-separated subset of job ids or families, to debug
    out = []
    for name, spec in specs.items():
        layers = plan_layers(spec)
        place = megatron(spec, layers[1:-1]) if name != "rootcnn" else {}
        # the root's own parameter belongs to no pipeline stage (stages.GenericStage refuses the cut): dp=4
        # ZeRO-1 is its nearest legal layout in place of tp2pp2
        for layout in LAYOUTS if name != "rootcnn" else ("dp4z3", "dp4z1", "dp2tp2"):
            job_id = f"{name}-{layout}"
            if only and name not in only.split(",") and job_id not in only.split(","):
                continue
            plan = layout_plan(layers, layout, place)
            plan = dataclasses.replace(plan, training={**plan.training, **SGD})
            out.append({"id": job_id, "spec": spec, "plan": plan.to_json(), "steps": STEPS, "parity": True})
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("parity")
    todo = jobs(tmp)
    (tmp / "jobs.json").write_text(json.dumps(todo))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(ROOT / "tests/runtime/model_matrix_worker.py"), str(tmp / "jobs.json"), str(tmp / "out.json")]
    t0 = time.perf_counter()
    with open(tmp / "log.txt", "w") as log:
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=420)
        except subprocess.TimeoutExpired:
            text = (tmp / "log.txt").read_text()
            pytest.fail(f"the parity launch hung; log tail:\n{text[-4000:]}")
    text = (tmp / "log.txt").read_text()
    first_error = text.find("Traceback")
    assert proc.returncode == 0, text[first_error : first_error + 6000] if first_error >= 0 else text[-6000:]
    print(f"parity matrix: {len(todo)} jobs in one launch, {time.perf_counter() - t0:.1f}s")
    return {"todo": todo, "got": json.loads((tmp / "out.json").read_text())}


def _bad(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{r['tensor']} {r['name']} rel {r['rel']:.2e} abs {r['max_abs']:.2e}" for r in rows if not r["ok"]]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_parameter_matches_one_device(matrix: dict[str, Any]) -> None:
    todo, got = matrix["todo"], matrix["got"]
    assert set(got) == {j["id"] for j in todo}
    failures = {job_id: _bad(r["parity"])[:5] for job_id, r in got.items() if _bad(r["parity"])}
    assert not failures, json.dumps(failures, indent=1)
    for job_id, r in got.items():
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["reference"]), rtol=1e-4, atol=1e-4)
        # every parameter of the single-device model was compared, gradients and values
        assert {x["tensor"] for x in r["parity"]} == {"grad@1", f"param@{STEPS}"}, job_id


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_issue31_faults_are_gone(matrix: dict[str, Any], fault: str) -> None:
    """The jobs that reproduced each fault now match one device on every parameter (the old code failed
    them: q_norm/k_norm gradients off by ~0.5-0.8 relative; the root ``scale`` never dp-synced)."""
    got = matrix["got"]
    for job_id in FAULTS[fault]:
        if job_id not in got:
            pytest.skip(f"{job_id} not in this launch (PARTITA_PARITY_ONLY)")
        assert not _bad(got[job_id]["parity"]), (fault, job_id, _bad(got[job_id]["parity"]))
        names = {r["name"] for r in got[job_id]["parity"]}
        faulty = ("q_norm.weight", "scale", "kv_a_proj_with_mqa.weight")
        assert any(n.endswith(faulty) for n in names), names  # the faulty parameter is checked
