"""One setup path (issue 33): the torchrun program and the rehearsal set a stage up through the same
function, ``materialize.setup_stage``, and a tied model's stages are tied again correctly.

* the setup-path test instruments ``materialize.setup_stage`` (a recording wrapper, in this process)
  and runs the program's own ``train.main`` on a 1-rank gloo world and ``rehearse.rehearse_rank`` on a
  fake world: each must call it exactly once, with the program's own ``setup_stage_0``, and use the
  module it returns; a path setting a stage up some other way leaves the count at 0 and fails;
* the stage set up on meta and filled shard by shard (tp = 2 on a fake world of 2: each rank's local
  shard) equals the single-device reference's weights, sliced;
* the rehearsal pairs every send between two rehearsed ranks with its receive (``rehearse.pair_p2p``,
  ``p2p_world``), each named by the action of torch's 1F1B schedule it belongs to, and reports a
  deliberately unpaired send added after a generated 1F1B schedule (more in ``test_rehearse_world.py``);
* the tied-embedding Qwen2 reproduction: a pipeline stage of a generic (non-adapter) model holds a
  ``Ghost`` of the other stage's tied module, whose ``getattr`` answers with that module's meta
  parameter; ``retie`` took it for a holder and raised ``KeyError: "attribute 'weight' already
  exists"`` (stage 0) or tied the head to the ghost's meta weight (the last stage).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partita.backends.torch import launch as torch_launch
from partita.backends.torch import materialize, rehearse
from partita.backends.torch import parallel as tpar
from partita.backends.torch import stages as torch_stages
from partita.backends.torch import train as torch_train
from partita.backends.torch.emit import emit_torch
from partita.frontends import torch_shim
from partita.models.families import config, write_config
from partita.models.zoo import resolve_model
from partita.search.pipeline.schedule import pipeline_actions
from partita.search.program import records
from tests.runtime.plans import _graph, layout, make_plan

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``materialize.setup_stage`` wrapped: one record per call, with the ``Materialized`` it set up,
    which must be one ``materialize.build_stage`` returned (recorded in ``built``)."""
    calls: list[dict[str, Any]] = []
    real = materialize.setup_stage
    real_build = materialize.build_stage
    built_ids: list[int] = []

    def build(*args: Any, **kw: Any) -> Any:
        out = real_build(*args, **kw)
        built_ids.append(id(out))
        return out

    monkeypatch.setattr(materialize, "build_stage", build)

    def wrapper(built: Any, setup: Any, rt: Any, device: Any, **kw: Any) -> nn.Module:
        module = real(built, setup, rt, device, **kw)
        calls.append(
            {
                "setup": setup,
                "module": module,
                "fill": kw.get("fill", True),
                "how": built.how,
                "host": kw.get("host_fill"),
                "built_here": id(built) in built_ids,  # the model came from materialize.build_stage
            }
        )
        return module

    monkeypatch.setattr(materialize, "setup_stage", wrapper)
    return calls


def test_program_and_rehearsal_set_a_stage_up_through_one_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = make_plan("gpt2-tiny", [{"layers": ["embed", "transformer.h.0", "transformer.h.1", "head"],
                                    "ranks": [0], "dp": 1, "tp": 1}], global_batch=4)  # fmt: skip
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "program_torch.py").write_text(emit_torch(plan, "gpt2-tiny"))
    program = torch_launch.load_program(tmp_path)
    calls = _recording(monkeypatch)

    made: list[Any] = []
    real_opt = torch_train.make_optimizer
    monkeypatch.setattr(torch_train, "make_optimizer", lambda ps, t: made.append(ps := list(ps)) or real_opt(ps, t))
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    res = torch_train.main(program.PROGRAM, program.SETUP_STAGE, program.make_runner, program.lr_lambda,
                           ["--steps", "1", "--no-count", "--log-every", "0"])  # fmt: skip
    assert res is not None and len(res["losses"]) == 1
    assert [c["setup"] for c in calls] == [program.SETUP_STAGE[0]] and calls[0]["fill"] and calls[0]["how"] == "stage"
    assert calls[0]["built_here"], "the program built its stage without materialize.build_stage"
    assert made[0] == list(calls[0]["module"].parameters())  # the program trains the module it returned

    got = rehearse.rehearse_rank(program, 0)
    assert len(calls) == 2, "the rehearsal set its stage up without materialize.setup_stage"
    assert calls[1]["setup"] is program.SETUP_STAGE[0] and not calls[1]["fill"]
    assert calls[1]["built_here"] and calls[1]["how"] == "stage", "the rehearsal built its stage another way"
    assert isinstance(calls[1]["host"], materialize.HostFill)  # the fill streamed through the host (issue 33 item 4)
    assert all(torch_shim.is_fake(p) for p in calls[1]["module"].parameters())
    assert got.peak_memory_bytes > 0 and got.host_peak_bytes > 0
    # the host peak is compared with the plan's bound: under it here, above a bound set too low
    bounded = records.memory_items(plan, _graph("gpt2-tiny")).stages[0]
    assert not [m for m in rehearse.compare_stage(bounded, [got])["mismatches"] if m.startswith("host")]
    low = dataclasses.replace(bounded, predicted={**bounded.predicted, "host_memory": {"bytes": 1.0}})
    assert [m for m in rehearse.compare_stage(low, [got])["mismatches"] if m.startswith("host memory: peak")]


