"""The profiler's measuring ranks: micro-benchmarks in every rank at once, then collectives.

Called by ``profile/profiler.profile`` through :func:`run_ranks`, which spawns ``nproc`` ranks with
``torch.multiprocessing`` (gloo on CPU, nccl on CUDA, one GPU per rank), shows a rich progress bar
fed by rank 0 and returns rank 0's raw tables. Every rank runs the same compute benchmarks at the
same time, so a CPU rank is timed while its siblings load the shared cores, as in a training run.

Collectives are timed with the cost model's size convention (``search/pricing/cost_model.py``): ``bytes``
is the per-rank size of the larger buffer (all-gather output, reduce-scatter input, all-reduce
buffer, all-to-all send buffer). A sample is the slowest rank's time of one call after a barrier
and, on CPU, ~2 ms of compute (``_burst``: as a training step issues it); the table keeps the
median. After the grid, :func:`bench_overlap` measures how much of an all-reduce hides behind
compute. Between compute and collectives every rank also runs the training-step probes
(``profile/step_probe.py``). Rank 0 and the budget decide how far each grid goes: all ranks agree
through one MAX all-reduce per item, so a tight ``time_budget_s`` shortens the grids, never hangs.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from partita.profile import step_probe
from partita.profile.measure import measure
from partita.search.pricing.cost_model import ProfileError

Report = Callable[[str, int], None]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MIN_PROBE_S = 8.0  # the step probes build Hugging Face models in every rank: skipped below this budget


def grids(devices: str) -> dict[str, Any]:
    """Shapes and sizes per device kind (CPU grids stay small: a rank may own half a core)."""
    if devices == "cpu":
        return {
            "kind": "cpu",
            "dtypes": ("f32", "bf16"),
            "gemm": [(n, n, n) for n in (32, 64, 128, 256, 512, 1024)]
            + [(512, 64, 256), (2048, 256, 1024), (2048, 1024, 256), (256, 768, 3072)],
            "attention": [(4, 4, 64, 16), (4, 4, 256, 32), (4, 8, 512, 64), (2, 12, 1024, 64)],
            "memory_numel": 8 << 20,
            # a sample spans several scheduler slices: ranks sharing cores are timed at their
            # sustained share, not at the full-core burst rate a short kernel sees
            "min_sample_s": 0.03,
            "burst_s": 2e-3,  # compute before each timed collective (``_burst``)
            "sizes": [4 << (2 * i) << 10 for i in range(7)],  # 4 KiB .. 16 MiB
        }
    return {
        "kind": "gpu",
        "dtypes": ("bf16", "f16", "f32"),
        "gemm": [(n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192)]
        + [(8192, 1024, 4096), (8192, 4096, 1024), (16384, 8192, 8192), (4096, 8192, 28672)],
        "attention": [(8, 16, 512, 64), (4, 32, 2048, 128), (2, 32, 4096, 128), (1, 64, 8192, 128)],
        "memory_numel": 256 << 20,
        "min_sample_s": 2e-3,
        "sizes": [64 << (2 * i) << 10 for i in range(8)],  # 64 KiB .. 1 GiB
    }


def _interleave(sizes: list[int]) -> list[int]:
    """Smallest, second largest, largest, then the rest: a short budget still spans the range."""
    if len(sizes) < 3:
        return sizes
    head = [sizes[0], sizes[-2], sizes[-1]]
    return head + [s for s in sizes if s not in head]


# ---- compute ------------------------------------------------------------------------------
def bench_compute(
    dev: torch.device, g: dict[str, Any], budget_s: float, report: Report, agree: Callable[[bool], bool] = bool
) -> dict[str, Any]:
    """GEMM grid, attention, memory bandwidth and tiny-op overhead on one rank. ``agree(stop)`` (a
    MAX all-reduce across ranks, so also a barrier) runs before every item: all ranks time the same
    kernel at the same time and skip the same items when the budget runs out."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    end = time.perf_counter() + budget_s
    out: dict[str, Any] = {"gemm": [], "attention": [], "memory": [], "overhead": {}}
    share = budget_s / (len(g["gemm"]) * len(g["dtypes"]) + 2 * len(g["attention"]) + 6)
    ms = float(g["min_sample_s"])

    def left() -> float:
        return end - time.perf_counter()

    x = torch.zeros(1, device=dev)
    agree(False)
    out["overhead"]["eager_op_s"] = measure(lambda: x.add_(1.0), sync, min(share, 0.5), ms)["median_s"]
    w = torch.ones(1, device=dev, requires_grad=True)

    def chain() -> None:
        y = w
        for _ in range(50):
            y = y * 1.0001
        y.sum().backward()

    agree(False)
    r = measure(chain, sync, min(share, 1.0), ms)
    out["overhead"]["autograd_op_s"] = r["median_s"] / 101  # 50 muls, sum, and their backward kernels
    report("overhead", 2)
    agree(False)
    for row in _bench_memory(dev, g["memory_numel"], sync, min(2 * share, 1.0), ms):
        out["memory"].append(row)
        report(f"memory {row['op']}", 1)
    gemm_end = time.perf_counter() + 0.75 * left()
    for m, k, n in sorted(g["gemm"], key=lambda s: s[0] * s[1] * s[2]):
        for dt_name in g["dtypes"]:
            if agree(time.perf_counter() >= gemm_end):
                report("gemm (budget spent)", 1)
                continue
            a = torch.randn(m, k, device=dev, dtype=DTYPES[dt_name])
            b = torch.randn(k, n, device=dev, dtype=DTYPES[dt_name])
            r = measure(
                lambda a=a, b=b: torch.matmul(a, b), sync, min(share, max(gemm_end - time.perf_counter(), 0.0)), ms
            )
            out["gemm"].append({"dtype": dt_name, "m": m, "k": k, "n": n, "flops": 2.0 * m * k * n, **r})
            report(f"gemm {dt_name} {m}x{k}x{n}", 1)
    for dt_name in g["dtypes"][:2]:
        for b_, h, s, d in g["attention"]:
            if agree(left() <= 0):
                report("attention (budget spent)", 1)
                continue
            q, kk, v = (torch.randn(b_, h, s, d, device=dev, dtype=DTYPES[dt_name]) for _ in range(3))
            r = measure(
                lambda q=q, kk=kk, v=v: F.scaled_dot_product_attention(q, kk, v, is_causal=True), sync, share, ms
            )
            flops = 4.0 * b_ * h * s * s * d  # the IR's convention: the full score matrix, causal or not
            out["attention"].append({"dtype": dt_name, "b": b_, "h": h, "s": s, "d": d, "flops": flops, **r})
            report(f"attention {dt_name} s={s}", 1)
    return out


