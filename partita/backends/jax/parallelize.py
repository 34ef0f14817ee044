"""``@partita.parallelize(...)`` for JAX: a loss function that runs with the plan's NamedShardings.

Called by ``partita/api.py``; sits beside the generated program (``backends/jax/emit.py``) and
uses the same pieces it does: ``emit_jax.param_specs`` for every parameter's PartitionSpec (ZeRO's
dp sharding folded in, and the optimizer-state specs), ``jax_parallel.stage_mesh`` for the mesh,
``jax_parallel.split_model`` to pin activations at layer boundaries, and the SPMD train step of
``_PROGRAM_SPMD`` (micro-batches unrolled, gradients constrained, optax update).

On the first call the function is traced on abstract values of the arguments' shapes (the
arguments' shapes and dtypes only: nothing is computed), planned through the compile cache, and
the layouts are built. Then:

* ``f(params, *batch)`` is the loss, jitted with the plan's in/out shardings (usable under
  ``jax.value_and_grad`` and inside the user's own ``jax.jit``: there the shardings act as
  constraints);
* ``f.train_step(optimizer)`` is the plan's whole step ``(params, opt_state, *batch) -> (params,
  opt_state, loss)``; ``f.init(params, optimizer)`` places parameters and optimizer state.

The loss must be a mean over the batch (micro-batch losses are averaged, as in the generated
program). One process; plans with one stage (pipelines run from the generated program).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from partita.backends.jax import parallel as jp
from partita.cluster import Cluster
from partita.errors import ConfigError, PlanError
from partita.plan import Plan, shares


def _shape(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def _fn_identity(fn: Callable[..., Any]) -> dict[str, Any]:
    """What decides the traced graph besides shapes: the function's code, its file, partial arguments."""
    base = fn
    extra: dict[str, Any] = {}
    while isinstance(base, functools.partial):
        extra = {"args": repr(base.args), "keywords": repr(sorted(base.keywords.items())), "inner": extra}
        base = base.func
    out: dict[str, Any] = {"name": f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', repr(base))}"}
    try:
        out["source"] = inspect.getsource(base)
        out["file"] = hashlib.sha256(Path(inspect.getfile(base)).read_bytes()).hexdigest()[:16]
    except (OSError, TypeError):
        code = getattr(base, "__code__", None)
        out["code"] = code.co_code.hex() if code is not None else repr(base)
    return out | extra


@dataclasses.dataclass
class FunctionHandle:
    """A JAX loss function as a model handle for ``frontends/trace.trace_handle``."""

    name: str
    loss_fn: Callable[..., Any]
    params: Any  # pytree of ShapeDtypeStruct
    batch: list[Any]  # ShapeDtypeStruct per batch argument, at the global batch
    seq_len: int
    framework: str = "jax"

    @property
    def config(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len}

    def abstract_params(self) -> Any:
        return self.params

    def example_batch(self, batch: int, seq: int | None = None) -> tuple[jax.ShapeDtypeStruct, ...]:
        s = seq or self.seq_len
        out = []
        for b in self.batch:
            dims = [batch, *(s if d == self.seq_len and s else d for d in b.shape[1:])]
            out.append(jax.ShapeDtypeStruct(tuple(dims), b.dtype))
        return tuple(out)

    def identity(self) -> str:
        shapes = {k: (list(v.shape), str(v.dtype)) for k, v in jp.flatten(self.params).items()}
        batch = [(list(b.shape[1:]), str(b.dtype)) for b in self.batch]
        payload = {"fn": _fn_identity(self.loss_fn), "params": shapes, "batch": batch, "framework": "jax"}
        return json.dumps(payload, sort_keys=True, default=str)


@dataclasses.dataclass
class Layout:
    """What the plan decided for one stage, as JAX objects."""

    plan: Plan
    mesh: Any
    param_sh: Any  # pytree like params of NamedSharding
    opt_specs: dict[str, Any]  # fqn -> NamedSharding of that parameter's optimizer state
    grad_sh: dict[str, Any]  # fqn -> NamedSharding the gradient is constrained to (ZeRO-2+: the opt layout)
    batch_sh: list[Any]
    replicated: Any
    loss_of: Any  # the split's StageProgram: apply(flat_params, [batch leaves]) -> [loss]


class ParallelFunction:
    """The decorated loss: call it like the original; ``train_step`` / ``init`` for the plan's step."""

    def __init__(
        self,
        fn: Callable[..., Any],
        cluster: Cluster | None,
        training: Any,
        plan: Plan | None,
        force: bool,
        planner: Callable[..., Any] | None = None,
    ) -> None:
        """``planner(handle, cluster, training, force=...)`` returns ``.plan`` / ``.cache_hit``: the
        driver's ``plan_handle`` (passed in by ``partita.api``, which sits above this backend)."""
        functools.update_wrapper(self, fn)
        self.fn, self.cluster, self.training, self.given, self.force = fn, cluster, training, plan, force
        self.planner = planner
        self.layout: Layout | None = None
        self.cache_hit: bool | None = None
        self._loss_jit: Any = None

    @property
    def plan(self) -> Plan | None:
        return self.layout.plan if self.layout else None

    # ---- planning ----------------------------------------------------------------------
    def prepare(self, params: Any, *batch: Any) -> Layout:
        """Trace on the arguments' shapes, plan (cache), build the layouts; once per function."""
        if self.layout is not None:
            return self.layout
        aparams = jax.tree_util.tree_map(_shape, params)
        abatch = [_shape(b) for b in batch]
        gb = int(self.training.global_batch)
        if any(b.ndim == 0 or b.shape[0] != gb for b in abatch):
            raise ConfigError(
                f"the batch arguments have leading dims {[b.shape[:1] for b in abatch]}; the plan is for a global "
                f"batch of {gb}.",
                f"pass global_batch={abatch[0].shape[0] if abatch and abatch[0].ndim else '?'} or batches of {gb}.",
            )
        name = getattr(self.fn, "__name__", "loss_fn")
        handle = FunctionHandle(name, self.fn, aparams, abatch, int(self.training.seq_len))
        if self.given is not None:
            plan, self.cache_hit = self.given, None
        else:
            if self.planner is None:
                raise PlanError(
                    "this function has neither a plan nor a planner.", "decorate it with partita.parallelize."
                )
            got = self.planner(handle, self.cluster, self.training, force=self.force)
            plan, self.cache_hit = got.plan, got.cache_hit
        self.layout = _layout(plan, handle)
        return self.layout

    # ---- the loss ----------------------------------------------------------------------
    def __call__(self, params: Any, *batch: Any) -> Any:
        lay = self.prepare(params, *batch)
        if self._loss_jit is None:
            self._loss_jit = jax.jit(self.fn, in_shardings=(lay.param_sh, *lay.batch_sh), out_shardings=lay.replicated)
        if not _tracing(params, batch):  # concrete arrays (maybe committed elsewhere): place them first
            params = jax.device_put(params, lay.param_sh)
            batch = tuple(jax.device_put(b, s) for b, s in zip(batch, lay.batch_sh))
        return self._loss_jit(params, *batch)

    def shard(self, params: Any) -> Any:
        """A copy of ``params`` laid out as the plan says (call after the first call or ``prepare``);
        a copy, so the train step may donate it without deleting the caller's arrays (``device_put``
        to a replicated layout can alias the source buffer even with ``may_alias=False``, jax 0.10.2)."""
        return jax.jit(lambda p: p, out_shardings=self._require().param_sh)(params)

    def init(self, params: Any, optimizer: Any, *batch: Any) -> tuple[Any, Any]:
        """Placed parameters and the optimizer state in the plan's (ZeRO) layout."""
        if batch:
            self.prepare(params, *batch)
        placed = self.shard(params)
        return placed, jax.jit(optimizer.init, out_shardings=self._opt_sh(optimizer, params))(placed)

    def train_step(self, optimizer: Any) -> Callable[..., tuple[Any, Any, Any]]:
        """``step(params, opt_state, *batch) -> (params, opt_state, loss)``, compiled on the first call."""
        compiled: dict[str, Any] = {}

        def step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
            if "fn" not in compiled:
                compiled["fn"] = self._build_step(optimizer, params, batch)
            return compiled["fn"](params, opt_state, *batch)

        return step

    # ---- internals ---------------------------------------------------------------------
    def _require(self) -> Layout:
        if self.layout is None:
            raise PlanError(
                "the function has no plan yet.", "call it once (or .prepare(params, *batch)) before shard/init."
            )
        return self.layout

    def _opt_sh(self, optimizer: Any, params: Any) -> Any:
        import optax

        lay = self._require()
        specs = jp.unflatten(params, lay.opt_specs)
        return optax.tree_map_params(
            optimizer,
            lambda _, s: s,
            jax.eval_shape(optimizer.init, params),
            specs,
            transform_non_params=lambda _: lay.replicated,
        )

    def _build_step(self, optimizer: Any, params: Any, batch: Sequence[Any]) -> Any:
        import optax

        lay = self.prepare(params, *batch)
        m = lay.plan.num_micro_batches
        grad_sh = lay.grad_sh

        def train_step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
            flat = jp.flatten(params)

            def micro_loss(p: dict[str, Any], k: int) -> Any:
                # micro-batch k = rows r * m + k: a dp shard of the batch holds whole micro-batch rows
                xs = [b.reshape(b.shape[0] // m, m, *b.shape[1:])[:, k] for b in batch]
                return lay.loss_of.apply(p, xs)[0]

            grads = {f: jnp.zeros_like(v) for f, v in flat.items()}
            loss = jnp.zeros((), jnp.float32)
            for k in range(m):  # unrolled, as in the generated program
                mb_loss, mb_grads = jax.value_and_grad(micro_loss)(flat, k)
                loss = loss + mb_loss / m
                grads = {f: g + mb_grads[f] / m for f, g in grads.items()}
            grads = {f: jax.lax.with_sharding_constraint(g, grad_sh[f]) for f, g in grads.items()}
            tree = jp.unflatten(params, grads)
            updates, opt_state = optimizer.update(tree, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        opt_sh = self._opt_sh(optimizer, params)
        return jax.jit(
            train_step,
            in_shardings=(lay.param_sh, opt_sh, *lay.batch_sh),
            out_shardings=(lay.param_sh, opt_sh, lay.replicated),
            donate_argnums=(0, 1),
        )


def _tracing(params: Any, batch: Sequence[Any]) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((params, *batch)))


def _layout(plan: Plan, handle: FunctionHandle) -> Layout:
    from partita.backends.jax.emit import plan_layouts

    if plan.num_stages != 1:
        raise PlanError(
            f"the plan for {handle.name} pipelines it over {plan.num_stages} stages; the decorator runs "
            "single-stage (SPMD) plans.",
            "compile it as a model (`partita compile package.module:factory ... --out DIR`) and run the generated "
            "program (`partita run DIR`), or plan for fewer devices.",
        )
    st = plan.stages[0]
    if len(set(shares(st, plan.micro_batch_size))) > 1:
        raise PlanError(f"stage 0 splits micro-batches unevenly ({list(st.batch_shares)}).", "use even shares.")
    mesh = jp.stage_mesh(st.ranks, st.dp, st.tp)
    flat = jp.flatten(handle.params)
    shapes = {f: tuple(v.shape) for f, v in flat.items()}
    lay = plan_layouts(plan, handle, shapes, dict.fromkeys(shapes, 0))  # as the generated program has them
    specs = lay.specs
    layout = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    micro = plan.micro_batch_size * st.dp
    in_spec = jp.partition_spec(st.input_placement, (micro * st.dp * st.tp,) * 4, st.mesh_shape, "input")
    batch_sh = [layout(jp.fit_spec(in_spec, b.ndim)) for b in handle.batch]

    def pin_layer_boundary(_stage: int, _value: int, x: Any) -> Any:  # as _PROGRAM_SPMD does
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1 and x.shape[0] == micro:
            spec = P(*jp.fit_spec(in_spec, 1), *[P.UNCONSTRAINED] * (x.ndim - 1))
            return jax.lax.with_sharding_constraint(x, layout(spec))
        return x

    layers = list(plan.model.get("layers") or st.layers)
    micro_batch = handle.example_batch(micro, handle.seq_len)
    split = jp.split_model(
        handle.loss_fn,
        handle.params,
        micro_batch,
        layers,
        [list(st.layers)],
        pin_layer_boundary,
        module_pins=lay.pins,
        pin=jp.module_pin([mesh], [st.tp]),
    )
    if [split.batch_ids.index(i) for i in split.stages[0].inputs] != list(range(len(handle.batch))):
        raise PlanError(f"{handle.name} does not read every batch argument in order.", "use every batch argument.")
    return Layout(
        plan=plan,
        mesh=mesh,
        param_sh=jp.unflatten(handle.params, {f: layout(s[0]) for f, s in specs.items()}),
        opt_specs={f: layout(s[1]) for f, s in specs.items()},
        grad_sh={f: layout(s[1] if st.zero_stage >= 2 else s[0]) for f, s in specs.items()},
        batch_sh=batch_sh,
        replicated=layout(P()),
        loss_of=split.stages[0],
    )
