"""Megatron sequence parallelism written into a hand layout's Plan (``search/program/sequence_parallel.py``), in-process.

Tiny Llama (h = 64, 2 blocks, 4 heads), seq s = 16, micro-batch b = 4 on tp = t = 2, bf16 (autocast),
compiled with and without ``sequence_parallel``. What the Plan must say, from Korthikanti et al. 2022,
sec. 4.2.2 (the full-size rehearsal of these records is ``tests/runtime/test_closed_forms.py``, the
2-rank run ``tests/runtime/test_sequence_parallel_multiprocess.py``):

* roles: ``colwise_sp`` / ``rowwise_sp`` for the blocks' tp modules, ``sequence_parallel`` per block, and
  the emitted program writes them literally; a plan without it is unchanged;
* traffic per block and micro-batch: 4 reduce-scatters and 4 all-gathers of ``b s h`` bf16 (2 of each
  forward and backward) replace its 4 all-reduces; two more all-gathers of ``b s h`` f32 per stage and
  micro-batch (the region's ends), and one all-reduce of ``4 h`` bytes per norm weight and micro-batch;
* activations: each block's two RMSNorms keep their f32 input and normalized tensor (``16 sbh`` bytes)
  and their f32 inverse RMS per row (``8 sb``) for ``s/t`` rows: ``(16 sbh + 8 sb)(1 - 1/t)`` less per
  block (the column inputs stay whole);
* refusals: a block the layer ILP replicates (gpt2-tiny at tp 2: its attention would see ``s/t`` rows),
  full recompute, tp = 1.
"""

from __future__ import annotations

import pytest

from partita.errors import ConfigError

H, S, B, T, L = 64, 16, 4, 2, 2


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from partita.cluster import parse_shorthand
    from partita.driver import trace_model
    from partita.models import families
    from partita.plan import Plan
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    spec = str(families.write_config(tmp_path_factory.mktemp("llama") / "llama", families.tiny("llama")))
    graph = trace_model(spec, seq=S).graph
    tr = TrainingConfig(global_batch=B, seq_len=S, dtype="bf16")
    kw = {"tp": T, "pp": 1, "dp": 1, "micro_batch": B}
    out = [hand_plan(graph, parse_shorthand("2xCPU"), tr, **kw, sequence_parallel=sp) for sp in (False, True)]
    return spec, *(Plan.from_json(p.to_json()) for p in out)


def test_roles_are_written_literally(plans: tuple) -> None:
    from partita.backends.torch.emit import emit_torch

    spec, plain, sp = plans
    roles = dict(sp.stages[0].tp_plan)
    assert {r for p, r in roles.items() if p.startswith("model.layers.")} == {
        "colwise_sp",
        "rowwise_sp",
        "sequence_parallel",
    }
    assert roles["model.layers.1"] == "sequence_parallel" and roles["model.layers.1.mlp.down_proj"] == "rowwise_sp"
    assert "sequence_parallel" not in plain.stages[0].tp_plan.values()
    src = emit_torch(sp, spec)
    assert "'model.layers.0.self_attn.q_proj': 'colwise_sp'," in src and "'model.layers.0': 'sequence_parallel'," in src
    assert "_sp'" not in emit_torch(plain, spec)


def test_records_follow_megatron_sequence_parallel_traffic(plans: tuple) -> None:
    from partita.search.program import records

    _, plain, sp = plans
    m, sbh = sp.num_micro_batches, S * B * H
    a, b = records.summary(plain.stages[0].collectives), records.summary(sp.stages[0].collectives)
    blocks_ar = 4 * L * m  # without SP: 4 all-reduces of b*s*h bf16 per block and micro-batch
    assert b["reduce_scatter@tp"] == {"count": blocks_ar, "bytes": pytest.approx(blocks_ar * sbh * 2)}
    ends = 2 * m * sbh * 4  # the region's two all-gathers, f32 residual stream
    # and, without recompute, each column parent's input gathered again in the backward (backends/torch/regather.py)
    regather = 2 * L * m
    want = a.get("all_gather@tp", {"count": 0})["count"] + blocks_ar + regather + 2 * m
    assert b["all_gather@tp"]["count"] == want
    want_ag = a.get("all_gather@tp", {"bytes": 0.0})["bytes"] + (blocks_ar + regather) * sbh * 2 + ends
    assert b["all_gather@tp"]["bytes"] == pytest.approx(want_ag)
    norms = 2 * L * m  # two RMSNorm weights per block, f32 gradients
    assert b["all_reduce@tp"]["count"] == a["all_reduce@tp"]["count"] - blocks_ar + norms
    want_ar = a["all_reduce@tp"]["bytes"] - blocks_ar * sbh * 2 + norms * 4 * H
    assert b["all_reduce@tp"]["bytes"] == pytest.approx(want_ar)


def test_norm_region_activations_are_split_over_tp(plans: tuple) -> None:
    _, plain, sp = plans
    acts = [p.stages[0].predicted["memory_by_category"]["activations"] for p in (plain, sp)]
    # the two fused norms' f32 inputs (backends/torch/fused.py; their per-row f32 statistic, 1/h of it, is not
    # priced) and the two column parents' gathered bf16 inputs, kept as this rank's rows (regather.py)
    per_block = 2 * 4 * S * B * H + 2 * 2 * S * B * H
    assert acts[0] - acts[1] == pytest.approx(L * per_block * (1 - 1 / T), rel=1e-6)
    assert sp.stages[0].predicted["memory_bytes"] == pytest.approx(
        plain.stages[0].predicted["memory_bytes"] - (acts[0] - acts[1])
    )


@pytest.mark.parametrize(
    ("model", "cluster", "kw", "words"),
    [  # gpt2-tiny at seq 32, micro-batch 1 on A100s: the layer ILP keeps its blocks replicated
        ("gpt2-tiny", "8xA100-80G", {"tp": 2, "micro_batch": 1}, "attention would see only this rank's rows"),
        ("llama", "2xCPU", {"tp": 2, "recompute": "full"}, "full recompute"),
        ("llama", "2xCPU", {"tp": 1}, "tp=1"),
    ],
)
def test_unbuilt_sequence_parallel_layouts_are_refused(
    plans: tuple, model: str, cluster: str, kw: dict, words: str
) -> None:
    from partita.cluster import parse_shorthand
    from partita.driver import trace_model
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    spec, seq = (plans[0], S) if model == "llama" else (model, 32)
    graph = trace_model(spec, seq=seq).graph
    tr = TrainingConfig(global_batch=8, seq_len=seq, dtype="bf16")
    kw = {"micro_batch": B, **kw}
    with pytest.raises(ConfigError) as e:
        hand_plan(graph, parse_shorthand(cluster), tr, pp=1, dp=1, sequence_parallel=True, **kw)
    assert words in str(e.value), str(e.value)
