"""The one place Partita touches private or unstable PyTorch APIs.

Used by ``frontends/trace_torch.py`` (capture), ``backends/torch/fidelity.py`` (collective counting) and
``backends/torch/parallel.py`` (selective recompute keeps collectives' outputs).
A torch upgrade that moves one of these names should only need an edit here.

* ``TorchDispatchMode`` (``torch.utils._python_dispatch``) is the base class of
  ``fidelity.CollectiveCounter``, which sees every ``c10d`` / ``_c10d_functional`` op a training
  step issues. The public ``torch.distributed.tensor.debug.CommDebugMode`` is the same kind of
  mode (and steps aside for DTensor ops the same way), but in torch 2.13 it counts no send/recv
  (its op set has no p2p, so pipeline transfers would go unseen), it tracks modules on every op,
  and FACTS.md records it crashing in FSDP2 hooks (a plain FSDP2 forward/backward under it
  counted fine when re-checked here); so Partita keeps its own small mode.
* Rehearsal (``backends/torch/rehearse.py``): the fake process group (``FakeStore``, from
  ``torch.testing._internal``), the process group behind a ``c10d`` op's ScriptObject argument,
  ``MemTracker`` (``torch.distributed._tools``) with DTensor's sharding propagation given a private
  ``FakeTensorMode`` (else, under the rehearsal's own fake mode, the tracker counts propagation's
  global-shape temporaries), FLOP formulas (``torch.utils.flop_counter``, plus the CPU flash
  attention ops it lacks), and static ``PipelineStage`` metadata with the warm-up vote skipped
  (the vote reads a received tensor with ``.item()``, which a fake tensor cannot answer).
* ``_StridedShard`` (``torch.distributed.tensor.placement_types``) is the placement of a plan's
  ``"SS(d,g)"`` (``backends/torch/tp.py``): each of ``g`` equal chunks of dim ``d`` sharded on its
  own, GPT-2's q|k|v weight split by heads. DTensor propagates it through ``addmm`` / ``view``
  (checked in torch 2.13: no collective forward, one all-reduce of the input gradient) and
  ``full_tensor()`` returns the canonical layout, so gradients and checkpoints stay the model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy
import torch
from torch.export import Dim, ExportedProgram
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "active_fake_mode",
    "fake_process_group",
    "fake_tensor_mode",
    "flop_formula",
    "group_name",
    "mem_tracker",
    "pipeline_static_meta",
    "private_propagation_fake_mode",
    "reset_dtensor_caches",
    "export_program",
    "fsdp_reduce_grads",
    "functional_collective_ops",
    "make_dim",
    "op_name",
    "schema_arg_names",
    "strided_shard",
    "strided_shard_spec",
    "sym_expr",
]


def functional_collective_ops() -> tuple[Any, ...]:
    """DTensor's collectives (``_c10d_functional``) and the wait that completes them."""
    ops = torch.ops._c10d_functional
    return (
        ops.all_reduce.default,
        ops.all_gather_into_tensor.default,
        ops.reduce_scatter_tensor.default,
        ops.all_to_all_single.default,
        ops.wait_tensor.default,
    )


def export_program(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    dynamic_shapes: Mapping[str, Any] | None,
) -> ExportedProgram:
    """``torch.export.export`` in non-strict mode (the training IR: ``aten.linear`` etc.)."""
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)


def make_dim(name: str, lo: int, hi: int) -> Any:
    return Dim(name, min=lo, max=hi)


def sym_expr(value: Any) -> sympy.Expr:
    """A python int or a ``torch.SymInt`` as a sympy expression (``SymInt.node.expr`` is private)."""
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))


def op_name(target: Any) -> str:
    """``aten.linear.default`` -> ``"linear"``; custom ops keep their namespace (``transformers.x``)."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        ns = getattr(target, "namespace", "aten")
        base = packet.__name__
        return base if ns == "aten" else f"{ns}.{base}"
    return getattr(target, "__name__", str(target))


def schema_arg_names(target: Any) -> list[str]:
    """Positional argument names from an OpOverload's schema (``[]`` for python callables)."""
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def strided_shard(dim: int, groups: int) -> Any:
    """DTensor placement: ``groups`` equal chunks of ``dim``, each sharded over the mesh axis."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=groups)


def strided_shard_spec(placement: Any) -> tuple[int, int] | None:
    """``(dim, groups)`` of a ``_StridedShard`` placement, None for any other placement."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return (int(placement.dim), int(placement.split_factor)) if isinstance(placement, _StridedShard) else None


