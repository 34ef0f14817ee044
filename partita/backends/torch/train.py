"""The training loop the generated program runs under torchrun, and the single-device reference.

``backends/torch/emit.py`` writes a module with the plan as literal data (``PROGRAM``), one
``setup_stage_<i>`` function per stage and a ``make_runner``; its ``__main__`` calls :func:`main`.
``backends/torch/launch.py`` starts it and reads the JSON rank 0 writes.

Semantics shared with :func:`reference_run` (so losses and gradients must agree):

* model: ``resolve_model(spec).build("cpu", seed)``; dropout is off in the zoo;
* data: step ``t`` uses ``torch.manual_seed(data_seed * 1_000_003 + t)`` then the handle's
  ``example_inputs(global_batch, seq)``; micro-batch ``k`` is rows ``[k*M, (k+1)*M)`` with
  ``M = sum(batch_shares)``, replica ``i`` takes its share of each micro-batch;
* loss: summed cross-entropy (next-token for LMs) divided by the global number of targets, so the
  sum over replicas and micro-batches is the global mean; gradient syncs are sums (uneven batch
  shares weight the average for free);
* optimizer: ``plan.training["optimizer"]`` (adam / adamw / sgd), ``lr`` from the plan or 1e-3,
  with the program's ``lr_lambda`` as a LambdaLR schedule.

Reliability (``docs/reliability.md``): a :class:`~partita.errors.PartitaError` in a rank prints one
``partita: error:`` line and exits 2; when torchrun restarts a failed job (``--max-restarts``) the
program resumes from the newest checkpoint this run published (see ``checkpoint.resume_point``).
:class:`Fault` is the test hook that kills a rank: ``PARTITA_FAULT_AT_STEP=k`` with
``PARTITA_FAULT_KIND=raise|sigkill`` (during step k, after backward) or ``sigkill_in_save`` (in
the save after step k, once the data is written and before it is published), on rank
``PARTITA_FAULT_RANK`` (default 0), on the first attempt only (``TORCHELASTIC_RESTART_COUNT=0``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partita.backends.torch import checkpoint, fidelity
from partita.backends.torch import parallel as tpar
from partita.errors import PartitaError, PlanError


# ---- shared with the reference -----------------------------------------------------------------
def make_batch(
    handle: Any, training: Mapping[str, Any], data_seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(data_seed * 1_000_003 + step)
    inputs = handle.example_inputs(int(training["global_batch"]), int(training.get("seq_len", 1)), "cpu")
    labels = inputs.pop("labels")
    return next(iter(inputs.values())), labels


def num_targets(labels: torch.Tensor) -> int:
    """Targets per global batch: next-token positions for (B, S) labels, samples for (B,)."""
    return labels.shape[0] * (labels.shape[1] - 1) if labels.dim() == 2 else labels.shape[0]


def make_loss(total: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss_fn(out: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = getattr(out, "logits", out)
        if labels.dim() == 2:  # causal LM: predict token s+1 from position s
            logits, labels = logits[:, :-1], labels[:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum")
        return ce / total

    return loss_fn


def make_optimizer(params: Any, training: Mapping[str, Any]) -> torch.optim.Optimizer:
    name = str(training.get("optimizer", "adamw")).lower()
    lr = float(training.get("lr", 1e-3))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def reference_run(
    model_spec: str,
    training: Mapping[str, Any],
    steps: int,
    *,
    seed: int = 0,
    data_seed: int = 0,
    lr_lambda: Callable[[int], float] | None = None,
    dump_steps: Sequence[int] = (),
) -> dict[str, Any]:
    """Single device, fp32, full global batch per step: ``{"losses": [...], "grads": {step: {fqn: t}}}``."""
    from partita.models.zoo import resolve_model

    handle = resolve_model(model_spec)
    model = handle.build("cpu", seed=seed).float()
    opt = make_optimizer(model.parameters(), training)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda or (lambda s: 1.0))
    losses, grads = [], {}
    for step in range(steps):
        x, y = make_batch(handle, training, data_seed, step)
        loss = make_loss(num_targets(y))(model(x), y)
        loss.backward()
        if step + 1 in dump_steps:
            grads[step + 1] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads}


# ---- fault injection (tests) -----------------------------------------------------------------------
FAULT_STEP_ENV, FAULT_KIND_ENV, FAULT_RANK_ENV = "PARTITA_FAULT_AT_STEP", "PARTITA_FAULT_KIND", "PARTITA_FAULT_RANK"
FAULT_KINDS = ("raise", "sigkill", "sigkill_in_save")


@dataclasses.dataclass(frozen=True)
class Fault:
    """Kill one rank once, at a chosen step: the hook the fault tests drive through the environment."""

    step: int
    kind: str
    rank: int

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Fault | None:
        raw = env.get(FAULT_STEP_ENV, "")
        if not raw or int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            return None  # no fault asked, or this is a restart: the fault fired on the first attempt
        kind = env.get(FAULT_KIND_ENV, "raise")
        if kind not in FAULT_KINDS or not raw.isdigit():
            raise PlanError(
                f"{FAULT_STEP_ENV}={raw!r} {FAULT_KIND_ENV}={kind!r} is not a fault this program can inject.",
                f"set {FAULT_STEP_ENV} to a step number and {FAULT_KIND_ENV} to one of {', '.join(FAULT_KINDS)}.",
            )
        return Fault(int(raw), kind, int(env.get(FAULT_RANK_ENV, "0")))

    def fire(self, point: str, step: int, rank: int) -> None:
        """``point`` is "step" (after backward of ``step``) or "save" (before publishing ``step``)."""
        if point != ("save" if self.kind == "sigkill_in_save" else "step") or (step, rank) != (self.step, self.rank):
            return
        print(f"partita: injected fault {self.kind} at step {step} on rank {rank}", file=sys.stderr, flush=True)
        if self.kind == "raise":
            raise RuntimeError(f"injected fault ({FAULT_KIND_ENV}=raise) at step {step} on rank {rank}")
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the distributed program ---------------------------------------------------------------------
@dataclasses.dataclass
class StageRuntime:
    """What ``setup_stage_<i>`` and ``make_runner`` in the generated program get to work with."""

    program: Mapping[str, Any]
    stage: Mapping[str, Any]
    rank: int
    device: torch.device
    mesh: Any
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    boundary: list[tuple[torch.Size, torch.dtype]]
    input_meta: tuple[torch.Size, torch.dtype]
    pp_group: Any = None
    module: nn.Module | None = None
    fsdp_modules: list[Any] = dataclasses.field(default_factory=list)

    @property
    def coords(self) -> tuple[int, int]:
        pos = list(self.stage["ranks"]).index(self.rank)
        return pos // self.stage["tp"], pos % self.stage["tp"]

    def examples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero tensors shaped like one micro-batch's input and output (pipelining shape declarations)."""
        s, n = self.stage["index"], self.stage["shares"][self.coords[0]]
        shape, dtype = self.input_meta if s == 0 else self.boundary[s - 1]
        x = torch.zeros((n, *shape), dtype=dtype, requires_grad=s > 0 and dtype.is_floating_point)
        shape, dtype = self.boundary[s]
        return x.to(self.device), torch.zeros((n, *shape), dtype=dtype, device=self.device)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Partita generated training program (run under torchrun).")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="model init seed (same as the reference)")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--json-out", default="", help="rank 0 writes the result JSON here")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default="")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--dump-grads", default="", help="directory for full gradients at --dump-steps")
    ap.add_argument("--no-count", action="store_true", help="do not count collectives (no dispatch mode)")
    ap.add_argument("--dump-steps", default="", help="comma-separated 1-based steps, e.g. 1,3")
    return ap.parse_args(argv)


