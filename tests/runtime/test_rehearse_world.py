"""Issue 33 item 3: the roles of a pipeline rehearsed together, every send matched with its receive.

Each role runs its own program on a fake process group (``rehearse.rehearse_rank``), where a receive
returns at once; ``p2p_world.match_world`` then plays the roles' recorded sends and receives together
with the schedule's blocking rules (``rehearse.pair_p2p``). What these tests prove, on a 4-stage ZB-H1
program of gpt2-tiny (``P2PPipeline``: one layer a stage, 4 micro-batches):

* the correct program's world pairs completely, and every operation carries the action of the
  program's own ``ACTIONS`` list it belongs to, in that list's order;
* the program with its generated schedule edited is reported by name (rank, stage, action): the
  last stage running three forwards before its first backward deadlocks with stage 2 (ZB-H1 gives
  stage 2 two forwards of warm-up); stage 1 receiving micro-batch 1 before 0 is a wrong order under
  NCCL (pairs in order) and none under gloo (pairs by tag); stage 0's ``F0.3`` sending its output
  twice is a send without its receive;
* a ZB-V program (2 rank groups x 2 chunks) is in NCCL order: once its two streams between one pair
  of ranks shared the default group and were issued in different orders on the two sides (issue 33's
  finding); ``P2PPipeline`` now gives each stream its own group, and the matcher pairs per group;
* the matcher's rules themselves on hand-written worlds: sends are asynchronous (a head-to-head
  exchange of sends then receives completes), a cycle of receives is a deadlock, a rank that was
  not rehearsed (a folded tp peer) is not checked, and NCCL pairs per group (gloo per group and tag).

Only the edited rank is rehearsed again: a rank's recorded operations depend on its own program alone.
The 2-stage torch.distributed.pipelining (1F1B) case is ``tests/runtime/test_setup_path.py``'s; the
interleaved and ZB-V programs pair inside ``rehearse_dir`` (``tests/runtime/test_rehearse.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from partita.backends.torch import launch as torch_launch
from partita.backends.torch import p2p_world, rehearse
from partita.backends.torch import schedule as torch_schedule
from partita.backends.torch.emit import emit_torch
from partita.search.pipeline.schedule import pipeline_actions
from tests.runtime.plans import LAYERS, make_plan

os.environ.setdefault("OMP_NUM_THREADS", "1")
M = 4
ACTIONS = [" ".join(map(str, r)) for r in pipeline_actions("zb_h1", 4, M)]
PLAN = make_plan(
    "gpt2-tiny",
    [{"layers": [layer], "ranks": [i], "dp": 1, "tp": 1} for i, layer in enumerate(LAYERS["gpt2-tiny"])],
    schedule="zb_h1",
    micro_batch_size=2,
    num_micro_batches=M,
)


def _program(tmp: Path, edits: dict[int, str] | None = None) -> Any:
    """The emitted program, with stage ``i``'s action list replaced by ``edits[i]``."""
    text = emit_torch(PLAN, "gpt2-tiny")
    for stage, actions in (edits or {}).items():
        assert f'"{ACTIONS[stage]}"' in text  # one line per stage at 12 actions
        text = text.replace(f'"{ACTIONS[stage]}"', f'"{actions}"')
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(PLAN.to_json())
    (tmp / "program_torch.py").write_text(text)
    return torch_launch.load_program(tmp)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[int, rehearse.RankResult]:
    program = _program(tmp_path_factory.mktemp("pp4"))
    return {r: rehearse.rehearse_rank(program, r) for r in range(4)}


def _expected_labels(stage: int, actions: str) -> list[str]:
    """The p2p operations an action list asks of ``stage`` of 4, in order: F receives its input
    (not stage 0) then sends its output (not the last); B receives its output gradient (not the
    last) then sends its input gradient (not stage 0); W moves nothing."""
    out = []
    for word in actions.split():
        kind = word[0]
        if kind == "F":
            out += [f"{word} recv"] * (stage > 0) + [f"{word} send"] * (stage < 3)
        elif kind == "B":
            out += [f"{word} recv"] * (stage < 3) + [f"{word} send"] * (stage > 0)
    return out


