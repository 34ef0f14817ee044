"""Predicted step time against published measurements of real training runs (issue 32).

Every row of ``partita/data/published_runs.csv`` is a training run that a paper or a framework's
benchmark page measured and published, with its citation, model shape, layout (tp / pp / dp / cp,
micro-batch, global batch, virtual stages, sequence parallelism, recompute, ZeRO stage), sequence
length and the published number: a step time, tokens per second, or TFLOP/s per GPU (converted to a
step time with the source's own FLOP formula, ``published_step_s``). What the source does not state
is in the row's ``assumed`` column; ``partita/data/README.md`` lists the sources.

Each row is priced the way ``partita evaluate`` prices it (``search.entry.evaluate.evaluate_config``
on ``{gpus}x{device}``, the shipped defaults), as the program it ran (the ``program`` column,
``PROGRAM_STYLE``): GPT rows on the model Megatron-LM ran
(``bench/megatron_gpt.py``) or the GPT-2 architecture as MPT runs it (MosaicML's benchmarks: no dropout,
exact GELU, ``arch`` ``mpt``), Llama rows on a Hugging Face Llama config. A Megatron-style row's sequence
parallelism is Megatron-LM's, priced in the layers (``tp_style="megatron_sp"``: norms and residual adds on
s/tp rows between all-gathers and reduce-scatters), with model chunks and with cp as it ran; Llama 3's
interleaved pipeline overlaps its p2p with compute (``P2P_OVERLAP``). A row whose layout ``evaluate`` cannot
express is reported as refused, with the refusal's words: never dropped (none today).

Reports per row predicted vs published, the median |error|, the mean signed error
(``(predicted - published) / published``: positive = predicted too slow) per device type and per
GPU-count bucket, and leave-one-source-out: for each source, a few ``Efficiency`` factors per device
family fitted (coordinate descent, ``fit``) on the priced rows of the *other* sources, then the
held-out source predicted with them; a family with no rows outside the held-out source keeps the
shipped defaults and is flagged. Writes ``bench/results/published.json`` and a short table
``bench/results/published.md``. ``--quick`` skips leave-one-source-out; ``--source NAME`` prices only
that source's rows with the shipped defaults and writes nothing (minutes instead of the full run).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpt_graphs import CACHE, TRACE_SOURCES, gpt_graph  # noqa: E402

from partita.cluster import parse_cluster  # noqa: E402
from partita.errors import ConfigError  # noqa: E402
from partita.ir import Graph  # noqa: E402
from partita.search.entry.evaluate import Evaluation, evaluate_config  # noqa: E402
from partita.search.pipeline.cp_costs import ContextParallelCosts  # noqa: E402
from partita.search.pipeline.stage_cost import SolverCosts  # noqa: E402
from partita.search.pricing.config import TrainingConfig  # noqa: E402
from partita.search.pricing.cost_model import CostModel, Efficiency  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "partita" / "data" / "published_runs.csv"
OUT = ROOT / "bench" / "results" / "published.json"
TABLE = ROOT / "bench" / "results" / "published.md"
INT_FIELDS = (
    "gpus hidden heads kv_heads ffn layers vocab seq tp pp dp cp micro_batch global_batch virtual_stages "
    "sequence_parallel zero"
).split()
BUCKETS = ((8, 8), (9, 64), (65, 512), (513, 4096), (4097, 1 << 30))
FAMILY = {"A100-80G": "A100", "A100-40G": "A100", "H100-80G": "H100", "H200": "H100"}
# The program each row ran, as the tensor parallelism / kernels it is priced with (``evaluate_config``'s
# ``tp_style``; ``search/layer/program_traits``): Megatron-LM's (Megatron-style tp, hand-fused pointwise
# kernels: the profile's fusion share; activations moved in the training dtype); llm-foundry's FSDP with eager PyTorch outside its flash
# attention, which is what Partita's own torch program runs (``"torch"``: no pointwise fusion). Llama 3's
# stack is priced as Megatron-style (an assumption, in its rows' ``assumed`` column).
PROGRAM_STYLE = {"megatron-lm": "megatron", "llm-foundry": "torch", "llama3": "megatron"}
# Programs whose interleaved pipeline overlaps its sends and receives with the chunks' compute
# (``evaluate_config(p2p_overlap=True)``): Llama 3's "asynchronous point-to-point communication in PP"
# (arXiv:2407.21783, sec. 3.3.2). Megatron-LM's rows here run no interleaved schedule.
P2P_OVERLAP = {"llama3"}
# Programs that all-reduce the data-parallel gradients once after the whole backward (nothing hides it):
# Megatron-LM of 2021 (``train_step`` calls ``allreduce_gradients`` on its contiguous gradient buffer after
# ``forward_backward_func``), priced by ``SolverCosts.flat_sync`` as Partita's ZeRO-0 torch program runs it.
# llm-foundry's FSDP reduce-scatters each unit's gradients inside the backward (FSDP's post-backward hook),
# as Partita's FSDP2 does: ``Efficiency.comm_overlap`` is a property of the program, not of the device.
SYNC_AFTER_BACKWARD = {"megatron-lm"}


def load_rows() -> list[dict]:
    with CSV.open() as f:
        rows = [dict(r) for r in csv.DictReader(f)]
    for r in rows:
        for k in INT_FIELDS:
            r[k] = int(r[k])
        r["value"] = float(r["value"])
        r["published_s"] = published_step_s(r)
    return rows


def published_step_s(r: dict) -> float:
    """The row's published number as seconds per step, with the source's own FLOP count.

    * ``step_time_s``: as published;
    * ``tokens_per_s``: global batch x seq / throughput;
    * ``tflops_per_gpu_megatron``: Narayanan et al. 2021's count of a step with full recompute,
      ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``, over GPUs x TFLOP/s;
    * ``tflops_per_gpu_6n``: ``6 N + 6 l h s`` FLOPs per token (N: parameters of the row's shape,
      dense Llama with GQA and SwiGLU; the attention term without causal halving, as Megatron counts
      it), over GPUs x TFLOP/s. The Llama 3 paper does not state its count: an assumption (``assumed``).
    """
    b, s, n_l, h, v = r["global_batch"], r["seq"], r["layers"], r["hidden"], r["vocab"]
    if r["metric"] == "step_time_s":
        return r["value"]
    if r["metric"] == "tokens_per_s":
        return b * s / r["value"]
    if r["metric"] == "tflops_per_gpu_megatron":
        flops = 96 * b * s * n_l * h * h * (1 + s / (6 * h) + v / (16 * n_l * h))
        return flops / (r["gpus"] * r["value"] * 1e12)
    if r["metric"] == "tflops_per_gpu_6n":
        kv = h // r["heads"] * r["kv_heads"]
        per_layer = h * h * 2 + 2 * h * kv + 3 * h * r["ffn"]
        params = n_l * per_layer + 2 * v * h
        flops = b * s * (6 * params + 6 * n_l * h * s)
        return flops / (r["gpus"] * r["value"] * 1e12)
    raise ValueError(f"unknown metric {r['metric']!r} in {r['row']}")


_GRAPHS: dict[tuple, Graph] = {}


def llama_graph(r: dict) -> Graph:
    """A Hugging Face Llama of the row's shape, traced once and cached beside the GPT graphs."""
    from partita.driver import source_fingerprint, trace_handle
    from partita.models import resolve_model

    CACHE.mkdir(parents=True, exist_ok=True)
    name = f"llama_h{r['hidden']}_a{r['heads']}_kv{r['kv_heads']}_f{r['ffn']}_l{r['layers']}_v{r['vocab']}"
    name += f"_s{r['seq']}_{source_fingerprint(TRACE_SOURCES)[:10]}"
    out = CACHE / f"{name}.graph.json"
    if out.exists():
        return Graph.from_json(out.read_text())
    cfg = CACHE / f"{name}.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": r["hidden"],
                "intermediate_size": r["ffn"],
                "num_attention_heads": r["heads"],
                "num_key_value_heads": r["kv_heads"],
                "num_hidden_layers": r["layers"],
                "vocab_size": r["vocab"],
                "max_position_embeddings": r["seq"],
                "tie_word_embeddings": False,
            }
        )
    )
    g = trace_handle(resolve_model(str(cfg)), batch=2, seq=r["seq"])
    out.write_text(g.to_json())
    return g


