"""`partita rehearse`: the emitted torch program run at full world size on fake tensors, compared with the plan.

What these tests prove:

* the rehearsal sees every collective the program issues: per stage, its counts equal the counts
  derived from first principles for each hand layout (``tests/runtime/plans.expected``, the same
  table the multi-process gloo tests check real runs against), and every non-tensor-parallel one
  equals the plan's own records (``search/program/records.py``: kind, axis, count, bytes within 2%);
* bytes and memory follow closed forms written here: Megatron's tensor parallelism moves one
  ``b*s*h`` activation per all-reduce (4 per block and micro-batch: Narayanan et al. 2021, sec.
  3.2; the program trains fp32, 4 bytes); parameters, gradients and AdamW's two moments per device
  are the stage's parameter bytes (sharded on tp), once, once and twice;
* the comparison applies the issue's tolerances (counts equal, bytes 2%, memory 10%, FLOPs 5%) and
  names each mismatch;
* bad input (no plan, a plan of another version, a program edited by hand) ends with one
  paragraph, exit 2, nothing written.

The rest is split out by fixture, so that the test run's workers (``--dist loadfile``) share it out:
``test_rehearse_schedules.py`` (hand pipelines of every schedule), ``test_rehearse_full_size.py``
(llama-7b on 64 ranks, Megatron placements by hand) and ``test_rehearse_real_size.py`` (searched
real-size plans, issue 15).

"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partita.backends.torch import rehearse
from partita.backends.torch.emit import emit_torch
from partita.cli import main as cli_main
from partita.errors import PlanError
from partita.models.zoo import resolve_model
from partita.plan import Collective, Plan
from tests.runtime.plans import expected, layout

KEYS = {
    "index", "ranks_rehearsed", "collectives", "planned_collectives", "peak_memory_bytes", "planned_memory_bytes",
    "memory_by_category", "flops", "planned_flops", "mismatches", "match",
}  # fmt: skip


def _write(tmp: Path, plan: Plan, model: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(plan.to_json())
    (tmp / "program_torch.py").write_text(emit_torch(plan, model))
    return tmp


def _kinds(collectives: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, v in collectives.items():
        kind = key.split("@")[0]
        out[kind] = out.get(kind, 0) + v["count"]
    return out


# one of each runner and sharding mechanism: DTensor tp + flat dp all-reduce, explicit p2p between
# stages of different shapes with a tied parameter (fast); FSDP2 ZeRO-3, torch.distributed.pipelining
# with tp, full recompute under tp (slow: each rehearsal is a fresh process, ~30 s on a loaded machine)
CASES = [
    ("llama-tiny", "dp_tp"),
    ("gpt2-tiny", "hetero"),
    pytest.param("llama-tiny", "zero3", marks=pytest.mark.slow),
    pytest.param("llama-tiny", "pp_tp", marks=pytest.mark.slow),
    pytest.param("gpt2-tiny", "tp_full", marks=pytest.mark.slow),
]
_DONE: dict[tuple[str, str], dict] = {}


def _rehearsed(tmp: Path, model: str, name: str) -> dict:
    """Each layout is rehearsed once per test session (the closed-form test reuses dp_tp)."""
    if (model, name) not in _DONE:
        _DONE[model, name] = rehearse.rehearse_dir(_write(tmp / f"{model}_{name}", layout(model, name), model))
    return _DONE[model, name]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rehearse")


@pytest.mark.parametrize("model, name", CASES)
def test_rehearsed_counts_follow_the_layout(work: Path, model: str, name: str) -> None:
    plan = layout(model, name)
    res = _rehearsed(work, model, name)
    want = expected(model, plan)
    assert [s["index"] for s in res["stages"]] == [s.index for s in plan.stages]
    for s in res["stages"]:
        assert set(s) >= KEYS
        assert s["ranks_rehearsed"][0] == plan.stages[s["index"]].ranks[0]
        assert _kinds(s["collectives"]) == want[s["index"]], (name, s["index"], s["mismatches"])
        assert s["flops"] > 0 and s["peak_memory_bytes"] > 0
        # the plan's own records (search/program/records.py; a hand plan has no ILP tp records): same keys,
        # counts, bytes within 2%
        tp = plan.stages[s["index"]].tp > 1
        assert not [m for m in s["mismatches"] if "@" in m and not (tp and "@tp:" in m)], s["mismatches"]
    # hand plans carry no memory or FLOPs records: the rehearsal must say so
    assert res["match"] is False
    assert any("records no memory_bytes" in m for s in res["stages"] for m in s["mismatches"])
    if name == "hetero":  # stage 0 (tp=2) feeds stage 1 from tp rank 0 only: tp rank 1 is no role, since
        # it runs rank 0's step but the sends (rehearse.roles): played here, it peaks, counts and computes
        # no more than rank 0
        assert res["stages"][0]["ranks_rehearsed"] == [0]
        got = rehearse.run_roles(work / f"{model}_{name}", [0, 1])
        r0, r1 = got[0], got[1]
        assert isinstance(r0, rehearse.RankResult) and isinstance(r1, rehearse.RankResult), got
        assert r1.peak_memory_bytes <= r0.peak_memory_bytes and r1.flops == r0.flops
        assert r1.memory_by_category == r0.memory_by_category
        others = {k: v for k, v in r0.collectives.items() if not k.startswith("p2p")}
        assert {k: v for k, v in r1.collectives.items() if not k.startswith("p2p")} == others
        assert r1.collectives["p2p@pp"]["count"] < r0.collectives["p2p@pp"]["count"]  # receives only


def test_tp_bytes_and_memory_follow_closed_forms(work: Path) -> None:
    """llama-tiny, dp=2 x tp=2, micro-batch 2, 2 micro-batches (the program runs fp32)."""
    plan = layout("llama-tiny", "dp_tp")
    cfg = resolve_model("llama-tiny").config
    b, s, h, v = plan.micro_batch_size, int(plan.training["seq_len"]), cfg["hidden"], cfg["vocab"]
    m, blocks, tp = plan.num_micro_batches, cfg["num_layers"], 2
    st = _rehearsed(work, "llama-tiny", "dp_tp")["stages"][0]
    # Megatron: 2 all-reduces of b*s*h forward + 2 backward per block; the column-parallel LM head
    # gathers its b*s*v logits forward and all-reduces its b*s*h input gradient backward
    n_ar = m * (4 * blocks + 1)
    assert st["collectives"]["all_reduce@tp"] == {"count": n_ar, "bytes": n_ar * b * s * h * 4}
    assert st["collectives"]["all_gather@tp"] == {"count": m, "bytes": m * b * s * v * 4}
    # gradient sync: one flat all-reduce of this rank's gradients (= its parameter bytes)
    model = resolve_model("llama-tiny").build("meta")
    sharded = {k for k, pl in plan.stages[0].param_placements.items() if pl[1] != "R"}
    local = sum(p.numel() // (tp if n in sharded else 1) for n, p in model.named_parameters()) * 4
    assert st["collectives"]["all_reduce@dp"] == {"count": 1, "bytes": local}
    mem = st["memory_by_category"]
    assert mem["gradients"] == local
    assert local <= mem["parameters"] <= local + 1024  # + the rotary inv_freq buffer
    assert 2 * local <= mem["optimizer"] <= 2 * local + 64 * len(list(model.parameters()))  # + step counters
    assert mem["activations"] > 0
    assert st["peak_memory_bytes"] >= mem["parameters"] + mem["gradients"] + mem["optimizer"]
    # FLOPs: 6 per local matmul weight and token (forward 2, backward 4), plus attention (flash:
    # Q K^T and P V forward, 5 matmuls of the same size backward, 2.5x: Dao 2023) on tp-local heads
    lin = sum(p.numel() // (tp if n in sharded else 1) for n, p in model.named_parameters() if p.dim() == 2)
    lin -= model.model.embed_tokens.weight.numel()  # a lookup, no matmul
    heads, d = cfg["heads"] // tp, h // cfg["heads"]
    attention = m * blocks * 7 * 2 * b * heads * s * s * d
    assert st["flops"] == 6 * lin * m * b * s + attention


def _stage_with(records: list[Collective], memory: float, flops: float) -> Plan:
    plan = layout("llama-tiny", "dp_tp")
    st = plan.stages[0]
    import dataclasses

    st = dataclasses.replace(st, collectives=tuple(records), predicted={"memory_bytes": memory, "flops": flops})
    return dataclasses.replace(plan, stages=(st,))


def test_comparison_tolerances_and_words() -> None:
    got = rehearse.RankResult(0, 0, {"all_reduce@tp": {"count": 4, "bytes": 4000}}, 1000, {}, 100)
    ok = _stage_with([Collective("all_reduce", "tp", 1015.0, 4)], 1090.0, 104.0).stages[0]
    assert rehearse.compare_stage(ok, [got])["match"] is True  # bytes +1.5%, memory -8%, FLOPs -3.8%
    bad = _stage_with(
        [Collective("all_reduce", "tp", 1030.0, 4), Collective("all_gather", "dp", 8.0, 1)], 1120.0, 106.0
    ).stages[0]
    rec = rehearse.compare_stage(bad, [got])
    assert rec["match"] is False
    assert rec["mismatches"] == [
        "all_gather@dp: the plan records 1 (8 B), the program issues none",
        "all_reduce@tp: 3.906 KiB rehearsed, 4.023 KiB planned (-2.9%)",
        "memory: peak 1000 B rehearsed, 1.094 KiB planned (-10.7%)",
        "flops: 100 rehearsed, 106 planned (-5.7%)",
    ]
    count = _stage_with([Collective("all_reduce", "tp", 1000.0, 5)], 1000.0, 100.0).stages[0]
    assert rehearse.compare_stage(count, [got])["mismatches"] == ["all_reduce@tp: count 4 rehearsed, 5 planned"]


def test_searched_plan_carries_what_the_rehearsal_compares(tmp_path: Path, monkeypatch) -> None:
    from partita.driver import compile_to_dir
    from partita.search.pricing.config import TrainingConfig

    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan"
    compile_to_dir("gpt2-tiny", "4xCPU", TrainingConfig(global_batch=8, seq_len=16), out)
    said: list[str] = []
    res = rehearse.rehearse_dir(out, progress=said.append)
    plan = Plan.from_json((out / "plan.json").read_text())
    # issue 35 item 10: a line as each role ends, not one line and then minutes of silence
    ranks = sorted(r for s in res["stages"] for r in s["ranks_rehearsed"])
    assert said[0].startswith("rehearsing ranks") and len(said) == 1 + len(ranks), said
    assert sorted(int(x.split()[1]) for x in said[1:]) == ranks
    assert [x.rsplit("(", 1)[1] for x in said[1:]] == [f"{k} of {len(ranks)})" for k in range(1, len(ranks) + 1)]
    for s, st in zip(res["stages"], plan.stages):
        assert s["planned_memory_bytes"] == st.predicted["memory_bytes"] > 0
        assert s["planned_flops"] == st.predicted["flops"] > 0
        cats = st.predicted["memory_by_category"]
        assert sum(cats.values()) == pytest.approx(st.predicted["memory_bytes"])
        assert s["planned_collectives"] == rehearse.planned_collectives(st)
        assert s["match"] == (not s["mismatches"])
    assert res["match"] == all(s["match"] for s in res["stages"])


# ---- bad input: one paragraph, exit 2, nothing written ---------------------------------------------
def _listing(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _refused(d: Path, capsys, needle: str) -> None:
    before = _listing(d) if d.exists() else {}
    assert cli_main(["rehearse", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("partita: error: ") and needle in " ".join(err.split()) and "Traceback" not in err
    assert (_listing(d) if d.exists() else {}) == before


def test_bad_input_is_refused(tmp_path: Path, capsys) -> None:
    _refused(tmp_path / "missing", capsys, "no plan at")
    d = _write(tmp_path / "edited", layout("llama-tiny", "dp_tp"), "llama-tiny")
    src = (d / "program_torch.py").read_text()
    (d / "program_torch.py").write_text(src.replace("'S(0)'", "'S(1)'", 1))  # one placement changed by hand
    _refused(d, capsys, "not the program this Partita emits")
    (d / "program_torch.py").write_text(src + "\nraise SystemExit('hand edit')\n")  # never executed
    _refused(d, capsys, "not the program this Partita emits")
    (d / "program_torch.py").unlink()
    _refused(d, capsys, "no PyTorch program")
    v = _write(tmp_path / "version", layout("llama-tiny", "dp_tp"), "llama-tiny")
    raw = json.loads((v / "plan.json").read_text())
    (v / "plan.json").write_text(json.dumps({**raw, "version": 99}))
    _refused(v, capsys, "plan version 99")


def test_json_output(tmp_path: Path, capsys) -> None:
    d = _write(tmp_path / "p", layout("llama-tiny", "tp"), "llama-tiny")
    assert cli_main(["rehearse", str(d), "--json"]) == 1  # hand plan: no memory / FLOPs records
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"match", "stages"} and len(out["stages"]) == 1
    assert all(set(s) >= KEYS for s in out["stages"])


def test_check_program_raises_plan_error(tmp_path: Path) -> None:
    plan = layout("llama-tiny", "tp")
    d = _write(tmp_path, plan, "llama-tiny")
    (d / "program_torch.py").write_text((d / "program_torch.py").read_text().replace("tp=2", "tp=3"))
    with pytest.raises(PlanError):
        rehearse.check_program(plan, d)


@pytest.mark.parametrize(("pairs", "num_experts", "p"), [(4096, 8, 2), (4096, 8, 4), (10, 4, 2), (6, 8, 8)])
def test_balanced_routing_under_fake_tensors_is_a_consistent_exchange(pairs: int, num_experts: int, p: int) -> None:
    """``moe._balanced_routing`` (what the expert-parallel forward assumes under fake tensors, where the
    router has no values): every rank sends all its ``pairs``; what rank ``d`` receives from ``s`` is
    what ``s`` sends to ``d``; each local expert's spans cover the received rows once, in order; with
    ``pairs`` divisible by ``num_experts`` every peer gets the plan's balanced share ``pairs / p``."""
    from partita.backends.torch import moe

    got = [moe._balanced_routing(pairs, num_experts, p, r) for r in range(p)]
    for r, (send, recv, spans) in enumerate(got):
        assert sum(send) == pairs
        assert recv == [got[src][0][r] for src in range(p)]
        rows = sorted(i for js in spans for start, n in js for i in range(start, start + n))
        assert rows == list(range(sum(recv)))
        if pairs % num_experts == 0:
            assert send == [pairs // p] * p