# ---- rehearsal (backends/torch/rehearse.py) ------------------------------------------------------
def fake_process_group(rank: int, world_size: int) -> None:
    """``dist.init_process_group("fake")`` as ``rank`` of ``world_size``: no communication at all."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def active_fake_mode() -> Any:
    """The ``FakeTensorMode`` an op runs under (``torch._guards.active_fake_mode``), or None."""
    from torch._guards import active_fake_mode as active

    return active()


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (``torch._subclasses.fake_tensor.is_fake``; DTensors looked through)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return bool(fake(t))


def fake_tensor_mode() -> Any:
    """A new ``FakeTensorMode`` (``torch._subclasses``): tensors with shapes, dtypes and devices, no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def reset_dtensor_caches() -> None:
    """Forget DTensor's sharding-propagation and redistribution caches.

    They are keyed by meshes that compare equal across process-group incarnations, and hold the
    old mesh's group names: a second rehearsal in the same process would resolve a destroyed group.
    """
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()  # fake results of collectives are keyed by group name too


def group_name(arg: Any) -> str | None:
    """The group name of a collective's group argument: a string (``_c10d_functional``) or the
    ScriptObject a ``c10d`` op receives (``ProcessGroup.unbox``); None for anything else."""
    import torch.distributed as dist

    if isinstance(arg, str):
        return arg
    if isinstance(arg, torch.ScriptObject):
        try:
            return str(dist.ProcessGroup.unbox(arg).group_name)
        except (RuntimeError, TypeError, AttributeError):
            return None
    return None


def mem_tracker(peak_only: bool = False) -> Any:
    """A new ``torch.distributed._tools.mem_tracker.MemTracker`` (categories: Parameter, Buffer,
    Gradient, Activation, Temp, Optstate, Other; ``get_tracker_snapshot("peak")``).

    ``peak_only``: after every op keep only the global peak snapshot (what ``"peak"`` returns), not
    each active module's; torch's per-op walk over every tracked module (weak references, deep
    copies) was most of a rehearsal's time (``partita rehearse``, issue 15)."""
    from torch.distributed._tools import mem_tracker as mt

    if not peak_only:
        return mt.MemTracker()

    class PeakTracker(mt.MemTracker):
        def __init__(self) -> None:
            super().__init__()
            # no module hooks on tensors: ModTracker puts a multi-grad hook on every module's inputs and
            # outputs whose closure holds their grad_fn, a Node <-> closure cycle through C++ that gc never
            # frees, so a retained graph (zb_h1's B and W, backends/torch/wsplit.py) lived, with the
            # gradients those hooks buffer, to the end of the step (issue 19/15); a peak needs no hierarchy
            mod = self._mod_tracker
            pre, post = mod._fw_pre_hook, mod._fw_post_hook
            mod._fw_pre_hook = lambda m, args: pre(m, ())  # type: ignore[method-assign]
            mod._fw_post_hook = lambda m, args, out: post(m, args, ())  # type: ignore[method-assign]

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                total = snap[mt._TOTAL_KEY]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)  # category -> bytes: a flat copy is a full one

    return PeakTracker()


class private_propagation_fake_mode:  # noqa: N801 - used as a context manager like a function
    """Within: DTensor's sharding propagation uses its own ``FakeTensorMode`` instead of the one
    active around it, so a ``MemTracker`` entered under that mode skips propagation's temporaries."""

    def __enter__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed.tensor import _sharding_prop

        self._mod, self._old = _sharding_prop, _sharding_prop.detect_fake_mode
        mode = FakeTensorMode()
        _sharding_prop.detect_fake_mode = lambda *a, **k: mode  # type: ignore[assignment]

    def __exit__(self, *exc: Any) -> None:
        self._mod.detect_fake_mode = self._old  # type: ignore[assignment]


