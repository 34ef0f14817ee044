"""Emitter goldens, tensor-parallel roles, predicted collectives, refusals and launch checks: no processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from partita.backends.torch import launch as torch_launch
from partita.backends.torch import tp as torch_tp
from partita.backends.torch.emit import emit_torch
from partita.backends.torch.parallel import check_launch, parse_placement
from partita.errors import PlanError
from partita.models.zoo import resolve_model
from partita.search.program import records
from tests.runtime.plans import expected, layout, tp_placements

GOLDEN = Path(__file__).parent.parent / "golden" / "emit_torch"
CASES = [("gpt2-tiny", n) for n in ("dp", "tp", "dp_tp", "zero3", "uneven", "pp_1f1b", "pp_gpipe", "pp_tp", "hetero")]
CASES += [("gpt2-tiny", "zero1"), ("llama-tiny", "pp_tp"), ("llama-tiny", "tp_full"), ("mlp", "dp_tp")]
CASES += [("mlp", "pp_zero2"), ("gpt2-tiny", "zero3_bf16"), ("llama-tiny", "hetero_bf16")]
LAYOUTS = ("dp", "tp", "dp_tp", "zero1", "zero2", "zero3", "uneven", "pp_1f1b", "pp_gpipe", "pp_tp", "hetero")
LAYOUTS += ("tp_full", "tp_selective", "pp_zero2")


@pytest.mark.parametrize("model, name", CASES)
def test_golden(model: str, name: str) -> None:
    src = emit_torch(layout(model, name), model)
    compile(src, "program_torch.py", "exec")
    path = GOLDEN / f"{model}_{name}.py.golden"  # not .py: ruff must not reformat it
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
    assert path.read_text() == src, f"regenerate with UPDATE_GOLDEN=1 if the change to {path.name} is intended"
    assert emit_torch(layout(model, name), model) == src  # deterministic


def _program(src: str) -> dict:
    """The PROGRAM literal of an emitted source (executed without the torch imports)."""
    ns: dict = {}
    exec(src[src.index("PROGRAM = ") : src.index('PROGRAM["__file__"]')], ns)  # noqa: S102 - our own emitted data
    return ns["PROGRAM"]


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny", "mlp"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_collectives_follow_the_layout(model: str, name: str) -> None:
    """The program's prediction is the plan's records, literally; for a stage without tensor parallelism
    (a hand plan has no ILP tp records) their counts per kind equal the first-principles counts."""
    plan = layout(model, name)
    prog = _program(emit_torch(plan, model))
    want = expected(model, plan)
    for s in plan.stages:
        pred = prog["predicted_collectives"][f"stage{s.index}"]
        assert pred == records.summary(s.collectives)
        folded: dict[str, int] = {}
        for key, v in pred.items():
            folded[key.split("@")[0]] = folded.get(key.split("@")[0], 0) + v["count"]
        if s.tp == 1:
            assert folded == want[s.index], (s.index, folded, want[s.index])


def test_tp_roles() -> None:
    gpt2 = resolve_model("gpt2-tiny").build("meta")
    pl = {k: v[1] for k, v in tp_placements("gpt2-tiny", ["embed", "transformer.h.0", "head"]).items()}
    roles = torch_tp.module_roles(gpt2, pl, fused=("attn.c_attn",))
    assert roles == {
        "transformer.wte": "vocab",
        "lm_head": "colwise_gather",  # tied to wte, no row-parallel sibling: logits are gathered
        "transformer.h.0.attn.c_attn": "colwise",  # fused q|k|v split per chunk (SS): whole heads per rank
        "transformer.h.0.attn.c_proj": "rowwise",
        "transformer.h.0.mlp.c_fc": "colwise",  # Conv1D weight [in, out]: S(1) is the output dim
        "transformer.h.0.mlp.c_proj": "rowwise",
    }
    pl = {k: v[1] for k, v in tp_placements("gpt2-tiny", ["transformer.h.0"], contiguous_qkv=True).items()}
    roles = torch_tp.module_roles(gpt2, pl, fused=("attn.c_attn",))
    assert roles["transformer.h.0.attn.c_attn"] == "colwise_gather"  # a contiguous shard splits q|k|v
    assert roles["transformer.h.0.attn.c_proj"] == "rowwise_replicated"
    llama = resolve_model("llama-tiny").build("meta")
    pl = {k: v[1] for k, v in tp_placements("llama-tiny", ["model.layers.0"]).items()}
    roles = torch_tp.module_roles(llama, pl)
    assert roles["model.layers.0.self_attn.q_proj"] == "colwise" and roles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert torch_tp.tp_collectives(roles) == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    assert torch_tp.module_roles(llama, {"model.norm.weight": "S(0)"}) == {"model.norm": "generic"}


def test_program_shows_layout() -> None:
    src = emit_torch(layout("gpt2-tiny", "hetero"), "gpt2-tiny")
    assert "'transformer.h.0.attn.c_attn.weight': 'SS(1,3)'" in src
    assert "P2PPipeline" in src and "setup_stage_1" in src and "'ranks': [0, 1]" in src
    assert "'transformer.h.0.mlp.c_fc': 'colwise'" in src and "roles={" in src
    src = emit_torch(layout("gpt2-tiny", "zero3"), "gpt2-tiny")
    assert "reshard_after_forward=True" in src and "apply_recompute(module, 'full')" in src
    src = emit_torch(layout("gpt2-tiny", "zero1"), "gpt2-tiny")
    assert "reshard_after_forward=False" in src and 'rt.stage["zero_stage"]' in src
    assert "Schedule1F1B" in emit_torch(layout("gpt2-tiny", "pp_1f1b"), "gpt2-tiny")
    assert "ScheduleGPipe" in emit_torch(layout("gpt2-tiny", "pp_gpipe"), "gpt2-tiny")


def test_pipelined_zero2_runs_per_micro_batch_sync() -> None:
    """Issue 15 item 6: torch.distributed.pipelining defers FSDP2's gradient sync to the last
    micro-batch (ZeRO-1), so a pipelined ZeRO-2/3 plan runs the P2P runner, which syncs per micro-batch."""
    src = emit_torch(layout("mlp", "pp_zero2"), "mlp")
    assert "torch_schedule.P2PPipeline(" in src and "Schedule1F1B" not in src
    assert "Schedule1F1B" in emit_torch(layout("mlp", "pp_1f1b"), "mlp")  # ZeRO-0 pipelines keep pipelining


def test_bf16_program_names_its_precision() -> None:
    """Issue 15 item 2: a bf16 plan's program computes in bf16, written literally."""
    zero3 = emit_torch(layout("gpt2-tiny", "zero3_bf16"), "gpt2-tiny")
    assert "mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in zero3
    assert zero3.count(", mp_policy=mp))") == 2 and "apply_autocast" not in zero3
    dp = emit_torch(layout("gpt2-tiny", "dp_bf16"), "gpt2-tiny")
    assert "tpar.apply_autocast(module, 'bf16')" in dp and "MixedPrecisionPolicy" not in dp
    hetero = emit_torch(layout("llama-tiny", "hetero_bf16"), "llama-tiny")
    assert hetero.count("tpar.apply_autocast(module, 'bf16')") == 2
    assert "tpar.boundary_in(rt.boundary, 'bf16')" in hetero
    f32 = emit_torch(layout("gpt2-tiny", "zero3"), "gpt2-tiny")
    assert "MixedPrecisionPolicy" not in f32 and "apply_autocast" not in f32


