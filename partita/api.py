"""The one-line annotation: ``partita.parallelize`` for a PyTorch module or a JAX loss function.

Top of the flow, beside the CLI: both call ``driver.py`` (``plan_handle``: compile cache,
else trace + search). This module imports neither torch nor jax itself; the framework halves live
in ``backends/torch/parallelize.py`` and ``backends/jax/parallelize.py``.

PyTorch::

    model = partita.parallelize(model, cluster="4xCPU", global_batch=64, seq_len=1, example_inputs=x)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = partita.step(model, x, y)   # forward + backward; the plan's schedule under torchrun
    opt.step(); opt.zero_grad()

Under torchrun the call returns this rank's :class:`~partita.backends.torch.parallelize.ParallelModel`
(``.module``, ``.plan``, ``.step(inputs, labels)``); outside it prints the plan and the torchrun
command and returns ``model`` unchanged, so the same script also runs on one device.

JAX::

    @partita.parallelize(cluster="8xCPU", global_batch=32, seq_len=16)
    def loss_fn(params, x, y): ...

    step = loss_fn.train_step(optax.adam(1e-3))      # jitted with the plan's NamedShardings
    params, opt_state = loss_fn.init(params, optax.adam(1e-3))
    params, opt_state, loss = step(params, opt_state, x, y)
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from partita.cluster import Cluster, parse_cluster
from partita.errors import ConfigError
from partita.plan import Plan


def _is_torch_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def training_config(global_batch: int | None, seq_len: int | None, plan: Plan | None, **kw: Any) -> Any:
    from partita.search.pricing.config import TrainingConfig

    if plan is not None:
        global_batch = global_batch or int(plan.training["global_batch"])
        seq_len = seq_len or int(plan.training.get("seq_len", 1))
    if global_batch is None or seq_len is None:
        raise ConfigError(
            "partita.parallelize needs global_batch and seq_len (the search prices one optimizer step).",
            "pass e.g. global_batch=64, seq_len=1024 (seq_len=1 for models without a sequence).",
        )
    return TrainingConfig(global_batch=global_batch, seq_len=seq_len, **kw)


def _cluster(cluster: str | Cluster | None, gpus_per_node: int | None) -> Cluster:
    if cluster is None:
        raise ConfigError("partita.parallelize needs a cluster.", 'pass cluster="4xCPU", a preset or a YAML path.')
    return cluster if isinstance(cluster, Cluster) else parse_cluster(str(cluster), gpus_per_node)


def _given_plan(plan: Plan | str | Path | None) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    from partita.driver import load_plan

    return load_plan(plan)


def parallelize(
    model: Any = None,
    *,
    cluster: str | Cluster | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    plan: Plan | str | Path | None = None,
    force: bool = False,
    gpus_per_node: int | None = None,
    count_collectives: bool = False,
    sync_weights: bool = True,
    verbose: bool = True,
    **training: Any,
) -> Any:
    """Plan ``model`` for ``cluster`` (cache hit or search) and run it as the plan says.

    ``model``: a ``torch.nn.Module`` (returns the rank's stage under torchrun, else ``model``), a
    JAX loss function ``f(params, *batch) -> scalar`` (returns a
    :class:`~partita.backends.jax.parallelize.ParallelFunction`), or nothing (returns a decorator).
    ``training``: further ``TrainingConfig`` fields (``dtype``, ``optimizer``). ``plan``: use this
    Plan (or plan directory) instead of searching. ``example_inputs`` (torch): see
    :func:`partita.models.zoo.module_handle`.
    """
    if model is None:
        return lambda fn: parallelize(
            fn,
            cluster=cluster,
            global_batch=global_batch,
            seq_len=seq_len,
            example_inputs=example_inputs,
            plan=plan,
            force=force,
            gpus_per_node=gpus_per_node,
            count_collectives=count_collectives,
            sync_weights=sync_weights,
            verbose=verbose,
            **training,
        )
    given = _given_plan(plan)
    if _is_torch_module(model):
        return _parallelize_torch(
            model,
            _cluster(cluster, gpus_per_node) if given is None else None,
            training_config(global_batch, seq_len, given, **training),
            example_inputs,
            given,
            force=force,
            count=count_collectives,
            sync_weights=sync_weights,
            verbose=verbose,
        )
    if callable(model):
        from partita import driver
        from partita.backends.jax.parallelize import ParallelFunction

        cl = _cluster(cluster, gpus_per_node) if given is None else None
        tr = training_config(global_batch, seq_len, given, **training)
        return ParallelFunction(model, cl, tr, given, force, planner=driver.plan_handle)
    raise ConfigError(
        f"partita.parallelize got a {type(model).__name__}.",
        "pass a torch.nn.Module, or decorate a JAX loss function f(params, *batch) -> scalar.",
    )


def step(model: Any, inputs: Any, labels: Any, loss_fn: Callable[..., Any] | None = None) -> Any:
    """One training step's forward + backward, parallel or not: ``ParallelModel.step`` under torchrun,
    else ``loss_fn(model(inputs), labels)`` (default: mean cross-entropy, next-token for (batch, seq)
    labels) and ``backward()``. Returns the loss (detached)."""
    from partita.backends.torch import parallelize as pt

    if isinstance(model, pt.ParallelModel):
        return model.step(inputs, labels, loss_fn)
    return pt.local_step(model, inputs, labels, loss_fn)


# ---- PyTorch -------------------------------------------------------------------------------
def _parallelize_torch(
    model: Any,
    cluster: Cluster | None,
    training: Any,
    example_inputs: Any,
    given: Plan | None,
    *,
    force: bool,
    count: bool,
    sync_weights: bool,
    verbose: bool,
) -> Any:
    from partita import driver
    from partita.backends.torch import parallelize as pt
    from partita.models.zoo import module_handle

    handle = module_handle(model, example_inputs)

    def make() -> tuple[Plan, str, Path]:
        if given is not None:
            return given, "given", Path(".")
        got = driver.plan_handle(handle, cluster, training, force=force)  # type: ignore[arg-type]
        return got.plan, "cache hit" if got.cache_hit else f"compiled in {got.elapsed_s:.1f} s", got.path.parent

    if pt.under_torchrun():
        pt.ensure_process_group()
        import torch.distributed as dist

        where: list[Path] = []

        def rank0() -> Plan:
            p, how, entry = make()
            where.append(entry)
            if verbose:
                print(f"partita: rank 0: {_plan_line(p, handle.name)} ({how})", file=sys.stderr, flush=True)
            return p

        p = pt.agree_on_plan(rank0)
        entry = where[0] if where else driver.cache_dir() / "plans"
        return pt.build(
            model,
            p,
            handle,
            seq_len=training.seq_len,
            where=entry,
            sync_weights=sync_weights and dist.get_world_size() > 1,
            count_collectives=count,
        )
    p, how, entry = make()
    if given is None:
        (entry / "report.txt").write_text(_report(p))
    if verbose:
        print(launch_message(p, handle.name, how, entry), file=sys.stderr, flush=True)
    return model


def _report(plan: Plan) -> str:
    from partita.report import plan_text

    return plan_text(plan) + "\n"


def _plan_line(plan: Plan, name: str) -> str:
    t = plan.predicted.get("step_time_s")
    pred = f"predicted step {float(t) * 1e3:.1f} ms" if t is not None else "no prediction"
    from partita.report.fmt import plural

    m = plural(plan.num_micro_batches, "micro-batch", "micro-batches")
    return (
        f"plan for {name} on {plan.cluster.get('name', '?')}: {plan.world_size} ranks, "
        f"{plural(plan.num_stages, 'stage')}, {plan.schedule}, {m} of {plan.micro_batch_size} per replica; {pred}"
    )


def torchrun_command(plan: Plan, argv: list[str] | None = None) -> str:
    """The command that runs this script with the plan: one node, or ``--nnodes`` with c10d rendezvous."""
    argv = list(sys.argv if argv is None else argv)
    script = argv[0] if argv and argv[0] not in ("", "-c", "-") else "your_script.py"
    args = " ".join(shlex.quote(a) for a in [script, *argv[1:]])
    groups = plan.cluster.get("spec", {}).get("groups", [])
    per = int(groups[0]["gpus_per_node"]) if groups else plan.world_size
    world = plan.world_size
    if world <= per:
        return f"torchrun --standalone --nproc-per-node {world} {args}"
    if world % per:
        return f"torchrun --nproc-per-node <devices on this node> --nnodes <nodes> ... {args}  ({world} ranks in all)"
    return (
        f"torchrun --nnodes {world // per} --nproc-per-node {per} --node-rank $NODE_RANK --rdzv-backend c10d "
        f"--rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id partita {args}   (on every node)"
    )


def launch_message(plan: Plan, name: str, how: str, entry: Path) -> str:
    lines = [f"partita: {_plan_line(plan, name)} ({how})"]
    for s in plan.stages:
        ranks = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else str(s.ranks[0])
        layers = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)} layers)"
        lines.append(
            f"  stage {s.index}: ranks {ranks}, mesh dp={s.dp} x tp={s.tp} on {s.device_type}, {layers}, "
            f"ZeRO-{s.zero_stage}, recompute {s.recompute}"
        )
    if (entry / "report.txt").exists():
        lines.append(f"  full report: {entry / 'report.txt'}")
    lines += [
        "Not under torchrun: the model runs unchanged in this process. To train with the plan, launch:",
        "  " + torchrun_command(plan),
    ]
    return "\n".join(lines)