def test_sharded_fill_equals_the_reference_weights() -> None:
    """tp = 2 on a fake world, as rank 1: the local shard of every parameter is the reference's slice
    (rank 1's: the second chunk; one rank a process, as in a run: a sub-mesh cached by an earlier
    process group of the same ranks would keep that group's coordinate)."""
    ref = dict(materialize.materialize(resolve_model("llama-tiny"), 0).model.named_parameters())
    layers = ["embed", "model.layers.0", "model.layers.1", "head"]
    plan = make_plan("llama-tiny", [{"layers": layers, "ranks": [0, 1], "dp": 1, "tp": 2}])
    placements = {n: p[1] for n, p in plan.stages[0].param_placements.items()}
    handle = resolve_model("llama-tiny")
    torch_shim.reset_dtensor_caches()
    torch_shim.fake_process_group(1, 2)
    try:
        mesh = tpar.build_mesh("cpu", [0, 1], 1, 2)
        x0, _ = torch_train.make_batch(handle, {**plan.training, "global_batch": 1}, 0, 0)
        built = materialize.build_stage(handle, 0, [layers], layers, x0, fallback=False)

        def setup(model: nn.Module, rt: Any) -> nn.Module:
            module = tpar.split_stage(model, layers, layers, rt.device)
            tpar.distribute_params(module, mesh["tp"], placements)
            return module

        rt = torch_train.StageRuntime({}, {}, 1, torch.device("cpu"), mesh, None, [], (x0.shape, x0.dtype))  # type: ignore[arg-type]
        module = materialize.setup_stage(built, setup, rt, torch.device("cpu"))
        sharded = 0
        for name, p in module.named_parameters():
            place, want = placements.get(name, "R"), ref[name]
            if place.startswith("S("):
                want = want.chunk(2, int(place[2:-1]))[1]
                sharded += 1
            local = p.to_local() if hasattr(p, "to_local") else p
            torch.testing.assert_close(local.detach(), want, rtol=0, atol=0, msg=name)
        assert sharded >= 14
    finally:
        torch.distributed.destroy_process_group()


def _tied_qwen(tmp: Path) -> Any:
    cfg = config("qwen2", h=64, l=4, a=4, k=2, f=128, v=128, p=64)
    cfg.update(bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    return resolve_model(str(write_config(tmp / "qwen", cfg)))


def test_retie_skips_a_ghost_of_the_tied_module(tmp_path: Path) -> None:
    handle = _tied_qwen(tmp_path)
    layers = ["embed", *(f"model.layers.{i}" for i in range(4)), "head"]
    cuts = [layers[:2], layers[2:4], layers[4:]]
    x0, _ = torch_train.make_batch(handle, {"global_batch": 1, "seq_len": 16}, 0, 0)
    for keep in (cuts[0], cuts[-1]):
        built = materialize.build_stage(handle, 0, cuts, keep, x0, fallback=False)  # meta: no CPU fallback
        assert built.tied == [["model.embed_tokens.weight", "lm_head.weight"]]
        stage = torch_stages.split(built.model, keep, layers, torch.device("meta"))
        stage.to_empty(device="cpu")
        held = {n: p for n, p in stage.named_parameters()}
        materialize.retie(stage, built.tied)  # the old retie: KeyError on stage 0, the ghost's weight on the last
        after = dict(stage.named_parameters())
        assert after.keys() == held.keys() and all(after[n] is held[n] for n in held)
        assert all(p.device.type == "cpu" for p in after.values())


def _pipeline_roles(tmp: Path) -> tuple[Any, list[int]]:
    plan = layout("gpt2-tiny", "pp_1f1b")
    (tmp / "plan.json").write_text(plan.to_json())
    (tmp / "program_torch.py").write_text(emit_torch(plan, "gpt2-tiny"))
    return torch_launch.load_program(tmp), [s.ranks[0] for s in plan.stages]


def test_rehearsal_pairs_every_send_with_its_receive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The roles of a 2-stage 1F1B pipeline, played in turn: every send meets its receive. Then a
    deliberately unpaired send (stage 0 sends one more tensor to stage 1 after its schedule) is
    reported, naming both ranks; a run would hang there."""
    program, ranks = _pipeline_roles(tmp_path)
    got = {r: rehearse.rehearse_rank(program, r) for r in ranks}
    # 4 micro-batches: stage 0 sends each activation and receives its gradient, stage 1 the other way,
    # each operation named by the action torch's Schedule1F1B ran it for, in the order of the plan's
    # own 1F1B action list (the one the cost model simulates): F sends / receives activations, B gradients
    for r, acts in zip(ranks, pipeline_actions("1f1b", 2, 4)):
        want = [f"{a} {'send' if (str(a)[0] == 'F') == (r == ranks[0]) else 'recv'}" for a in acts]
        assert [row[4] for row in got[r].p2p] == want, r
    assert rehearse.pair_p2p(got) == {}

    real = torch_train.forward_backward

    def extra_send(runner: Any, rt: Any, me: Any, *args: Any) -> Any:
        out = real(runner, rt, me, *args)
        if me["index"] == 0:
            torch.distributed.send(torch.zeros(16), dst=ranks[1], group=rt.pp_group)
        return out

    monkeypatch.setattr(torch_train, "forward_backward", extra_send)
    got = {r: rehearse.rehearse_rank(program, r) for r in ranks}
    found = rehearse.pair_p2p(got)
    assert set(found) == set(ranks), found
    assert found[ranks[0]] == [
        f"p2p: rank {ranks[0]} (stage 0) outside the schedule (64 B) to rank {ranks[1]} (stage 1) has no receive: "
        f"rank {ranks[1]} ended its step with 1 of rank {ranks[0]}'s sends unreceived (the pipeline would hang)"
    ]
