"""Issue 15: a rehearsed Megatron layout's tensor-parallel traffic and activation memory per layer, against
closed forms derived here for the model as written.

The model: Hugging Face Llama at Llama-2-7B's width (h = 4096, f = 11008, a = 32 heads, MHA, vocab 32000),
seq s = 2048, micro-batch b = 1, on one stage of tp = t = 8 (Megatron's column / row pairs: q, k, v, gate,
up column-parallel, o and down row-parallel), no sequence parallelism, no recompute, bf16 under
``torch.autocast`` (the torch program's precision mode for a stage without FSDP2: f32 master weights
and residual stream). "Per layer" is the difference between a 4-layer and a 2-layer model, halved,
so the embedding, the LM head and the loss drop out.

Megatron-LM's published forms (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", sec. 4: ``sbh(10 + 24/t + 5as/(ht))`` bytes per layer; Narayanan et al. 2021,
sec. 3.2: 4 all-reduces of ``b*s*h`` per layer and micro-batch, two forward and two backward) are for
Megatron's GPT: LayerNorm, GeLU MLP of 4h, explicit softmax and dropout, everything in 16 bits. The
variant for this model, derived op by op from what autograd saves (flash attention saves q, k, v, its
output and an f32 log-sum-exp instead of the ``5as/h`` softmax and dropout terms; the rotary
multiplications by cos / sin save only the tables; ``add`` saves nothing):

* ``12 sbh``: two RMSNorms, each run fused (``backends/torch/fused.py``, the program's
  ``fused.fuse_ops(module)`` line for a bf16 stage) on the f32 residual stream: its f32 input,
  4 bytes, and a per-row statistic; and one bf16 copy of each norm's output, shared by its column
  siblings (the program casts once before the DTensor boundary), 2 bytes each. (HF's RMSNorm as written
  also kept the f32 normalized tensor, 4 bytes each: ``20 sbh`` before issue 32.)
* ``10 sbh / t``: q and k after rotary, v, the attention output, and o's input (the output made
  contiguous as ``[b, s, h/t]``), 2 bytes each;
* ``6 sbf / t``: gate's output (SiLU's input), up's output and their product (down's input), 2 bytes
  each: the SwiGLU product runs fused (the same ``fused.fuse_ops`` line) and recomputes SiLU's output in
  the backward (HF's ``act(gate) * up`` as written also kept it: ``8 sbf / t``);
* ``2 (4h^2 + 3hf) / t``: autocast's bf16 copy of each local weight, which the matmul keeps for its
  input gradient (autocast caches casts within a forward; the copy lives as long as the graph);
* ``4 a s b / t``: flash attention's f32 log-sum-exp.

Traffic per layer: ``4`` all-reduces over tp of ``b s h`` bf16 values each (the row outputs forward,
the column inputs' gradients backward), as Megatron's.

**Selective recompute** (``--recompute selective``, same layout). The runtime checkpoints each block
with a policy (``backends/torch/parallel._save_matmuls``, ``torch.utils.checkpoint``'s selective
checkpoint contexts) that saves the outputs of ``mm`` / ``addmm`` / ``bmm`` and of the tp collectives
and recomputes every other op in the backward; the block's input is the checkpoint's input. What a
layer keeps, op by op:

* ``4 sbh``: the block input (the f32 residual stream under autocast);
* ``6 sbh / t``: q, k, v's matmul outputs, bf16, ``[b, s, h/t]`` each;
* ``2 sbh + 2 sbh``: o's matmul output (a partial sum over tp, whole ``h``) and its all-reduced copy;
* ``4 sbf / t``: gate's and up's matmul outputs;
* ``2 sbh + 2 sbh``: down's matmul output and its all-reduced copy;

``sbh (12 + 6/t) + 4 sbf / t`` in all. The norms, rotary, SiLU, the product and flash attention
(with its log-sum-exp) are recomputed, and so are autocast's bf16 weight copies (a cast is no
matmul). Megatron-LM's selective recompute (Korthikanti et al. 2022, sec. 5: ``sbh (10 + 24/t)``
without sequence parallelism for its GPT) keeps the matmul *inputs* and drops only the attention
core; this runtime's policy keeps outputs instead, so the form differs. Nothing is communicated
again: the collectives' outputs are saved, the traffic per layer is the same 4 all-reduces.

"Per layer" here is read at the moment the step's backward starts (``tests/runtime/saved_probe.py``,
the same rehearsal with a probe): under recompute the step's peak lies inside the backward, where
gradients grow while activations are freed, so a difference of peaks would not be a layer's bytes.
(Without recompute both readings agree.) The plan's per-layer record is
the difference of its activation records (``Stage.predicted["memory_by_category"]``), which for a
recomputing stage are the saved bytes of every layer plus one layer's recomputed ones: the latter
cancel in the difference. The pricing counted the rotary cos / sin and the mask, made once before
the blocks, as every layer's checkpoint input (``stage_cost._cache_prev_boundary``, 0.75 sbh a layer
too many, 5.3% over): they are one tensor held by the stage, now left out.

**Sequence parallelism** (``--sequence-parallel``, same layout; ``backends/torch/tp.py``). Korthikanti et
al. 2022, sec. 4.2.2: with sequence parallelism Megatron's GPT keeps ``sbh (34/t + 5as/(ht))`` per layer,
everything split over tp, and each layer's tp traffic is 2 all-gathers + 2 reduce-scatters of
``b s h`` forward, the same backward (an all-reduce is a reduce-scatter plus an all-gather: the same
bytes on a ring). Megatron re-gathers the column input in the backward and keeps only the shard, and so
does this runtime without recompute (``backends/torch/regather.py``: torch's
``ColwiseParallel(input_layouts=Shard(1))``, as torchtitan applies it, would keep the all-gathered input,
``4 sbh`` here), so for HF Llama the variant is:

* ``8 sbh / t``: the two fused RMSNorms' f32 input (the residual stream is this rank's ``s/t`` rows);
* ``4 sbh / t``: each norm's bf16 output, this rank's rows, all-gathered before q/k/v and gate/up and
  again in the backward for their weight gradients;
* ``10 sbh / t``, ``6 sbf / t``, ``2 (4h^2 + 3hf) / t``, ``4 a s b / t``: as without it (already split
  over heads / features);

``sbh 22/t + 6 sbf / t + 2 (4h^2 + 3hf) / t + 4 a s b / t`` in all. Traffic per
layer: 2 all-gathers (attention's and the MLP's input) and 2 reduce-scatters (o's and down's output) of
``b s h`` bf16 forward, and in the backward 2 reduce-scatters (the inputs' gradients) and 2 all-gathers
(the outputs' gradients) and 2 more (the re-gathered inputs); plus one all-reduce over tp of each norm's f32 weight gradient (``4h``
bytes, twice a layer), which Megatron also runs (its layer-norm gradients under sequence parallelism).

With selective recompute on top, the policy keeps (as above) the block input, the matmul outputs and the
collectives' outputs: ``4 sbh / t`` (input) ``+ 6 sbh / t`` (q, k, v) ``+ 2 sbh + 2 sbh / t`` (o's output,
its reduce-scatter) ``+ 4 sbf / t`` ``+ 2 sbh + 2 sbh / t`` (down) ``+ 4 sbh`` (the two all-gathered
inputs, collective outputs, which the policy keeps: nothing re-gathered): ``sbh (8 + 14/t) + 4 sbf / t``. Korthikanti's selective + SP form for
its GPT, ``34 sbh / t``, keeps matmul inputs, not outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partita.backends.torch import rehearse
from partita.cli import main as cli_main
from partita.driver import load_plan

H, F, A, V, S, B, T = 4096, 11008, 32, 32000, 2048, 1, 8


def _compiled(tmp: Path, layers: int, *extra: str) -> Path:
    """``partita compile`` of the layout (module docstring) at ``layers`` blocks, plus ``extra`` flags."""
    cfg = tmp / f"llama{layers}.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": H,
                "intermediate_size": F,
                "num_hidden_layers": layers,
                "num_attention_heads": A,
                "num_key_value_heads": A,
                "vocab_size": V,
                "max_position_embeddings": 4096,
            }
        )  # fmt: skip
    )
    out = tmp / f"plan{layers}{''.join(extra)}"
    args = ["compile", str(cfg), "--cluster", "8xH100-80G", "--global-batch", str(B), "--seq", str(S)]
    args += ["--tp", str(T), "--pp", "1", "--dp", "1", "--micro-batch", str(B), "--precision", "bf16", *extra]
    assert cli_main([*args, "--out", str(out)]) == 0
    return out


def _probed(*dirs: Path) -> list[dict]:
    """Rank 0 of each plan rehearsed with the probe (module docstring): memory by category when the
    backward starts, the step's peak, the collectives (``tests/runtime/saved_probe.py``)."""
    probe = Path(__file__).with_name("saved_probe.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    got = subprocess.run([sys.executable, str(probe), *map(str, dirs)], capture_output=True, text=True, env=env)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = [json.loads(x) for x in got.stdout.splitlines() if x.startswith("{")]
    by_dir = {x["dir"]: x for x in lines}
    return [by_dir[str(d)] for d in dirs]


def _planned(plan_dir: Path) -> dict:
    return json.loads((plan_dir / "plan.json").read_text())["stages"][0]


def _rehearsed(tmp: Path, layers: int) -> dict:
    out = _compiled(tmp, layers)
    res = rehearse.rehearse_dir(out)
    assert res["match"], [s["mismatches"] for s in res["stages"]]
    return res["stages"][0]


@pytest.mark.slow
def test_megatron_layout_per_layer_traffic_and_activations_follow_closed_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    two, four = _rehearsed(tmp_path, 2), _rehearsed(tmp_path, 4)
    sbh, sbf = S * B * H, S * B * F
    # traffic: 4 all-reduces of b*s*h bf16 values per layer
    ar2, ar4 = two["collectives"]["all_reduce@tp"], four["collectives"]["all_reduce@tp"]
    assert (ar4["count"] - ar2["count"]) / 2 == 4
    assert (ar4["bytes"] - ar2["bytes"]) / 2 == pytest.approx(4 * sbh * 2, rel=0.05)
    # activations (module docstring)
    closed = 12 * sbh + 10 * sbh / T + 6 * sbf / T + 2 * (4 * H * H + 3 * H * F) / T + 4 * A * S * B / T
    per_layer = (four["memory_by_category"]["activations"] - two["memory_by_category"]["activations"]) / 2
    assert per_layer == pytest.approx(closed, rel=0.05)
    # the plan prices the same layer (its activation record, the same difference)
    planned = (four["planned_memory_by_category"]["activations"] - two["planned_memory_by_category"]["activations"]) / 2
    assert planned == pytest.approx(closed, rel=0.05)
    # Megatron's form for this model (bf16 module, fused norms: sbh (8 + 8/t) + 6 sbf/t) is half of it: the f32
    # residual stream and autocast's weight copies (tests/runtime/test_megatron_forms.py: FSDP2's bf16, within 10%)
    assert per_layer > 1.8 * (sbh * (8 + 8 / T) + 6 * sbf / T)


@pytest.mark.slow
def test_selective_recompute_per_layer_activations_and_traffic_follow_closed_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    dirs = [_compiled(tmp_path, n, "--recompute", "selective") for n in (2, 4)]
    two, four = _probed(*dirs)
    sbh, sbf = S * B * H, S * B * F
    closed = sbh * (12 + 6 / T) + 4 * sbf / T  # module docstring
    per_layer = (four["at_backward"]["Activation"] - two["at_backward"]["Activation"]) / 2
    assert per_layer == pytest.approx(closed, rel=0.05)
    # no recompute keeps 184,336,384 B a layer (the test above): selective keeps under 70%
    assert per_layer < 0.7 * 184_336_384
    # the plan's per-layer record: the difference of its activation records (the recomputed layer cancels)
    plans = [_planned(d) for d in dirs]
    acts = [p["predicted"]["memory_by_category"]["activations"] for p in plans]
    assert (acts[1] - acts[0]) / 2 == pytest.approx(closed, rel=0.05)
    # traffic: the same 4 all-reduces of b*s*h bf16 per layer, none again in the recompute
    ar2, ar4 = two["collectives"]["all_reduce@tp"], four["collectives"]["all_reduce@tp"]
    assert (ar4["count"] - ar2["count"]) / 2 == 4
    assert (ar4["bytes"] - ar2["bytes"]) / 2 == pytest.approx(4 * sbh * 2, rel=0.05)
    # and the rehearsed collectives are the plan's records (counts equal, bytes within 2%)
    for got, plan_dir in zip((two, four), dirs):
        planned = rehearse.planned_collectives(load_plan(plan_dir).stages[0])
        assert set(got["collectives"]) == set(planned)
        for key, c in got["collectives"].items():
            assert c["count"] == planned[key]["count"], key
            assert c["bytes"] == pytest.approx(planned[key]["bytes"], rel=0.02), key


@pytest.mark.slow
def test_sequence_parallel_per_layer_activations_and_traffic_follow_closed_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    sbh, sbf = S * B * H, S * B * F
    forms = {
        "none": sbh * 22 / T + 6 * sbf / T + 2 * (4 * H * H + 3 * H * F) / T + 4 * A * S * B / T,
        "selective": sbh * (8 + 14 / T) + 4 * sbf / T,
    }  # module docstring
    for recompute, closed in forms.items():
        dirs = [_compiled(tmp_path, n, "--sequence-parallel", "--recompute", recompute) for n in (2, 4)]
        two, four = _probed(*dirs)
        per_layer = (four["at_backward"]["Activation"] - two["at_backward"]["Activation"]) / 2
        assert per_layer == pytest.approx(closed, rel=0.05), recompute
        acts = [_planned(d)["predicted"]["memory_by_category"]["activations"] for d in dirs]
        assert (acts[1] - acts[0]) / 2 == pytest.approx(closed, rel=0.05), recompute
        # traffic per layer: 2 all-gathers + 2 reduce-scatters of b*s*h bf16 forward, the same backward (and
        # without recompute 2 all-gathers more: the re-gathered column inputs), no all-reduce of b*s*h left; the
        # norms' weight gradients: 2 all-reduces of 4h bytes
        c2, c4 = two["collectives"], four["collectives"]
        for kind, n in (("all_gather@tp", 6 if recompute == "none" else 4), ("reduce_scatter@tp", 4)):
            assert (c4[kind]["count"] - c2[kind]["count"]) / 2 == n, (recompute, kind)
            assert (c4[kind]["bytes"] - c2[kind]["bytes"]) / 2 == pytest.approx(n * sbh * 2, rel=0.05)
        ar = c4["all_reduce@tp"]["count"] - c2["all_reduce@tp"]["count"]
        assert ar / 2 == 2 and (c4["all_reduce@tp"]["bytes"] - c2["all_reduce@tp"]["bytes"]) / 2 == 2 * 4 * H
        for got, plan_dir in zip((two, four), dirs):  # and the rehearsed collectives are the plan's records
            planned = rehearse.planned_collectives(load_plan(plan_dir).stages[0])
            assert set(got["collectives"]) == set(planned)
            for key, c in got["collectives"].items():
                assert c["count"] == planned[key]["count"], (recompute, key)
                assert c["bytes"] == pytest.approx(planned[key]["bytes"], rel=0.02), (recompute, key)
