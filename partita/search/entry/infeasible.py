"""When no plan fits: rule R9's proof before any configuration is priced, and the message after.

Called by ``search/planner.plan_graph``: :func:`check_states_fit` before the outer loop (a model
whose parameters, gradients and optimizer state exceed the usable memory of the whole cluster),
:func:`infeasible` when the loop found nothing (per device type, the least memory any plan on it
alone needs, against what it has). Each names the numbers and a fix (issue 20).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from partita.device_reserve import tensor_cap
from partita.errors import InfeasibleError
from partita.search.pricing.config import powers_of_two
from partita.search.program import receive_buffers


def _states_bytes(search: Any) -> tuple[float, float]:
    """(parameter + gradient + optimizer bytes of the whole model, of its largest layer), as the
    stage costs count them, unsharded (tp = 1; one solve per layer kind, memoised)."""
    dev = search.types[0]
    total, largest = 0.0, 0.0
    for i in range(len(search.graph.layers)):
        got = search.costs.layer(i, dev, 1, 1)
        if got is None:
            continue
        c = got[0]
        here = c.param_bytes + c.grad_bytes + c.optimizer_bytes
        total += here
        largest = max(largest, here)
    return total, largest


def check_states_fit(search: Any) -> None:
    """R9: a proof that no plan fits, in milliseconds. Every plan keeps each parameter's weights,
    gradients and optimizer state on some device, sharded at most over all of a stage's devices
    (ZeRO-3 over ``dp``, tensor parallelism over ``tp``), so their total is at most the usable
    memory of the whole cluster; a model whose states exceed it cannot fit, whatever the search."""
    total, _ = _states_bytes(search)
    have = sum(search.cluster.count(d.name) * tensor_cap(d) for d in search.types)
    if total <= have:
        return
    n = search.cluster.num_devices
    big = search.types[0]  # most memory per device
    need_devices = math.ceil(total / tensor_cap(big))
    per_dev = ", ".join(
        f"each {d.name} has {_size(d.memory_bytes)} ({_size(tensor_cap(d))} usable for tensors)" for d in search.types
    )
    params = search.graph.num_params()
    raise InfeasibleError(
        f"no plan fits in memory: the model's parameters, gradients and {search.training.optimizer} state take "
        f"{_size(total)} ({_count(params)} parameters, {total / max(params, 1):.1f} bytes each); even sharded "
        f"evenly over all {n} devices that is {_size(total / n)} per device, and {per_dev}: {_size(have)} usable "
        f"in total, {total / have:.1f}x too little.",
        f"add devices (at least {need_devices} x {big.name}, or as much memory in total, before activations), "
        "use devices with more memory, or train a smaller model.",
    )


def _min_max_memory(mem: np.ndarray, max_stages: int) -> float:
    """The least, over splits of the units into at most ``max_stages`` stages, of the largest stage
    memory; ``mem[k, j, s]`` is a stage ``[k, j)`` with ``s`` stages left (1F1B: in-flight activations)."""
    num_units = mem.shape[0]
    best = math.inf
    prev = np.full(num_units + 1, math.inf)  # prev[k]: min max memory of units [k, U) in s - 1 stages
    prev[num_units] = 0.0
    for s in range(1, min(max_stages, num_units) + 1):
        cur = np.full(num_units + 1, math.inf)
        for k in range(num_units):
            cur[k] = float(np.min(np.maximum(mem[k, k + 1 :, s], prev[k + 1 :]), initial=math.inf))
        best = min(best, cur[0])
        prev = cur
    return best


def infeasible(search: Any) -> InfeasibleError:
    """Per device type, the least memory per device any plan on that type alone needs (its largest
    stage, at the best dp x tp x pp split, micro-batch 1, with every ZeRO stage and recompute on
    offer), against what the type has."""
    need: dict[str, float] = {}
    for dp in powers_of_two(search.cluster.num_devices):
        if search.training.global_batch % dp:
            continue
        m = search.training.global_batch // dp
        opts, caps, _ = search.options_for(dp, 1, m, "1f1b", 1)
        for o in opts:
            if len(o.devices) > 1:
                continue
            name = o.devices[0][0].name
            pp = (
                1
                if search.graph.meta.get("no_pipeline")
                else max(1, min(len(search.units), caps[o.segment] // o.width))
            )
            torch = search.graph.meta.get("framework", "torch") == "torch"
            buffers = receive_buffers.range_bytes(search, m, 1) if torch and pp > 1 else None
            for a, (zero, _r) in zip(o.arrays, o.combos):
                mem = a.memory
                if buffers is not None and (dp == 1 or zero < 2):  # torch.distributed.pipelining's runner
                    mem = mem + buffers[:, :, None]
                need[name] = min(need.get(name, math.inf), _min_max_memory(mem, pp))
    parts = [
        f"on {d.name} alone the plan with the least memory per device needs {_size(need[d.name])}, "
        f"a {d.name} has {_size(d.memory_bytes)} ({_size(tensor_cap(d))} usable for tensors)"
        for d in search.types
        if d.name in need and math.isfinite(need[d.name])
    ]
    why = search.graph.meta.get("no_pipeline")
    return InfeasibleError(
        "no plan fits in memory ("
        + ("; ".join(parts) or "no stage option could run the model")
        + ")"
        + (f"; pipeline stages are not searched for this model: {why}" if why else "")
        + ".",
        "add devices, use devices with more memory, or lower the global batch / sequence length.",
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def _size(nbytes: float) -> str:
    """1.5 GB / 12.0 MB / 3.0 kB: enough digits that tiny devices do not read "0.0 GB vs 0.0 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
