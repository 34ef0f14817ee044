"""The GPT that Megatron-LM trained for ``a100_megatron_measured.csv``, as a plain PyTorch module.

Used by ``bench/costmodel_accuracy.py`` through ``gpt_graphs.megatron_graph``. It differs from
Hugging Face's GPT-2 where the difference changes what is computed or communicated:

* the fused QKV projection lays its output out per head (``[B, S, heads, 3 * head_dim]``) as
  Megatron does, so a tensor-parallel split of its columns is a split of the heads; HF GPT-2 puts
  ``[q | k | v]`` side by side, which a contiguous column split cannot shard without a gather;
* unfused attention (QK^T, causal mask, softmax, dropout on the probabilities, PV): no flash
  attention existed in the Megatron-LM version these rows were measured with;
* dropout 0.1 on embeddings, attention probabilities and both residual branches; tanh GeLU;
  pre-LayerNorm blocks; LM head tied to the word embedding.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from partita.models.zoo import ModelHandle

DROPOUT = 0.1


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        pos = torch.arange(s, device=x.device)
        scores = torch.where(pos[None, :] <= pos[:, None], scores, float("-inf"))  # causal
        probs = F.dropout(torch.softmax(scores, dim=-1), DROPOUT, self.training)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(ctx), DROPOUT, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return x + F.dropout(mlp, DROPOUT, self.training)


class MegatronGPT(nn.Module):
    def __init__(self, hidden: int, heads: int, layers: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=seq)  # the tracer bounds S by it
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = F.dropout(self.wte(input_ids) + self.wpe(pos), DROPOUT, self.training)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def handle(hidden: int, heads: int, layers: int, seq: int, vocab: int = 51200) -> ModelHandle:
    """A zoo-style handle (meta build, token inputs) the tracer and ``trace_handle`` accept."""

    def inputs(batch: int, seq_len: int, device: str) -> dict[str, Any]:
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        return {"input_ids": ids, "labels": ids.clone()}

    summary = {"kind": "gpt", "hidden": hidden, "num_layers": layers, "heads": heads, "vocab": vocab}
    summary |= {"seq_len": seq, "tokens": True}
    name = f"megatron_gpt_h{hidden}_a{heads}_l{layers}_s{seq}"
    return ModelHandle(name, "torch", summary, lambda: MegatronGPT(hidden, heads, layers, seq, vocab), inputs)