def test_pp4_zero_bubble_world_pairs_in_the_schedules_order(world: dict[int, rehearse.RankResult]) -> None:
    assert all(isinstance(world[r].p2p, list) for r in world)
    assert rehearse.pair_p2p(world) == {}
    for r, got in world.items():
        assert [row[4] for row in got.p2p] == _expected_labels(r, ACTIONS[r]), r
        assert all(row[1] == r + (1 if "F" in row[4][0] else -1) * (1 if row[0] == "send" else -1) for row in got.p2p)


def test_an_edited_schedule_that_deadlocks_is_named(world: dict[int, rehearse.RankResult], tmp_path: Path) -> None:
    """Stage 3 runs F3.0 F3.1 F3.2 before B3.0: it waits for micro-batch 2's activation, which stage 2
    sends only after B2.0, which waits for stage 3's gradient of micro-batch 0."""
    edited = "F3.0 F3.1 F3.2 B3.0 B3.1 B3.2 F3.3 B3.3 W3.0 W3.1 W3.2 W3.3"
    got = {**world, 3: rehearse.rehearse_rank(_program(tmp_path, {3: edited}), 3)}
    found = rehearse.pair_p2p(got)
    assert found[3] == [
        "p2p: deadlock: rank 3 (stage 3) waits at F3.2 recv from rank 2 (stage 2), which itself waits at B2.0 "
        "recv from rank 3 (stage 3)"
    ]
    assert found[2] == [
        "p2p: deadlock: rank 2 (stage 2) waits at B2.0 recv from rank 3 (stage 3), which itself waits at F3.2 "
        "recv from rank 2 (stage 2)"
    ]
    assert set(found) == {0, 1, 2, 3}  # stages 0 and 1 wait for gradients behind them


def test_a_receive_out_of_order_is_a_wrong_order(world: dict[int, rehearse.RankResult], tmp_path: Path) -> None:
    """Stage 1 receives micro-batch 1 before 0: NCCL (a GPU plan) pairs messages between two ranks in
    order and would hand F1.1 micro-batch 0's activation; gloo (this CPU plan's backend) pairs by tag,
    so there it is no finding."""
    edited = ACTIONS[1].replace("F1.0 F1.1", "F1.1 F1.0")
    got = {**world, 1: rehearse.rehearse_rank(_program(tmp_path, {1: edited}), 1)}
    assert rehearse.pair_p2p(got, in_order=False) == {}
    found = rehearse.pair_p2p(got, in_order=True)
    want = "p2p: wrong order: rank 1 (stage 1) F1.1 recv from rank 0 (stage 0) receives, as message 1 between them, "
    assert any(m.startswith(want + "what F0.0 send sent (tag 2 sent, 10 expected)") for m in found[0]), found
    assert any(m.startswith("p2p: wrong order: rank 2 (stage 2) F2.0 recv from rank 1 (stage 1)") for m in found[2])
    assert not any("deadlock" in m for ms in found.values() for m in ms)  # the sends are asynchronous