def _bench_memory(
    dev: torch.device, numel: int, sync: Callable[[], None], max_s: float, min_sample_s: float
) -> list[dict[str, Any]]:
    """Streaming bandwidth: a copy moves 2 buffers, an add 3 (float32, ``numel`` elements each)."""
    src, dst, other = (torch.randn(numel, device=dev) for _ in range(3))
    rows = []
    for name, fn, nbytes in (
        ("copy", lambda: dst.copy_(src), 2 * numel * 4),
        ("add", lambda: torch.add(src, other, out=dst), 3 * numel * 4),
    ):
        rows.append({"op": name, "bytes": float(nbytes), **measure(fn, sync, max_s, min_sample_s)})
    return rows


def num_compute_items(g: dict[str, Any]) -> int:
    compute = 2 + len(g["gemm"]) * len(g["dtypes"]) + len(g["attention"]) * len(g["dtypes"][:2]) + 2
    return compute + step_probe.num_items(g["kind"])


# ---- collectives --------------------------------------------------------------------------
def _op(kind: str, nbytes: int, p: int, group: Any, dev: torch.device) -> Callable[[], Any]:
    numel = max(p, (nbytes // 4) // p * p)
    buf = torch.ones(numel, device=dev)
    small = torch.ones(numel // p, device=dev)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(buf, small, group=group)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(small, buf, group=group)
    if kind == "all_to_all":
        recv = torch.empty_like(buf)
        return lambda: dist.all_to_all_single(recv, buf, group=group)
    raise ValueError(kind)


def _pingpong(rank: int, nbytes: int, dev: torch.device) -> Callable[[], None]:
    buf = torch.ones(max(1, nbytes // 4), device=dev)
    if rank == 0:
        return lambda: (dist.send(buf, 1), dist.recv(buf, 1))  # type: ignore[func-returns-value]
    if rank == 1:
        return lambda: (dist.recv(buf, 0), dist.send(buf, 0))  # type: ignore[func-returns-value]
    return lambda: None


def _agree(dev: torch.device, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def bench_collectives(rank: int, world: int, dev: torch.device, g: dict[str, Any], end: float, report: Report) -> dict:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    items: list[tuple[str, int, int]] = []  # (kind, group size, bytes)
    groups: dict[int, Any] = {world: None}
    if world > 2:  # pairs too, to separate the per-hop alpha from the fixed latency
        for i in range(0, world - world % 2, 2):
            grp = dist.new_group([i, i + 1])
            if rank in (i, i + 1):
                groups[2] = grp
    for s in _interleave(list(g["sizes"])):
        items += [(k, world, s) for k in KINDS]
        if world > 2:
            items.append(("all_reduce", 2, s))
        items.append(("p2p", 2, s))
    report("collectives: total", -len(items) - 1)  # + the overlap probe
    burst_s = float(g.get("burst_s", 0.0))
    burst = _burst(dev, burst_s, sync)
    rows: list[dict[str, Any]] = []
    p2p: list[dict[str, Any]] = []
    for idx, (kind, p, nbytes) in enumerate(items):
        in_group = p == world or kind == "p2p" or p in groups
        fn = _pingpong(rank, nbytes, dev) if kind == "p2p" else _op(kind, nbytes, p, groups.get(p), dev)
        if not in_group:
            fn = lambda: None  # noqa: E731 - odd rank out of the pairs
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        warm = time.perf_counter() - t0
        per_item = max(end - time.perf_counter(), 0.0) / max(1, len(items) - idx)
        warm, stop = _agree(dev, [warm, float(time.perf_counter() >= end)])
        if stop:
            report(f"{kind} (budget spent)", 1)
            continue
        reps = int(max(2, min(20, per_item / max(warm + burst_s, 1e-6))))
        times = []
        for _ in range(reps):
            dist.barrier()
            burst()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        times = sorted(_agree(dev, times))
        one_way = 0.5 if kind == "p2p" else 1.0
        row = {
            "kind": kind,
            "group_size": p,
            "bytes": float(nbytes),
            "median_s": times[len(times) // 2] * one_way,
            "min_s": times[0] * one_way,
            "max_s": times[-1] * one_way,
            "reps": reps,
            "after_compute_s": burst_s,
        }
        (p2p if kind == "p2p" else rows).append(row)
        report(f"{kind} p={p} {nbytes >> 10} KiB", 1)
    out = {"collectives": sorted(rows, key=lambda r: (r["kind"], r["group_size"], r["bytes"])), "p2p": p2p}
    if time.perf_counter() < end:
        out["overlap"] = bench_overlap(dev, sync)
        report("overlap", 1)
    return out


def _burst(dev: torch.device, seconds: float, sync: Callable[[], None]) -> Callable[[], None]:
    """About ``seconds`` of GEMMs, the same count on every rank: a collective is then timed as a
    training step issues it, right after compute (on a shared CPU that costs more than back to
    back: caches, sleeping gloo threads, ranks arriving apart), not after an idle barrier."""
    if seconds <= 0:
        return lambda: None
    a, b = torch.randn(128, 128, device=dev), torch.randn(128, 128, device=dev)
    one = measure(lambda: torch.mm(a, b), sync, 0.1, 0.0)["median_s"]
    n = int(_agree(dev, [float(max(1, round(seconds / max(one, 1e-9))))])[0])

    def run() -> None:
        for _ in range(n):
            torch.mm(a, b)
        sync()

    return run


def bench_overlap(dev: torch.device, sync: Callable[[], None], nbytes: int = 4 << 20, reps: int = 7) -> dict:
    """How much of an all-reduce hides behind compute on this machine: the same all-reduce alone
    (``comm_s``), GEMMs of about its length alone (``compute_s``) and both at once, the all-reduce
    issued async first (``both_s``); ``overlap = (compute + comm - both) / min(compute, comm)``
    clipped to [0, 1] (1: fully hidden, 0: the two serialize, as when ranks own every core)."""
    buf = torch.ones(nbytes // 4, device=dev)
    a, b = torch.randn(256, 256, device=dev), torch.randn(256, 256, device=dev)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):  # a fixed count: every rank must issue the same collectives
        dist.all_reduce(buf)
    sync()
    comm_once = (time.perf_counter() - t0) / 3
    gemm = measure(lambda: torch.mm(a, b), sync, 0.2, 0.0)["median_s"]  # local only
    n = int(_agree(dev, [float(max(1, round(comm_once / max(gemm, 1e-9))))])[0])

    def compute() -> None:
        for _ in range(n):
            torch.mm(a, b)
        sync()

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()
        sync()

    fns = {"compute_s": compute, "comm_s": lambda: (dist.all_reduce(buf), sync()), "both_s": both}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    med = {k: sorted(_agree(dev, v))[reps // 2] for k, v in times.items()}
    hidden = med["compute_s"] + med["comm_s"] - med["both_s"]
    overlap = min(1.0, max(0.0, hidden / max(min(med["compute_s"], med["comm_s"]), 1e-9)))
    return {"bytes": float(nbytes), "num_gemms": n, **med, "overlap": overlap}


# ---- ranks --------------------------------------------------------------------------------
def _worker(rank: int, devices: str, world: int, port: int, end_wall: float, threads: int, q: Any, out: str) -> None:
    import json

    torch.set_num_threads(threads)
    dev = torch.device("cuda", rank) if devices == "cuda" else torch.device("cpu")
    if devices == "cuda":
        torch.cuda.set_device(dev)
    report: Report = (lambda what, n: q.put((what, n))) if rank == 0 else (lambda what, n: None)
    g = grids(devices)
    if world > 1:
        backend = "nccl" if devices == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dist.barrier()
    left = end_wall - time.time()

    def agree(stop: bool) -> bool:
        return bool(_agree(dev, [float(stop)])[0]) if world > 1 else stop

    tables = bench_compute(dev, g, max(left * (0.35 if world > 1 else 0.6), 0.1), report, agree)
    probe_s = left * (0.25 if world > 1 else 0.35)
    if agree(probe_s < MIN_PROBE_S):
        report("step probes (budget too short)", step_probe.num_items(g["kind"]))
    else:
        slowest = (lambda v: _agree(dev, v)) if world > 1 else list
        tables |= step_probe.bench_probes(dev, g["kind"], probe_s, agree, report, slowest)
    if world > 1:
        dist.barrier()
        tables |= bench_collectives(rank, world, dev, g, time.perf_counter() + max(end_wall - time.time(), 0.5), report)
    if rank == 0:  # before the teardown: gloo has aborted in destroy_process_group here (rarely)
        with open(out + ".tmp", "w") as f:
            json.dump(tables, f)
        os.replace(out + ".tmp", out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(devices: str, nproc: int, time_budget_s: float, threads: int, progress: bool) -> dict[str, Any]:
    """Spawn ``nproc`` ranks (in-process when 1), show progress, return rank 0's tables."""
    import json
    import tempfile

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    g = grids(devices)
    start = time.time()
    startup = 0.0 if nproc == 1 else min(30.0, 0.15 * time_budget_s)  # importing torch in every rank
    end_wall = start + time_budget_s - startup * 0.5
    bar = Progress(TextColumn("{task.description:<36}"), BarColumn(), TimeElapsedColumn(), disable=not progress)
    total = num_compute_items(g)
    with bar, tempfile.TemporaryDirectory(prefix="partita-profile-") as tmp:
        task = bar.add_task("profiling", total=total)
        out = os.path.join(tmp, "tables.json")
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned ranks
        try:
            if nproc == 1:

                def report(what: str, n: int) -> None:
                    bar.update(task, advance=max(n, 0), description=what)

                _worker(0, devices, 1, 0, end_wall, threads, _Local(report), out)
            else:
                q = mp.get_context("spawn").SimpleQueue()
                ctx = mp.start_processes(
                    _worker, args=(devices, nproc, _free_port(), end_wall, threads, q, out),
                    nprocs=nproc, join=False, start_method="spawn",
                )  # fmt: skip
                hard = start + time_budget_s + max(30.0, 0.25 * time_budget_s)
                while not _joined(ctx, out):
                    while not q.empty():
                        what, n = q.get()
                        if n < 0:
                            bar.update(task, total=total - n)
                        else:
                            bar.update(task, advance=n, description=what)
                    if time.time() > hard:
                        for p in ctx.processes:
                            if p.is_alive():
                                p.terminate()
                        raise ProfileError(
                            f"the profiler ranks ran past {hard - start:.0f} s and were stopped.",
                            "raise time_budget_s or lower nproc; the machine may be overloaded.",
                        )
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        with open(out) as f:
            return dict(json.load(f))


def _joined(ctx: Any, out: str) -> bool:
    """``ctx.join`` that forgives a rank dying in the teardown once rank 0 wrote the tables."""
    try:
        return bool(ctx.join(timeout=0.2))
    except mp.ProcessExitedException as err:
        if os.path.exists(out):
            return all(p.join(timeout=5) or True for p in ctx.processes)
        raise ProfileError(f"a profiler rank failed: {err}.", "re-run `partita profile`; see the log above.") from None


class _Local:
    """Queue stand-in for the in-process (one-rank) path."""

    def __init__(self, report: Report) -> None:
        self.report = report

    def put(self, item: tuple[str, int]) -> None:
        self.report(*item)
