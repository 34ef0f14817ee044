"""Layouts that ran in public, priced by ``partita evaluate`` as they ran (issue 32 item 3).

Llama 3 405B (arXiv:2407.21783, sec. 3.3.2) ran 126 blocks on 16 pipeline stages with the interleaved
schedule, one layer fewer on the first and the last stage so that the first stage's first model chunk
holds only the embedding and the last stage's last chunk only the output layer: one layer per chunk, 8
chunks per stage. Before this, ``evaluate`` refused it ("126 blocks do not split into pp=16 stages of 8
virtual chunks each"), and refused Megatron sequence parallelism with model chunks or with context
parallelism although the published rows are Megatron-style programs that ran both
(``evaluate_config(tp_style="megatron")``); ``partita compile`` of Partita's own program still refuses
what it does not build, in the same words.
"""

from __future__ import annotations

import pytest

from partita.cluster import parse_cluster
from partita.errors import ConfigError
from partita.search.entry.evaluate import evaluate_config, megatron_split
from partita.search.pricing.config import TrainingConfig
from partita.search.program import chunk_layout
from tests.search.builders import gpt_with_ends

TR = TrainingConfig(global_batch=32, seq_len=1024)


@pytest.fixture(scope="module")
def g126():  # noqa: ANN201
    return gpt_with_ends(126, 256, 8, light=True)


def test_126_blocks_on_16_interleaved_stages_are_priced_as_llama3_split_them(g126) -> None:  # noqa: ANN001
    cl = parse_cluster("16xH100-80G")
    kw = {"tp": 1, "pp": 16, "dp": 1, "micro_batch": 1}
    inter = evaluate_config(g126, cl, TR, schedule="interleaved_1f1b", num_virtual=8, **kw)
    plain = evaluate_config(g126, cl, TR, schedule="1f1b", **kw)
    assert inter.layout["num_virtual_stages"] == 8 and inter.layout["num_micro_batches"] == 32
    # interleaving divides the bubble by about v: (p - 1) / (v m) of the step instead of (p - 1) / m
    assert 0 < inter.bubble_s < plain.bubble_s / 4 and inter.predicted_step_time_s > inter.bubble_s
    # the chunks compile lays out: 7 blocks plus an end layer on the end stages, 8 elsewhere, one layer each
    ranges = megatron_split(g126, 16)
    assert [b - a for a, b in ranges] == [8] * 16
    bounds = chunk_layout._bounds(g126, [list(range(a, b)) for a, b in ranges], "interleaved_1f1b", 8)
    assert all(b - a == 1 for a, b in bounds) and len(bounds) == 128
    assert g126.layers[bounds[0][0]].kind == "embed" and g126.layers[bounds[-1][0]].kind == "head"


def test_an_interleaved_split_the_chunks_cannot_hold_is_still_refused(g126) -> None:  # noqa: ANN001
    # 126 blocks on 5 stages: 25, 25, 26, 25, 25; stage 1 (no end layer) holds 25, which 2 chunks cannot split
    with pytest.raises(ConfigError, match=r"126 blocks do not split into pp=5 stages of 2 virtual chunks each") as e:
        evaluate_config(
            g126,
            parse_cluster("5xH100-80G"),
            TR,
            tp=1,
            pp=5,
            dp=1,
            micro_batch=1,
            schedule="interleaved_1f1b",
            num_virtual=2,
        )
    assert "Fix:" in str(e.value)


@pytest.fixture(scope="module")
def g4():  # noqa: ANN201
    return gpt_with_ends(4, 1024, 16)  # embed + 4 blocks + head: pp=2 holds 3 layers per stage, 3 chunks of one


@pytest.mark.parametrize(
    "kw, refusal",
    [
        ({"schedule": "interleaved_1f1b", "num_virtual": 3}, r"interleaved_1f1b schedule .* is not built with it"),
        ({"cp": 2}, r"with context parallelism \(cp=2\) it has no Plan layout yet"),
        ({"cp": 2, "schedule": "interleaved_1f1b", "num_virtual": 3}, r"is not built with it"),
    ],
)
def test_sequence_parallel_is_priced_where_megatron_ran_it_and_refused_for_partitas_program(
    g4,
    kw: dict,
    refusal: str,  # noqa: ANN001
) -> None:
    cl, tr = parse_cluster("8xH100-80G"), TrainingConfig(global_batch=32, seq_len=4096)  # tp splits the blocks
    base = {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 1} | kw
    mega = evaluate_config(g4, cl, tr, tp_style="megatron", sequence_parallel=True, **base)
    without = evaluate_config(g4, cl, tr, tp_style="megatron", **base)
    assert mega.layout["sequence_parallel"] and mega.layout["cp"] == kw.get("cp", 1)
    assert any("sequence parallel (Megatron-LM's program)" in n for n in mega.notes)
    # the saved activations of the norms and residual adds shrink to s/tp rows on every stage
    assert all(a["activations"] < b["activations"] for a, b in zip(mega.memory_by_category, without.memory_by_category))
    with pytest.raises(ConfigError, match=r"sequence parallelism cannot be built here: .*" + refusal) as e:
        evaluate_config(g4, cl, tr, sequence_parallel=True, **base)  # the program Partita emits: compile's words
    assert "Fix:" in str(e.value)