def test_an_unpaired_send_in_the_generated_schedule_is_reported(
    world: dict[int, rehearse.RankResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 0's last forward (F0.3) sends its output twice; stage 1 receives it once."""
    real = torch_schedule.P2PPipeline._send

    def twice(self: Any, t: Any, peers: Any, stage: int, k: int, backward: bool) -> list[Any]:
        out = real(self, t, peers, stage, k, backward)
        return out + real(self, t, peers, stage, k, backward) if (stage, k, backward) == (1, M - 1, False) else out

    monkeypatch.setattr(torch_schedule.P2PPipeline, "_send", twice)
    got = {**world, 0: rehearse.rehearse_rank(_program(tmp_path), 0)}
    found = rehearse.pair_p2p(got)
    assert set(found) == {0, 1}, found
    assert found[0] == found[1] and len(found[0]) == 1
    assert found[0][0].startswith("p2p: rank 0 (stage 0) F0.3 send (")
    assert found[0][0].endswith(
        "to rank 1 (stage 1) has no receive: rank 1 ended its step with 1 of rank 0's sends unreceived "
        "(the pipeline would hang)"
    )


@pytest.mark.slow  # ~9 s: two roles of a 4-chunk program
def test_zero_bubble_v_program_is_in_nccl_order(tmp_path: Path) -> None:
    """Issue 33's finding, fixed: on one group rank 1's B2.0 receive was its 3rd from rank 0, whose 3rd
    send was F0.2's activation (NCCL, which ignores tags, would deliver an activation as a gradient).
    ``P2PPipeline`` now gives each message stream (boundary, direction) its own group, each in
    micro-batch order on both sides; the recorded operations name their group, and the matcher pairs
    per group. The program's messages of the two rank groups fall in exactly the four streams."""
    layers = LAYERS["gpt2-tiny"]
    plan = make_plan(
        "gpt2-tiny",
        [{"layers": [layer], "ranks": [r], "dp": 1, "tp": 1} for layer, r in zip(layers, (0, 1, 1, 0))],
        schedule="zbv",
        micro_batch_size=2,
        num_micro_batches=M,
    )
    assert plan.chunked
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "program_torch.py").write_text(emit_torch(plan, "gpt2-tiny"))
    program = torch_launch.load_program(tmp_path)
    got = {r: rehearse.rehearse_rank(program, r) for r in (0, 1)}
    assert rehearse.pair_p2p(got, in_order=False) == {}  # gloo, by tag: pairs
    assert rehearse.pair_p2p(got, in_order=True) == {}  # NCCL, in order per group: the finding is gone
    # the streams as the program ran them: per group, one direction, one boundary, micro-batches in order
    streams: dict[str, set[tuple[int, str, str]]] = {}
    for r in (0, 1):
        for op, peer, _, _, label, group in got[r].p2p:
            src = r if op == "send" else peer
            kind, stage = label[0], int(label[1 : label.index(".")])
            boundary = stage if op == "recv" and kind == "F" or op == "send" and kind == "B" else stage + 1
            streams.setdefault(group, set()).add((src, kind, f"boundary into {boundary}"))
    assert sorted(streams.values(), key=sorted) == sorted(
        [{(0, "F", "boundary into 1")}, {(1, "B", "boundary into 1")}, {(1, "F", "boundary into 3")},
         {(0, "B", "boundary into 3")}], key=sorted)  # fmt: skip
    for r in (0, 1):
        for group in streams:
            micro = [int(row[4].split(".")[1].split()[0]) for row in got[r].p2p if row[5] == group]
            assert micro == sorted(micro) and len(micro) == M, (r, group, micro)


def _ops(*rows: tuple[str, int, str]) -> list[p2p_world.Op]:
    return [p2p_world.Op(op, peer, 64, 0, label) for op, peer, label in rows]


def test_the_matchers_blocking_rules() -> None:
    stages = {0: 0, 1: 1}
    # both send first, then receive: sends are asynchronous, the exchange completes
    swap = {0: _ops(("send", 1, "a"), ("recv", 1, "b")), 1: _ops(("send", 0, "c"), ("recv", 0, "d"))}
    assert p2p_world.match_world(swap, stages) == {}
    # both receive first: a cycle of receives
    cycle = {0: _ops(("recv", 1, "b"), ("send", 1, "a")), 1: _ops(("recv", 0, "d"), ("send", 0, "c"))}
    found = p2p_world.match_world(cycle, stages)
    assert found[0] == ["p2p: deadlock: rank 0 (stage 0) waits at b from rank 1 (stage 1), which itself waits at d "
                        "from rank 0 (stage 0)"]  # fmt: skip
    # a receive whose peer ends its step without the send
    short = {0: _ops(("recv", 1, "b")), 1: []}
    assert "ended its step without that send" in p2p_world.match_world(short, stages)[0][0]
    # rank 2 was not rehearsed (a folded tp peer): its operations are not checked
    folded = {0: _ops(("send", 2, "a"), ("recv", 2, "b"), ("send", 1, "c")), 1: _ops(("recv", 0, "d"))}
    assert p2p_world.match_world(folded, stages) == {}


def test_nccl_pairs_per_group_and_gloo_per_group_and_tag() -> None:
    """Two streams between one pair of ranks, issued in different orders on the two sides (ZB-V's
    finding): on one group NCCL pairs them in issue order (a wrong order); on a group each they pair;
    a send and a receive on different groups never pair, under NCCL or gloo."""
    stages = {0: 0, 1: 1}

    def world(act: str, grad: str) -> dict[int, list[p2p_world.Op]]:
        """Rank 0 sends F0.0, F0.2 (activations, group ``act``) then B3.0 (a gradient, group ``grad``);
        rank 1 receives F1.0, B2.0, F1.2."""
        sends = [("F0.0 send", 0, act), ("F0.2 send", 2, act), ("B3.0 send", 3, grad)]
        recvs = [("F1.0 recv", 0, act), ("B2.0 recv", 3, grad), ("F1.2 recv", 2, act)]
        return {
            0: [p2p_world.Op("send", 1, 64, tag, label, g) for label, tag, g in sends],
            1: [p2p_world.Op("recv", 0, 64, tag, label, g) for label, tag, g in recvs],
        }

    one = p2p_world.match_world(world("1", "1"), stages)
    assert one[1] == [
        "p2p: wrong order: rank 1 (stage 1) B2.0 recv from rank 0 (stage 0) receives, as message 2 between them, "
        "what F0.2 send sent (tag 2 sent, 3 expected) (and 1 more pairs after it)"
    ]
    assert p2p_world.match_world(world("1", "1"), stages, in_order=False) == {}  # gloo: by tag
    assert p2p_world.match_world(world("1", "2"), stages) == {}  # a group per stream: in order per group
    crossed = {
        0: [p2p_world.Op("send", 1, 64, 0, "F0.0 send", "1")],
        1: [p2p_world.Op("recv", 0, 64, 0, "F1.0 recv", "2")],
    }
    for in_order in (True, False):
        found = p2p_world.match_world(crossed, stages, in_order=in_order)
        assert "ended its step without that send" in found[1][0], found


@pytest.mark.slow
def test_tied_qwen2_tp2_pp4_zero_bubble_rehearses_and_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33's tied-embedding reproduction end to end: a 4-layer Qwen2 config with tied embeddings,
    ``partita compile`` as tp 2 x pp 4 under ZB-H1 (8 ranks), rehearsed through ``rehearse_dir``: its
    roles (tp rank 0 of each stage) run the program's own setup (``retie`` once raised ``KeyError:
    "attribute 'weight' already exists"`` here) and pair every send with its receive in one world;
    every stage matches the plan (collectives, memory, FLOPs)."""
    from partita.cli import main as cli_main
    from partita.models.families import config, write_config
    from partita.plan import read_plan

    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    cfg = config("qwen2", h=64, l=4, a=4, k=2, f=128, v=128, p=64)
    cfg.update(bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    path = write_config(tmp_path / "qwen", cfg)
    out = tmp_path / "plan"
    args = ["compile", str(path), "--cluster", "8xCPU", "--global-batch", "8", "--seq", "16", "--tp", "2", "--pp", "4"]
    args += ["--dp", "1", "--micro-batch", "1", "--schedule", "zb_h1", "--precision", "f32", "--out", str(out)]
    assert cli_main(args) == 0
    plan = read_plan(out / "plan.json")
    assert plan.schedule == "zb_h1" and [(s.tp, s.dp) for s in plan.stages] == [(2, 1)] * 4
    res = rehearse.rehearse_dir(out)
    assert [s["ranks_rehearsed"] for s in res["stages"]] == [[0], [2], [4], [6]]
    assert res["match"], [(s["index"], s["mismatches"]) for s in res["stages"]]
    # 8 micro-batches; per cut and micro-batch tp rank 0 sends its tensor to both tp ranks of the neighbour
    # stage (P2PPipeline) and receives the neighbour's once: 3 operations per cut, 8 x 3 an end stage, twice inner
    assert [s["collectives"]["p2p@pp"]["count"] for s in res["stages"]] == [24, 48, 48, 24]
