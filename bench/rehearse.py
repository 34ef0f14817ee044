"""Rehearse real-size plans (issue 15's list) and print, per plan and stage, match or the exact mismatches.

Each row compiles a plan (the search, ``partita compile``; or a hand Megatron layout priced by the
same model, ``search/entry/hand_plan.py``) into a directory under ``bench/.cache/rehearse/`` and runs
``partita rehearse`` on it (``backends/torch/rehearse.py``): the emitted program at the plan's full
world size and model size, on fake tensors and a fake process group, compared with the plan's
records. Writes ``bench/results/rehearse.json`` with wall and CPU seconds per rehearsal (the CPU time
of the role processes does not depend on how loaded the machine is), and ``bench/results/rehearse.md``:
per stage, the device peak against the plan and the host peak (each role's ``VmHWM``, the set-up's
streamed fill included) against the plan's host bound (issue 33).

    python bench/rehearse.py                     # every row (compiles take minutes each)
    python bench/rehearse.py llama-7b-search     # rows whose name contains the argument (or that row only,
                                                 # where the argument is a row's whole name)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
OUT = ROOT / ".cache" / "rehearse"  # compiled plan directories (ignored by git); the table: results/rehearse.json

# name: (model, cluster, global batch, seq, hand layout or None for the search)
ROWS: dict[str, tuple[str, str, int, int, dict[str, Any] | None]] = {
    "llama-7b-search": ("llama-7b", "64xH100-80G", 8, 2048, None),
    "llama-7b-megatron-dp8-tp8": ("llama-7b", "64xH100-80G", 8, 2048, {"tp": 8, "pp": 1, "dp": 8, "micro_batch": 1}),
    "llama-7b-megatron-pp4-dp2-tp8": (
        "llama-7b", "64xH100-80G", 8, 2048, {"tp": 8, "pp": 4, "dp": 2, "micro_batch": 1},
    ),
    "gpt3-6.7b-search": ("gpt3-6.7b", "mixed-lab", 256, 2048, None),
    "gpt3-13b-search": ("gpt3-13b", "16xA100-80G+16xV100-32G", 256, 2048, None),
    "llama-70b-search": ("llama-70b", "128xH100-80G", 128, 2048, None),
    "gpt3-175b-search": ("gpt3-175b", "512xH100-80G+256xA100-80G+256xV100-32G", 1536, 2048, None),
    "mixtral-8x7b-search": ("mixtral-8x7b", "64xH100-80G", 64, 2048, None),
    # issue 33 item 3: config.json models (CONFIGS), not tuned on before
    "gpt3-13b-config-tp8-pp2-dp2": (
        "config:gpt3-13b", "32xA100-80G", 64, 2048, {"tp": 8, "pp": 2, "dp": 2, "micro_batch": 1},
    ),
    "qwen2-1.5b-config-search-a100-l4": ("config:qwen2-1.5b", "8xA100-80G+8xL4", 64, 2048, None),
    "qwen2-7b-config-search-a100-l4": ("config:qwen2-7b", "16xA100-80G+16xL4", 128, 2048, None),
    "llama-8b-config-tp8-pp2": (
        "config:llama-8b", "16xH100-80G", 16, 2048, {"tp": 8, "pp": 2, "dp": 1, "micro_batch": 1},
    ),
    # issue 33 item 2 (this session): two more searched plans on mixed clusters, not tuned on
    "gpt3-13b-config-search-a100-l4": ("config:gpt3-13b", "16xA100-80G+16xL4", 128, 2048, None),
    "mixtral-8x7b-search-h100-a100": ("mixtral-8x7b", "32xH100-80G+32xA100-80G", 64, 2048, None),
    # issue 33: a searched ZeRO-3 plan on a mixed cluster (dp 8 ZeRO-3 on the A100-40Gs; the L4s too slow to
    # help), from a config.json of examples/configs
    "qwen2-7b-shape-search-a100-40g-l4": ("examples/configs/qwen2-7b-shape.json", "8xA100-40G+8xL4", 64, 2048, None),
}  # fmt: skip

# config.json models of public shapes, written by models.families.config (family, hidden, layers, heads,
# kv heads, ffn, vocab, positions): GPT-3 13B (Brown et al. 2020, table 2.1) as a GPT-2 model, Qwen2-1.5B
# and Qwen2-7B and Llama-3-8B as their Hugging Face config.json give them
CONFIGS: dict[str, tuple[str, dict[str, int]]] = {
    "gpt3-13b": ("gpt2", {"h": 5120, "l": 40, "a": 40, "k": 40, "f": 20480, "v": 50257, "p": 2048}),
    "qwen2-1.5b": ("qwen2", {"h": 1536, "l": 28, "a": 12, "k": 2, "f": 8960, "v": 151936, "p": 32768}),
    "qwen2-7b": ("qwen2", {"h": 3584, "l": 28, "a": 28, "k": 4, "f": 18944, "v": 152064, "p": 32768}),
    "llama-8b": ("llama", {"h": 4096, "l": 32, "a": 32, "k": 8, "f": 14336, "v": 128256, "p": 8192}),
}


def model_spec(model: str) -> str:
    """A zoo name as it is; ``config:NAME`` written as ``bench/.cache/configs/NAME/config.json`` (its directory);
    ``examples/...`` a config.json of the repository, as an absolute path."""
    if model.startswith("examples/"):
        return str((ROOT.parent / model).resolve())
    if not model.startswith("config:"):
        return model
    from partita.models.families import config, write_config

    name = model.removeprefix("config:")
    family, dims = CONFIGS[name]
    cfg = {**config(family, **dims), "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    return str(write_config(ROOT / ".cache" / "configs" / name, cfg).resolve())


def make_dir(name: str, model: str, cluster: str, batch: int, seq: int, layout: dict[str, Any] | None) -> Path:
    """Compile one row into ``OUT/name`` (plan.json + program_torch.py)."""
    from partita.search.pricing.config import TrainingConfig

    out = OUT / name
    model = model_spec(model)
    training = TrainingConfig(global_batch=batch, seq_len=seq)
    if layout is not None and layout.get("placements") == "megatron-by-hand":
        kw = {k: v for k, v in layout.items() if k != "placements"}
        return write_plan(out, megatron_llama_plan(model, cluster, batch, seq, **kw), model)
    if layout is None:
        from partita.driver import compile_to_dir

        compile_to_dir(model, cluster, training, out)
        return out
    write_hand_plan(out, model, cluster, training, **layout)
    return out


def write_hand_plan(out: Path, model: str, cluster: str, training: Any, **layout: Any) -> Path:
    """A hand Megatron layout's plan and its emitted program in ``out``."""
    from partita.backends.torch.emit import emit_torch
    from partita.cluster import parse_cluster
    from partita.driver import trace_model
    from partita.frontends.trace import TRACE_BATCH
    from partita.plan import Plan
    from partita.search.entry.hand_plan import hand_plan

    traced = trace_model(model, batch=TRACE_BATCH, seq=training.seq_len)
    plan = hand_plan(traced.graph, parse_cluster(cluster), training, **layout)
    plan = Plan.from_json(plan.to_json())  # the program is emitted from what plan.json holds
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(plan.to_json())
    (out / "program_torch.py").write_text(emit_torch(plan, model))
    return out


