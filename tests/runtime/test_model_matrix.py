"""Any model a user brings trains: 15 Hugging Face families by config.json, a ConvNet and an MLP-Mixer.

Each architecture is a tiny config written to ``DIR/config.json`` (``partita/models/families.py``),
resolved by ``resolve_model(DIR)`` in the program exactly as ``partita compile DIR`` would; the torch
models are ``tests.runtime.test_model_matrix:convnet`` / ``:mixer``. Plan layers are the module
paths of the model's repeated container (``stages.guess_blocks``; ``tests/test_models.py`` checks
that the tracer names the same layers). Layouts on 4 CPU ranks, 3 steps, global batch 8:

Issue 31's three layouts for every architecture:

* ``dp4z3``: one stage, dp=4, ZeRO-3;
* ``tp2pp2``: two stages (cut in the middle, 1F1B) of tp=2, dp=1;
* ``dp2tp2``: one stage, tp=2 x dp=2.

The tp layouts are Megatron column / row placements per family (``tests/runtime/tp_layouts.py``): heads and
MLP split, or the nearest legal split that file's ``NEAREST`` names with its reason (MLP only for Phi-3, OPT,
Falcon, BLOOM and T5; BERT's pairs gathered across their two parent modules; Qwen2-MoE's routed experts
replicated; the ConvNet's classifier head only, its tp2 x pp2 stage 0 of convolutions stated as
``tp_shards_nothing``). Every other tp stage shards something: ``Stage.tp_shards_nothing`` is false, asserted
(:func:`check_tp_shards`). Mixtral's tp layouts are the layer ILP's expert-parallel ones (``expert_plan``):
``ep2`` (dp=2 x tp=2, collectives counted) and ``tp2pp2`` (its pipeline, ``expert_pipeline``). ``falcon-dp2tp2`` and
``falcon-tp2pp2`` failed on the old runtime (a row-parallel output, a view made by ``DTensor.to_local``, met
Falcon's in-place ``mlp_output += attention_output``: a RuntimeError at the first step; ``tp.py`` copies it now).
Beside them:

* ``pp2``: two stages of dp=2, 1F1B, for T5 (``COUNTED_PIPELINES``: its cut carries three tensors packed into
  one, ``backends/torch/boundary.py``, and the counted step must issue the plan's p2p records) and, ZeRO-0 /
  ZeRO-2 alternating, the ``-api`` jobs;
* ``dp4z1``: one stage, dp=4, ZeRO-1, in place of ``tp2pp2`` for the models the runtime does not pipeline
  (``NOT_PIPELINED``, empty now).

Each task trains on its own loss (``train.make_loss``): next-token for causal LMs, the masked positions
for BERT (``hf.mask_tokens``), the decoder targets for T5 (its inputs packed on dim 1, ``hf.pack``),
class labels for ViT, the ConvNet and the Mixer. Losses equal the seeded single-device run within 1e-4, and
(issue 31) every job but the ``-api`` ones compares every parameter's step-1 gradient and its value after
the last step with it, name by name, at ``backends/torch/parity.py``'s f32 tolerances. Seven models (``THROUGH_API``) also train through
``partita.parallelize(model, plan=...)`` and ``partita.step`` (``dp4z3`` and ``pp2``). All jobs run in ONE torchrun launch
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
from tests.runtime import tp_layouts
from tests.runtime.plans import image_inputs

ROOT = Path(__file__).resolve().parents[2]
# Models the runtime does not pipeline (passes/boundaries.pipeline_refusal marks their graphs): none of the
# matrix. T5 pipelines: its decoder cut carries the hidden state, the encoder output and the position bias,
# packed into one boundary tensor (backends/torch/boundary.py).
NOT_PIPELINED: set[str] = set()


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


_images = image_inputs(16)  # 16 x 16 RGB images, 10 classes


def convnet() -> tuple[nn.Module, Any]:
    return ConvNet(), _images


def mixer() -> tuple[nn.Module, Any]:
    return Mixer(), _images


# expert parallel (tp role ``expert``, backends/torch/moe.py): experts sharded over tp=2, tokens all_to_all'd;
# the blocks' tp layout is the ILP's own (expert_plan), so the plan carries the records the run is counted against
EXPERT_PARALLEL = {"mixtral"}
AUX_COEF = 0.02  # router_aux_loss_coef of the expert-parallel job's config (output_router_logits on)
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


def expert_plan(spec: str, layers: list[str]) -> Plan:
    """dp=2 x tp=2 with each block laid out on tp as the search lays it out: the layer ILP
    (``intra_op.solve_layer``, torch style, 2 CPU ranks, the plan's micro-batch). At this size a
    replicated block is cheapest, so each block gets 80% of the memory its replicated layout needs;
    to fit, the ILP shards the experts (``e@tp:expert``, role ``expert``: they are most of the
    block's bytes). Its placements, roles and records go into the stage and
    ``search/records.complete`` adds the rest, as ``plan_build`` does. Embedding and head replicated."""
    from partita.cluster import DEVICE_PRESETS
    from partita.driver import trace_model
    from partita.search.layer.intra_op import solve_layer
    from partita.search.pricing.cost_model import CostModel
    from partita.search.pricing.mesh import LogicalMesh
    from partita.search.program import records

    plan = make_plan(layers, "dp2tp2")
    graph = trace_model(spec, batch=plan.micro_batch_size, seq=int(plan.training["seq_len"])).graph
    cpu = DEVICE_PRESETS["CPU"]
    mesh = LogicalMesh((1, 2), ("dp", "tp"), cpu, 4)
    env = {"B": plan.micro_batch_size, "S": int(plan.training["seq_len"])}
    placements: dict[str, tuple[str, ...]] = {}
    roles: dict[str, str] = {}
    colls = []
    for layer in graph.layers:
        if layer.name in layers[1:-1]:
            kw = {"env": env, "dtype": "f32", "cost_model": CostModel.for_device(cpu), "tp_style": "torch"}
            need = solve_layer(graph, layer, mesh, **kw).memory_bytes  # type: ignore[arg-type]
            sol = solve_layer(graph, layer, mesh, memory_budget=0.8 * need, **kw)  # type: ignore[arg-type]
            assert sol.tp_plan == {f"{layer.name}.mlp.experts": "expert"}, sol.tp_plan
            placements.update(sol.param_placements)
            roles.update(sol.tp_plan)
            colls += sol.collectives
    stage = dataclasses.replace(plan.stages[0], param_placements=placements, tp_plan=roles, collectives=tuple(colls))
    return records.complete(dataclasses.replace(plan, stages=(stage,)), graph)


# pipelines whose counted step must issue the plan's records: T5's cut carries three tensors packed into one
# (backends/torch/boundary.py), and its p2p bytes are their sum (passes/boundaries.py)
COUNTED_PIPELINES = {"t5"}


def counted_plan(spec: str, plan: Plan) -> Plan:
    """``plan`` with the records ``search/records.complete`` derives from the traced graph."""
    from partita.driver import trace_model
    from partita.search.program import records

    graph = trace_model(spec, batch=plan.micro_batch_size, seq=int(plan.training["seq_len"])).graph
    return records.complete(plan, graph)


def expert_pipeline(ep: Plan, layers: list[str]) -> Plan:
    """Two stages of tp=2 (1F1B on ``torch.distributed.pipelining``), each block laid out as in ``ep``
    (the ILP's expert role): stage 1's first forward runs on uninitialised tensors (pipelining's shape
    inference), so the tp ranks route different tokens there; the runtime must not assume they agree."""
    half, stage = len(layers) // 2, ep.stages[0]
    out = []
    for i, (names, ranks) in enumerate(((layers[:half], (0, 1)), (layers[half:], (2, 3)))):
        prefixes = tuple(n + "." for n in names)
        out.append(
            dataclasses.replace(
                stage,
                index=i,
                layers=tuple(names),
                ranks=ranks,
                dp=1,
                tp=2,
                param_placements={k: v for k, v in stage.param_placements.items() if k.startswith(prefixes)},
                tp_plan={k: v for k, v in stage.tp_plan.items() if k.startswith(prefixes)},
                collectives=(),
            )
        )
    return dataclasses.replace(make_plan(layers, "pp2"), stages=tuple(out), micro_batch_size=4)


def make_plan(layers: list[str], layout: str, zero: int = 0, placements: dict | None = None) -> Plan:
    cluster = parse_shorthand("4xCPU")
    if layout in ("dp4z3", "dp4z1"):
        groups, mb = [(layers, (0, 1, 2, 3), 4, int(layout[-1]))], 1
    elif layout == "dp2tp2":
        groups, mb = [(layers, (0, 1, 2, 3), 2, 0)], 2
    elif layout == "tp2pp2":  # two stages of tp=2, dp=1
        half = len(layers) // 2
        groups, mb = [(layers[:half], (0, 1), 1, 0), (layers[half:], (2, 3), 1, 0)], 4
    else:
        half = len(layers) // 2
        groups, mb = [(layers[:half], (0, 1), 2, zero), (layers[half:], (2, 3), 2, zero)], 2
    tp = 2 if layout in ("dp2tp2", "tp2pp2") else 1
    out = []
    for i, (ls, ranks, dp, z) in enumerate(groups):
        mine = {k: v for k, v in (placements or {}).items() if len(groups) == 1 or _in_layers(k, ls, layers)}
        out.append(
            Stage(
                index=i, layers=tuple(ls), device_type="CPU", ranks=ranks, dp=dp, tp=tp, zero_stage=z,
                param_placements=mine,
            )
        )  # fmt: skip
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


def _in_layers(fqn: str, mine: list[str], layers: list[str]) -> bool:
    """Is parameter ``fqn`` in the plan layers ``mine``: under one of their blocks, or outside every block
    (the embedding's or head's) and ``mine`` holds the head (the only such tp-placed parameter: ConvNet's ``fc``)."""
    block = next((b for b in layers[1:-1] if fqn.startswith(b + ".")), None)
    return block in mine if block is not None else "head" in mine


def jobs(tmp: Path) -> list[dict[str, Any]]:
    specs = {f: str(families.write_config(tmp / f, families.tiny(f))) for f in families.FAMILIES}
    specs.update(TORCH_MODELS)
    only = os.environ.get("PARTITA_MATRIX_ONLY")  # a comma-separated subset, to debug a few models
    if only:
        specs = {k: v for k, v in specs.items() if k in only.split(",")}
    out = []
    for i, (name, spec) in enumerate(specs.items()):
        layers = plan_layers(spec)
        job = {"spec": spec, "steps": 3}
        out.append({**job, "id": f"{name}-dp4z3", "plan": make_plan(layers, "dp4z3", 3).to_json()})
        if name in THROUGH_API:
            out.append({**out[-1], "id": f"{name}-dp4z3-api", "api": True})
        pp2 = make_plan(layers, "pp2", 2 * (i % 2))  # two stages of dp=2, ZeRO-0 / ZeRO-2 alternating
        if name in COUNTED_PIPELINES:  # the plan's records, counted against the run
            out.append({**job, "id": f"{name}-pp2", "plan": counted_plan(spec, pp2).to_json(), "count": True})
        if name in THROUGH_API:
            out.append({**job, "id": f"{name}-pp2-api", "plan": pp2.to_json(), "api": True})
        if name in EXPERT_PARALLEL:  # experts over tp=2, with the load-balancing loss; collectives counted
            aux = {**families.tiny(name), "output_router_logits": True, "router_aux_loss_coef": AUX_COEF}
            aux_spec = str(families.write_config(tmp / f"{name}_aux", aux))
            plan = expert_plan(aux_spec, layers)
            out.append({**job, "id": f"{name}-ep2", "spec": aux_spec, "plan": plan.to_json(), "count": True})
            # its pipeline runs the experts expert-parallel, tp=2 per stage
            out.append({**job, "id": f"{name}-tp2pp2", "plan": expert_pipeline(plan, layers).to_json()})
            continue
        # Megatron tp=2 (tp_layouts.py: heads and MLP, or the nearest legal split it names), x dp=2 and x pp=2
        place = tp_layouts.placements(name, resolve_model(spec).build("meta"), layers[1:-1])
        out.append({**job, "id": f"{name}-dp2tp2", "plan": make_plan(layers, "dp2tp2", placements=place).to_json()})
        tp2pp2 = make_plan(layers, "dp4z1", 1) if name in NOT_PIPELINED else make_plan(layers, "tp2pp2", 0, place)
        out.append({**job, "id": f"{name}-tp2pp2", "plan": tp2pp2.to_json()})
    for job in out:  # issue 31: every parameter's step-1 gradient and last value, not only the losses
        if not job.get("api"):
            job["parity"] = True
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_architecture_trains_like_one_device(tmp_path: Path) -> None:
    todo = jobs(tmp_path)
    check_tp_shards(todo)
    (tmp_path / "jobs.json").write_text(json.dumps(todo))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += [str(ROOT / "tests/runtime/model_matrix_worker.py"), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")]
    t0 = time.perf_counter()
    with open(tmp_path / "log.txt", "w") as log:  # under pytest's own timeout, so a hang shows its log
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=420)
        except subprocess.TimeoutExpired:
            text = (tmp_path / "log.txt").read_text()
            done = [line for line in text.splitlines() if line.startswith("matrix: ")]
            pytest.fail(f"the matrix launch hung after {done[-1:] or 'no job'}; log tail:\n{text[-4000:]}")
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
    failures = {job_id: _bad(r["parity"])[:5] for job_id, r in got.items() if "parity" in r and _bad(r["parity"])}
    assert not failures, json.dumps(failures, indent=1)  # per parameter, at parity.py's f32 tolerances
    for job in (j for j in todo if j.get("parity")):
        assert {x["tensor"] for x in got[job["id"]]["parity"]} == {"grad@1", "param@3"}, job["id"]
    names = {j.split("-")[0] for j in got}
    assert names == (set(families.FAMILIES) | set(TORCH_MODELS) if not os.environ.get("PARTITA_MATRIX_ONLY") else names)
    assert {j.split("-")[0] for j in got if j.endswith("-api")} == THROUGH_API & names
    assert {j.split("-")[0] for j, r in got.items() if j.endswith("-dp2tp2")} == names - EXPERT_PARALLEL
    assert {j.split("-")[0] for j, r in got.items() if j.endswith("-tp2pp2")} == names - NOT_PIPELINED
    pipelined = {j.split("-")[0] for j, r in got.items() if r["num_stages"] > 1}
    assert pipelined == names - NOT_PIPELINED
    assert {j.split("-")[0] for j in got if j.endswith("-ep2")} == EXPERT_PARALLEL & names
    for job in (j for j in todo if j.get("count") and j["id"].endswith("-pp2")):  # several boundary tensors
        # the counted step's p2p (count and bytes per stage) is the plan's record: the packed tensors' bytes
        from partita.search.program import records

        plan, measured = Plan.from_json(job["plan"], job["id"]), got[job["id"]]["collectives"]
        for i, s in enumerate(plan.stages):
            want = records.summary(s.collectives)["p2p@pp"]
            assert measured[f"stage{i}"]["p2p@pp"] == want, (job["id"], i, measured, want)
    for job in (j for j in todo if j["id"].endswith("-ep2")):
        check_expert_parallel(job, got[job["id"]])
        # same weights and data as the dp4z3 job, plus the load-balancing loss (about 2 x coef for top-2 of 4)
        name = job["id"].split("-")[0]
        extra = got[job["id"]]["losses"][0] - got[f"{name}-dp4z3"]["losses"][0]
        assert 0.5 * AUX_COEF < extra < 5 * AUX_COEF, extra


def check_tp_shards(todo: list[dict[str, Any]]) -> None:
    """Every tp stage splits something (heads / MLP, ``tp_layouts.py``): ``Stage.tp_shards_nothing`` is false,
    except the one stage that holds only convolutions (ConvNet's tp2 x pp2 stage 0), whose plan states it."""
    stated = {("convnet-tp2pp2", 0)}
    for job in todo:
        for s in Plan.from_json(job["plan"], job["id"]).stages:
            if s.tp > 1:
                assert s.tp_shards_nothing == ((job["id"], s.index) in stated), (job["id"], s.index, s.param_placements)


def _bad(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{r['tensor']} {r['name']} rel {r['rel']:.2e} abs {r['max_abs']:.2e}" for r in rows if not r["ok"]]


def check_expert_parallel(job: dict[str, Any], r: dict[str, Any]) -> None:
    """The run issued what the plan records: every kind@axis, count and byte total of the counted
    step equal the plan's (``fidelity.compare``; all_to_all by count, its bytes follow the routing);
    for those, each rank ran the plan's count every step and each tp group moved, summed over its two
    ranks, exactly twice the plan's balanced bytes (every routed pair goes somewhere once)."""
    from partita.search.program import records

    plan = Plan.from_json(job["plan"], job["id"])
    want = records.summary(plan.stages[0].collectives)
    assert {"all_to_all@tp", "all_gather@tp"} <= set(want), want
    assert set(r["collectives"]["stage0"]) == set(want), (r["collectives"], want)
    assert r["collective_mismatches"]["stage0"] == []  # all_to_all by count (fidelity.compare), the rest by bytes
    a2a, steps = want["all_to_all@tp"], job["steps"]
    per_rank = r["all_to_all_per_rank"]
    assert [x["count"] for x in per_rank] == [steps * a2a["count"]] * 4
    for group in ((0, 1), (2, 3)):  # the tp groups of a dp=2 x tp=2 mesh
        assert sum(per_rank[i]["bytes"] for i in group) == steps * 2 * a2a["bytes"], (group, per_rank, a2a)