def graph(r: dict) -> Graph:
    key = (r["arch"], r["hidden"], r["heads"], r["kv_heads"], r["ffn"], r["layers"], r["vocab"], r["seq"])
    if key not in _GRAPHS:
        if r["arch"] == "megatron_gpt":
            _GRAPHS[key] = gpt_graph(r["hidden"], r["heads"], r["layers"], r["seq"], r["vocab"], megatron_2021=True)
        elif r["arch"] in ("gpt2", "mpt"):
            _GRAPHS[key] = gpt_graph(r["hidden"], r["heads"], r["layers"], r["seq"], r["vocab"], mpt=r["arch"] == "mpt")
        elif r["arch"] == "llama":
            _GRAPHS[key] = llama_graph(r)
        else:
            raise ValueError(f"unknown arch {r['arch']!r}")
    return _GRAPHS[key]


def refusal(r: dict) -> str | None:
    """Why ``evaluate`` cannot express the row before anything is traced, or None (every row today:
    Llama 3's cp16 row with sequence parallelism is priced as Megatron-LM builds it,
    ``sequence_parallel.check(program="megatron")``; a row ``evaluate_config`` refuses is reported with
    its words by :func:`main`)."""
    return None


_COSTS: dict[tuple, SolverCosts] = {}


def evaluate_row(r: dict, eff: Efficiency | None = None) -> Evaluation:
    """One row through ``evaluate_config``: ``eff`` None = the shipped defaults (the CLI's path),
    else the uncalibrated preset priced with ``eff`` (fitting)."""
    cl = parse_cluster(f"{r['gpus']}x{r['device']}", calibrated=eff is None)
    tr = TrainingConfig(global_batch=r["global_batch"], seq_len=r["seq"])
    g = graph(r)
    style = PROGRAM_STYLE[r["program"]]
    if style == "megatron" and r["sequence_parallel"]:  # Megatron-LM's sequence parallelism, in its layers
        style = "megatron_sp"
    flat = r["program"] in SYNC_AFTER_BACKWARD
    key = (id(g), r["gpus"], r["device"], eff, style, r["cp"], r["seq"] if r["cp"] > 1 else 0, flat)
    if key not in _COSTS:  # a cp row's costs solve its layers at seq / cp (ContextParallelCosts)
        _COSTS[key] = (
            ContextParallelCosts(g, cl, tr, r["cp"], tp_style=style)
            if r["cp"] > 1
            else SolverCosts(g, cl, tr, tp_style=style)
        )
        _COSTS[key].flat_sync = flat  # the program's data-parallel sync (SYNC_AFTER_BACKWARD)
        if eff is not None:
            _COSTS[key]._cm[cl.groups[0].device.name] = CostModel(cl.groups[0].device, eff)
    costs = _COSTS[key]
    if r["cp"] == 1:
        costs.training = tr
    v = r["virtual_stages"]
    return evaluate_config(
        g,
        cl,
        tr,
        tp=r["tp"],
        pp=r["pp"],
        dp=r["dp"],
        micro_batch=r["micro_batch"],
        zero_stage=r["zero"],
        recompute=r["recompute"],
        schedule="interleaved_1f1b" if v > 1 else "1f1b",
        num_virtual=v,
        sequence_parallel=bool(r["sequence_parallel"]),
        cp=r["cp"],
        p2p_overlap=v > 1 and r["program"] in P2P_OVERLAP,
        costs=costs,
        tp_style=style,  # the program the row ran (PROGRAM_STYLE)
    )


