"""The compile driver: model spec -> traced IR -> Plan -> program files, with a compile cache.

Sits between the CLI / ``partita.api`` above and the tracers, passes, search and emitters below.
Staged like JAX's ``Traced -> Lowered -> Compiled``: :func:`trace_model` gives a :class:`Traced`,
``Traced.plan(cluster, training)`` a :class:`Planned`, ``Planned.compile(out_dir)`` a
:class:`Compiled`; each has ``as_text()``.

The compile cache is keyed by (model identity, cluster fingerprint, training config, search
options, Partita version). The model identity is the zoo entry's config, or the content hash of
a ``config.json`` / factory module file, so a hit is decided without tracing (< 1 s); the graph
hash is recorded in the plan and checked by the runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partita.cluster import Cluster, parse_cluster
from partita.errors import ConfigError, ModelError, PlanError
from partita.fingerprint import (  # noqa: F401  (re-exported: tests, benches and callers read them from driver)
    _model_identity,
    _profile_hash,
    cache_key,
    code_fingerprint,
    source_fingerprint,
    spec_identity,
)
from partita.frontends.trace import TRACE_BATCH, seq_default, trace_handle
from partita.gc_freeze import frozen_heap, settle
from partita.outputs import (  # noqa: F401  (re-exported: tests and callers read them from driver)
    HASH_FILE,
    _atomic_write,
    _is_factory_spec,
    _user_frame,
    _write_all,
    file_hashes,
    store_cache_entry,
    user_code,
    verified_entry,
)
from partita.plan import Plan
from partita.run_checks import _check_program, _check_resume, _check_run_log, _flag_value, check_data_fn  # noqa: F401

if TYPE_CHECKING:  # annotations only: the driver needs the IR (and sympy) only when it traces
    from partita.ir import Graph

PLAN_FILE = "plan.json"
CACHE_FILE = "cache_key.json"


def cache_dir() -> Path:
    # "" is unset; a quoted "~/..." (no shell to expand it) means the home directory, not a "~" folder here
    return Path(os.environ.get("PARTITA_CACHE_DIR") or Path.home() / ".cache" / "partita").expanduser()


# ---- tracing -----------------------------------------------------------------------------
@dataclasses.dataclass
class Traced:
    handle: Any
    graph: Graph
    trace_time_s: float

    def summary(self, batch: int = 1, seq: int | None = None) -> dict[str, Any]:
        from partita.passes.annotate import layer_stats

        env = self.env(batch, seq)
        stats = layer_stats(self.graph, env)
        kinds: dict[str, list[str]] = {}
        for s in stats:
            kinds.setdefault(s.kind, []).append(s.name)
        return {
            "model": self.handle.name,
            "framework": self.handle.framework,
            "batch": env.get("B", batch),
            "seq": env.get("S", seq),
            "num_nodes": len(self.graph.nodes),
            "num_params": self.graph.num_params(),
            "param_bytes": self.graph.param_bytes(),
            "forward_flops": int(sum(s.forward_flops for s in stats)),
            "backward_flops": int(sum(s.backward_flops for s in stats)),
            "num_layers": len(stats),
            "layers": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "num_nodes": s.num_nodes,
                    "num_params": s.param_count,
                    "forward_flops": int(s.forward_flops),
                    "activation_bytes": int(s.activation_bytes),
                }
                for s in stats
            ],
            "repeated_layers": [{"kind": k, "count": len(v), "layers": v} for k, v in kinds.items() if len(v) > 1],
            "trace_time_s": round(self.trace_time_s, 3),
        }

    def env(self, batch: int, seq: int | None) -> dict[str, int]:
        return {"B": batch, "S": seq or seq_default(self.handle)}

    def as_text(self, batch: int = 1, seq: int | None = None) -> str:
        s = self.summary(batch, seq)
        lines = [
            f"{s['model']} ({s['framework']}): {s['num_nodes']} nodes, {s['num_params']:,} params "
            f"({s['param_bytes'] / 1e9:.2f} GB), forward {s['forward_flops'] / 1e12:.3f} TFLOP at batch {s['batch']}, "
            f"seq {s['seq']}; traced in {s['trace_time_s']:.1f} s",
            f"{'layer':<24} {'kind':<18} {'nodes':>6} {'params':>14} {'fwd GFLOP':>12}",
        ]
        for lay in s["layers"]:
            lines.append(
                f"{lay['name']:<24} {lay['kind']:<18} {lay['num_nodes']:>6} {lay['num_params']:>14,} "
                f"{lay['forward_flops'] / 1e9:>12.2f}"
            )
        for r in s["repeated_layers"]:
            lines.append(f"repeated: {r['count']} x kind {r['kind']} ({r['layers'][0]} .. {r['layers'][-1]})")
        return "\n".join(lines)

    def plan(
        self,
        cluster: str | Cluster,
        training: Any,
        *,
        gpus_per_node: int | None = None,
        progress: Callable[[str], None] | bool = False,
    ) -> Planned:
        from partita.search.entry.planner import plan_graph

        cl = parse_cluster(cluster, gpus_per_node) if isinstance(cluster, str) else cluster
        t0 = time.perf_counter()
        from partita.search.entry.hand_best import yardstick  # the report's yardstick (issue 18)
        from partita.search.layer.memo import IntraOpMemo

        memo = IntraOpMemo()  # shared: the yardstick re-prices layers the search solved
        plan = plan_graph(
            self.graph, cl, training, progress=progress, memo=memo, yardstick=yardstick(self.graph, cl, memo)
        )
        return Planned(self, cl, training, plan, time.perf_counter() - t0)


def trace_model(spec: str, *, batch: int = TRACE_BATCH, seq: int | None = None) -> Traced:
    from partita.hf_config_check import check_model_spec
    from partita.models import resolve_model

    check_model_spec(spec)  # a config.json's sizes, before transformers reads it

    with user_code(spec):
        handle = resolve_model(spec)
        t0 = time.perf_counter()
        graph = trace_handle(handle, batch=batch, seq=seq)
    return Traced(handle, graph, time.perf_counter() - t0)


# ---- planning and compiling --------------------------------------------------------------
@dataclasses.dataclass
class Planned:
    traced: Traced
    cluster: Cluster
    training: Any
    plan: Plan
    search_time_s: float

    def as_text(self) -> str:
        from partita.report import plan_text

        return plan_text(self.plan)

    def compile(self, out_dir: str | Path) -> Compiled:
        return _write_outputs(
            self.plan, self.traced.handle.name, Path(out_dir), cache_hit=False, search_time_s=self.search_time_s
        )


@dataclasses.dataclass
class Compiled:
    out_dir: Path
    plan: Plan
    cache_hit: bool
    files: dict[str, str]
    elapsed_s: float
    # wall times and peak memory of this compile (trace_time_s, search_time_s, peak_rss_bytes):
    # side data for --json, never in plan.json (plans stay byte-identical)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        p = self.plan
        return {
            "out_dir": str(self.out_dir),
            "cache_hit": self.cache_hit,
            "predicted_step_time_s": p.predicted.get("step_time_s"),
            "search_time_s": self.timings.get("search_time_s", p.search.get("time_s")),
            "trace_time_s": self.timings.get("trace_time_s"),
            "search_cpu_s": self.timings.get("search_cpu_s"),
            "trace_cpu_s": self.timings.get("trace_cpu_s"),
            "compile_time_s": round(self.elapsed_s, 3),
            "peak_rss_bytes": self.timings.get("peak_rss_bytes", _peak_rss_bytes()),
            "schedule": p.schedule,
            "micro_batch_size": p.micro_batch_size,
            "num_micro_batches": p.num_micro_batches,
            "world_size": p.world_size,
            "model": p.model.get("name"),
            "cluster": p.cluster.get("name"),
            "stages": [
                {
                    "index": s.index,
                    "layers": list(s.layers),
                    "device_type": s.device_type,
                    "num_devices": s.num_devices,
                    "dp": s.dp,
                    "tp": s.tp,
                    "zero_stage": s.zero_stage,
                    "recompute": s.recompute,
                    "batch_shares": list(s.batch_shares),
                }
                for s in p.stages
            ],
            "predicted": dict(p.predicted),
            "best_hand_layout": p.search.get("best_hand_layout"),  # report: against the best hand layout
            "files": self.files,
        }

    def as_text(self) -> str:
        from partita.report import plan_text

        head = (
            f"cache hit: loaded {self.out_dir / PLAN_FILE} in {self.elapsed_s:.2f} s (use --force to recompile)"
            if self.cache_hit
            else f"wrote {', '.join(sorted(self.files.values()))}"
        )
        return plan_text(self.plan) + "\n" + head


@dataclasses.dataclass
class CachedPlan:
    """A plan for a model handle, from the compile cache or a fresh trace + search."""

    plan: Plan
    cache_hit: bool
    key: str
    path: Path  # the cache entry's plan.json
    elapsed_s: float
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # trace / search wall times


def _peak_rss_bytes() -> int:
    """The largest peak resident set size of this process and of the worker processes it waited for
    (``search/entry/prefetch.py``'s forks; ``resource.getrusage``; Linux reports KiB)."""
    try:
        import resource
        import sys

        peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return 0


def _cpu_s() -> float:
    """CPU seconds of this process and of the worker processes it waited for (the search's forks)."""
    try:
        import resource

        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime
    except (ImportError, OSError):
        return time.process_time()


def plan_handle(
    handle: Any,
    cluster: str | Cluster,
    training: Any,
    *,
    force: bool = False,
    progress: bool = False,
    key: str | None = None,
    graph: Graph | None = None,
    store: bool = True,
    took: tuple[float, float] = (0.0, 0.0),
) -> CachedPlan:
    """The plan for ``handle`` on ``cluster``: a cache hit when the key matches (no trace), else
    trace + search, written to the cache. Used by :func:`compile_to_dir` and ``partita.parallelize``.
    ``graph``: the traced graph when the caller has it already (a stored trace, a child's trace);
    ``handle`` is then unused and ``took`` is what getting it took (wall, CPU seconds)."""
    t0 = time.perf_counter()
    cl = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    _check_training(training)
    key = key or cache_key(handle, cl, training)
    cached = cache_dir() / "plans" / key / PLAN_FILE
    got = None if force else verified_entry(cached.parent, [PLAN_FILE])
    if got is not None:
        try:
            plan = Plan.from_json(got[PLAN_FILE], str(cached))
        except PlanError:
            plan = None  # a corrupt cache entry is recompiled, never trusted
        if plan is not None:
            return CachedPlan(plan, True, key, cached, time.perf_counter() - t0)
    c0 = _cpu_s()  # CPU seconds too: on a shared machine wall seconds measure the neighbours
    from partita.progress import say

    with frozen_heap():  # the collector kept off the imported modules, the model and the graph (gc_freeze.py)
        settle(collect=False)  # what is imported and built so far frozen
        if graph is None:
            if progress:
                say(f"tracing {getattr(handle, 'name', '') or 'the model'} on the meta device (no weights)")
            with user_code(getattr(handle, "name", "") or ""):
                graph = trace_handle(handle, batch=TRACE_BATCH, seq=training.seq_len)
        _refuse_batch_stats(graph)
        settle()  # the trace's garbage cycles collected, the graph frozen: the search's collections scan its own objects
        traced = Traced(handle, graph, 0.0)
        traced.trace_time_s = time.perf_counter() - t0 + took[0]
        c1 = _cpu_s()
        if progress:
            blocks = graph.meta.get("traced_blocks")
            how = f" ({blocks[0]} of {blocks[1]} blocks traced, the rest copied)" if blocks else ""
            say(
                f"traced {len(graph.layers)} layers in {traced.trace_time_s:.1f} s{how}; searching {cl.num_devices} devices"
            )
        planned = traced.plan(cl, training, progress=say if progress else False)
        c2 = _cpu_s()  # the workers' too: they are waited for before the plan is returned
    if store:
        store_cache_entry(cached.parent, {PLAN_FILE: planned.plan.to_json()})
    timings = {
        "trace_time_s": round(traced.trace_time_s, 3),
        "search_time_s": round(planned.search_time_s, 3),
        "trace_cpu_s": round(c1 - c0 + took[1], 3),
        "search_cpu_s": round(c2 - c1, 3),
    }
    return CachedPlan(planned.plan, False, key, cached, time.perf_counter() - t0, timings)


def _refuse_batch_stats(graph: Graph) -> None:
    """Refuse a model that normalizes over the batch in training (BatchNorm; issue 31): every plan splits
    the batch (data-parallel replicas, micro-batches), so each piece would normalize by its own statistics
    and train differently from one device. Synchronized batch statistics are not implemented."""
    from partita.ir import Prim

    where = sorted(
        {n.module or n.name for n in graph.nodes if n.prim == Prim.BATCH_NORM and "no_training" not in n.target}
    )
    if where:
        raise ModelError(
            f"{graph.name} normalizes over the batch in training (BatchNorm at {', '.join(where[:4])}"
            f"{' ...' if len(where) > 4 else ''}); Partita splits every batch over data-parallel replicas and "
            "micro-batches, so each piece would use its own batch statistics and the run would not match one "
            "device, and it does not synchronize batch statistics",
            "replace BatchNorm with GroupNorm or LayerNorm (batch-independent), or put the model in eval mode for "
            "its BatchNorm layers (running statistics), then compile again",
        )


def stored_graph(model: str, seq: int, ident: str | None = None) -> Graph | None:
    """A zoo model's stored trace at ``seq`` (``frontends/stored.py``: no torch import, no export), or
    None (not a zoo name, none shipped, or not current)."""
    ident = ident if ident is not None else spec_identity(model)
    if ident is None or not json.loads(ident).get("spec", "").startswith("zoo:"):
        return None
    from partita.frontends.stored import load_stored

    return load_stored(model, seq, TRACE_BATCH)


def compile_to_dir(
    model: str,
    cluster: str,
    training: Any,
    out_dir: str | Path,
    *,
    force: bool = False,
    gpus_per_node: int | None = None,
    progress: bool = False,
) -> Compiled:
    with frozen_heap():  # the collector off the imports and the model (gc_freeze.py; plan_handle settles it)
        return _compile_to_dir(model, cluster, training, out_dir, force, gpus_per_node, progress)


def _compile_to_dir(
    model: str, cluster: str, training: Any, out_dir: str | Path, force: bool, gpus_per_node: int | None, progress: bool
) -> Compiled:
    t0 = time.perf_counter()
    model = resolve_spec(model)  # a model path: absolute in the program (it runs in the plan directory)
    from partita.hf_config_check import check_model_spec

    check_model_spec(model)  # a config.json's sizes, before transformers reads it
    cl = parse_cluster(cluster, gpus_per_node)
    _check_training(training)
    # --precision fp8 without a layout lets the search choose FP8 where it is faster and the program runs it
    # (search/entry/choices.py), per stage on the types with FP8; with a layout (compile_layout) every stage
    # trains in FP8 (its device type, the first, must have it)
    ident = spec_identity(model)
    if ident is not None and not force:
        key = cache_key(None, cl, training, ident)
        entry = cache_dir() / "plans" / key
        hit = _cached_outputs(entry, model, Path(out_dir), key, t0)
        if hit is not None:
            return hit
    t1, c1 = time.perf_counter(), time.process_time()
    # a built-in model's stored trace (frontends/stored.py): no torch import, no export; None if not current
    graph = stored_graph(model, training.seq_len, ident)
    load_s, load_cpu_s = time.perf_counter() - t1, time.process_time() - c1
    handle = None
    if graph is None and ident is not None and not _is_factory_spec(model):
        from partita.trace_child import named_trace  # in a child, the search imported beside it

        graph, load_s, load_cpu_s = named_trace(model, training.seq_len, TRACE_BATCH, progress) or (None, 0.0, 0.0)
    if graph is None:
        from partita.models import resolve_model

        with user_code(model):
            handle = resolve_model(model)
    key = cache_key(handle, cl, training, ident)
    # a searched torch plan carries its tp roles (Stage.tp_plan): emitting it imports no torch either
    took = (load_s, load_cpu_s) if graph is not None else (0.0, 0.0)  # the stored graph's load, the child's trace
    got = plan_handle(
        handle, cl, training, force=force, progress=progress, key=key, graph=graph, store=False, took=took
    )
    done = _write_outputs(
        got.plan,
        model,
        Path(out_dir),
        cache_hit=got.cache_hit,
        elapsed_s=time.perf_counter() - t0,
        key=got.key,
    )
    stored = got.path.parent
    if not got.cache_hit or not any(
        (stored / n).exists() for n in PROGRAM_FILES
    ):  # --out is whole: now the entry, plan and program (a hit copies both)
        entry = {PLAN_FILE: got.plan.to_json()}
        for name in PROGRAM_FILES:
            if (done.out_dir / name).exists():
                entry[name] = (done.out_dir / name).read_text()
        store_cache_entry(stored, entry)
    done.timings.update(got.timings, peak_rss_bytes=_peak_rss_bytes())
    return done


PROGRAM_FILES = ("program_torch.py", "program_jax.py")


def _cached_outputs(entry: Path, model: str, out: Path, key: str, t0: float) -> Compiled | None:
    """A cache hit served from the entry's plan and program files (no trace, no emit, no torch)."""
    if not entry.is_dir():
        return None
    names = sorted(n for n in (PLAN_FILE, *PROGRAM_FILES) if (entry / n).exists())
    got = verified_entry(entry, names)  # every file against its stored content hash
    if got is None or not any(n in got for n in PROGRAM_FILES):
        return None
    try:
        plan = Plan.from_json(got[PLAN_FILE], str(entry / PLAN_FILE))
    except (KeyError, PlanError):
        return None  # missing or corrupt: recompile, never trust it
    name = "program_jax.py" if plan.model.get("framework") == "jax" else "program_torch.py"
    if name not in got:
        return None
    program = (name, got[name])
    if program_model(program[1]) != model:  # emitted for another path to the same content (or a moved file)
        return None  # the slow path emits the program again for this spec (the plan itself is still a hit)
    return _write_outputs(plan, model, out, cache_hit=True, key=key, program=program, t0=t0)


def resolve_spec(spec: str) -> str:
    """A model spec naming a file or directory (``config.json``, a model directory, with an optional
    ``#task``), made absolute: every command reads the spec from the program, which runs in the plan
    directory. Zoo names and ``module:factory`` specs are returned unchanged."""
    base, sep, task = spec.partition("#")
    if base and ":" not in base and Path(base).exists():
        return str(Path(base).resolve()) + sep + task
    return spec


def program_model(source: str) -> str | None:
    """The model spec a generated program was emitted for (its ``PROGRAM["model"]``), read without
    running it; None when the source has none."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PROGRAM" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                for k, v in zip(node.value.keys, node.value.values):
                    if isinstance(k, ast.Constant) and k.value == "model" and isinstance(v, ast.Constant):
                        return str(v.value)
    return None


def _check_fp8(training: Any, cl: Any, tp: int | Sequence[int] | None = None) -> None:
    """``--precision fp8`` with a hand layout: its device type (every stage on the cluster's first,
    ``search/entry/evaluate.py``) has FP8 tensor cores; with ``tp`` (compile), the program builds it. The
    cluster's other types run no stage of the layout (a search keeps them in bf16, ``Stage.fp8``)."""
    if getattr(training, "fp8", None) is None:
        return
    from partita.search.pricing import fp8

    fp8.check(cl.device_types()[:1])
    if tp is not None:
        fp8.check_layout(max(tp) if isinstance(tp, Sequence) else tp)


def _check_training(training: Any) -> None:
    if training.global_batch < 1 or training.seq_len < 1:
        raise ConfigError(
            f"global batch {training.global_batch} and sequence length {training.seq_len} must be positive.",
            "pass --global-batch N and --seq S with N, S >= 1.",
        )


def _write_outputs(
    plan: Plan,
    model_spec: str,
    out: Path,
    *,
    cache_hit: bool,
    elapsed_s: float = 0.0,
    key: str = "",
    search_time_s: float = 0.0,
    program: tuple[str, str] | None = None,
    t0: float | None = None,
) -> Compiled:
    """Write plan, report, generated program and cache key into ``out``. ``program`` is a
    ``(file name, source)`` already generated (a cache hit); otherwise the emitter runs."""
    from partita.report import plan_text

    files = {"plan": str(out / PLAN_FILE), "report": str(out / "report.txt")}
    contents = {PLAN_FILE: plan.to_json(), "report.txt": plan_text(plan, width=110) + "\n"}  # fixed width: a file
    framework = plan.model.get("framework", "torch")
    if program is None and framework == "torch":
        from partita.backends.torch.emit import emit_torch

        program = ("program_torch.py", emit_torch(plan, model_spec))
    elif program is None and framework == "jax":
        try:
            from partita.backends.jax.emit import emit_jax
        except ImportError:
            emit_jax = None
        if emit_jax is not None:
            program = ("program_jax.py", emit_jax(plan, model_spec))
    if program is not None:
        contents[program[0]] = program[1]
        files["program"] = str(out / program[0])
    if framework == "torch" and program is not None:  # beside a multi-node program: its launch files
        from partita.backends.torch import launch as torch_launch

        for name, text in torch_launch.launch_files(plan).items():
            contents[name] = text
            files[name] = str(out / name)
        for old in [*out.glob("launch_*.sh"), out / torch_launch.SBATCH_FILE]:
            if old.name not in contents:
                old.unlink(missing_ok=True)  # a previous plan's, in this directory
    contents[CACHE_FILE] = json.dumps({"key": key, "model": model_spec}, indent=1) + "\n"
    _write_all(out, contents)  # every file whole, or none (emitted before the first is written)
    return Compiled(out, plan, cache_hit, files, elapsed_s if t0 is None else time.perf_counter() - t0)


def load_plan(plan_dir: str | Path) -> Plan:
    from partita.plan import read_plan

    path = Path(plan_dir) / PLAN_FILE if Path(plan_dir).is_dir() else Path(plan_dir)
    if not path.exists():
        raise PlanError(f"no plan at {path}.", "run `partita compile MODEL --out DIR` first, then pass DIR.")
    return read_plan(path)


# ---- evaluate / run / report -------------------------------------------------------------
def evaluate_model(
    model: str,
    cluster: str,
    training: Any,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    zero_stage: int = 0,
    recompute: str = "none",
    schedule: str = "1f1b",
    gpus_per_node: int | None = None,
    num_virtual: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    progress: bool = False,
) -> Any:
    """``partita evaluate``: one hand layout priced by the search's own model (no search, no program);
    ``progress``: one line per phase on stderr (``partita/progress.py``)."""
    _check_training(training)
    cl = parse_cluster(cluster, gpus_per_node)  # validate the cheap inputs before tracing
    _check_fp8(training, cl)  # priced with any tp: evaluate predicts, it builds no program
    from partita.search.entry.evaluate import evaluate_config, tp_style_of
    from partita.search.program import sequence_parallel as sp

    if sequence_parallel:  # what the runtime does not build with it, refused before tracing (as compile_layout)
        sp.check(
            tp=tp, dp=dp, zero_stage=zero_stage, recompute=recompute, schedule=schedule, num_virtual=num_virtual, cp=cp
        )
    from partita.search.pricing.context_parallel import check_degree

    check_degree(training.seq_len, cp)  # the rest of context_parallel.check needs the graph

    from partita.progress import say

    graph = stored_graph(model, training.seq_len)  # as compile reads it: a zoo model imports no torch
    if graph is None:
        if progress:
            say(f"tracing {model} on the meta device (no weights)")
        traced = trace_model(model, batch=TRACE_BATCH, seq=training.seq_len)
        graph = traced.graph
        if progress:
            say(f"traced {len(graph.layers)} layers in {traced.trace_time_s:.1f} s; pricing the layout")
    return evaluate_config(
        graph,
        cl,
        training,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=micro_batch,
        zero_stage=zero_stage,
        recompute=recompute,
        schedule=schedule,
        num_virtual=num_virtual,
        sequence_parallel=sequence_parallel,
        tp_style=tp_style_of(graph),  # the program's tp, as compile_layout prices it (issue 32)
        cp=cp,
    )


def compile_layout(
    model: str,
    cluster: str,
    training: Any,
    out_dir: str | Path,
    *,
    layout: dict[str, Any],
    gpus_per_node: int | None = None,
) -> Compiled:
    """``partita compile MODEL --tp T --pp P --dp D --micro-batch b ...``: the Plan and program of one
    hand-made layout (``search/entry/hand_plan.py``), priced as ``evaluate`` prices it; no search, no cache.
    A layout that cannot be built raises ``ConfigError`` before anything is written."""
    t0 = time.perf_counter()
    model = resolve_spec(model)  # a model path: absolute in the program (it runs in the plan directory)
    _check_training(training)
    cl = parse_cluster(cluster, gpus_per_node)  # validate the cheap inputs before tracing
    _check_fp8(training, cl, layout.get("tp", 1))
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.precision import choose_precision
    from partita.search.program import sequence_parallel

    if layout.get("sequence_parallel"):  # what the runtime does not build with it, refused before tracing
        keys = ("tp", "dp", "zero_stage", "recompute", "schedule", "num_virtual")
        sequence_parallel.check(**{k: layout[k] for k in keys}, cp=layout.get("cp", 1))

    if layout.get("cp", 1) > 1:  # what the program does not build with cp, refused before tracing
        from partita.backends.torch.emit import check_cp_layout

        tps = layout["tp"] if isinstance(layout["tp"], (tuple, list)) else (layout["tp"],)
        check_cp_layout(
            model, cp=layout["cp"], tp=max(tps), pp=layout["pp"], zero=layout["zero_stage"], schedule=layout["schedule"]
        )
    training = choose_precision(cl, training)  # the search's and evaluate's rule
    traced = trace_model(model, batch=TRACE_BATCH, seq=training.seq_len)
    plan = Plan.from_json(hand_plan(traced.graph, cl, training, **layout).to_json())  # as plan.json holds it
    if plan.model.get("framework") == "jax":  # emitted before anything is written: an emitter's refusal
        from partita.backends.jax.emit import emit_jax  # (a schedule it cannot run) leaves no file behind

        program = ("program_jax.py", emit_jax(plan, model))
    else:
        from partita.backends.torch.emit import emit_torch

        program = ("program_torch.py", emit_torch(plan, model))
    return _write_outputs(plan, model, Path(out_dir), cache_hit=False, program=program, t0=t0)


def run_plan(
    plan_dir: str,
    *,
    steps: int,
    reference: bool = False,
    dry_run: bool = False,
    nnodes: int = 1,
    checkpoint_every: int = 0,
    resume: bool = False,
    max_restarts: int | None = None,
    extra_args: Sequence[str] = (),
    hostfile: str | None = None,
) -> Mapping[str, Any]:
    from partita.report import run_log

    plan = load_plan(plan_dir)
    _check_program(plan_dir, plan)
    if resume:
        _check_resume(plan_dir, extra_args)
    data_fn = _flag_value(extra_args, "--data-fn")
    if data_fn:
        check_data_fn(data_fn)
    if plan.model.get("framework") != "jax":
        from partita.run_checks import check_program_args

        check_program_args(extra_args)
    if hostfile:
        from partita.user_files import check_regular

        check_regular(hostfile, "hostfile", "pass --hostfile with a file of `HOST device=TYPE` lines.", ConfigError)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # run log: a loaded machine?
    if plan.model.get("framework") == "jax":
        from partita.backends.jax.run import run as jax_run

        result = jax_run(plan_dir, steps=steps, reference=reference)
        run_log.write(plan_dir, run_log.build(plan, result, steps=steps, framework="jax", load_before=load_before))
        return result
    from partita.backends.torch.launch import run

    extra = list(extra_args)
    if checkpoint_every:
        extra += ["--checkpoint-every", str(checkpoint_every)]
    if resume:
        extra += ["--resume"]
    with contextlib.redirect_stdout(io.StringIO()):  # the launcher prints; the CLI decides what to show
        result = run(
            plan_dir,
            steps=steps,
            reference=reference,
            dry_run=dry_run,
            nnodes=nnodes,
            max_restarts=max_restarts,
            extra_args=tuple(extra),
            hostfile=hostfile,
        )
    if not dry_run and not hostfile:  # DIR/run_log.json: measured beside predicted, for `partita report DIR`
        log = run_log.build(plan, result, steps=steps, framework="torch", load_before=load_before)
        run_log.write(plan_dir, log)
    return result


def rehearse(plan_dir: str, progress: Any = None) -> dict[str, Any]:
    """``partita rehearse DIR``: run the emitted program at full scale on fake tensors and a fake
    process group (torch, ``backends/torch/rehearse.py``) or compile its step for the full device
    count on abstract inputs (JAX, ``backends/jax/rehearse.py``), and compare it with the plan.
    Writes nothing."""
    plan = load_plan(plan_dir)  # no plan / another version / malformed: PlanError before torch loads
    _check_program(plan_dir, plan)
    if plan.model.get("framework", "torch") == "jax":
        return _rehearse_jax(plan, plan_dir, progress)
    from partita.backends.torch.rehearse import rehearse_dir

    return rehearse_dir(plan_dir, progress=progress)


def _rehearse_jax(plan: Plan, plan_dir: str, progress: Any) -> dict[str, Any]:
    """A JAX plan's step compiled by XLA at the plan's world size on abstract inputs
    (``backends/jax/rehearse.py``, in a subprocess owning that many CPU devices), each stage's
    collectives, memory and FLOPs set beside the plan's with the torch rehearsal's rule."""
    from partita.backends.jax.run import rehearse as rehearse_jax
    from partita.backends.torch.rehearse import RankResult, compare_stage

    if progress is not None:
        progress(f"compiling the JAX step for {plan.world_size} devices on abstract inputs")
    got = rehearse_jax(plan_dir)
    stages = []
    for s in plan.stages:
        r = got[f"stage{s.index}"]
        res = RankResult(
            s.ranks[0], s.index, r["collectives"], int(r["peak_memory_bytes"]), r["memory_by_category"], int(r["flops"])
        )
        stages.append(compare_stage(s, [res]))
    return {"match": all(s["match"] for s in stages), "stages": stages}


def report(dirs: Sequence[str], html: str | None = None, verbose: bool = False) -> str:
    """Text report of one plan (with its run log's "Predicted vs measured" when DIR has one), or
    the comparison of two; ``html`` also writes the page there (of both plans when two)."""
    from partita import report as rep
    from partita.report import run_log

    plans = [load_plan(d) for d in dirs]
    for d in dirs:
        _check_run_log(d)
    logs = [run_log.load(d) for d in dirs]
    if html:  # two plans: the comparison page of both
        page = (
            rep.compare_html(plans, logs, dirs=list(dirs))
            if len(plans) == 2
            else rep.plan_html(plans[0], logs[0], out_dir=dirs[0])
        )
        _atomic_write(Path(html), page)
    if len(plans) == 2:
        return rep.compare_text(plans[0], plans[1])
    return "\n\n".join(rep.plan_text(p, log, verbose=verbose) for p, log in zip(plans, logs))
