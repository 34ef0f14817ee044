"""Hand-built Plans for the JAX codegen/runtime tests (``searched_plans.py`` has the search's own).

Each case names a model and a layout: ``dp``, ``tp`` (Megatron), ``dp_tp``, ``zero3``, ``pp`` (2 stages
of dp=2 x tp=2), ``interleaved`` (the GPT in 4 model chunks on 2 rank groups of dp=2, interleaved
1F1B), ``uneven`` (dp=4 replicas taking 1, 1, 2 and 4 samples of each micro-batch) and
``uneven_pp`` (2 stages of dp=2, shares 1 and 3); ``dp_tp_remat`` recomputes its layers in the backward. Parameter placements are per mesh axis (dp, tp).
Hand plans carry no predicted collectives: their HLO is checked against the layout in the tests.
"""

from __future__ import annotations

from collections.abc import Mapping

from partita.plan import Plan, Stage

MLP_LAYERS = ("fc1", "fc2")
GPT_LAYERS = ("wte", "wpe", "blocks_0", "blocks_1", "ln_f", "lm_head")
NUM_MICRO_BATCHES = 2


def megatron_mlp(tp: bool) -> dict[str, tuple[str, str]]:
    if not tp:
        return {}
    return {
        "params.fc1.kernel": ("R", "S(1)"),
        "params.fc1.bias": ("R", "S(0)"),
        "params.fc2.kernel": ("R", "S(0)"),
        "params.fc2.bias": ("R", "R"),
    }


def megatron_gpt(tp: bool, num_layers: int = 2) -> dict[str, tuple[str, str]]:
    if not tp:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for i in range(num_layers):
        b = f"params.blocks_{i}"
        out |= {
            f"{b}.mlp.fc.kernel": ("R", "S(1)"),
            f"{b}.mlp.fc.bias": ("R", "S(0)"),
            f"{b}.mlp.proj.kernel": ("R", "S(0)"),
        }
    return out  # attention stays replicated: its fused qkv columns are not head-aligned for tp=4


def _stage(
    index: int,
    layers: tuple[str, ...],
    ranks: range,
    dp: int,
    tp: int,
    placements: Mapping,
    zero: int,
    shares: tuple[int, ...] = (),
    recompute: str = "none",
) -> Stage:
    return Stage(
        index=index,
        layers=layers,
        device_type="CPU",
        ranks=tuple(ranks),
        dp=dp,
        tp=tp,
        zero_stage=zero,
        batch_shares=shares,
        recompute=recompute,
        param_placements=dict(placements),
    )


def make_plan(model: str, layout: str, *, schedule: str = "gpipe", optimizer: str = "adamw") -> Plan:
    gpt = model == "jax-gpt-tiny"
    layers = GPT_LAYERS if gpt else MLP_LAYERS
    megatron = megatron_gpt if gpt else megatron_mlp
    micro_batch = 8  # samples per micro-batch over all replicas: the same global batch for every layout
    num_micro_batches = NUM_MICRO_BATCHES
    if layout in ("pp", "uneven_pp"):
        cut = 3 if gpt else 1
        pl = megatron(layout == "pp")
        shares = (1, 3) if layout == "uneven_pp" else ()
        if shares:
            micro_batch, num_micro_batches = 4, 4
        first, rest = layers[:cut], layers[cut:]
        stages = (
            _stage(0, first, range(0, 4), 2, 2, {k: v for k, v in pl.items() if _in(k, first)}, 0, shares),
            _stage(1, rest, range(4, 8), 2, 2, {k: v for k, v in pl.items() if _in(k, rest)}, 0, shares),
        )
        dp = 2
    elif layout == "interleaved":  # 4 model chunks on 2 rank groups of dp=2 (loop placement: 0, 1, 0, 1)
        chunks = (layers[:2], layers[2:3], layers[3:4], layers[4:]) if gpt else ((layers[0],), (layers[1],))
        groups = (range(0, 2), range(2, 4))
        stages = tuple(_stage(k, c, groups[k % 2], 2, 1, {}, 0) for k, c in enumerate(chunks))
        dp = 2
    elif layout == "uneven":
        dp = 4
        stages = (_stage(0, layers, range(4), 4, 1, {}, 0, (1, 1, 2, 4)),)
    else:
        dp, tp = {"dp": (4, 1), "tp": (1, 4), "dp_tp": (2, 4), "dp_tp_remat": (2, 4), "zero3": (4, 1)}[layout]
        pl = megatron(tp > 1)
        if layout == "zero3":  # explicit dp sharding of the kernels; the emitter shards the rest
            pl = {"params.fc1.kernel": ("S(0)", "R"), "params.fc2.kernel": ("S(1)", "R")} if not gpt else {}
        zero = 3 if layout.startswith("zero3") else 0
        remat = "full" if layout.endswith("remat") else "none"
        stages = (_stage(0, layers, range(dp * tp), dp, tp, pl, zero, recompute=remat),)
    micro_per_replica = micro_batch // dp
    return Plan(
        model={"name": model, "framework": "jax", "layers": list(layers)},
        cluster={"name": "8xCPU"},
        training={
            "global_batch": micro_batch * num_micro_batches,
            "seq_len": 16 if gpt else 0,
            "dtype": "f32",
            "optimizer": optimizer,
        },
        stages=stages,
        schedule="interleaved_1f1b" if layout == "interleaved" else schedule,
        num_virtual_stages=2 if layout == "interleaved" else 1,
        micro_batch_size=micro_per_replica,
        num_micro_batches=num_micro_batches,
    )


def _in(fqn: str, layers: tuple[str, ...]) -> bool:
    return any(fqn.startswith(f"params.{lay}.") for lay in layers)
