"""The training loop the generated program runs under torchrun, and the single-device reference.

``backends/torch/emit.py`` writes a module with the plan as literal data (``PROGRAM``), one
``setup_stage_<i>`` function per stage and a ``make_runner``; its ``__main__`` calls :func:`main`.
``backends/torch/launch.py`` starts it and reads the JSON rank 0 writes.

Semantics shared with :func:`reference_run` (so losses and gradients must agree):

* model: built on the meta device, each rank allocating only its stage, every parameter filled from a
  generator seeded by (seed, FQN) (``materialize.py``); the reference builds the whole model the same
  way; dropout is off in the zoo;
* training config (``optim.py``): the plan's optimizer, weight decay, warm-up + cosine learning rate,
  gradient clipping by global norm (one all-reduce, counted with the step's collectives); under f16
  dynamic loss scaling (``optim.LossScaler``: the overflow check is one more counted all-reduce);
* process group: ``cpu:gloo,cuda:nccl`` for GPU plans (host-side collectives reach gloo), each rank
  on GPU ``LOCAL_RANK``, checked against the plan's device type at start-up (``hosts.check_device``);
* data (``data.py``): a token file or a callable, each rank reading only its rows; by default step
  ``t`` uses ``torch.manual_seed(data_seed * 1_000_003 + t)`` then the handle's
  ``example_inputs(global_batch, seq)``; micro-batch ``k`` is rows ``[k*M, (k+1)*M)`` with
  ``M = sum(batch_shares)``, replica ``i`` takes its share of each micro-batch;
* loss: summed cross-entropy divided by the global number of targets, so the sum over replicas and
  micro-batches is the global mean; gradient syncs are sums (uneven batch shares weight the average
  for free). Targets per task (:func:`make_loss`, ``models/hf.py``): the next token (causal LMs), the
  masked positions (masked LMs), the decoder targets (seq2seq, inputs packed on dim 1), the class;
* the learning-rate schedule is ``optim.lr_factor`` times the program's ``lr_lambda`` (1.0 unless edited).

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
import resource
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partita.backends.torch import checkpoint, fidelity, hosts, materialize, optim
from partita.backends.torch import data as tdata
from partita.backends.torch import parallel as tpar
from partita.backends.torch.schedule import replica_ranges
from partita.errors import PartitaError, PlanError
from partita.models import hf, moe_aux


# ---- shared with the reference -----------------------------------------------------------------
def make_batch(
    handle: Any, training: Mapping[str, Any], data_seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(data_seed * 1_000_003 + step)
    inputs = handle.example_inputs(int(training["global_batch"]), int(training.get("seq_len", 1)), "cpu")
    labels = inputs.pop("labels")
    packed = handle.config.get("packed_inputs")  # several model inputs travel stacked on dim 1 (models/hf.py)
    return (hf.pack(inputs, packed) if packed else next(iter(inputs.values()))), labels


def shift_labels(handle: Any) -> bool:
    """Whether the loss predicts the next token: the handle's config says (``models/hf.py``: causal LMs
    only; masked LM and seq2seq labels are aligned with the logits); a user's live module
    (``partita.parallelize``) by its transformers class; anything else (the zoo's GPTs): True."""
    if "shift_labels" in handle.config:
        return bool(handle.config["shift_labels"])
    return hf.task_of_model(getattr(handle, "module", None)) in (None, "causal-lm")


def num_targets(labels: torch.Tensor, shift: bool = True) -> int:
    """Targets per global batch: next-token positions for (B, S) labels, labelled positions (not
    ``hf.IGNORE_INDEX``) for aligned (B, S) labels, samples for (B,)."""
    if labels.dim() != 2:
        return labels.shape[0]
    return labels.shape[0] * (labels.shape[1] - 1) if shift else int((labels != hf.IGNORE_INDEX).sum())


def make_loss(total: int, shift: bool = True) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Summed cross-entropy over the targets divided by ``total`` (the global target count): next-token
    for (B, S) labels when ``shift``, position for position otherwise (labels ``hf.IGNORE_INDEX`` are
    not targets), class labels for (B,)."""

    def loss_fn(out: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = getattr(out, "logits", out)
        if labels.dim() == 2 and shift:  # causal LM: predict token s+1 from position s
            logits, labels = logits[:, :-1], labels[:, 1:]
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            reduction="sum",
            ignore_index=hf.IGNORE_INDEX,
        )
        return ce / total

    return loss_fn


def make_optimizer(params: Any, training: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The plan's optimizer, learning rate and weight decay (``backends/torch/optim.py``)."""
    return optim.make_optimizer(params, training)


def make_data(
    handle: Any,
    training: Mapping[str, Any],
    data_seed: int,
    data_file: str = "",
    data_dtype: str = "uint16",
    data_fn: str = "",
) -> tdata.DataSource:
    """The run's data source: a token file, a user callable, or the seeded synthetic batches."""
    seq = int(training.get("seq_len", 1))
    tf = None
    if data_file:
        vocab = int(handle.config.get("vocab") or 0) or None
        tf = tdata.TokenFile(data_file, data_dtype, seq, int(training["global_batch"]), vocab)
    fn = tdata.load_callable(data_fn) if data_fn else None
    prepare = None
    if tf is not None and handle.config.get("packed_inputs"):
        raise tdata.DataError(
            f"{handle.name} takes {', '.join(handle.config['packed_inputs'])}: (source, target) pairs, and a token "
            "file holds one stream of tokens.",
            "pass --data-fn module:function returning (inputs stacked on dim 1, labels) for the rows asked.",
        )
    if tf is not None and "mask_token_id" in handle.config:  # masked LM: mask each window (hf.mask_rows)
        mask_id = int(handle.config["mask_token_id"])

        def prepare(step: int, rows: Sequence[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return hf.mask_rows(ids, mask_id, [(data_seed * 1_000_003 + step) * (1 << 20) + r for r in rows])

    return tdata.DataSource(lambda t: make_batch(handle, training, data_seed, t), tf, fn, seq, prepare)


def reference_run(
    model_spec: str,
    training: Mapping[str, Any],
    steps: int,
    *,
    seed: int = 0,
    data_seed: int = 0,
    lr_lambda: Callable[[int], float] | None = None,
    dump_steps: Sequence[int] = (),
    data_file: str = "",
    data_dtype: str = "uint16",
    data_fn: str = "",
    precision: str = "f32",
    params: bool = False,
) -> dict[str, Any]:
    """Single device, full global batch per step, f32 parameters computing as ``precision`` says
    (``parallel.precision_of``: "f32", "autocast" or "fsdp" in ``training["dtype"]``), the plan's optimizer, learning-rate schedule and
    clipping (``torch.nn.utils.clip_grad_norm_``): ``{"losses", "grads": {step: {fqn: t}}, "lrs", "grad_norms"}``;
    under f16 the program's dynamic loss scaling too (``optim.LossScaler``: ``"loss_scales"``, ``"skipped_steps"``);
    ``params``: also ``"params"``, every parameter by FQN after the last step."""
    from partita.models.zoo import resolve_model

    handle = resolve_model(model_spec)
    model = materialize.materialize(handle, seed).model  # the initializer every parallel layout uses
    opt = make_optimizer(model.parameters(), training)
    sched = optim.make_scheduler(opt, training, steps, lr_lambda)
    clip = optim.grad_clip(training)
    scaler = optim.LossScaler.from_training(training) if optim.loss_scaling(training) else None
    source = make_data(handle, training, data_seed, data_file, data_dtype, data_fn)
    rows = list(range(int(training["global_batch"])))
    aux = moe_aux.router_aux(model, len(rows))  # + the MoE load-balancing loss when the config asks for it
    losses, grads, lrs, norms, scales, skipped = [], {}, [], [], [], []
    for step in range(steps):
        x, y = source.rows(step, rows)
        out = tpar.reference_forward(model, x, precision, str(training.get("dtype", "f32")))
        loss_fn = aux(make_loss(num_targets(y, shift_labels(handle)), shift_labels(handle)))
        loss = (scaler.wrap(loss_fn) if scaler else loss_fn)(out, y)
        loss.backward()
        overflow, used = False, 1.0
        if scaler is not None:  # as the program: unscale, check, then clip; skip the step on overflow
            used = scaler.scale
            overflow = bool(scaler.unscale_(model.parameters()) > 0)
            scales.append(used)
        if step + 1 in dump_steps:
            grads[step + 1] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        lrs.append(float(opt.param_groups[0]["lr"]))
        if scaler is None:
            opt.step()
        elif not scaler.update(overflow, opt):
            skipped.append(step)
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()) / used)
    result = {"losses": losses, "grads": grads, "lrs": lrs, "grad_norms": norms}
    if params:
        result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result | ({"loss_scales": scales, "skipped_steps": skipped} if scaler else {})


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
    replicas: Any = None  # cp stage: the ("dp_cp",) mesh its parameters are replicated over (parallel.replica_mesh)
    sequence: Any = None  # cp stage: this rank's context_parallel.SequenceSplit (set by setup_stage)
    grad_buckets: Any = None  # ZeRO-0, dp > 1: Stage.grad_buckets as a parallel.GradBuckets (set by setup_stage)

    @property
    def coords(self) -> tuple[int, int]:
        """(dp, tp) coordinates of this rank in its stage; the cp coordinate is :attr:`cp_index`."""
        pos, cp = list(self.stage["ranks"]).index(self.rank), self.stage.get("cp", 1)
        return pos // (cp * self.stage["tp"]), pos % self.stage["tp"]

    @property
    def cp_index(self) -> int:
        pos = list(self.stage["ranks"]).index(self.rank)
        return (pos // self.stage["tp"]) % self.stage.get("cp", 1)

    def examples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero tensors shaped like one micro-batch's input and output (pipelining shape declarations)."""
        s, n = self.stage["index"], self.stage["shares"][self.coords[0]]
        shape, dtype = self.input_meta if s == 0 else self.boundary[s - 1]
        x = torch.zeros((n, *shape), dtype=dtype, requires_grad=s > 0 and dtype.is_floating_point)
        shape, dtype = self.boundary[s]
        return x.to(self.device), torch.zeros((n, *shape), dtype=dtype, device=self.device)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Partita generated training program (run under torchrun).")
    ap.add_argument("--steps", type=int, default=0, help="steps to train (default: the plan's training steps, or 10)")
    ap.add_argument("--seed", type=int, default=0, help="model init seed (same as the reference)")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--json-out", default="", help="rank 0 writes the result JSON here")
    ap.add_argument("--checkpoint-every", type=int, default=-1, help="default: the plan's checkpoint_every, or 0")
    ap.add_argument("--checkpoint-dir", default="")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--dump-grads", default="", help="directory for full gradients at --dump-steps")
    ap.add_argument("--no-count", action="store_true", help="do not count collectives (no dispatch mode)")
    ap.add_argument("--dump-steps", default="", help="comma-separated 1-based steps, e.g. 1,3")
    ap.add_argument("--dump-params", default="", help="directory for the full parameters after the last step")
    ap.add_argument(
        "--deterministic", action="store_true", help="torch.use_deterministic_algorithms (`partita run --reference`)"
    )
    ap.add_argument("--backend", default="", help="process group backend (default: parallel.check_launch's)")
    ap.add_argument("--data-file", default="", help="flat binary of token ids (nanoGPT's train.bin)")
    ap.add_argument("--data-dtype", default="uint16", choices=sorted(tdata.DTYPES))
    ap.add_argument("--data-fn", default="", help="module:function(step, rows, seq_len) -> (inputs, labels)")
    ap.add_argument("--log-every", type=int, default=1, help="rank 0 prints a step line every N steps (0: none)")
    return ap.parse_args(argv)


def resolve_args(args: argparse.Namespace, training: Mapping[str, Any]) -> argparse.Namespace:
    """Fill ``--steps`` / ``--checkpoint-every`` from the plan's training record when not given."""
    if args.steps <= 0:
        args.steps = int(training.get("steps", 0) or 10)
    if args.checkpoint_every < 0:
        args.checkpoint_every = int(training.get("checkpoint_every", 0) or 0)
    return args


def main(
    program: Mapping[str, Any],
    setup_stage: Sequence[Callable[[nn.Module, StageRuntime], nn.Module]],
    make_runner: Callable[[StageRuntime], Any],
    lr_lambda: Callable[[int], float],
    argv: Sequence[str] | None = None,
) -> dict[str, Any] | None:
    args = resolve_args(parse_args(argv), program["training"])
    stages = program["stages"]
    try:
        backend = tpar.check_launch(
            program["world_size"],
            [s["kind"] for s in stages],
            int(os.environ.get("WORLD_SIZE", "1")),
            torch.cuda.is_available(),
        )
        backend = args.backend or backend
        optim.check_training(program["training"])
        _check_gpu(program, int(os.environ.get("RANK", "0")))
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
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: the result is written, nothing is lost
        tpar.leave_process_group()
    dist.destroy_process_group()
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
    if getattr(args, "deterministic", False):
        torch.use_deterministic_algorithms(True, warn_only=True)
    if tpar.backend_for("cuda", backend) == "nccl":  # each rank binds its node-local GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    meshes = tpar.build_meshes(device.type, stages)
    replicas = tpar.replica_mesh(device.type, stages, rank)  # cp stages: the dp x cp groups
    me = next(s for s in stages if rank in s["ranks"])
    pp_group = None
    if program["runner"] == "torch_pipeline":  # ranks at the same (dp, cp, tp) coordinate of every stage
        for c in range(len(me["ranks"])):
            g = dist.new_group([s["ranks"][c] for s in stages])
            if rank in [s["ranks"][c] for s in stages]:
                pp_group = g

    handle = resolve_model(program["model"])
    x0, _ = make_batch(handle, {**training, "global_batch": 1}, args.data_seed, 0)
    x0 = local_sample(x0, me)  # under cp each rank holds S / cp tokens: boundaries are shaped for them
    # meta build, boundary shapes from meta tensors; the stage is set up below (materialize.py)
    cut = stage_cuts(program)  # model chunks (interleaved 1F1B, ZB-V): boundaries per virtual stage
    built = materialize.build_stage(handle, args.seed, cut, me["layers"], x0)
    model, tied, boundary = built.model, built.tied, built.boundary
    tied_group, tied_n = _tied_group(model, tied, stages, rank)
    _, y1 = make_batch(handle, {**training, "global_batch": 1}, args.data_seed, 0)
    shift = shift_labels(handle)  # per-row target counts are fixed (hf.mask_tokens), so one row gives the total
    # under context parallelism the labels are shifted before the sequence split (forward_backward)
    loss_fn = make_loss(int(training["global_batch"]) * num_targets(y1, shift), shift and me.get("cp", 1) == 1)
    # + the MoE load-balancing loss per sequence when the config asks for it (models/moe_aux.py; one stage only)
    loss_fn = moe_aux.router_aux(model, int(training["global_batch"]), len(cut))(loss_fn)
    scaler = optim.LossScaler.from_training(training) if optim.loss_scaling(training) else None
    if scaler is not None:  # f16: dynamic loss scaling (optim.LossScaler); the schedule sees the scaled loss
        loss_fn = scaler.wrap(loss_fn)
    rt = StageRuntime(program, me, rank, device, meshes[me["index"]], loss_fn, boundary, (x0.shape[1:], x0.dtype))
    rt.pp_group, rt.replicas = pp_group, replicas
    # setup_stage on meta, to_empty(device), each parameter's local shard filled (the rehearsal's path too)
    rt.module = materialize.setup_stage(built, setup_stage[me["index"]], rt, device)
    # every parameter in one dp unit (issue 31); under cp the units are over the dp x cp replicas
    tpar.check_dp_units(rt.module, me["dp"] * me.get("cp", 1), me["zero_stage"])
    tpar.refuse_batch_stats(model, any(s["dp"] > 1 for s in stages) or int(program["num_micro_batches"]) > 1)
    runner = make_runner(rt)
    opt = make_optimizer(rt.module.parameters(), training)
    sched = optim.make_scheduler(opt, training, args.steps, lr_lambda)
    clip = optim.grad_clip(training)
    holders = _tied_holders(model, tied, stages, me) if clip else {}
    source = make_data(handle, training, args.data_seed, args.data_file, args.data_dtype, args.data_fn)
    host = HostCollectives(backend)
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
    lo, hi = replica_ranges(me["shares"])[i]
    m, mb = program["num_micro_batches"], sum(me["shares"])
    first, last = holds_ends(program, me)
    rows = tdata.rank_rows(m, mb, lo, hi) if (first or last) else []  # this rank's share of the batch only
    log = StepLog(program, args, rank)
    losses, times, counts, norms, lrs, scales, skipped = [], [], [], [], [], [], []
    axes = fidelity.axis_names(rt.mesh, pp_group, tied_group, replicas)  # group name -> the plan's axis names
    for step in range(start, args.steps):
        x, y = source.rows(step, rows) if rows else (None, None)
        n = hi - lo
        xs = [x[k * n : (k + 1) * n].to(device) for k in range(m)] if first and x is not None else []
        ys = [y[k * n : (k + 1) * n].to(device) for k in range(m)] if last and y is not None else []
        dist.barrier()
        t0 = time.perf_counter()
        # counting puts a dispatch mode under every op: only the run's first and last steps
        counter = fidelity.CollectiveCounter(
            enabled=not args.no_count and fidelity.counted_step(step, start, args.steps)
        )
        used, overflow = scaler.scale if scaler else 1.0, False
        with counter:
            local = forward_backward(runner, rt, me, xs, ys, (tied, tied_group, tied_n))
            if scaler is not None:  # the overflow check: one float64 all-reduce of every rank's flag (plan records it)
                overflow = float(host.all_reduce_sum(scaler.unscale_(rt.module.parameters()))) > 0
            if clip:  # the global-norm all-reduce is a collective of the step (plan records it)
                norm = host.all_reduce_sum(optim.local_sq_sum(rt.module, len(me["ranks"]), holders)).sqrt()
                optim.clip_(rt.module, clip, float(norm))
                norms.append(float(norm))
        if fault is not None:
            fault.fire("step", step + 1, rank)
        if step + 1 in dump_steps:  # full gradients are gathered outside the counted window
            _dump_grads(args.dump_grads, step + 1, rt, tied)
        lrs.append(float(opt.param_groups[0]["lr"]))
        if scaler is None:
            opt.step()  # no collectives: every optimizer state lives beside its (sharded) parameter
        elif not scaler.update(overflow, opt):  # GradScaler: no step on overflow, the scheduler still steps
            skipped.append(step)
        sched.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        counts.append(counter.summary(axes) if counter.enabled else None)
        losses.append(float(step_loss(local, j == 0, torch.device("cpu"), host)) / used)
        scales += [used] if scaler else []
        log.step(step, losses[-1], times[-1])
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            hook = (lambda k=step + 1: fault.fire("save", k, rank)) if fault is not None else None
            checkpoint.save(ckpt_dir, step + 1, rt.module, opt, {**meta, "losses": prior + losses}, hook)
    if getattr(args, "dump_params", ""):  # after the last step; a collective over every stage's ranks
        _dump_params(args.dump_params, rt, tied)
    extra = {"losses_all": prior + losses, "restart_count": restart, "resumed_from": str(found[1]) if found else None}
    extra |= {"grad_norms": norms, "lrs": lrs, "backend": backend, "data": source.kind, "materialized": built.how}
    if scaler is not None:
        extra |= {"loss_scales": scales, "skipped_steps": skipped}
    extra["rank_info"] = {  # gathered per rank by _report
        "peak_host_memory_bytes": peak_host_memory_bytes(),
        "peak_device_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
        "data_reads": source.reads(),
        "host_collectives": host.records,
        "num_params_local": sum(p.numel() for p in rt.module.parameters()),
    }
    return _report(program, args, losses, times, counts, start, extra)


def local_sample(x0: torch.Tensor, me: Mapping[str, Any]) -> torch.Tensor:
    """One sample as this rank's stage holds it: its first ``S / cp`` tokens under context parallelism
    (``PROGRAM["stages"][i]["cp"]``; the shapes pipeline boundaries and examples are declared with), else ``x0``."""
    cp = int(me.get("cp", 1))
    return x0 if cp == 1 else x0[:, : x0.shape[1] // cp]


def stage_cuts(program: Mapping[str, Any]) -> list[list[str]]:
    """The layers of each pipeline stage in model order, whose outputs are the boundary tensors: the
    virtual stages of a program with model chunks (``PROGRAM["chunks"]``, interleaved 1F1B and ZB-V:
    ``backends/torch/chunks.py``), else the stages."""
    if "chunks" in program:
        return [list(c["layers"]) for c in program["chunks"]]
    return [list(s["layers"]) for s in program["stages"]]


def holds_ends(program: Mapping[str, Any], me: Mapping[str, Any]) -> tuple[bool, bool]:
    """Does stage ``me`` take the model's inputs (first) / compute the loss (last)? Under ZB-V the
    last model chunk sits on the first rank group."""
    last = len(program["stages"]) - 1
    if "chunks" in program:
        last = program["chunks"][-1]["position"]
    return me["index"] == 0, me["index"] == last


def forward_backward(runner: Any, rt: StageRuntime, me: Mapping[str, Any], xs: list, ys: list, tied: tuple) -> list:
    """One step's schedule (forward + backward over the micro-batches), then the gradient syncs the
    plan asks for: tp alignment, FSDP's dp mean undone (losses are pre-weighted), the dp
    all-reduce at ZeRO-0 (over dp x cp under context parallelism, whose sequence split runs first), tied
    weights. Shared by this loop and ``parallelize_torch.ParallelModel``.

    ZeRO-0 with ``Stage.grad_buckets`` (``rt.grad_buckets``): the buckets are all-reduced inside the
    stage's last backward (``grad_buckets.GradBuckets``, hooked before the schedule) and waited for here;
    without them, one flat all-reduce after the schedule (``parallel.all_reduce_grads``)."""
    if rt.sequence is not None:  # context parallelism: this rank's 1/cp of each sequence, labels shifted first
        xs, ys = [rt.sequence.inputs(x) for x in xs], [rt.sequence.labels(y) for y in ys]
    replicas = me["dp"] * me.get("cp", 1)  # parameters are replicated over dp x cp (one group: rt.replicas)
    group = None
    if me["zero_stage"] == 0 and replicas > 1:
        group = rt.replicas.get_group() if me.get("cp", 1) > 1 else rt.mesh.get_group("dp")
        if rt.grad_buckets is not None:
            rt.grad_buckets.attach(rt.module, group)
    local = runner.step(xs, ys)
    if me["tp"] > 1 and not rt.fsdp_modules:
        tpar.align_grads(rt.module)
    if rt.fsdp_modules:
        tpar.scale_grads(rt.module, float(replicas))
    if group is not None and rt.grad_buckets is not None:
        rt.grad_buckets.finish()  # issued inside the last backward: wait, copy back
    elif group is not None:
        tpar.all_reduce_grads(rt.module, group)
    tpar.sync_tied_grads(rt.module, *tied)
    return local


def step_loss(
    local: list, first_tp_rank: bool, device: torch.device, host: HostCollectives | None = None
) -> torch.Tensor:
    """The step's global loss: each replica's last stage holds its pre-weighted share."""
    mine = sum(float(v) for v in local) if (local and first_tp_rank) else 0.0
    t = torch.tensor([mine], dtype=torch.float64, device=device)
    if host is not None:
        return host.all_reduce_sum(t)[0]
    dist.all_reduce(t)
    return t[0]


class HostCollectives:
    """The training loop's host-side (CPU tensor) collectives, each checked to reach a backend that
    takes CPU tensors and recorded (``op``, tensor device, backend) for the run's result.

    Under an NCCL-only group (``"nccl"``) a CPU all-reduce fails after the first step on a GPU
    cluster; with ``"cpu:gloo,cuda:nccl"`` (``parallel.check_launch``) it reaches gloo. This refuses
    the first case before calling into the backend.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.records: list[dict[str, str]] = []

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        # torch's own device -> backend table of the initialized group ("cpu:gloo,cuda:nccl")
        table = dist.get_backend_config() if dist.is_initialized() else self.backend
        where = tpar.backend_for(t.device.type, table)
        if where not in ("gloo", "fake") and t.device.type == "cpu":
            raise PlanError(
                f"a CPU collective would reach the {where or 'missing'} backend of process group {self.backend!r}.",
                'initialize the process group with "cpu:gloo,cuda:nccl" (parallel.check_launch does).',
            )
        self.records.append({"op": "all_reduce", "device": t.device.type, "backend": where})
        dist.all_reduce(t)
        return t


def peak_host_memory_bytes() -> int:
    """This process's peak resident set size: ``VmHWM`` of ``/proc/self/status`` where it exists
    (Linux keeps ``ru_maxrss`` across fork + exec, so a rank started by a large parent would report
    the parent's peak), else ``getrusage`` (KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _check_gpu(program: Mapping[str, Any], rank: int) -> None:
    """On a CUDA machine, refuse a rank whose GPU is not the plan's device type for it (hosts.check_device)."""
    if not torch.cuda.is_available():
        return
    expected = _rank_device(program, rank)
    if expected is None or expected.get("kind", "gpu") != "gpu":
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    props = torch.cuda.get_device_properties(local)
    hosts.check_device(expected, torch.cuda.get_device_name(local), int(props.total_memory), rank)


def _plan_beside(program: Mapping[str, Any]) -> Any:
    """The plan.json beside the program (``launch`` checked they match), or None."""
    from partita.plan import read_plan

    path = os.path.join(os.path.dirname(os.path.abspath(program.get("__file__", "."))), "plan.json")
    return read_plan(path) if os.path.exists(path) else None


def _rank_device(program: Mapping[str, Any], rank: int) -> Mapping[str, Any] | None:
    """The plan's device spec for ``rank`` (None without a plan beside the program)."""
    plan = _plan_beside(program)
    return hosts.device_spec(plan, hosts.rank_devices(plan)[rank]) if plan is not None else None


class StepLog:
    """Rank 0's per-step line: loss, tokens/s, step time, MFU and the plan's predicted step time."""

    def __init__(self, program: Mapping[str, Any], args: argparse.Namespace, rank: int) -> None:
        tr = program["training"]
        self.every, self.rank, self.steps = args.log_every, rank, args.steps
        self.tokens = int(tr["global_batch"]) * int(tr.get("seq_len", 1))
        self.predicted = program.get("predicted_step_time_s")
        plan = _plan_beside(program) if rank == 0 else None
        pred = dict(plan.predicted) if plan is not None else {}
        # model FLOPs per step / peak FLOP/s of the used devices = predicted MFU x predicted step time
        self.flops_over_peak = float(pred.get("mfu", 0.0) or 0.0) * float(pred.get("step_time_s", 0.0) or 0.0)

    def line(self, step: int, loss: float, dt: float) -> str:
        bar_n = 20
        done = int(bar_n * (step + 1) / max(self.steps, 1))
        parts = [f"[{'#' * done}{'.' * (bar_n - done)}] step {step + 1}/{self.steps}", f"loss {loss:.4f}"]
        parts.append(f"{self.tokens / dt:,.0f} tok/s" if dt > 0 else "- tok/s")
        parts.append(f"step {dt:.3f} s" + (f" (predicted {self.predicted:.3f} s)" if self.predicted else ""))
        if self.flops_over_peak and dt > 0:
            parts.append(f"MFU {100 * self.flops_over_peak / dt:.1f}%")
        return " | ".join(parts)

    def step(self, step: int, loss: float, dt: float) -> None:
        if self.rank == 0 and self.every and ((step + 1) % self.every == 0 or step + 1 == self.steps):
            print("partita: " + self.line(step, loss, dt), file=sys.stderr, flush=True)


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


def _tied_holders(
    model: nn.Module, tied: list[list[str]], stages: Sequence[Mapping[str, Any]], me: Mapping[str, Any]
) -> dict[str, int]:
    """Per FQN of a tied parameter: how many stages hold a copy (the clipping norm counts it once)."""
    out: dict[str, int] = {}
    for names in tied:
        held = 0
        for s in stages:
            paths = [q for x in s["layers"] for q in tpar.layer_paths(model, x)]
            held += any(any(n == p or n.startswith(p + ".") for p in paths) for n in names)
        out |= {n: max(held, 1) for n in names}
    return out


def _dump_grads(root: str, step: int, rt: StageRuntime, tied: list[list[str]]) -> None:
    canon = {n: names[0] for names in tied for n in names}
    grads = {canon.get(n, n): g for n, g in tpar.full_grads(rt.module).items()}
    if rt.coords == (0, 0) and rt.cp_index == 0 and root:
        os.makedirs(root, exist_ok=True)
        torch.save(grads, os.path.join(root, f"grads_step{step}_rank{rt.rank}.pt"))


def _dump_params(root: str, rt: StageRuntime, tied: list[list[str]]) -> None:
    """Full parameters by (canonical) FQN, written by each stage's rank at (dp, tp) = (0, 0)."""
    canon = {n: names[0] for names in tied for n in names}
    params = {canon.get(n, n): p for n, p in tpar.full_params(rt.module).items()}
    if rt.coords == (0, 0) and rt.cp_index == 0 and root:
        os.makedirs(root, exist_ok=True)
        torch.save(params, os.path.join(root, f"params_rank{rt.rank}.pt"))


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
    info = dict((extra or {}).get("rank_info", {}))
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "counts": counts, "times": times, **info})
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
            k: fidelity.compare(measured[k], program["predicted_collectives"].get(k, {})) for k in measured if counts
        },
        "predicted_step_time_s": program.get("predicted_step_time_s"),
        **{k: v for k, v in (extra or {}).items() if k != "rank_info"},
    }
    for key in (
        "peak_host_memory_bytes",
        "peak_device_memory_bytes",
        "data_reads",
        "host_collectives",
        "num_params_local",
    ):
        result[key] = {str(g["rank"]): g.get(key) for g in gathered}
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.json_out:
        tmp = args.json_out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, args.json_out)
    print("PARTITA_RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return result
