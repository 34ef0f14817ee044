"""``partita.parallelize(model, ...)`` for PyTorch: the user script in examples/ trains under torchrun
with the losses of the same script run on one device, and outside torchrun it says how to launch.

The single-process run of ``examples/train_torch.py`` is the reference: it seeds, draws the same
batches and trains the plain model with the same optimizer. Under ``torchrun --nproc-per-node 4``
(gloo) the search's plans (an MLP on dp=2 x tp=2, a GPT-2 on dp=4 at the time of writing) must give
the same losses (fp32, rtol 1e-4), and a hand-made 3-rank pipeline (tp=2 stage + 1-rank stage,
P2P schedule) for the GPT-2 too.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import partita
from partita.errors import ConfigError, ModelError
from partita.models.zoo import module_handle
from tests.runtime.plans import LAYERS, make_plan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_torch.py"


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return env | {"PARTITA_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _run(cmd: list[str], cache: Path) -> tuple[dict[str, dict], str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(cache), cwd=ROOT, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[d["model"]] = d
    return out, proc.stderr


def _torchrun(n: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        str(SCRIPT),
        *args,
    ]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], str, Path]:
    """The script on one device (not under torchrun): losses, the launch message, the warmed cache."""
    cache = tmp_path_factory.mktemp("cache")
    out, err = _run([sys.executable, str(SCRIPT)], cache)
    return out, err, cache


def test_outside_torchrun_explains_the_launch_and_trains_the_plain_model(single) -> None:
    out, err, cache = single
    assert f"torchrun --standalone --nproc-per-node 4 {SCRIPT}" in err
    assert "Not under torchrun: the model runs unchanged" in err
    assert "plan for MLP(user module) on 4xCPU: 4 ranks" in err and "stage 0: ranks 0-3" in err
    assert err.count("(compiled in ") == 2  # a fresh cache: both models were searched
    reports = list((cache / "plans").glob("*/report.txt"))
    assert len(reports) == 2 and "Plan for" in reports[0].read_text()
    for name in ("mlp", "gpt2"):
        losses = out[name]["losses"]
        assert out[name]["ranks"] == 1 and len(losses) == 3 and all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0]  # both tasks are learnable


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_trains_like_one_device(single) -> None:
    ref, _, cache = single
    out, err = _run(_torchrun(4), cache)
    assert err.count("(cache hit)") == 2  # rank 0 found both plans; the others got them by broadcast
    for name in ("mlp", "gpt2"):
        assert out[name]["ranks"] == 4
        assert out[name]["losses"] == pytest.approx(ref[name]["losses"], rel=1e-4, abs=1e-6)
    # A dp-only stage's collectives are all counted, with their mesh axis
    gpt = out["gpt2"]
    pred = gpt["predicted_collectives"]["stage0"]
    if set(pred) == {"all_reduce@dp"} and pred["all_reduce@dp"]["count"] == 1:
        assert {k: v["count"] for k, v in gpt["collectives"][0].items()} == {"all_reduce@dp": 1}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_with_a_pipeline_plan(single, tmp_path: Path) -> None:
    """A given 3-rank plan: stage 0 = embed + block 0 on tp=2, stage 1 on one rank (P2P pipeline)."""
    ref, _, cache = single
    a, b = LAYERS["gpt2-tiny"][:2], LAYERS["gpt2-tiny"][2:]
    plan = make_plan(
        "gpt2-tiny",
        [dict(layers=a, ranks=[0, 1], dp=1, tp=2), dict(layers=b, ranks=[2], dp=1, tp=1)],
        micro_batch_size=4,
        num_micro_batches=2,
        seq_len=32,
    )
    (tmp_path / "plan.json").write_text(plan.to_json())
    out, _ = _run(_torchrun(3, "--model", "gpt2", "--plan", str(tmp_path)), cache)
    assert out["gpt2"]["losses"] == pytest.approx(ref["gpt2"]["losses"], rel=1e-4, abs=1e-6)
    p2p = out["gpt2"]["collectives"][0]["p2p@pp"]["count"]
    assert p2p == 2 * plan.num_micro_batches  # tp rank 0 of stage 0: sends activations, receives grads


# ---- in-process: handles, cache keys, refusals ---------------------------------------------------
class Chain(torch.nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, hidden), torch.nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_module_handle_traces_a_weightless_copy_and_keys_the_cache() -> None:
    from partita.cluster import parse_cluster
    from partita.driver import cache_key
    from partita.search.pricing.config import TrainingConfig

    m = Chain()
    h = module_handle(m, torch.randn(3, 8))
    meta = h.build("meta")
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert all(p.device.type == "cpu" for p in m.parameters()) and h.build("cpu") is m
    assert h.example_inputs(5, 1, "meta")["x"].shape == (5, 8)
    cl, tr = parse_cluster("4xCPU"), TrainingConfig(global_batch=16, seq_len=1)
    key = cache_key(h, cl, tr)
    assert cache_key(module_handle(Chain(), torch.randn(7, 8)), cl, tr) == key  # weights, sample batch: same
    assert cache_key(module_handle(Chain(hidden=32), torch.randn(3, 8)), cl, tr) != key  # shapes differ


def test_refusals_name_the_fix(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelError, match="example_inputs"):
        partita.parallelize(Chain(), cluster="4xCPU", global_batch=16, seq_len=1)
    with pytest.raises(ConfigError, match="global_batch"):
        partita.parallelize(Chain(), cluster="4xCPU", example_inputs=torch.randn(2, 8))


def test_non_chain_forwards_are_split_by_their_own_forward() -> None:
    """A model without a hand adapter runs its own forward in every stage, with the other stages'
    modules swapped out (``backends/torch/stages.py``, issue 16): a functional relu between fc1 and fc2
    survives the cut, where running the plan layers as a chain would drop it."""
    import copy

    from partita.backends.torch import parallel as tpar
    from partita.backends.torch.parallelize import _check_chain

    model, x = Chain(), torch.randn(4, 8)
    _check_chain(model, ["fc1", "fc2"], x[:1])  # accepted: the plan layers in order are the model's forward
    parts = []
    for keep in (["fc1"], ["fc2"]):
        m = copy.deepcopy(model)
        tpar.boundary_shapes(m, [["fc1"], ["fc2"]], x[:1])
        parts.append(tpar.split_stage(m, keep, ["fc1", "fc2"], torch.device("cpu")))
    torch.testing.assert_close(parts[1](parts[0](x)), model(x))


def _example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_torch_example", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_takes_the_rank_count_from_torchrun_or_cluster() -> None:
    """Issue 35 item 8: the example hard-coded 4xCPU, so under 2 ranks it died in two tracebacks plus
    torchrun's dump. The cluster now follows torchrun's world size unless --cluster names one."""
    ex = _example_module()
    assert ex.resolve_cluster("", {}) == "4xCPU"
    assert ex.resolve_cluster("", {"WORLD_SIZE": "2"}) == "2xCPU"
    assert ex.resolve_cluster("8xCPU", {"WORLD_SIZE": "8"}) == "8xCPU"
    assert ex.resolve_cluster("16xA100-80G", {}) == "16xA100-80G"
    with pytest.raises(ConfigError, match="has 4 devices but torchrun started 2 ranks.*--nproc-per-node 4"):
        ex.resolve_cluster("4xCPU", {"WORLD_SIZE": "2"})


def test_example_refuses_a_mismatched_cluster_in_one_paragraph(tmp_path: Path) -> None:
    env = _env(tmp_path) | {"WORLD_SIZE": "2", "RANK": "0"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "mlp", "--cluster", "4xCPU"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("train_torch.py: error: --cluster 4xCPU has 4 devices but torchrun")