def test_refusals() -> None:
    import dataclasses

    plan = dataclasses.replace(layout("gpt2-tiny", "pp_1f1b"), schedule="interleaved_1f1b", num_virtual_stages=2)
    with pytest.raises(PlanError, match="virtual stages"):
        emit_torch(plan, "gpt2-tiny")
    with pytest.raises(PlanError, match="WORLD_SIZE=3"):
        check_launch(4, ["cpu"], 3, cuda=False)
    with pytest.raises(PlanError, match="torch.cuda is not available"):
        check_launch(2, ["gpu"], 2, cuda=False)
    assert check_launch(2, ["cpu"], 2, cuda=False) == "gloo"
    with pytest.raises(PlanError, match="partial"):
        parse_placement("P")


def test_dry_run(tmp_path: Path) -> None:
    plan = layout("gpt2-tiny", "dp_tp")
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "program_torch.py").write_text(emit_torch(plan, "gpt2-tiny"))
    out = torch_launch.run(tmp_path, steps=5, dry_run=True, nnodes=2)
    assert out["command"][1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    assert "--nnodes" in out["command"] and "${NODE_RANK}" in out["command_str"]
    assert out["command"][-2:] == ["--steps", "5"]
    with pytest.raises(PlanError, match="do not split"):
        torch_launch.run(tmp_path, steps=1, dry_run=True, nnodes=3)
    with pytest.raises(PlanError, match="dry-run"):
        torch_launch.run(tmp_path, steps=1, nnodes=2)
