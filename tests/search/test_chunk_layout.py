"""A hand-made interleaved 1F1B layout laid out as model chunks (``search/chunk_layout.py``), in process.

``partita compile MODEL --pp 2 --schedule interleaved_1f1b --virtual-stages 2`` prices the layout per
rank group and lays it out as 4 virtual stages (loop placement). Checked here on a 4-block GPT-2 from a
config.json: every rank group holds the layer kinds it was priced with, the step time is the simulator's
on the chunks' own action list, the records carry every chunk's p2p (none twice, one dp gradient sync per
rank group), and the program prints the chunk placement. The runtime running chunked plans is
``tests/runtime/test_schedules_runtime.py``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from partita.cli import main as cli_main
from partita.cluster import parse_shorthand
from partita.driver import trace_model
from partita.errors import ConfigError
from partita.plan import Plan, chunk_position
from partita.search import records, schedule_cost
from partita.search.chunk_layout import piece_sizes
from partita.search.config import SearchOptions, TrainingConfig
from partita.search.hand_plan import hand_plan

CFG = {"model_type": "gpt2", "n_embd": 32, "n_layer": 4, "n_head": 2, "vocab_size": 64, "n_positions": 16}


@pytest.fixture(scope="module")
def gpt2_4(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    path = tmp_path_factory.mktemp("chunks") / "gpt2-4.json"
    path.write_text(json.dumps(CFG))
    return str(path), trace_model(str(path), seq=16).graph


def test_piece_sizes() -> None:
    assert piece_sizes([3, 3], 2) == [2, 1, 1, 2]  # embed + 2 blocks | 2 blocks + head
    assert piece_sizes([4, 4], 2) == [2, 2, 2, 2]
    with pytest.raises(ConfigError, match="rank group 1"):
        piece_sizes([2, 3, 2], 2)


def test_hand_interleaved_plan_is_chunked_as_priced(gpt2_4: tuple) -> None:
    _, graph = gpt2_4
    training = TrainingConfig(global_batch=8, seq_len=16, dtype="f32")
    plan = hand_plan(
        graph, parse_shorthand("4xCPU"), training, tp=1, pp=2, dp=2, micro_batch=1, schedule="interleaved_1f1b",
        num_virtual=2,
    )  # fmt: skip
    plan = Plan.from_json(plan.to_json())
    assert plan.chunked and plan.num_stages == 4 and plan.num_positions == 2 and plan.world_size == 4
    names = [lay.name for lay in graph.layers]
    assert [x for s in plan.stages for x in s.layers] == names  # virtual stages cut the model in order
    for r, group in enumerate(plan.positions()):
        assert [chunk_position("interleaved_1f1b", s.index, 2) for s in group] == [r, r]
    kinds = {lay.name: lay.kind for lay in graph.layers}
    # rank group r holds the kinds of the range it was priced with (megatron_split: embed + 2 blocks, 2 blocks + head)
    assert [kinds[x] for s in plan.positions()[0] for x in s.layers] == [kinds[x] for x in names[:3]]
    assert [kinds[x] for s in plan.positions()[1] for x in s.layers] == [kinds[x] for x in names[3:]]
    # the step is the simulated interleaved action list on the rank groups' F/B/W (chunks summed back)
    fbw = [[sum(s.predicted[f"{k}_action_s"] for s in g) for g in plan.positions()] for k in "fbw"]
    pt = schedule_cost.pipeline_time("interleaved_1f1b", plan.num_micro_batches, 2, *fbw)
    tail = max(s.predicted["tail_s"] for s in plan.stages)
    assert plan.predicted["step_time_s"] == pytest.approx(pt.step_s + tail, rel=1e-6)
    # records: p2p only across rank groups (every boundary here is), one dp all-reduce per rank group
    summ = [records.summary(s.collectives) for s in plan.stages]
    assert [x.get("all_reduce@dp", {}).get("count", 0) for x in summ] == [1, 1, 0, 0]
    m = plan.num_micro_batches
    assert [x["p2p@pp"]["count"] for x in summ] == [2 * m, 4 * m, 4 * m, 2 * m]
    # the report counts each rank group once and draws one timeline row per rank group
    from partita.report import fmt, html

    assert fmt.used_devices(plan) == {"CPU": 4}
    page = html.timeline_html(plan)
    assert page.count('<div class="row">') == 2 and "(model chunk 1)" in page


def test_cli_compiles_interleaved_hand_layout(gpt2_4: tuple, tmp_path: Path) -> None:
    spec, _ = gpt2_4
    out = tmp_path / "out"
    argv = ["compile", spec, "--cluster", "2xCPU", "--global-batch", "4", "--seq", "16", "--pp", "2"]
    argv += ["--schedule", "interleaved_1f1b", "--virtual-stages", "2", "--out", str(out)]
    assert cli_main(argv) == 0
    plan = Plan.from_json((out / "plan.json").read_text())
    assert plan.chunked and plan.num_virtual_stages == 2
    src = (out / "program_torch.py").read_text()
    assert "schedule interleaved_1f1b" in src and "loop placement: chunk c of rank group r is stage c*p + r" in src
    assert 'chunks=PROGRAM["chunks"]' in src
    bad = tmp_path / "bad"
    assert cli_main([*argv[:-1], str(bad), "--virtual-stages", "3"]) == 2  # 4 blocks: no pp=2 x 3 chunks
    assert not bad.exists()


def test_search_picks_interleaved_as_model_chunks() -> None:
    """The default schedules include interleaved 1F1B; where it wins (here a 16-block GPT on 8 V100s,
    held to ZeRO-0 without recompute) the plan is laid out as chunks, each rank group keeping the
    layer kinds it was priced with, and its step is the simulated action list on those groups."""
    from partita.backends.torch.emit import emit_torch
    from partita.search.planner import plan_graph
    from tests.search import builders

    g = builders.gpt(16, 4096, 16)
    training = TrainingConfig(global_batch=64, seq_len=1024)
    opts = dataclasses.replace(SearchOptions(), max_micro_batch=4, zero_stages=(0,), recompute=("none",))
    assert "interleaved_1f1b" in opts.schedules
    plan = Plan.from_json(plan_graph(g, parse_shorthand("8xV100-32G"), training, options=opts).to_json())
    v = plan.num_virtual_stages
    assert plan.schedule == "interleaved_1f1b" and plan.chunked and v > 1, plan.search.get("schedules")
    assert [x for s in plan.stages for x in s.layers] == [lay.name for lay in g.layers]
    assert all(len(grp) == v and len({s.ranks for s in grp}) == 1 for grp in plan.positions())
    fbw = [[sum(s.predicted[f"{k}_action_s"] for s in grp) for grp in plan.positions()] for k in "fbw"]
    pt = schedule_cost.pipeline_time("interleaved_1f1b", plan.num_micro_batches, v, *fbw)
    tail = max(s.predicted["tail_s"] for s in plan.stages)
    assert plan.predicted["step_time_s"] == pytest.approx(pt.step_s + tail, rel=1e-6)
    src = emit_torch(plan, "builders-gpt")
    assert 'chunks=PROGRAM["chunks"]' in src and f"{len(plan.stages)} virtual stages" in src