def main(
    program: Mapping[str, Any],
    setup_stage: Sequence[Callable[[nn.Module, StageRuntime], nn.Module]],
    make_runner: Callable[[StageRuntime], Any],
    lr_lambda: Callable[[int], float],
    argv: Sequence[str] | None = None,
) -> dict[str, Any] | None:
    args = parse_args(argv)
    stages = program["stages"]
    try:
        backend = tpar.check_launch(
            program["world_size"],
            [s["kind"] for s in stages],
            int(os.environ.get("WORLD_SIZE", "1")),
            torch.cuda.is_available(),
        )
    except PartitaError as err:
        print(f"partita: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    try:
        fault = Fault.from_env(os.environ)
        init_process_group(backend)
        result = _train(program, setup_stage, make_runner, lr_lambda, args, backend, fault)
    except PartitaError as err:  # bad launch or checkpoint: one line, exit 2, no traceback
        print(f"partita: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    # Only a clean finish destroys the group: after a failure peers may sit in a collective, and
    # destroy would wait for them; exiting closes the sockets so they fail and torchrun restarts all.
    dist.destroy_process_group()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun, skip interpreter finalization: there gloo (torch 2.13) sometimes aborts
        # after a clean finish ("terminate called without an active exception", no Python frame
        # on the stack; about 1 run in 10 on a loaded 2-core machine), and torchrun then reports
        # the whole run as failed. The result is written and the group destroyed: nothing is lost.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return result


def init_process_group(backend: str) -> None:
    """``dist.init_process_group``, with a fresh key space per torchrun attempt.

    torchrun (2.13) keeps one rendezvous TCPStore for every restart of a job, so a restarted
    worker would read the previous attempt's gloo addresses and fail to connect; prefixing the
    store with the restart count keeps the attempts apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    import datetime

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=datetime.timedelta(minutes=5),
    )
    store = dist.PrefixStore(f"/partita/attempt_{attempt}", client)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def _train(
    program: Mapping[str, Any],
    setup_stage: Sequence[Callable[[nn.Module, StageRuntime], nn.Module]],
    make_runner: Callable[[StageRuntime], Any],
    lr_lambda: Callable[[int], float],
    args: argparse.Namespace,
    backend: str,
    fault: Fault | None = None,
) -> dict[str, Any] | None:
    from partita.models.zoo import resolve_model

    rank, stages, training = dist.get_rank(), program["stages"], program["training"]
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    meshes = [tpar.build_mesh(device.type, s["ranks"], s["dp"], s["tp"]) for s in stages]
    me = next(s for s in stages if rank in s["ranks"])
    pp_group = None
    if program["runner"] == "torch_pipeline":  # ranks at the same (dp, tp) coordinate of every stage
        for c in range(me["dp"] * me["tp"]):
            g = dist.new_group([s["ranks"][c] for s in stages])
            if rank in [s["ranks"][c] for s in stages]:
                pp_group = g

    handle = resolve_model(program["model"])
    model = handle.build("cpu", seed=args.seed).float()
    tied = tpar.tied_groups(model)
    x0, _ = make_batch(handle, {**training, "global_batch": 1}, args.data_seed, 0)
    boundary = tpar.boundary_shapes(model, [s["layers"] for s in stages], x0)
    tied_group, tied_n = _tied_group(model, tied, stages, rank)
    _, y_all = make_batch(handle, training, args.data_seed, 0)
    loss_fn = make_loss(num_targets(y_all))
    rt = StageRuntime(program, me, rank, device, meshes[me["index"]], loss_fn, boundary, (x0.shape[1:], x0.dtype))
    rt.pp_group = pp_group
    rt.module = setup_stage[me["index"]](model, rt)
    runner = make_runner(rt)
    opt = make_optimizer(rt.module.parameters(), training)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    ckpt_dir = args.checkpoint_dir or os.path.join(os.path.dirname(os.path.abspath(program["__file__"])), "checkpoints")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    found = checkpoint.resume_point(ckpt_dir, program, resume=args.resume, restart=restart, run_id=run_id)
    if found is None and args.checkpoint_every and (other := checkpoint.latest(ckpt_dir)):
        raise PlanError(
            f"{ckpt_dir} already holds {other[1].name} from another run; saving there would mix two runs.",
            "pass --resume to continue that run, or give this one a fresh --checkpoint-dir.",
        )
    start, prior = 0, []
    if found is not None:
        start = checkpoint.load(found[1], rt.module, opt)
        prior = list(checkpoint.read_meta(found[1]).get("losses", []))[:start]
        for _ in range(start):
            sched.step()
    meta = {"model": program["model"], "training": dict(training), "world_size": program["world_size"]}
    meta["run_id"] = run_id
    dump_steps = {int(s) for s in args.dump_steps.split(",") if s}
    i, j = rt.coords
    lo, hi = tpar_ranges(me["shares"])[i]
    m, mb = program["num_micro_batches"], sum(me["shares"])
    losses, times, counts = [], [], []
    for step in range(start, args.steps):
        x, y = make_batch(handle, training, args.data_seed, step)
        xs = [x[k * mb + lo : k * mb + hi].to(device) for k in range(m)]
        ys = [y[k * mb + lo : k * mb + hi].to(device) for k in range(m)]
        dist.barrier()
        t0 = time.perf_counter()
        # counting puts a dispatch mode under every op: only the run's first and last steps
        counter = fidelity.CollectiveCounter(
            enabled=not args.no_count and fidelity.counted_step(step, start, args.steps)
        )
        with counter:
            local = forward_backward(runner, rt, me, xs, ys, (tied, tied_group, tied_n))
        if fault is not None:
            fault.fire("step", step + 1, rank)
        if step + 1 in dump_steps:  # full gradients are gathered outside the counted window
            _dump_grads(args.dump_grads, step + 1, rt, tied)
        opt.step()  # no collectives: every optimizer state lives beside its (sharded) parameter
        sched.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        counts.append(counter.summary() if counter.enabled else None)
        losses.append(float(step_loss(local, j == 0, torch.device("cpu"))))
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            hook = (lambda k=step + 1: fault.fire("save", k, rank)) if fault is not None else None
            checkpoint.save(ckpt_dir, step + 1, rt.module, opt, {**meta, "losses": prior + losses}, hook)
    extra = {"losses_all": prior + losses, "restart_count": restart, "resumed_from": str(found[1]) if found else None}
    return _report(program, args, losses, times, counts, start, extra)


def forward_backward(runner: Any, rt: StageRuntime, me: Mapping[str, Any], xs: list, ys: list, tied: tuple) -> list:
    """One step's schedule (forward + backward over the micro-batches), then the gradient syncs the
    plan asks for: tp alignment, FSDP's dp mean undone (losses are pre-weighted), the dp
    all-reduce at ZeRO-0, tied weights. Shared by this loop and ``parallelize_torch.ParallelModel``."""
    local = runner.step(xs, ys)
    if me["tp"] > 1 and not rt.fsdp_modules:
        tpar.align_grads(rt.module)
    if rt.fsdp_modules:
        tpar.scale_grads(rt.module, float(me["dp"]))
    if me["zero_stage"] == 0 and me["dp"] > 1:
        tpar.all_reduce_grads(rt.module, rt.mesh.get_group("dp"))
    tpar.sync_tied_grads(rt.module, *tied)
    return local


def step_loss(local: list, first_tp_rank: bool, device: torch.device) -> torch.Tensor:
    """The step's global loss: each replica's last stage holds its pre-weighted share."""
    mine = sum(float(v) for v in local) if (local and first_tp_rank) else 0.0
    t = torch.tensor([mine], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t[0]


def tpar_ranges(shares: Sequence[int]) -> list[tuple[int, int]]:
    from partita.backends.torch.schedule import replica_ranges

    return replica_ranges(shares)


def _tied_group(
    model: nn.Module, tied: list[list[str]], stages: Sequence[Mapping[str, Any]], rank: int
) -> tuple[Any, int]:
    """A process group over the stages that each hold a copy of a tied parameter (or None)."""
    holders = []
    for s in stages:
        paths = {p for name in s["layers"] for p in tpar.layer_paths(model, name)}
        if any(any(n.startswith(p + ".") for p in paths) for names in tied for n in names):
            holders.append(s)
    if len(holders) < 2:
        return None, 1
    ranks = sorted(r for s in holders for r in s["ranks"])
    group = dist.new_group(ranks)
    n = next((len(s["ranks"]) for s in holders if rank in s["ranks"]), 1)
    return (group if rank in ranks else None), n


def _dump_grads(root: str, step: int, rt: StageRuntime, tied: list[list[str]]) -> None:
    canon = {n: names[0] for names in tied for n in names}
    grads = {canon.get(n, n): g for n, g in tpar.full_grads(rt.module).items()}
    if rt.coords == (0, 0) and root:
        os.makedirs(root, exist_ok=True)
        torch.save(grads, os.path.join(root, f"grads_step{step}_rank{rt.rank}.pt"))


def _report(
    program: Mapping[str, Any],
    args: argparse.Namespace,
    losses: list[float],
    times: list[float],
    counts: list[dict[str, Any]],
    start: int,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "counts": counts, "times": times})
    if dist.get_rank() != 0:
        return None
    stages = program["stages"]

    def last_counted(rank: int) -> dict[str, Any]:
        return next((c for c in reversed(gathered[rank]["counts"]) if c is not None), {})

    measured = {f"stage{s['index']}": last_counted(s["ranks"][0]) if counts else {} for s in stages}
    step_times = [max(g["times"][k] for g in gathered) for k in range(len(times))]
    result = {
        "losses": losses,
        "start_step": start,
        "step_time_s": step_times,
        "collectives": measured,
        "collectives_per_step": {f"stage{s['index']}": gathered[s["ranks"][0]]["counts"] for s in stages},
        "predicted_collectives": program["predicted_collectives"],
        "collective_mismatches": {
            k: fidelity.compare(measured[k], program["predicted_collectives"].get(k, {}))
            for k in measured
            if program["predicted_collectives"].get(k)
        },
        "predicted_step_time_s": program.get("predicted_step_time_s"),
        **(extra or {}),
    }
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.json_out:
        tmp = args.json_out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, args.json_out)
    print("PARTITA_RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return result
