"""``partita.parallelize(model, ...)`` for PyTorch: this rank's share of a plan, on a live module.

Called by ``partita/api.py``; sits beside ``torch_train.py`` and builds a rank's stage with the same
code the generated program runs: the plan is emitted by ``backends/torch/emit.py`` and executed in
memory, and its ``setup_stage_<i>`` / ``make_runner`` get a :class:`torch_train.StageRuntime`
built like ``torch_train._train`` builds it (meshes, pp group, boundary shapes, tied groups). One
training step (:meth:`ParallelModel.step`) is the body of ``torch_train``'s loop: the runner's
forwards and backwards, then the plan's gradient syncs (tp alignment, FSDP rescale, the bucketed
dp all-reduce, tied weights).

Decisions, and why:

* **One plan for all ranks**: rank 0 loads the cached plan or compiles it, then broadcasts the plan
  JSON (``broadcast_object_list``). The search is deterministic, but its solvers run under time
  limits (a loaded machine can stop at a different incumbent), N ranks searching at once on one
  node compete for the same cores, and N writers race on the cache entry; a broadcast gives equal
  plans by construction. A failure on rank 0 is broadcast too, so every rank raises the same error.
* **Weights are rank 0's**: after the plan is known, every parameter and buffer is broadcast from
  rank 0 before the stage split, so seeding on every rank is not required (with the same seed the
  broadcast changes nothing).
* **Data**: ``step(inputs, labels)`` takes the *global* batch (the same on every rank, as the
  reference run and the generated program use it) and keeps this rank's micro-batch rows.
* **Loss**: by default the runtime's (cross-entropy, next-token for (batch, seq) labels, divided by
  the global target count); a user ``loss_fn(output, labels) -> mean loss`` is weighted by the
  rank's share of rows, so the sum over replicas and micro-batches is the global mean again.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.backends.torch import fidelity
from partita.backends.torch import parallel as tpar
from partita.backends.torch import train as torch_train
from partita.backends.torch.schedule import replica_ranges
from partita.errors import ConfigError, PartitaError, PlanError
from partita.models import hf
from partita.plan import Plan

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def under_torchrun() -> bool:
    """True inside a torchrun launch (``WORLD_SIZE`` and ``RANK`` set) or an initialised process group."""
    return ("WORLD_SIZE" in os.environ and "RANK" in os.environ) or (dist.is_available() and dist.is_initialized())


def ensure_process_group() -> None:
    """Join the launch's process group if the script has not (gloo for CPU, NCCL for CUDA tensors)."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    atexit.register(_leave_process_group)
    hook, leave = sys.excepthook, sys.exit

    def failed(*exc: Any) -> None:  # an uncaught exception: the process exits 1, with finalization
        _FAILED.append(True)
        hook(*exc)

    def exits(code: Any = None) -> None:  # sys.exit(n), n != 0: keep that exit code
        if code not in (None, 0):
            _FAILED.append(True)
        leave(code)

    sys.excepthook, sys.exit = failed, exits


_FAILED: list[bool] = []


def _leave_process_group() -> None:
    """At exit of the user's script: destroy the group; after a clean finish under torchrun also skip
    interpreter finalization, where gloo aborts now and then (``parallel.leave_process_group``; seen
    under the test suite's load on the README's torchrun example: SIGABRT on one rank after its output).
    A script that failed (an uncaught exception, ``sys.exit(n)`` with ``n != 0``) keeps its exit code."""
    if not dist.is_initialized():
        return
    if not _FAILED and "TORCHELASTIC_RUN_ID" in os.environ:
        tpar.leave_process_group()
    dist.destroy_process_group()


def agree_on_plan(make_plan: Callable[[], Plan]) -> Plan:
    """Rank 0 makes the plan (cache or search) and broadcasts it; every rank returns the same Plan."""
    payload: Any = None
    if dist.get_rank() == 0:
        try:
            payload = ("plan", make_plan().to_json())
        except PartitaError as err:
            payload = ("error", type(err).__name__, err.problem, err.fix)
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    kind, *rest = box[0]
    if kind == "error":
        name, problem, fix = rest
        raise PlanError(f"rank 0 could not make the plan ({name}): {problem}", fix)
    return Plan.from_json(rest[0], "plan broadcast by rank 0")