def _cpu_flash(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_flash_backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kw: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return int(sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape))


def _grouped_mm_flops(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """``aten._grouped_mm`` (transformers' grouped experts): 2 x rows x contraction x columns summed over
    the groups. Its three calls in a step: forward ``[M, K] x [E, K, N] -> [M, N]``, input gradient
    ``[M, N] x [E, N, K] -> [M, K]``, weight gradient ``[K, M] x [M, N] -> [E, K, N]`` (the groups
    split the contracted rows ``M``)."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * int(a.numel()) * int(b.shape[-1])
    return 2 * int(out_val.numel()) * int(a.shape[-1])


def flop_formula(func: Any) -> Any:
    """FLOP formula ``f(*args, out_val=out, **kwargs) -> int`` for an aten op, or None (0 FLOPs).

    ``torch.utils.flop_counter``'s table (matmuls, convolutions, GPU attention kernels) plus the
    CPU flash attention forward/backward and ``_grouped_mm`` it has no formula for (FACTS.md: they
    counted 0; a tp = 1 mixtral stage's experts, issue 15).
    """
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "overloadpacket", None)
    aten = torch.ops.aten
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        return _cpu_flash
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return _cpu_flash_backward
    if packet is getattr(aten, "_grouped_mm", None) and packet not in flop_registry:
        return _grouped_mm_flops
    return flop_registry.get(packet)


def pipeline_static_meta(schedule: Any, inputs: tuple[Any, ...], outputs: tuple[Any, ...]) -> None:
    """Give a ``PipelineStage`` static input/output metadata and skip the schedule's warm-up vote.

    Under a fake process group the vote (``schedule._warmup_p2p``) reads a received tensor with
    ``.item()`` and dynamic shape inference receives Python objects; neither can work, and neither
    changes the transfers of a step once the pipeline is set up.
    """
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas

    stage = schedule._stage  # a single-stage schedule (ScheduleGPipe / Schedule1F1B)
    stage._user_meta = _StageMeta(
        inputs=extract_tensor_metas(tuple(inputs)),
        outputs=extract_tensor_metas(tuple(outputs)),
        input_grads=None,
        output_grads=None,
    )

    def warmup(stages: Any, has_backward: bool, p2p_done: bool) -> None:
        for st in stages:
            st._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup


def pytree() -> Any:
    """``torch.utils._pytree`` (flatten / unflatten / map over nested outputs): backends/torch/stages.py."""
    from torch.utils import _pytree

    return _pytree


def fsdp_reduce_grads(root: Any) -> None:
    """Run FSDP2's post-backward (reduce-scatter the accumulated unsharded gradients, reshard) for
    every unit under the ``fully_shard`` module ``root`` now, outside any backward: what
    ``torch.distributed.pipelining``'s REDUCE_GRAD action does (``PipelineStage.perform_reduce_grad``)
    after the last W of a zero-bubble schedule (``backends/torch/schedule.py``, ZeRO-1). FSDP2 has no
    public call for it in torch 2.13: ``fully_shard.state``, ``_fsdp_param_groups``, ``post_backward``
    and ``_root_post_backward_final_callback`` are private."""
    from torch.distributed.fsdp import fully_shard

    root.set_is_last_backward(True)
    root.set_reshard_after_backward(True)
    root.set_requires_gradient_sync(True)
    state = fully_shard.state(root)  # type: ignore[attr-defined]
    for st in state._state_ctx.all_states:
        for group in st._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def saved_tensor_hooks_active() -> bool:
    """Whether a ``saved_tensors_hooks`` context is active (``torch.utils.checkpoint``'s, a split backward's):
    ``backends/torch/tp.py``'s sequence-parallel re-gather steps aside inside one (private
    ``torch._C._autograd._top_saved_tensors_default_hooks``)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def storage_ref(t: Any) -> Any:
    """A weak reference to ``t``'s storage that compares equal for tensors sharing it (fake tensors too):
    ``StorageWeakRef`` (``torch.multiprocessing.reductions``)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())
