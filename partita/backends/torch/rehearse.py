"""Rehearsal: run the emitted torch program at the plan's full world size and model size on this CPU.

``partita rehearse DIR`` (``driver.rehearse``) calls :func:`rehearse_dir`. Nothing is allocated and
nothing is communicated: every rank role is played in its own process (one
``python -m partita.backends.torch.rehearse DIR RANK...`` imports once and forks a child per role,
as many at once as there are CPUs or ``PARTITA_REHEARSE_JOBS``: :func:`run_roles`) on a fake
process group (``dist.init_process_group("fake")``, world size = the plan's) with fake tensors. A *role* is a rank whose step can differ from its stage's first rank: tp rank 0 of the first replica
of each distinct batch share (cp rank 0 of it in a context-parallel stage: its other cp ranks run the same
shapes and collectives on their slice of the sequence). The other tp ranks of a replica run the same SPMD step on shards no
larger (torch's chunking gives rank 0 the largest) and, in a pipeline of stages of different shapes
(``P2PPipeline``), receive as tp rank 0 does but send nothing: a subset of its collectives, no more
memory, the same FLOPs. The mixtral-8x7b plan's tp rank 1 rehearsed exactly tp rank 0's peak, categories
and collectives but the sends (stages 0 and 16), and rehearsing it doubled the roles (34, 460 s of CPU).

Each role runs the program's own code: ``DIR/program_torch.py``'s ``PROGRAM``, ``SETUP_STAGE`` and
``make_runner``, with the calls ``backends/torch/train._train`` makes, in its order (meshes of every
stage, the pp group, tied-parameter group, ``StageRuntime``, ``setup_stage``, ``make_runner``,
``make_optimizer``, ``forward_backward``, ``opt.step``). What differs, and only so that it can run here:

* the model is built on the meta device and the stage is set up there (``split_stage``, tensor
  parallelism, FSDP2), then ``to_empty(device="cpu")`` under ``FakeTensorMode`` (values never matter);
* data are fake tensors of the real shapes (``make_batch`` under the fake mode);
* ``torch.distributed.pipelining`` gets static stage metadata and skips its warm-up vote
  (``torch_shim.pipeline_static_meta``): both exchange Python objects / read received values.

The optimizer takes one step on zero gradients first (its state exists, as in any step after the
first; no forward, no communication); then one training step is measured: every collective and p2p transfer (kind, mesh axis, bytes
of the full tensor: all-gather output, reduce-scatter input), peak memory by category
(``MemTracker``, keeping only the step's peak: ``torch_shim.mem_tracker(peak_only=True)``) and FLOPs (``torch.utils.flop_counter`` formulas, with CPU flash attention added).

The comparison is with the Plan's own records and nothing else: ``Stage.collectives`` (per step,
``kind@axis``: counts equal, total bytes within 2%), ``Stage.predicted["memory_bytes"]`` (peak within
10%) and ``Stage.predicted["flops"]`` (per device and step, within 5%). A record the plan lacks is a
mismatch that says so; this module never predicts anything itself.

The roles of a pipeline are then played together (``pair_p2p``, ``p2p_world``): every send and
receive a role's schedule issued, with its action (``F1.2 recv``), replayed with the schedule's
blocking rules and the plan's backend's matching (NCCL in order, gloo by tag), so a deadlock, a
message received by the wrong action or a send without its receive is a mismatch of the stages
involved, by rank, stage and action.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partita.backends.torch import fidelity, materialize, optim, p2p_world, rehearse_record
from partita.backends.torch import parallel as tpar
from partita.backends.torch import train as torch_train
from partita.backends.torch.chunks import physical_plan
from partita.backends.torch.host_memory import (  # noqa: F401  (re-exported: tests read them from here)
    HostMeter,
    host_fill,
    host_peak,
    reset_host_peak,
    status_bytes,
)
from partita.backends.torch.schedule import replica_ranges
from partita.errors import PlanError
from partita.frontends import torch_shim
from partita.plan import Plan, Stage
from partita.search.program import records

BYTES_TOL, MEMORY_TOL, FLOPS_TOL = 0.02, 0.10, 0.05
MEMORY_CATEGORIES = {
    "parameters": ("Parameter", "Buffer"),
    "gradients": ("Gradient",),
    "optimizer": ("Optstate",),
    "activations": ("Activation", "Temp", "Other"),
}


@dataclasses.dataclass
class RankResult:
    """What one rank did in its measured step."""

    rank: int
    stage: int
    collectives: dict[str, dict[str, float]]  # "kind@axis" -> {count, bytes (total over the step)}
    peak_memory_bytes: int
    memory_by_category: dict[str, int]
    flops: int
    seconds: float = 0.0
    p2p: list[list[Any]] = dataclasses.field(default_factory=list)  # [op, peer rank, bytes, tag, label] in order
    host_peak_bytes: int = 0  # the role's host peak: its set-up's streamed fill (HostMeter) and its step (VmHWM)
    # "kind@axis" -> issued inside a backward; None where the rehearsal cannot see phases (the JAX one: XLA
    # schedules the step as one program), which skips the phase check
    in_backward: dict[str, int] | None = None


# ---- recording (rehearse_record: one dispatch mode records collectives, p2p, FLOPs and memory) ----------
StepRecorder = rehearse_record.StepRecorder


def pair_p2p(results: Mapping[int, RankResult], *, in_order: bool = True) -> dict[int, list[str]]:
    """The rehearsed roles played together as one point-to-point world (``p2p_world.match_world``):
    per rank, a deadlock, a wrong order, a send without its receive or a receive without its send,
    each named by rank, stage and schedule action. ``in_order``: matched as NCCL matches (a GPU plan),
    else by tag as gloo does (a CPU plan). A peer that was not rehearsed (a folded tp rank) is not checked."""
    world = {r: p2p_world.ops_of(v.p2p) for r, v in results.items()}
    return p2p_world.match_world(world, {r: v.stage for r, v in results.items()}, in_order=in_order)


# ---- one rank ----------------------------------------------------------------------------------------
def rehearse_rank(program: Any, rank: int) -> RankResult:
    """Play ``rank`` of the program for one warm-up and one measured step (module docstring)."""
    with _unpacked_sequences(), _layer_norm_as_on_cuda():  # (each context's docstring)
        return _rehearse_rank(program, rank)


def _rehearse_rank(program: Any, rank: int) -> RankResult:
    import time

    from partita.models.zoo import resolve_model

    t0 = time.perf_counter()
    reset_host_peak()
    prog = program.PROGRAM
    stages, training = prog["stages"], prog["training"]
    torch_shim.reset_dtensor_caches()  # they hold the group names of a previous rehearsal
    torch_shim.fake_process_group(rank, int(prog["world_size"]))
    try:
        cpu = torch.device("cpu")
        # as train._train: every rank builds every stage's mesh, in order, then the pp group
        meshes = tpar.build_meshes("cpu", stages)
        replicas = tpar.replica_mesh("cpu", stages, rank)  # cp stages: the dp x cp groups
        me = next(s for s in stages if rank in s["ranks"])
        pp_group = None
        if prog["runner"] == "torch_pipeline":
            for c in range(len(me["ranks"])):
                g = dist.new_group([s["ranks"][c] for s in stages])
                if rank in [s["ranks"][c] for s in stages]:
                    pp_group = g
        handle = resolve_model(prog["model"])
        x0, _ = torch_train.make_batch(handle, {**training, "global_batch": 1}, 0, 0)
        x0 = torch_train.local_sample(x0, me)  # cp: S / cp tokens per rank
        # train._train's setup path (materialize.build_stage, materialize.setup_stage): meta build, boundary
        # shapes on meta, other stages' layers dropped, the program's setup_stage on meta, to_empty, the
        # tied parameters tied again; to_empty runs under the fake mode here and nothing is filled
        built = materialize.build_stage(handle, 0, torch_train.stage_cuts(prog), me["layers"], x0, fallback=False)
        model, tied, boundary = built.model, built.tied, built.boundary
        tied_group, tied_n = torch_train._tied_group(model, tied, stages, rank)
        fake = torch_shim.fake_tensor_mode()
        # one real row (tiny): a masked-LM target count is counted from its labels (num_targets)
        _, y1 = torch_train.make_batch(handle, {**training, "global_batch": 1}, 0, 0)
        loss_fn = torch_train.make_loss(
            int(training["global_batch"]) * torch_train.num_targets(y1, torch_train.shift_labels(handle)),
            torch_train.shift_labels(handle) and me.get("cp", 1) == 1,  # cp: labels shifted before the split
        )
        mesh = meshes[me["index"]]
        rt = torch_train.StageRuntime(prog, me, rank, cpu, mesh, loss_fn, boundary, (x0.shape[1:], x0.dtype))
        rt.pp_group, rt.replicas = pp_group, replicas

        @contextlib.contextmanager
        def allocate() -> Iterator[None]:  # to_empty allocates fake tensors (FACTS.md's recipe)
            with fake:
                fake.allow_non_fake_inputs = True
                try:
                    yield
                finally:
                    fake.allow_non_fake_inputs = False

        setup = program.SETUP_STAGE[me["index"]]
        # the run's fill, streamed through the host parameter by parameter, measured (host_fill)
        fill, meter = host_fill(fake)
        rt.module = materialize.setup_stage(built, setup, rt, cpu, fill=False, allocate=allocate, host_fill=fill)
        with fake:
            runner: Any = program.make_runner(rt)
            if isinstance(runner, _torch_pipeline()):
                x, out = rt.examples()
                low = tpar.LOW_PRECISION.get(str(training.get("dtype", "f32")))
                if low is not None:  # boundaries travel in the plan's dtype (apply_autocast / FSDP2's param_dtype),
                    # as the shapes a real run infers at its first step say
                    x = x.detach().to(low).requires_grad_(x.requires_grad) if x.is_floating_point() else x
                    out = out.to(low) if out.is_floating_point() else out
                if out.is_floating_point():
                    out.requires_grad_(True)
                torch_shim.pipeline_static_meta(runner.schedule, (x,), (out,))
            opt = torch_train.make_optimizer(rt.module.parameters(), training)
            labels = p2p_world.labeler(runner, prog)  # each p2p operation's schedule action, for pair_p2p
            result = _measure(rt, me, runner, opt, handle, model, prog, (tied, tied_group, tied_n), labels)
        axes = fidelity.axis_names(mesh, pp_group, tied_group, replicas)
        rec, peak, cats = result
        return RankResult(
            rank=rank,
            stage=int(me["index"]),
            collectives=rec.summary(axes),
            peak_memory_bytes=peak,
            memory_by_category=cats,
            flops=rec.flops,
            seconds=time.perf_counter() - t0,
            p2p=rec.p2p,
            host_peak_bytes=max(host_peak(), meter.peak),
            in_backward=rec.issued_in_backward(axes),
        )
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _layer_norm_as_on_cuda() -> Iterator[None]:
    """``layer_norm`` under CPU autocast as CUDA autocast runs it: in f32 (CUDA's autocast lists it among
    the ops it runs in f32; CPU's lists it nowhere, so it ran in its input's dtype). The program is
    written for GPUs: a bf16 stage input (boundaries travel in the plan's dtype) made a GPT-2 layer
    norm return bf16 here where a GPU returns f32, and its output gradient, which a zero-bubble W
    holds from B on, half the size (GPT-2 ZB-H1: 176 KiB a block and micro-batch held, 208 on a GPU)."""
    fn = torch.nn.functional
    original = fn.layer_norm

    def layer_norm(x: torch.Tensor, shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
        if x.device.type != "cpu" or not torch.is_autocast_enabled("cpu") or x.dtype == torch.float32:
            return original(x, shape, weight, bias, eps)
        with torch.autocast("cpu", enabled=False):
            f32 = [t if t is None else t.float() for t in (weight, bias)]
            return original(x.float(), shape, f32[0], f32[1], eps)

    fn.layer_norm = layer_norm  # type: ignore[assignment]
    try:
        yield
    finally:
        fn.layer_norm = original  # type: ignore[assignment]


_unpacked_sequences = materialize.unpacked_sequences  # moved: the setup path uses it too


def _torch_pipeline() -> Any:
    from partita.backends.torch.schedule import TorchPipeline

    return TorchPipeline


def _measure(
    rt: Any,
    me: Mapping[str, Any],
    runner: Any,
    opt: Any,
    handle: Any,
    model: Any,
    prog: Any,
    tied: tuple,
    labels: p2p_world.Label | None = None,
) -> tuple[StepRecorder, int, dict[str, int]]:
    """A warm-up step, then the measured one under the recorder and the memory tracker."""
    training = prog["training"]
    m, mb = int(prog["num_micro_batches"]), sum(me["shares"])
    lo, hi = replica_ranges(me["shares"])[rt.coords[0]]

    first, last = torch_train.holds_ends(prog, me)  # ZB-V: the last chunk is on the first rank group
    clip = optim.grad_clip(training)
    holders = torch_train._tied_holders(model, tied[0], prog["stages"], me) if clip else {}
    host = torch_train.HostCollectives("fake")
    f16 = optim.loss_scaling(training)

    def step(k: int) -> None:  # train._train's loop body: first stage gets inputs, last stage targets
        x, y = torch_train.make_batch(handle, training, 0, k)
        xs = [x[j * mb + lo : j * mb + hi] for j in range(m)] if first else []
        ys = [y[j * mb + lo : j * mb + hi] for j in range(m)] if last else []
        torch_train.forward_backward(runner, rt, me, xs, ys, tied)
        if f16:  # the loss-scale overflow check: one float64 all-reduce of the rank's flag (optim.LossScaler;
            # the flag itself reads gradient values, which fake tensors do not have)
            host.all_reduce_sum(torch.zeros((), dtype=torch.float64))
        if clip:  # the global-norm all-reduce; the scale itself is local (a fake norm has no value)
            host.all_reduce_sum(optim.local_sq_sum(rt.module, len(me["ranks"]), holders))
            optim.clip_(rt.module, clip, 1.0)
        opt.step()
        opt.zero_grad()

    # steady state without a whole warm-up step: the optimizer's state exists (one step on zero
    # gradients, no forward, no communication), as from the second step of a run on
    with torch.no_grad():
        for p in rt.module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    rec = StepRecorder()
    rec.labels = labels
    # one mode: the step's peak by category (no per-module peaks), and what rec records (rehearse_record)
    mt = rehearse_record.recording_tracker(torch_shim.mem_tracker(peak_only=True), rec)
    mt.track_external(rt.module, opt)
    root = rt.module

    def forget_root(module: torch.nn.Module, args: Any) -> None:
        if module is root:  # the stage root runs once per micro-batch: not "a next iteration"
            mt.memory_tracking.pop(module, None)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(forget_root)
    try:
        with torch_shim.private_propagation_fake_mode(), mt:
            step(1)
    finally:
        hook.remove()
    snap: dict[str, int] = next(iter(mt.get_tracker_snapshot("peak").values()), {})
    cats = {k: int(sum(snap.get(c, 0) for c in cs)) for k, cs in MEMORY_CATEGORIES.items()}
    return rec, int(snap.get("Total", 0)), cats


# ---- roles, comparison, the directory ---------------------------------------------------------------
def roles(program: Mapping[str, Any]) -> dict[int, list[int]]:
    """Stage index -> ranks to rehearse (module docstring); the first is the stage's ``ranks[0]``."""
    out = {}
    for s in program["stages"]:
        picks: list[int] = []
        seen: set[int] = set()
        for i, share in enumerate(s["shares"]):
            if share in seen:
                continue
            seen.add(share)
            picks.append(s["ranks"][i * s.get("cp", 1) * s["tp"]])  # cp ranks of a replica: same shapes
        out[int(s["index"])] = picks
    return out


def planned_collectives(stage: Stage) -> dict[str, dict[str, float]]:
    """The plan's ``Stage.collectives`` per step as ``kind@axis`` -> {count, bytes (total)}."""
    return records.summary(stage.collectives)


def _within(got: float, want: float, tol: float) -> bool:
    return abs(got - want) <= tol * abs(want) if want else got == 0


def compare_stage(stage: Stage, results: Sequence[RankResult]) -> dict[str, Any]:
    """The issue's per-stage record: measured beside planned, and every mismatch in words."""
    first = results[0]
    planned = planned_collectives(stage)
    got = first.collectives
    problems = []
    for key in sorted(set(got) | set(planned)):
        g, p = got.get(key), planned.get(key)
        if p is None and g is not None:
            problems.append(f"{key}: the program issues {g['count']} ({_fmt(g['bytes'])}), the plan records none")
        elif g is None and p is not None:
            problems.append(f"{key}: the plan records {p['count']} ({_fmt(p['bytes'])}), the program issues none")
        elif g is None or p is None:
            continue
        elif g["count"] != p["count"]:
            problems.append(f"{key}: count {g['count']} rehearsed, {p['count']} planned")
        elif not _within(g["bytes"], p["bytes"], BYTES_TOL):
            problems.append(
                f"{key}: {_fmt(g['bytes'])} rehearsed, {_fmt(p['bytes'])} planned ({_pct(g['bytes'], p['bytes'])})"
            )
    if first.in_backward is not None:
        problems += rehearse_record.phase_mismatches(stage.collectives, first.in_backward)
    peak = max(r.peak_memory_bytes for r in results)
    mem_rank = max(results, key=lambda r: r.peak_memory_bytes)
    planned_mem = stage.predicted.get("memory_bytes")
    if planned_mem is None:
        problems.append("memory: the plan records no memory_bytes for this stage")
    elif not _within(peak, float(planned_mem), MEMORY_TOL):
        problems.append(f"memory: peak {_fmt(peak)} rehearsed, {_fmt(planned_mem)} planned ({_pct(peak, planned_mem)})")
    flops = max(r.flops for r in results)
    planned_flops = stage.predicted.get("flops")
    if planned_flops is None:
        problems.append("flops: the plan records no flops for this stage")
    elif not _within(flops, float(planned_flops), FLOPS_TOL):
        problems.append(
            f"flops: {flops:.4g} rehearsed, {float(planned_flops):.4g} planned ({_pct(flops, planned_flops)})"
        )
    host = max(r.host_peak_bytes for r in results)
    planned_host = (stage.predicted.get("host_memory") or {}).get("bytes")
    if planned_host is not None and host > float(planned_host):
        problems.append(
            f"host memory: peak {_fmt(host)} rehearsed (VmHWM), above the plan's bound {_fmt(planned_host)} "
            f"({_pct(host, planned_host)})"
        )
    planned_cats = stage.predicted.get("memory_by_category")
    return {
        "index": stage.index,
        "ranks_rehearsed": [r.rank for r in results],
        "collectives": got,
        "planned_collectives": planned,
        "issued_in_backward": first.in_backward,  # kind@axis -> count issued while a backward ran (phases)
        "peak_memory_bytes": peak,
        "planned_memory_bytes": planned_mem,
        "memory_by_category": mem_rank.memory_by_category,
        "planned_memory_by_category": planned_cats,
        "host_peak_bytes": host,
        "planned_host_memory": stage.predicted.get("host_memory"),
        "planned_memory_beyond_tensors": stage.predicted.get("memory_beyond_tensors"),
        "flops": flops,
        "planned_flops": planned_flops,
        "seconds": round(sum(r.seconds for r in results), 1),
        "mismatches": problems,
        "match": not problems,
    }


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"


def _pct(got: float, want: float) -> str:
    return f"{(float(got) / float(want) - 1) * 100:+.1f}%" if want else "planned 0"


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-8 * max(abs(a), abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _parts(src: str) -> tuple[str, str, str] | None:
    """(text before the ``PROGRAM`` literal, the literal, text after it)."""
    start, end = "PROGRAM = ", '\nPROGRAM["__file__"]'
    i, j = src.find(start), src.find(end)
    return (src[:i], src[i + len(start) : j], src[j:]) if 0 <= i < j else None


def same_program(text: str, emitted: str) -> bool:
    """``text`` is ``emitted`` up to the float digits of its ``PROGRAM`` literal.

    ``partita compile`` emits from the search's in-memory plan, whose floats carry more digits than
    plan.json keeps (9 significant), so the literal may differ in the last digits; every other
    character must be the same.
    """
    import ast

    a, b = _parts(text), _parts(emitted)
    if a is None or b is None or a[0] != b[0] or a[2] != b[2]:
        return False
    try:
        return _close(ast.literal_eval(a[1]), ast.literal_eval(b[1]))
    except (ValueError, SyntaxError):
        return False


def check_program(plan: Plan, plan_dir: Path) -> dict[str, Any]:
    """The ``PROGRAM`` of the program beside the plan, refused (PlanError) unless the file is
    exactly what this Partita emits for the plan. Read as text, never executed here."""
    import ast

    from partita.backends.torch.emit import emit_torch
    from partita.backends.torch.launch import PROGRAM_FILE

    path = plan_dir / PROGRAM_FILE
    if not path.exists():
        raise PlanError(f"no PyTorch program at {path}.", "recompile with `partita compile ... --out DIR`.")
    try:
        text = path.read_text()
        parts = _parts(text)
        prog = ast.literal_eval(parts[1]) if parts else None
    except (OSError, UnicodeDecodeError, ValueError, SyntaxError):
        prog = None
    spec = prog.get("model") if isinstance(prog, dict) else None
    if not isinstance(spec, str) or not same_program(text, emit_torch(plan, spec)):
        raise PlanError(
            f"{path} is not the program this Partita emits for the plan.json beside it (edited by hand, or "
            "emitted by another version).",
            "recompile with `partita compile ... --out DIR`; to rehearse another layout, compile it as its own plan.",
        )
    return dict(prog)  # type: ignore[arg-type]


def rehearse_dir(plan_dir: str | Path, *, progress: Any = None) -> dict[str, Any]:
    """Rehearse every stage of the plan in ``plan_dir`` (issue 15's JSON). Writes nothing."""
    from partita.plan import read_plan

    plan_dir = Path(plan_dir)
    path = plan_dir / "plan.json" if plan_dir.is_dir() else plan_dir
    if not path.exists():
        raise PlanError(f"no plan at {path}.", "run `partita compile MODEL --out DIR` first, then pass DIR.")
    plan = read_plan(path)
    if plan.model.get("framework", "torch") != "torch":
        raise PlanError(f"{path} is a {plan.model.get('framework')} plan; this rehearsal runs torch programs.", "")
    program = check_program(plan, path.parent)
    return _rehearse(plan, path.parent, program, progress)


def _rehearse(plan: Plan, plan_dir: Path, program: Mapping[str, Any], progress: Any) -> dict[str, Any]:
    plan_roles = roles(program)
    if progress is not None:
        progress(f"rehearsing ranks {sorted(r for rs in plan_roles.values() for r in rs)} of {plan.world_size}")
    got = run_roles(plan_dir, [r for rs in plan_roles.values() for r in rs], progress)
    # the program's stages are pipeline positions: a chunked plan's chunks of one rank group merged, their
    # records together (chunks.physical_plan), which is what one rank of the group issues
    view = physical_plan(plan)
    # the roles played together: every send between two of them must meet its receive (pair_p2p)
    nccl = any(s.get("kind") == "gpu" for s in program["stages"])  # the backend the program's p2p runs on
    unpaired = pair_p2p({r: v for r, v in got.items() if isinstance(v, RankResult)}, in_order=nccl)
    stages = []
    for index, ranks in plan_roles.items():
        failure = next((got[r] for r in ranks if isinstance(got[r], str)), None)
        if failure is not None:
            stages.append(failed_stage(view.stages[index], ranks, str(failure)))
        else:
            rec = compare_stage(view.stages[index], [got[r] for r in ranks])  # type: ignore[misc]
            rec["mismatches"] += [m for r in ranks for m in unpaired.get(r, [])]
            rec["match"] = not rec["mismatches"]
            stages.append(rec)
    return {"match": all(s["match"] for s in stages), "stages": stages}


_MARK = "PARTITA_REHEARSAL "


def run_roles(plan_dir: Path, ranks: Sequence[int], progress: Any = None) -> dict[int, RankResult | str]:
    """Every role in its own process: one fresh process
    (``python -m partita.backends.torch.rehearse DIR RANK...``) imports torch, the program and the
    model's library once, then forks a child per role (where ``fork`` exists), :func:`num_jobs` at a
    time (the mixtral-8x7b plan's 34 roles took 583 s one after the other). A fresh process per
    role is needed: DTensor keeps per-process caches keyed by meshes that compare equal across ranks
    and plans, which handed one rank's process-group names to the next (gpt3-13b: "could not resolve
    the process group 1" on the second role); forking after the imports, before any process group or
    tensor exists, gives each role that clean state without importing again (~10 s of CPU a role).
    A string is the failure on that rank, in words. ``progress``: called with a line as each role
    ends (``rank R rehearsed (K of N)``), as the child prints it: a 34-role rehearsal said nothing for
    minutes (issue 35 item 10)."""
    import os

    done = [0]

    def ended(rank: int, result: RankResult | str) -> None:
        done[0] += 1
        if progress is not None:
            how = "rehearsed" if isinstance(result, RankResult) else "failed"
            progress(f"rank {rank} {how} ({done[0]} of {len(ranks)})")

    if hasattr(os, "fork"):
        return _run_process(plan_dir, ranks, ended)
    out: dict[int, RankResult | str] = {}
    for r in ranks:
        out.update(_run_process(plan_dir, [r], ended))
    return out


def _run_process(plan_dir: Path, ranks: Sequence[int], ended: Any = None) -> dict[int, RankResult | str]:
    """One rehearsal process for ``ranks``; its marked lines read as it prints them (``ended(rank,
    result)`` called for each), its stderr kept in a file (a pipe read only at the end could fill
    and stall the child)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "partita.backends.torch.rehearse", str(plan_dir), *map(str, ranks)]
    out: dict[int, RankResult | str] = {}
    last = ""

    def read(lines: Any) -> None:
        nonlocal last
        for line in lines:
            if not line.startswith(_MARK):
                last = line.strip() or last
                continue
            d = json.loads(line[len(_MARK) :])
            rank = int(d["rank"])
            out[rank] = d["failure"] if "failure" in d else RankResult(**d)
            if ended is not None:
                ended(rank, out[rank])

    with tempfile.TemporaryFile("w+") as err:
        server = server_for(env)
        rfd, wfd = os.pipe()
        sock = ask_server(server, (str(plan_dir), list(ranks)), env, (wfd, err.fileno())) if server else None
        os.close(wfd)
        if sock is not None:  # a test run's rehearsal server forks the same body (rehearse_server)
            with os.fdopen(rfd) as lines:
                read(lines)
            code = server_exit_code(sock)
        else:
            os.close(rfd)
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
                assert proc.stdout is not None
                read(proc.stdout)
            code = proc.returncode
        err.seek(0)
        stderr = err.read()
    for r in ranks:
        if r not in out:
            tail = stderr.strip().splitlines()[-1:] or ([last] if last else []) or [f"exit {code}"]
            out[r] = f"the rehearsal of rank {r} died (exit {code}): {tail[0][:300]}"
            if ended is not None:
                ended(r, out[r])
    return out


def _child(plan_dir: str, ranks: Sequence[int]) -> int:
    """The body of the rehearsal process: one marked JSON line per rank (a RankResult or a failure).
    With several ranks (``run_roles``), each is played in a child forked after the imports, up to
    :func:`num_jobs` at once (each role's CPU time is its own: they share nothing but the imports)."""
    import logging
    import os
    import tempfile

    from partita.backends.torch.launch import load_program
    from partita.models.zoo import resolve_model

    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # a failure is reported once
    program = load_program(plan_dir)
    if len(ranks) == 1 or not hasattr(os, "fork"):
        for rank in ranks:
            _play(program, rank)
        return 0
    _import_once(resolve_model(program.PROGRAM["model"]))  # the imports every role makes, once, before the forks
    jobs = num_jobs(len(ranks))
    waiting = list(ranks)
    running: dict[int, tuple[int, str]] = {}  # pid -> (rank, its result file)
    with tempfile.TemporaryDirectory(prefix="partita-rehearse-") as tmp:
        while waiting or running:
            while waiting and len(running) < jobs:
                rank = waiting.pop(0)
                path = os.path.join(tmp, f"{rank}.json")  # a file per role: lines of parallel roles never interleave
                pid = os.fork()
                if pid == 0:  # the child: one role, then leave without running the parent's exit handlers
                    code = 0
                    try:
                        _play(program, rank, path)
                    except BaseException:  # noqa: BLE001 - the parent reports a rank without a result as died
                        code = 1
                    finally:
                        os._exit(code)
                running[pid] = (rank, path)
            pid, status = os.wait()
            if pid not in running:
                continue
            rank, path = running.pop(pid)
            line = Path(path).read_text() if os.path.exists(path) else ""
            if status != 0 or not line:
                code = os.waitstatus_to_exitcode(status)
                line = _json({"rank": rank, "failure": f"the rehearsal of rank {rank} died (exit {code})"})
            print(_MARK + line, flush=True)
    return 0


def _import_once(handle: Any) -> None:
    """Make, in the process that forks the roles, the imports each role makes: the model's classes (its meta
    build: ``zoo._hf_model`` imports six Hugging Face model modules), ``transformers.masking_utils`` (with
    dynamo: ``unpacked_sequences``), ``torch.distributed.pipelining`` and the memory tracker. A
    forked role made them all again: 56% of a gpt2-tiny role's CPU. Nothing is kept: no process group, no
    tensor (meta), so each role still starts from the clean state ``run_roles`` forks for. A model that does
    not build on meta here is left to its roles (``materialize.build_stage`` falls back, or reports)."""
    import torch.distributed.pipelining  # noqa: F401

    torch_shim.mem_tracker(peak_only=True)  # (its module)

    with materialize.unpacked_sequences():
        pass
    if handle is not None:  # (rehearse_server: no model yet)
        with contextlib.suppress(Exception):  # an import cache warmed, not a check: a failure is the role's to report
            handle.build("meta")


SERVER_ENV = "PARTITA_REHEARSE_SERVER"  # the socket of a rehearsal server (rehearse_server), where one runs
SERVER_PATH_ENV = "PARTITA_REHEARSE_SERVER_PYTHONPATH"  # the PYTHONPATH that server was started with


def server_for(env: dict[str, str]) -> str:
    """The rehearsal server's socket for a rehearsal run in ``env``, or "" (start a process): only where
    ``env``'s PYTHONPATH is the one the server started with, since its forks keep the server's
    ``sys.path`` (a caller that adds a directory, as the fp8 tests add torchao's, needs a fresh process)."""
    server = env.get(SERVER_ENV, "")
    if server and env.get("PYTHONPATH", "") != env.get(SERVER_PATH_ENV, ""):
        return ""
    return server


def ask_server(path: str, job: tuple[str, list[int]], env: dict[str, str], fds: tuple[int, int]) -> Any:
    """Send a rehearsal (plan directory, ranks) to the rehearsal server at ``path`` (``rehearse_server``), to
    run in ``env`` and this working directory with ``fds`` as its stdout and stderr: the connected socket
    (read the exit code with :func:`server_exit_code`), or None when no server answers there (the caller
    starts a process itself)."""
    import json
    import os
    import socket
    import struct

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        body = json.dumps({"plan_dir": job[0], "ranks": job[1], "cwd": os.getcwd(), "env": env})
        socket.send_fds(sock, [struct.pack("!I", len(body)) + body.encode()], list(fds))
    except OSError:
        sock.close()
        return None
    return sock


def server_exit_code(sock: Any) -> int:
    """The exit code of the rehearsal sent on ``sock`` (1 when the server went away without one)."""
    import struct

    with sock:
        data = _read_n(sock, 4)
    return struct.unpack("!i", data)[0] if len(data) == 4 else 1


def _read_n(sock: Any, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def num_jobs(num_roles: int) -> int:
    """Roles played at once: ``PARTITA_REHEARSE_JOBS`` when set (a positive integer), else the CPUs this
    process may run on; never more than the roles."""
    import os

    env = os.environ.get("PARTITA_REHEARSE_JOBS", "")
    if env.strip().isdigit() and int(env) > 0:
        n = int(env)
    else:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(n, num_roles))


def _json(d: dict[str, Any]) -> str:
    import json

    return json.dumps(d)


def _play(program: Any, rank: int, path: str | None = None) -> None:
    """Rehearse one rank: its marked line printed, or (``path``) its JSON written there; the finding
    when the program raises."""
    import sys

    try:
        out: dict[str, Any] = dataclasses.asdict(rehearse_rank(program, rank))
    except Exception as e:  # noqa: BLE001 - the program itself failed: that is the finding
        why = f"the program fails on rank {rank}: {type(e).__name__}: {_first_line(e)} (at {_where(e)})"
        out = {"rank": rank, "failure": why}
    if path is not None:  # whole or not at all (a role killed while writing leaves no half line)
        Path(path + ".part").write_text(_json(out))
        Path(path + ".part").replace(path)
        return
    print(_MARK + _json(out), flush=True)
    sys.stdout.flush()


def failed_stage(stage: Stage, ranks: Sequence[int], failure: str) -> dict[str, Any]:
    """The per-stage record of a stage whose program raised: nothing measured, one mismatch."""
    return {
        "index": stage.index,
        "ranks_rehearsed": list(ranks),
        "collectives": {},
        "planned_collectives": planned_collectives(stage),
        "peak_memory_bytes": None,
        "planned_memory_bytes": stage.predicted.get("memory_bytes"),
        "memory_by_category": {},
        "planned_memory_by_category": stage.predicted.get("memory_by_category"),
        "flops": None,
        "planned_flops": stage.predicted.get("flops"),
        "mismatches": [failure],
        "match": False,
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1][:300] if text else ""


def _where(e: BaseException) -> str:
    """The innermost frame of the traceback in Partita or the model's own code."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    mine = [
        f
        for f in frames
        if ("partita" in f.filename or "transformers/models" in f.filename) and not f.filename.endswith("rehearse.py")
    ]
    f = (mine or frames)[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


if __name__ == "__main__":
    import sys

    sys.exit(_child(sys.argv[1], [int(r) for r in sys.argv[2:]]))