def megatron_llama_plan(model: str, cluster: str, batch: int, seq: int, *, tp: int, dp: int, micro_batch: int) -> Any:
    """A one-stage plan with Megatron-LM's placements written by hand (no search, no records but the
    gradient sync): q/k/v and gate/up column-parallel (``S(0)`` of ``nn.Linear``'s ``[out, in]``),
    o and down row-parallel (``S(1)``), the LM head column-parallel. For the closed-form checks of
    the runtime's tensor-parallel traffic at full size (``tests/runtime/test_rehearse_full_size.py``); it is no
    row of the table: a plan written by hand has no tensor-parallel, memory or FLOPs records to
    compare (the ``llama-7b-megatron-*`` rows are the same layouts priced by ``search/entry/hand_plan.py``)."""
    from partita.cluster import parse_cluster
    from partita.models.zoo import resolve_model
    from partita.plan import Collective, Plan, Stage

    handle = resolve_model(model)
    n = int(handle.config["num_layers"])
    layers = ["embed", *(f"model.layers.{i}" for i in range(n)), "head"]
    pl: dict[str, tuple[str, str]] = {"lm_head.weight": ("R", "S(0)")}
    for i in range(n):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            pl[f"model.layers.{i}.{name}.weight"] = ("R", "S(0)")
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            pl[f"model.layers.{i}.{name}.weight"] = ("R", "S(1)")
    cl = parse_cluster(cluster)
    m = batch // (micro_batch * dp)
    stage = Stage(
        index=0, layers=tuple(layers), device_type=cl.device_types()[0].name, ranks=tuple(range(dp * tp)),
        dp=dp, tp=tp, param_placements=pl,
        collectives=(Collective("all_reduce", "dp", 0.0, 1, "optimizer", "gradient sync (dp)"),) if dp > 1 else (),
    )  # fmt: skip
    return Plan(
        model={"name": model, "framework": "torch", "layers": layers},
        cluster={"name": cl.name, "fingerprint": cl.fingerprint(), "spec": cl.to_dict()},
        training={"global_batch": batch, "seq_len": seq, "dtype": "bf16", "optimizer": "adam"},
        stages=(stage,),
        schedule="1f1b",
        micro_batch_size=micro_batch,
        num_micro_batches=m,
    )


