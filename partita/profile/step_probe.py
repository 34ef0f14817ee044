"""Training-step probes of the profiler: real small training steps, priced by the cost model, fitted.

Part of ``partita profile`` (``profile/profiler.py``). The micro-benchmarks time one kernel at a
time; a training step of a real model also pays the framework's per-op cost (Python module calls,
autograd bookkeeping, views the IR does not count) and runs its kernels at a lower sustained rate
(cold caches between ops, transposed GEMMs in the backward, time-slicing over a long step). So
every rank also trains small Hugging Face GPT-2 *probe* models (sizes of their own, none of them a
benchmark model) and times, like the runtime does (``backends/torch/train.py``):

* forward + loss + backward of one micro-batch (``fb_s``), and the Adam step (``opt_s``), each
  sample after a barrier and for the slowest rank (a step waits for it at the gradient sync);
* the Adam step alone over grids of parameter tensors (``optimizer`` rows).

The parent then prices each probe with the cost model's own path (trace, intra-op ILP at tp=1,
``search/stage_cost.SolverCosts``) under the micro-benchmark calibration, split into the roofline
part ``A`` and the number of kernels ``N`` that pay ``kernel_overhead_s`` (:func:`probe_terms`), and
fits ``fb = A / share + N * k`` over the probes (:func:`fit_step`): ``share`` scales the matmul,
attention and memory efficiencies, ``k`` becomes ``kernel_overhead_s``. The optimizer rows fit
``t = n * c + bytes * d`` (:func:`fit_optimizer`): ``c`` is ``optimizer_tensor_s``, ``d`` gives
``optimizer_memory``. Nothing here reads a benchmark's measured step times.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# (name, HF config, micro-batch, seq) per device kind; an overhead-bound, a middle and a compute-bound one
PROBES: dict[str, list[tuple[str, dict[str, Any], int, int]]] = {
    "cpu": [
        ("probe-s", {"n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 64, "n_positions": 16}, 2, 16),
        ("probe-m", {"n_embd": 96, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 48}, 2, 48),
        ("probe-l", {"n_embd": 192, "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 96}, 2, 96),
    ],
    "gpu": [
        ("probe-s", {"n_embd": 64, "n_layer": 1, "n_head": 2, "vocab_size": 128, "n_positions": 64}, 2, 64),
        ("probe-m", {"n_embd": 512, "n_layer": 2, "n_head": 8, "vocab_size": 4096, "n_positions": 256}, 4, 256),
        ("probe-l", {"n_embd": 2048, "n_layer": 2, "n_head": 16, "vocab_size": 8192, "n_positions": 1024}, 4, 1024),
    ],
}
# Adam over (number of tensors, elements each): per-tensor cost vs streaming cost
OPTIMIZER_GRID = {"cpu": [(64, 1024), (16, 16384), (4, 262144)], "gpu": [(256, 4096), (16, 1 << 20), (4, 1 << 24)]}
ADAM_STATE_BYTES = 16  # param + grad + two moments per element touched (f32); the stage formula's count
PROBE_OVERHEAD_STEP_S = 1e-5  # the k at which probe_terms re-prices the probes to get N


def write_configs(kind: str, root: str | Path) -> list[tuple[str, str, int, int]]:
    """The probes' HF config files under ``root``: ``(name, path, micro_batch, seq)``."""
    out = []
    for name, cfg, b, seq in PROBES[kind]:
        path = Path(root) / f"{name}.json"
        path.write_text(json.dumps({"model_type": "gpt2", **cfg}))
        out.append((name, str(path), b, seq))
    return out


