"""Issue 31, fault (e): a tp degree that shards nothing (gpt-oss, ModernBERT, Mamba at tp=2: every block
weight replicated, each tp rank computing the whole stage) was offered by the search and said nowhere.

* the search does not offer it: ``Search.options_for`` keeps a tp > 1 option only for the layer ranges
  where something is placed on tp (``plan.shards_on_tp``), and drops the option where no range is;
* a hand layout that asks for it (``partita compile --tp 2``) gets it, stated: ``tp_shards_nothing`` is a
  stage field of plan.json (derived from the stage's placements, checked when the plan is read), the
  report's layout says it, and the program says it and checks at set-up that its stage indeed shards
  nothing (``parallel.check_tp_shards``).

A user model whose blocks multiply by their weight with ``torch.matmul`` (no ``nn.Linear``: no tp role the
torch runtime builds) stands in for those families; tracing it takes well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from partita.cli import main
from partita.cluster import parse_shorthand
from partita.driver import trace_model
from partita.errors import PlanError
from partita.plan import Plan
from partita.search.entry.planner import Search
from partita.search.pricing.config import SearchOptions, TrainingConfig

HIDDEN = 256
BATCH = 64  # big enough that the ILP shards the head at tp 2 (at batch 8 it keeps it whole)


class MatmulBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.w)


class MatmulNet(nn.Module):
    """Blocks that tp cannot shard; with ``head`` a head of two ``nn.Linear`` that it can."""

    def __init__(self, head: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MatmulBlock() for _ in range(4)])
        # a Megatron MLP pair (colwise + rowwise) tp shards with one small all-reduce
        self.head = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, 8)) if head else None
        self.out = None if head else nn.Parameter(torch.randn(HIDDEN, 8))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        logits = self.head(x) if self.head is not None else x @ self.out
        return logits if labels is None else nn.functional.cross_entropy(logits, labels)


def _inputs(batch: int, seq: int, device: str) -> dict[str, Any]:
    if device == "meta":
        return {
            "x": torch.zeros(batch, HIDDEN, device=device),
            "labels": torch.zeros(batch, dtype=torch.long, device=device),
        }
    return {"x": torch.randn(batch, HIDDEN), "labels": torch.randint(0, 8, (batch,))}


def with_head() -> tuple[nn.Module, Any]:
    return MatmulNet(head=True), _inputs


def without_head() -> tuple[nn.Module, Any]:
    return MatmulNet(head=False), _inputs


def _search(spec: str) -> Search:
    graph = trace_model(f"tests.search.test_tp_shards_nothing:{spec}", batch=BATCH, seq=1).graph
    training = TrainingConfig(global_batch=BATCH, seq_len=1, dtype="f32")
    return Search(graph, parse_shorthand("4xCPU"), training, SearchOptions())


def test_search_offers_no_tp_that_shards_nothing() -> None:
    """On the old code both models got tp 2 and 4 options, finite for every range."""
    s = _search("without_head")
    opts, _, _ = s.options_for(1, BATCH, 1, "1f1b", 1)
    assert opts and {o.tp for o in opts} == {1}, "tp 2 / 4 shard nothing in this model: not a choice"
    s = _search("with_head")
    assert s.graph.layers[-1].name == "head" and s.units[-1][1] == len(s.graph.layers)
    opts, _, _ = s.options_for(1, BATCH, 1, "1f1b", 1)
    tp2 = next(o for o in opts if o.tp == 2)  # the head shards at tp 2: offered for the ranges that hold it
    u = len(s.units)
    for k in range(u):
        for j in range(k + 1, u + 1):
            assert np.isfinite(tp2.best[k, j]).any() == (j == u), (k, j)


def test_a_hand_layout_that_shards_nothing_is_stated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """``--tp 2`` asked by hand on blocks tp cannot shard: compiled (the user asked; it trains correctly), and
    plan.json, the report and the program say that tp shards nothing; a plan.json edited to disagree is
    refused. On the old code plan.json had no such field and the program said nothing."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "out"
    spec = "tests.search.test_tp_shards_nothing:without_head"
    args = ["compile", spec, "--cluster", "4xCPU", "--global-batch", str(BATCH), "--seq", "1"]
    rc = main([*args, "--tp", "2", "--dp", "2", "--pp", "1", "--micro-batch", str(BATCH // 2), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    d = json.loads((out / "plan.json").read_text())
    assert [s["tp_shards_nothing"] for s in d["stages"]] == [True]
    assert "tp shards nothing" in text and "tp shards nothing" in (out / "report.txt").read_text()
    program = (out / "program_torch.py").read_text()
    assert "plan.json: tp_shards_nothing" in program and "tpar.check_tp_shards_nothing(module, roles)" in program
    d["stages"][0]["tp_shards_nothing"] = False  # edited by hand: the field disagrees with the placements
    with pytest.raises(PlanError, match=r"stages\[0\]\.tp_shards_nothing"):
        Plan.from_dict(d)
    d["stages"][0].pop("tp_shards_nothing")  # a plan written before the field reads as before
    assert Plan.from_dict(d).stages[0].tp_shards_nothing


def test_hand_best_and_the_megatron_grid_skip_a_tp_that_shards_nothing(monkeypatch: Any) -> None:
    """The yardstick (``hand_best``) and the Megatron-grid baseline apply the search's rule: a tp > 1 layout
    with a stage that places nothing on tp is no choice. ``evaluate_config`` states it per stage
    (``Evaluation.tp_shards_nothing``, with a note). On the old code hand_best priced the tp 2 and 4 layouts
    too, and the grid took a tp layout that shards nothing when it priced fastest (forced here: every
    tp > 1 point said to shard nothing and priced at half its step)."""
    import dataclasses

    from partita.search.entry import baselines
    from partita.search.entry.evaluate import evaluate_config, tp_style_of
    from partita.search.entry.hand_best import _layouts, best_hand_layout

    s = _search("without_head")
    cluster = parse_shorthand("4xCPU")
    style = {"tp_style": tp_style_of(s.graph)}  # the torch program's roles, as compile and evaluate price it
    ev = evaluate_config(s.graph, cluster, s.training, tp=2, pp=1, dp=2, micro_batch=BATCH // 2, **style)
    assert ev.tp_shards_nothing == (True,) and any("tp=2 shards nothing in stage(s) 0" in n for n in ev.notes)
    one = evaluate_config(s.graph, cluster, s.training, tp=1, pp=1, dp=4, micro_batch=BATCH // 4, **style)
    assert one.tp_shards_nothing == (False,) and not any("shards nothing" in n for n in one.notes)
    h = _search("with_head")  # tp shards the head at tp 2: nothing to say
    assert evaluate_config(
        h.graph, cluster, h.training, tp=2, pp=1, dp=2, micro_batch=BATCH // 2, **style
    ).tp_shards_nothing == (False,)

    rec = best_hand_layout(s.graph, cluster, s.training)
    assert rec is not None and rec["tp"] == 1
    assert {t for t, *_ in _layouts(s.graph, cluster, s.training, 32)} == {1, 2, 4}  # tp 2 / 4 can be built ...
    with monkeypatch.context() as m:  # ... and the old code priced them: the rule off, more layouts priced
        m.setattr(Search, "mask_tp_shards_nothing", lambda self, *a: True)
        old = best_hand_layout(s.graph, cluster, s.training)
    assert old is not None and old["num_priced"] > rec["num_priced"], (old["num_priced"], rec["num_priced"])

    real = baselines.evaluate_config
    said = {"nothing": True}

    def tp_looks_fast(*args: Any, **kw: Any) -> Any:
        got = real(*args, **kw)
        if kw["tp"] == 1:
            return got
        nothing = tuple(said["nothing"] for _ in got.stage_times_s)
        return dataclasses.replace(got, predicted_step_time_s=got.predicted_step_time_s / 2, tp_shards_nothing=nothing)

    monkeypatch.setattr(baselines, "evaluate_config", tp_looks_fast)
    best, _ = baselines.megatron_grid(s.graph, cluster, s.training)
    assert best is not None and best.tp == 1, best
    said["nothing"] = False  # the same points, sharding something: the fast tp layout wins
    best, _ = baselines.megatron_grid(s.graph, cluster, s.training)
    assert best is not None and best.tp > 1, best
