"""Worker of ``test_context_parallel_multiprocess.py``: run under ``torchrun --nproc-per-node 4``.

For each layout ``(dp, cp)`` in ``LAYOUTS`` (ranks laid out ``(dp, cp)``, cp fastest): a seeded tiny
Llama (f32) trains one step on its dp share of the samples and its cp slice of every sequence through
``partita.backends.torch.context_parallel``; the loss summed and the gradients summed over all ranks are
compared with the same model's single-device step on the whole batch (Hugging Face's own SDPA
attention, no context-parallel code). Rank 0 writes the largest differences and the collectives
counted to the JSON file named by argv[1].
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from partita.backends.torch import context_parallel as cpr
from partita.models import families

LAYOUTS = ((2, 2), (1, 4))
B, S = 4, 16


def model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    cfg = {k: v for k, v in families.tiny("llama").items() if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attention_dropout=0.0))
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    return model, ids


def reference(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


class Count:
    """Counts this rank's all_gather_single / reduce_scatter_single calls and bytes (their outputs / inputs)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}
        self._ag, self._rs = dist.all_gather_single, dist.reduce_scatter_single

    def __enter__(self) -> Count:
        def ag(out, inp, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.calls["all_gather"][0] += 1
            self.calls["all_gather"][1] += out.numel() * out.element_size()
            return self._ag(out, inp, *a, **k)

        def rs(out, inp, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.calls["reduce_scatter"][0] += 1
            self.calls["reduce_scatter"][1] += inp.numel() * inp.element_size()
            return self._rs(out, inp, *a, **k)

        dist.all_gather_single, dist.reduce_scatter_single = ag, rs
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single, dist.reduce_scatter_single = self._ag, self._rs


def run(dp: int, cp: int, out: dict) -> None:
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(dp)]
    d, c = divmod(rank, cp)
    model, ids = model_and_batch()
    ref_model = copy.deepcopy(model)
    ref_loss, ref_grads = reference(ref_model, ids)
    cpr.install(groups[d])
    model.config._attn_implementation = cpr.ATTENTION
    rows = ids[d * (B // dp) : (d + 1) * (B // dp)]
    x = cpr.shard_sequence(rows, c, cp)
    y = cpr.shift_then_shard(rows, c, cp)
    with Count() as count:
        logits = model(input_ids=x, position_ids=cpr.position_ids(S, c, cp)).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum") / (B * (S - 1))
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)  # replicated over dp and cp alike: the sum is the single-device gradient
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        worst = max(worst, float((p.grad - ref_grads[n]).abs().max()))
    out[f"dp{dp}_cp{cp}"] = {
        "loss": float(total),
        "reference_loss": ref_loss,
        "max_grad_diff": worst,
        "num_parameters": len(ref_grads),
        "collectives": count.calls,
    }


def main() -> None:
    dist.init_process_group("gloo")
    out: dict = {}
    for dp, cp in LAYOUTS:
        run(dp, cp, out)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