# ---- rank side ----------------------------------------------------------------------------
def interleaved(
    fns: Sequence[Callable[[], Any]],
    sync: Callable[[], None],
    budget_s: float,
    min_sample_s: float,
    agree: Callable[[bool], bool],
    slowest: Callable[[list[float]], list[float]] = list,
    min_rounds: int = 5,
    max_rounds: int = 41,
) -> list[dict[str, float]]:
    """Seconds per call of each ``fn`` as the runtime times a step: every sample starts after a
    barrier (``agree``) and counts for the slowest rank (``slowest``: element-wise max over ranks).
    Samples go round-robin (one of each per round) so a load change on a shared machine hits all
    ``fns`` alike. A sample repeats ``fn`` until it lasts ``min_sample_s`` (0: one call, with the
    rank-to-rank jitter one training step has). Returns the median, min and max per ``fn``."""
    inner = []
    for fn in fns:
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        inner.append(float(max(1, min(1000, int(min_sample_s / max(time.perf_counter() - t0, 1e-7))))))
    inner = slowest(inner)  # one count for all ranks, so that a sample is the same work everywhere
    end = time.perf_counter() + budget_s
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(max_rounds):
        if agree(r >= min_rounds and time.perf_counter() >= end):
            break
        for fn, n, out in zip(fns, inner, samples):
            agree(False)
            t0 = time.perf_counter()
            for _ in range(int(n)):
                fn()
            sync()
            out.append((time.perf_counter() - t0) / n)
    rows = []
    for out in samples:
        out = sorted(slowest(out))
        rows.append({"median_s": out[len(out) // 2], "min_s": out[0], "max_s": out[-1], "reps": len(out)})
    return rows


def bench_probes(
    dev: Any,
    kind: str,
    budget_s: float,
    agree: Callable[[bool], bool],
    report: Callable,
    slowest: Callable[[list[float]], list[float]] = list,
) -> dict[str, list[dict[str, Any]]]:
    """Time the probes' training steps and the Adam grid, all ranks at once (:func:`interleaved`)."""
    import torch

    from partita.backends.torch.train import make_batch, make_loss, make_optimizer, num_targets
    from partita.models import resolve_model

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    fb_fns, opt_fns = [], []
    with tempfile.TemporaryDirectory(prefix="partita-probe-") as tmp:
        for name, path, b, seq in write_configs(kind, tmp):
            handle = resolve_model(path)
            model = handle.build("cpu", seed=0).float().to(dev)
            opt = make_optimizer(model.parameters(), {"optimizer": "adam"})
            x, y = make_batch(handle, {"global_batch": b, "seq_len": seq}, 0, 0)
            x, y = x.to(dev), y.to(dev)
            loss_fn = make_loss(num_targets(y))
            fb_fns.append(lambda m=model, f=loss_fn, x=x, y=y: f(m(x), y).backward())
            opt_fns.append(opt.step)  # the gradients stay: every call steps every tensor
            params = [p for p in model.parameters() if p.requires_grad]
            rows.append({"name": name, "config": json.loads(Path(path).read_text()), "micro_batch": b, "seq": seq,
                         "num_tensors": len(params), "numel": sum(p.numel() for p in params)})  # fmt: skip
    grid = []
    for n, size in OPTIMIZER_GRID[kind]:
        params = [torch.zeros(size, device=dev, requires_grad=True) for _ in range(n)]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt_fns.append(make_optimizer(params, {"optimizer": "adam"}).step)
        grid.append({"num_tensors": n, "numel": n * size})
    left = budget_s - (time.perf_counter() - t_start)
    agree(False)
    for row, r in zip(rows, interleaved(fb_fns, sync, 0.6 * left, 0.0, agree, slowest)):  # one step a sample
        row |= {"fb_s": r["median_s"], "fb_min_s": r["min_s"], "fb_max_s": r["max_s"], "fb_reps": r["reps"]}
    report("step probes", len(rows))
    opt_times = interleaved(opt_fns, sync, 0.3 * left, 0.0, agree, slowest)
    for row, r in zip(rows, opt_times):
        row["opt_s"] = r["median_s"]
    report("optimizer", len(grid))
    return {"step_probe": rows, "optimizer": [g | r for g, r in zip(grid, opt_times[len(rows) :])]}


def num_items(kind: str) -> int:
    return len(PROBES[kind]) + len(OPTIMIZER_GRID[kind])


# ---- parent side: the cost model's price of each probe ------------------------------------
def probe_terms(prelim: Mapping[str, Any], device_name: str, rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """``{"roofline_s": A, "kernels": N}`` per probe row: the cost model's forward + backward of one
    micro-batch on one device is ``A + N * kernel_overhead_s`` (priced at k = 0 and k = 1e-5)."""
    import dataclasses

    from partita.cluster import DEVICE_PRESETS, Cluster, NodeGroup, apply_profile
    from partita.frontends.trace import trace_handle
    from partita.models import resolve_model
    from partita.search.entry.planner import Search
    from partita.search.pricing.config import SearchOptions, TrainingConfig

    base = DEVICE_PRESETS[device_name]
    opts = SearchOptions(zero_stages=(0,), recompute=("none",), max_layer_units=0, max_tp=1)
    out = []
    with tempfile.TemporaryDirectory(prefix="partita-probe-") as tmp:
        devs = []
        for k in (0.0, PROBE_OVERHEAD_STEP_S):
            path = Path(tmp) / f"prelim-{k}.json"
            path.write_text(json.dumps({**prelim, "efficiency": {**prelim["efficiency"], "kernel_overhead_s": k}}))
            devs.append(apply_profile(dataclasses.replace(base, memory_bytes=1e15), path))
        for row in rows:
            cfg = Path(tmp) / f"{row['name']}.json"
            cfg.write_text(json.dumps(row["config"]))
            graph = trace_handle(resolve_model(str(cfg)), batch=2, seq=int(row["seq"]))
            training = TrainingConfig(global_batch=int(row["micro_batch"]), seq_len=int(row["seq"]), dtype="f32")
            t = []
            for dev in devs:
                search = Search(graph, Cluster("probe", (NodeGroup(dev, 1, 1),)), training, opts)
                tab = search.table(dev, 1, int(row["micro_batch"]))
                if tab is None:
                    raise RuntimeError(f"probe {row['name']} has no tp=1 solution")
                t.append(float(tab.fwd.sum() + tab.bwd.sum()))
            out.append({"roofline_s": t[0], "kernels": (t[1] - t[0]) / PROBE_OVERHEAD_STEP_S})
    return out


# ---- fits ---------------------------------------------------------------------------------
def fit_step(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``fb = A / share + N * k`` over the probes (relative least squares, non-negative)."""
    from partita.profile.measure import nnls_fit

    use = [r for r in rows if r.get("terms") and r["fb_s"] > 0]
    if len(use) < 2:
        return None
    (inv_share, k), err = nnls_fit([[r["terms"]["roofline_s"], r["terms"]["kernels"]] for r in use],
                                   [r["fb_s"] for r in use])  # fmt: skip
    if inv_share <= 0:
        return None
    return {"sustained_share": 1.0 / inv_share, "kernel_overhead_s": k, "rel_rms_error": err, "num_probes": len(use)}


def fit_optimizer(rows: Sequence[Mapping[str, Any]], hbm_bandwidth: float, passes: float) -> dict[str, Any] | None:
    """``t = n * c + bytes * d`` (``bytes`` = 16 per element); ``optimizer_memory = passes / (hbm * d)``."""
    from partita.profile.measure import nnls_fit

    use = [r for r in rows if r["median_s"] > 0]
    if len(use) < 2:
        return None
    (c, d), err = nnls_fit(
        [[r["num_tensors"], ADAM_STATE_BYTES * r["numel"]] for r in use], [r["median_s"] for r in use]
    )
    out = {"optimizer_tensor_s": c, "s_per_byte": d, "rel_rms_error": err, "num_points": len(use)}
    if d > 0 and hbm_bandwidth > 0:
        out["optimizer_memory"] = passes / (hbm_bandwidth * d)
    return out