def test_overlapped_p2p_costs_a_micro_batch_the_longer_of_the_stage_and_its_sends(g4, monkeypatch) -> None:  # noqa: ANN001
    """The term ``p2p_overlap`` changes (``stage_ranges.stage_parts``): a stage's micro-batch costs
    ``max(rest, p2p)`` instead of ``rest + p2p``; priced on one stage option of a real layout, with its
    p2p made small, then made to dominate."""
    import numpy as np

    from partita.search.entry.planner import Search
    from partita.search.pipeline import stage_ranges

    seen: list = []
    orig = Search.stage_parts

    def spy(self, tab, terms=None, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append((tab, kw))
        return orig(self, tab, terms, **kw)

    monkeypatch.setattr(Search, "stage_parts", spy)
    cl = parse_cluster("8xH100-80G")
    kw = {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 1, "schedule": "interleaved_1f1b", "num_virtual": 3}
    plain = evaluate_config(g4, cl, TR, tp_style="megatron", **kw)
    hidden = evaluate_config(g4, cl, TR, tp_style="megatron", p2p_overlap=True, **kw)
    assert hidden.layout["p2p_overlap"] and hidden.predicted_step_time_s < plain.predicted_step_time_s
    tab, args = seen[0]
    assert args["p2p_mult"] == 3  # interleaved: every chunk sends
    for per_byte in (args["p2p"][1], 1e-6):  # the layout's link, then one slow enough that the sends dominate
        base = args | {"p2p": (args["p2p"][0], per_byte), "p2p_overlap": False}
        rest = stage_ranges.stage_parts(tab, **(base | {"p2p_mult": 0})).time
        summed = stage_ranges.stage_parts(tab, **base).time
        overlapped = stage_ranges.stage_parts(tab, **(base | {"p2p_overlap": True})).time
        ok = np.isfinite(rest)
        p2p = summed[ok] - rest[ok]
        assert np.allclose(overlapped[ok], np.maximum(rest[ok], p2p))
        assert (p2p > 0).any()
    assert (p2p > rest[ok]).any()  # the slow link: some ranges wait on their sends
    with pytest.raises(ConfigError, match=r"priced only for Megatron-LM's interleaved schedule"):
        evaluate_config(g4, cl, TR, p2p_overlap=True, **kw)  # Partita's program waits for its receives


def test_megatron_sequence_parallel_moves_the_bytes_of_its_all_reduces_as_gathers_and_scatters() -> None:
    """The term sequence parallelism changes in Megatron-LM's program (``tp_style="megatron_sp"``): per block
    the two forward all-reduces become reduce-scatters after the row matmuls and all-gathers before the
    column matmuls, the backward likewise (Korthikanti et al. 2022, sec. 4.2.2: the same bytes), and the norms
    and residual adds run on s/tp rows, so they save less. Before, ``evaluate`` priced the step of the layout
    without it (and the layer ILP, kept off the sequence, split the norms on the hidden dim instead)."""
    from partita.search.pipeline.stage_cost import SolverCosts

    g = gpt_with_ends(4, 1024, 16)
    cl, tr = parse_cluster("8xH100-80G"), TrainingConfig(global_batch=32, seq_len=4096)
    dev = cl.device_types()[0]
    sols = {st: SolverCosts(g, cl, tr, tp_style=st).solution(2, dev, 2, 1) for st in ("megatron", "megatron_sp")}
    moved = {st: [c for c in sol.collectives if c.axis == "tp" and c.phase != "optimizer"] for st, sol in sols.items()}
    full = 1 * 4096 * 1024 * 2  # b * s * h in bf16
    assert {(c.kind, c.bytes) for c in moved["megatron"]} == {("all_reduce", full)} and len(moved["megatron"]) == 4
    sp = moved["megatron_sp"]
    assert sorted((c.kind, c.phase) for c in sp) == sorted(
        [("all_gather", "forward"), ("reduce_scatter", "forward")] * 2
        + [("all_gather", "backward"), ("reduce_scatter", "backward")] * 2
    )
    assert all(c.bytes == full for c in sp)  # a ring all-reduce = its reduce-scatter + its all-gather: same bytes
    strat = sols["megatron_sp"].op_strategies
    assert all(strat[n] != "R" for n in ("h.1.ln_1", "h.1.ln_2", "h.1.add_1", "h.1.add_2"))
    assert sols["megatron_sp"].activation_bytes < sols["megatron"].activation_bytes