def broadcast_weights(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer takes rank 0's values (tied tensors are sent once)."""
    seen: set[int] = set()
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            buf = t.detach().to(device)
            dist.broadcast(buf, src=0)
            if buf is not t:
                t.copy_(buf)


class _GlobalLoss:
    """The stage's ``loss_fn(output, labels)``, normalised to the global batch of the current step."""

    def __init__(self) -> None:
        self.total, self.rows, self.user = 1, 1, None  # set by ParallelModel.step
        self.shift = True  # next-token loss (train.shift_labels of the handle; set by build)

    def __call__(self, out: Any, labels: torch.Tensor) -> torch.Tensor:
        if self.user is None:
            return torch_train.make_loss(self.total, self.shift)(out, labels)
        return self.user(out, labels) * (labels.shape[0] / self.rows)


def _load_program(plan: Plan, name: str, where: Path) -> dict[str, Any]:
    """The generated program's namespace (``PROGRAM``, ``SETUP_STAGE``, ``make_runner``), run in memory."""
    from partita.backends.torch.emit import emit_torch

    path = where / "program_torch.py"
    ns: dict[str, Any] = {"__name__": "partita_program", "__file__": str(path)}
    exec(compile(emit_torch(plan, name), str(path), "exec"), ns)  # noqa: S102 - our own emitted source
    return ns


def _check_chain(model: nn.Module, layers: list[str], x0: torch.Tensor) -> None:
    """The runtime runs a model as its plan layers in order; refuse a forward that is not that chain."""
    ctx = tpar.StageContext(x0.device)
    with torch.no_grad():
        chain = tpar.run_layers(model, type(model).__name__, layers, x0, ctx)
        ref = model(x0)
    ref = getattr(ref, "logits", ref)
    if not isinstance(ref, torch.Tensor) or ref.shape != chain.shape or not torch.allclose(ref, chain, atol=1e-5):
        raise PlanError(
            f"{type(model).__name__}.forward is not the chain of its plan layers {layers} (running them one "
            "after another gives a different output), so a stage split would change the model.",
            "write forward as a sequence of submodules (x = layer(x)), or use a Hugging Face GPT-2 / Llama "
            "model (their embeddings, blocks and heads have adapters in backends/torch/parallel.py).",
        )


class ParallelModel(nn.Module):
    """This rank's stage of ``plan``: train with ``loss = model.step(inputs, labels)``, then ``opt.step()``.

    ``module`` is the stage (parameters as DTensors under tp, FSDP2 under ZeRO); ``parameters()``
    are the ones the optimizer must get. ``forward`` runs the stage module and exists for
    single-stage plans only (a pipeline stage needs its neighbours: use ``step``).
    """

    def __init__(
        self,
        plan: Plan,
        rt: torch_train.StageRuntime,
        runner: Any,
        loss: _GlobalLoss,
        tied: tuple[list[list[str]], Any, int],
        count: bool,
    ) -> None:
        super().__init__()
        assert rt.module is not None
        self.module = rt.module
        self.plan, self.rt, self.runner, self._loss, self._tied, self._count = plan, rt, runner, loss, tied, count
        self.rank = rt.rank
        self.step_times: list[float] = []
        self.collectives: list[dict[str, Any]] = []  # per step, when count_collectives=True

    @property
    def stage(self) -> Mapping[str, Any]:
        return self.rt.stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.plan.num_stages > 1:
            raise PlanError(
                f"this plan pipelines the model over {self.plan.num_stages} stages; a stage has no full forward.",
                "train with loss = model.step(inputs, labels) (it runs the plan's schedule).",
            )
        return self.module(*args, **kwargs)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn | None = None) -> torch.Tensor:
        """Forward + backward of one global batch under the plan's schedule; returns the global mean loss.

        Gradients are left on ``parameters()``, synchronised as the plan says; call the optimizer after.
        """
        rt, me = self.rt, self.rt.stage
        batch = int(self.plan.training["global_batch"])
        if inputs.shape[0] != batch or labels.shape[0] != batch:
            raise ConfigError(
                f"step got {inputs.shape[0]} inputs / {labels.shape[0]} labels; the plan is for a global batch of "
                f"{batch}.",
                f"pass the whole global batch ({batch} rows, the same on every rank); each rank keeps its share.",
            )
        shape = tuple(rt.input_meta[0])
        if tuple(inputs.shape[1:]) != shape:
            raise ConfigError(
                f"step got inputs of per-sample shape {tuple(inputs.shape[1:])}; the stage was built for {shape} "
                f"(seq_len={self.plan.training.get('seq_len')}): pipeline stages exchange fixed-shape activations.",
                "pass inputs of the planned shape, or parallelize again with this seq_len.",
            )
        total = torch_train.num_targets(labels, self._loss.shift)
        self._loss.total, self._loss.rows, self._loss.user = total, batch, loss_fn
        i, j = rt.coords
        lo, hi = replica_ranges(me["shares"])[i]
        m, mb = self.plan.num_micro_batches, sum(me["shares"])
        xs = [inputs[k * mb + lo : k * mb + hi].to(rt.device) for k in range(m)]
        ys = [labels[k * mb + lo : k * mb + hi].to(rt.device) for k in range(m)]
        t0 = time.perf_counter()
        counter = fidelity.CollectiveCounter(enabled=self._count)
        with counter:
            local = torch_train.forward_backward(self.runner, rt, me, xs, ys, self._tied)
        self.step_times.append(time.perf_counter() - t0)
        if self._count:
            self.collectives.append(counter.summary(fidelity.axis_names(rt.mesh, rt.pp_group, self._tied[1])))
        return torch_train.step_loss(local, j == 0, rt.device).to(torch.float32).cpu()