_PRED: dict[tuple, float] = {}


def predict(r: dict, eff: Efficiency | None = None) -> float:
    key = (r["row"], eff)
    if key not in _PRED:
        _PRED[key] = evaluate_row(r, eff).predicted_step_time_s
    return _PRED[key]


def signed(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def summary(rows: list[dict], preds: list[float]) -> dict[str, Any]:
    errs = [signed(p, r["published_s"]) for r, p in zip(rows, preds)]
    if not errs:
        return {"n": 0}
    out: dict[str, Any] = {
        "n": len(errs),
        "median_abs_err": float(np.median(np.abs(errs))),
        "mean_abs_err": float(np.mean(np.abs(errs))),
        "mean_signed_err": float(np.mean(errs)),
    }
    out["per_device"] = {
        d: float(np.mean([e for r, e in zip(rows, errs) if r["device"] == d]))
        for d in sorted({r["device"] for r in rows})
    }
    out["per_bucket"] = {}
    for lo, hi in BUCKETS:
        sel = [e for r, e in zip(rows, errs) if lo <= r["gpus"] <= hi]
        if sel:
            out["per_bucket"][bucket_name(lo, hi)] = {"n": len(sel), "mean_signed_err": float(np.mean(sel))}
    return out


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else (f">{lo - 1}" if hi >= 1 << 29 else f"{lo}-{hi}")


# Coordinate descent, one value list per factor, starting from the start profile's own value. Device
# factors only: whether the gradient sync hides under the backward is the program's (SYNC_AFTER_BACKWARD).
CANDIDATES: dict[str, list[float]] = {
    "matmul": [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95],
    "memory": [0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
    "network_bandwidth": [0.3, 0.5, 0.7, 0.85, 1.0],
}
# Shipped profiles fitted on this table's rows (``bench/h100_calibration.py``): leave-one-source-out starts
# such a family from the uncalibrated preset, so no factor fitted on a held-out source reaches its prediction.
FITTED_HERE = "published_runs.csv"


def start_efficiency(device: str) -> Efficiency:
    """What ``partita evaluate`` uses for the device: its shipped profile (the A100 one is fitted on the
    109-row Megatron set, independent of this table), else the defaults; a profile fitted on this table's
    rows (``FITTED_HERE`` in its ``fitted_on``) is replaced by the uncalibrated preset's defaults."""
    from partita.cluster import SHIPPED_PROFILES, profile_path

    path = profile_path(SHIPPED_PROFILES[device]) if device in SHIPPED_PROFILES else None
    # a profile not yet written (bench/h100_calibration.py's first fit) leaves the preset uncalibrated too
    calibrated = path is not None and path.exists() and FITTED_HERE not in json.loads(path.read_text())["fitted_on"]
    dev = parse_cluster(f"8x{device}", calibrated=calibrated).groups[0].device
    return CostModel.for_device(dev).efficiency


def fit(train: list[dict], family: str, sweeps: int = 1) -> Efficiency:
    """Factors for one device family minimizing the median |error| of ``train`` (its rows)."""
    mine = [r for r in train if FAMILY[r["device"]] == family]
    device = mine[0]["device"] if mine else next(d for d, f in FAMILY.items() if f == family)
    start = start_efficiency(device)
    if not mine:
        return start
    import dataclasses

    def with_values(vals: dict[str, float]) -> Efficiency:
        return dataclasses.replace(start, **vals, attention=min(1.0, start.attention * vals["matmul"] / start.matmul))

    cur = {k: getattr(start, k) for k in CANDIDATES}

    def score(vals: dict[str, float]) -> float:
        e = with_values(vals)
        return float(np.median([abs(signed(predict(r, e), r["published_s"])) for r in mine]))

    best = score(cur)
    for _ in range(sweeps):
        for name, options in CANDIDATES.items():
            for val in options:
                trial = cur | {name: val}
                s = score(trial)
                if s < best - 1e-9:
                    best, cur = s, trial
    return with_values(cur)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip leave-one-source-out (refits)")
    ap.add_argument(
        "--source",
        action="append",
        help="price only this source's rows (repeatable): shipped defaults, no leave-one-source-out, "
        "nothing written (a quick look while changing the cost model)",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = load_rows()
    if args.source:
        unknown = sorted(set(args.source) - {r["source"] for r in rows})
        if unknown:
            ap.error(f"unknown source(s) {unknown}; the sources are {sorted({r['source'] for r in rows})}")
        rows = [r for r in rows if r["source"] in args.source]
    priced: list[dict] = []
    table: list[dict] = []
    for r in rows:
        why = refusal(r)
        ev = None
        if why is None:
            try:
                ev = evaluate_row(r)
            except ConfigError as e:
                why = str(e).splitlines()[0]
        entry = {
            k: r[k] for k in ("row", "source", "device", "gpus", "tp", "pp", "dp", "cp", "micro_batch", "global_batch")
        }
        entry |= {"published_s": r["published_s"], "citation": r["citation"], "assumed": r["assumed"]}
        if ev is None:
            entry |= {"refused": why}
        else:
            _PRED[(r["row"], None)] = ev.predicted_step_time_s
            entry |= {
                "predicted_s": ev.predicted_step_time_s,
                "err": signed(ev.predicted_step_time_s, r["published_s"]),
                "fits": ev.fits,
                "breakdown": {"pipeline_s": ev.pipeline_s, "bubble_s": ev.bubble_s, "tail_s": ev.tail_s},
            }
            priced.append(r)
        table.append(entry)
        print(f"  {r['row']:<24} " + (f"refused: {why}" if ev is None else f"{entry['err']:+.1%}"), flush=True)
    res: dict[str, Any] = {
        "n_rows": len(rows),
        "n_priced": len(priced),
        "n_refused": len(rows) - len(priced),
        "sources": sorted({r["source"] for r in rows}),
        "rows": table,
        "shipped": summary(priced, [predict(r) for r in priced]),
    }
    if not args.quick and not args.source:
        loso_pred: dict[str, float] = {}
        res["loso"] = {"per_source": {}, "fitted": {}}
        for src in res["sources"]:
            held = [r for r in priced if r["source"] == src]
            if not held:
                continue
            train = [r for r in priced if r["source"] != src]
            fitted = {}
            for fam in sorted({FAMILY[r["device"]] for r in held}):
                eff = fit(train, fam)
                has = any(FAMILY[r["device"]] == fam for r in train)
                fitted[fam] = {k: getattr(eff, k) for k in CANDIDATES} | {"fitted": has}
                for r in held:
                    if FAMILY[r["device"]] == fam:
                        loso_pred[r["row"]] = predict(r, eff)
            res["loso"]["fitted"][src] = fitted
            res["loso"]["per_source"][src] = summary(held, [loso_pred[r["row"]] for r in held])
            print(f"  loso {src}: {res['loso']['per_source'][src]['median_abs_err']:.1%} {fitted}", flush=True)
        res["loso"]["all"] = summary(priced, [loso_pred[r["row"]] for r in priced])
        for e in table:
            if e["row"] in loso_pred:
                e["loso_predicted_s"] = loso_pred[e["row"]]
    res["time_s"] = time.perf_counter() - t0
    if args.source:  # a subset: its summary only, the results files stay the full run's
        print(render(res))
        return res
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    text = render(res)
    TABLE.write_text(text)
    print(text)
    return res


def render(res: dict) -> str:
    lines = [
        f"# Published runs: {res['n_rows']} rows from {len(res['sources'])} sources, {res['n_priced']} priced, "
        f"{res['n_refused']} refused",
        "",
        "| row | device | GPUs | tp/pp/dp/cp | published s | predicted s | error | LOSO error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in res["rows"]:
        lay = f"{e['tp']}/{e['pp']}/{e['dp']}/{e['cp']}"
        if "refused" in e:
            lines.append(
                f"| {e['row']} | {e['device']} | {e['gpus']} | {lay} | {e['published_s']:.3f} | refused | "
                f"{e['refused'][:90]} | |"
            )
            continue
        loso = f"{signed(e['loso_predicted_s'], e['published_s']):+.1%}" if "loso_predicted_s" in e else ""
        lines.append(
            f"| {e['row']} | {e['device']} | {e['gpus']} | {lay} | {e['published_s']:.3f} | "
            f"{e['predicted_s']:.3f} | {e['err']:+.1%} | {loso} |"
        )
    lines.append("")
    for name in ("shipped", "loso"):
        s = res.get(name, {}).get("all") if name == "loso" else res.get(name)
        if not s or not s.get("n"):
            continue
        lines.append(
            f"**{name}**: n={s['n']} median |err| {s['median_abs_err']:.1%}, mean |err| {s['mean_abs_err']:.1%}, "
            f"mean signed {s['mean_signed_err']:+.1%}; per device "
            + ", ".join(f"{d} {v:+.1%}" for d, v in s["per_device"].items())
            + "; per GPU count "
            + ", ".join(f"{b} (n={v['n']}) {v['mean_signed_err']:+.1%}" for b, v in s["per_bucket"].items())
        )
        lines.append("")
    if "loso" in res:
        for src, s in res["loso"]["per_source"].items():
            fitted = res["loso"]["fitted"][src]
            flags = ", ".join(
                f"{f}: {'fitted' if v['fitted'] else 'no rows elsewhere, shipped defaults'}" for f, v in fitted.items()
            )
            lines.append(f"- held out {src}: median |err| {s['median_abs_err']:.1%} ({flags})")
    lines.append(f"\ntime {res['time_s']:.0f} s\n")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