def write_plan(out: Path, plan: Any, model: str) -> Path:
    from partita.backends.torch.emit import emit_torch

    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(plan.to_json())
    (out / "program_torch.py").write_text(emit_torch(plan, model))
    return out


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main(argv: list[str]) -> int:
    from partita.backends.torch.rehearse import rehearse_dir

    exact = [a for a in argv if a in ROWS]  # a whole row name selects that row only
    rows = {k: v for k, v in ROWS.items() if not argv or k in exact or any(a in k for a in argv if a not in exact)}
    results = {}
    for name, (model, cluster, batch, seq, layout) in rows.items():
        t0 = time.perf_counter()
        try:
            d = make_dir(name, model, cluster, batch, seq, layout)
        except Exception as e:  # noqa: BLE001 - a row that cannot compile is reported, not fatal
            results[name] = {"error": f"compile failed: {type(e).__name__}: {e}"}
            print(f"{name}: compile failed: {type(e).__name__}: {e}", flush=True)
            continue
        t1, c1 = time.perf_counter(), _children_cpu()
        res = rehearse_dir(d)
        res["compile_s"], res["rehearse_s"] = round(t1 - t0, 1), round(time.perf_counter() - t1, 1)
        res["rehearse_cpu_s"] = round(_children_cpu() - c1, 1)  # the role processes' CPU time (load-independent)
        results[name] = res
        print(f"{name}: {'MATCH' if res['match'] else 'mismatch'} (compile {res['compile_s']} s, "
              f"rehearse {res['rehearse_s']} s wall, {res['rehearse_cpu_s']} s CPU)", flush=True)  # fmt: skip
        for s in res["stages"]:
            print(f"  stage {s['index']} ranks {s['ranks_rehearsed']}: peak {s['peak_memory_bytes']} B "
                  f"(plan {s['planned_memory_bytes']}), FLOPs {s['flops']} (plan {s['planned_flops']}), "
                  f"host peak {s.get('host_peak_bytes')} B (bound {(s.get('planned_host_memory') or {}).get('bytes')})")  # fmt: skip
            for key in sorted(set(s["collectives"]) | set(s["planned_collectives"])):
                print(
                    f"    {key:<20} rehearsed {s['collectives'].get(key)}  planned {s['planned_collectives'].get(key)}"
                )
            for m in s["mismatches"]:
                print(f"    ! {m}")
    path = ROOT / "results" / "rehearse.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    old = {k: v for k, v in old.items() if k in ROWS}  # rows no longer in the table are dropped
    path.write_text(json.dumps({**old, **results}, indent=1, sort_keys=True) + "\n")
    (path.parent / "rehearse.md").write_text(table({**old, **results}))
    return 0


def table(results: dict[str, Any]) -> str:
    """Per row and stage: the device peak against the plan's tensors, and the host peak (the roles'
    ``VmHWM``, the streamed fill of the set-up included) against the plan's bound (issue 33)."""
    gib = 2**30
    lines = [
        "| row | stage | device peak / plan | host peak (VmHWM; fill: RSS + VmPeak growth) | host bound (base + largest + shard) | match |",
        "|---|---|---|---|---|---|",
    ]
    for name, res in sorted(results.items()):
        for s in res.get("stages", []):
            want, got = s.get("planned_memory_bytes"), s.get("peak_memory_bytes")
            dev = f"{got / gib:.2f} / {want / gib:.2f} GiB ({got / want - 1:+.1%})" if want and got else "-"
            host, bound = s.get("host_peak_bytes"), (s.get("planned_host_memory") or {}).get("bytes")
            hb = f"{bound / gib:.2f} GiB" if bound else "-"
            lines.append(
                f"| {name} | {s['index']} | {dev} | {f'{host / gib:.2f} GiB' if host else '-'} | {hb} | {s['match']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
