"""``evaluate.memory_by_category`` on a traced torch model: the categories sum to the priced total.

The synthetic graph of ``test_evaluate.py`` has no loss transient and no FSDP2 copies; gpt2-tiny in
bf16 has both, so here the activations must carry what ``stage_cost.stage_arrays`` adds beside the
saved activations: the loss's backward buffers (the last stage), a ZeRO-2/3 unit's gradients in
flight to the reduce-scatter (``stage_cost.reduce_scatter_in_flight``) and ZeRO-0's flat gradient
copy. (Before, gpt2-tiny pp2 x dp4 ZeRO-2 stage 0 summed to 590,720 B against 890,624 B priced.)
"""

from __future__ import annotations

import pytest

from partita.cluster import parse_cluster
from partita.ir import Graph
from partita.search.config import TrainingConfig
from partita.search.evaluate import evaluate_config


@pytest.fixture(scope="module")
def gpt2() -> Graph:
    from partita.frontends.trace import trace_handle
    from partita.models import resolve_model

    return trace_handle(resolve_model("gpt2-tiny"), batch=1, seq=32)


@pytest.mark.parametrize(
    ("zero", "recompute", "dtype"),
    [(3, "none", "bf16"), (2, "none", "bf16"), (0, "none", "bf16"), (3, "full", "bf16"), (1, "selective", "f32")],
)
def test_torch_memory_categories_sum_to_the_priced_total(gpt2: Graph, zero: int, recompute: str, dtype: str) -> None:
    tr = TrainingConfig(global_batch=16, seq_len=32, dtype=dtype)
    ev = evaluate_config(
        gpt2, parse_cluster("8xA100-80G"), tr, tp=1, pp=2, dp=4, micro_batch=1, zero_stage=zero, recompute=recompute
    )
    for cat, total in zip(ev.memory_by_category, ev.memory_per_device, strict=True):
        assert sum(cat.values()) == pytest.approx(total, rel=1e-9), (zero, recompute, cat, total)