def build(
    model: nn.Module,
    plan: Plan,
    handle: Any,
    *,
    seq_len: int,
    where: Path,
    sync_weights: bool = True,
    count_collectives: bool = False,
) -> ParallelModel:
    """This rank's :class:`ParallelModel` for ``plan`` (every rank of the launch must call it)."""
    cps = sorted({s.cp for s in plan.stages if s.cp > 1})
    if cps:  # the live-module path does not split the sequence (train.py's _train does)
        raise PlanError(
            f"this plan splits the sequence over cp={cps[0]} ranks (context parallelism), which "
            "partita.parallelize does not build for a live module: it would not shard the sequence.",
            "train the plan with its program (`partita compile ... --cp`, then `partita run DIR`), or pass a plan "
            "without cp.",
        )
    ns = _load_program(plan, handle.name, where)
    program, setup_stage, make_runner = ns["PROGRAM"], ns["SETUP_STAGE"], ns["make_runner"]
    stages = program["stages"]
    cuda = torch.cuda.is_available()
    backend = tpar.check_launch(program["world_size"], [s["kind"] for s in stages], dist.get_world_size(), cuda)
    rank = dist.get_rank()
    if "nccl" in backend:  # "cpu:gloo,cuda:nccl" (parallel.check_launch)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if sync_weights:
        broadcast_weights(model, device if "nccl" in backend else torch.device("cpu"))
    meshes = [tpar.build_mesh(device.type, s["ranks"], s["dp"], s["tp"]) for s in stages]
    me = next(s for s in stages if rank in s["ranks"])
    pp_group = None
    if program["runner"] == "torch_pipeline":  # as in torch_train: ranks at one (dp, tp) coordinate
        for c in range(me["dp"] * me["tp"]):
            g = dist.new_group([s["ranks"][c] for s in stages])
            if rank in [s["ranks"][c] for s in stages]:
                pp_group = g
    example = {k: v for k, v in handle.example_inputs(1, seq_len, "cpu").items() if k != "labels"}
    packed = handle.config.get("packed_inputs")  # an encoder-decoder's inputs, stacked on dim 1 (models/hf.py)
    x0 = hf.pack(example, packed) if packed else next(iter(example.values()))
    _check_chain(model, list(program["layers"]), x0)
    tied = tpar.tied_groups(model)
    boundary = tpar.boundary_shapes(model, torch_train.stage_cuts(program), x0)  # chunks: per virtual stage
    tied_group, tied_n = torch_train._tied_group(model, tied, stages, rank)
    loss = _GlobalLoss()
    loss.shift = torch_train.shift_labels(handle)
    rt = torch_train.StageRuntime(
        program, me, rank, device, meshes[me["index"]], loss, boundary, (x0.shape[1:], x0.dtype)
    )
    rt.pp_group = pp_group
    rt.module = setup_stage[me["index"]](model, rt)
    runner = make_runner(rt)
    return ParallelModel(plan, rt, runner, loss, (tied, tied_group, tied_n), count_collectives)


def local_step(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn | None = None) -> Any:
    """The same step on one device (the plain model outside torchrun): forward, loss, backward."""
    out = model(inputs)
    if loss_fn is None:
        shift = hf.task_of_model(model) in (None, "causal-lm")  # as train.shift_labels for a live module
        loss = torch_train.make_loss(torch_train.num_targets(labels, shift), shift)(out, labels)
    else:
        loss = loss_fn(out, labels)
    loss.backward()
    return loss.detach()
