"""frontends/block_list.py: a model with no shallow builder (a config.json model, a user's module) traces
a few blocks and expands them into exactly the graph of a full trace (issue 35 item 10)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from partita.frontends import block_list, repeat
from partita.frontends.trace import trace_handle
from partita.ir import Graph
from partita.models.zoo import module_handle, resolve_model

QWEN_TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 6,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "_name_or_path": "qwen2-tiny",
}


def _exact(g: Graph) -> dict[str, Any]:
    d = json.loads(g.to_json())
    d["meta"].pop("traced_blocks", None)
    return d


@pytest.mark.slow  # two traces of a 6-block model: ~8 CPU s
def test_config_json_model_traces_three_blocks_into_the_full_graph(tmp_path: Path) -> None:
    """The Qwen2 shape of the issue (a config.json, no stored trace), small: 3 of 6 blocks traced,
    and the expanded graph equals the full trace byte for byte (node names and hash included)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN_TINY))
    h = resolve_model(str(tmp_path / "config.json"))
    assert getattr(h, "depth_builder", None) is None  # the path this module adds, not the zoo's
    full = trace_handle(h, seq=16, repeat=False)
    cut = trace_handle(h, seq=16)
    assert cut.meta["traced_blocks"] == [repeat.TRACED_BLOCKS, 6]
    assert "traced_blocks" not in full.meta
    assert _exact(cut) == _exact(full)
    assert cut.hash() == full.hash()  # provenance is not content: one plan file either way


class Block(torch.nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx  # counts the position: the one attribute allowed to differ
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class Net(torch.nn.Module):
    def __init__(self, num_blocks: int = 6, by_index: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(Block(i) for i in range(num_blocks))
        self.out = torch.nn.Linear(16, 4)
        self.by_index = by_index
        self.num_blocks = num_blocks

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.by_index:  # a forward that cannot run on a shorter list
            for i in range(self.num_blocks):
                h = self.blocks[i](h)
        else:
            for blk in self.blocks:
                h = blk(h)
        return torch.nn.functional.cross_entropy(self.out(h), labels)


def _user(net: Net) -> Any:
    return module_handle(net, {"x": torch.zeros(4, 8), "labels": torch.zeros(4, dtype=torch.long)})


@pytest.mark.slow
def test_user_module_traces_three_blocks_into_the_full_graph() -> None:
    h = _user(Net())
    full = trace_handle(h, repeat=False)
    cut = trace_handle(h)
    assert cut.meta["traced_blocks"] == [repeat.TRACED_BLOCKS, 6]
    assert _exact(cut) == _exact(full)


def test_a_forward_that_needs_every_block_traces_fully() -> None:
    net = Net(by_index=True)
    calls: list[int] = []

    def trace(m: Any) -> Graph:
        calls.append(len(m.blocks))
        raise IndexError("list index out of range")  # what the short list gives this forward

    assert block_list.trace_cut(net, repeat.TRACED_BLOCKS, repeat.MIN_BLOCKS, trace) is None
    assert calls == [repeat.TRACED_BLOCKS]
    assert len(net.blocks) == 6  # the list is put back


def test_blocks_that_differ_beyond_the_traced_ones_are_not_cut() -> None:
    """Qwen2 with sliding-window attention from layer 3 on: blocks 0-2 alike, 3-5 not (an attribute
    says so): a cut would trace only the first kind, so the list is refused and traced whole."""
    import transformers

    shape = {k: v for k, v in QWEN_TINY.items() if k not in ("architectures", "model_type", "_name_or_path")}
    cfg = transformers.Qwen2Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=3)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg)
        plain = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    assert block_list.find_block_list(model, repeat.MIN_BLOCKS) is None
    assert block_list.find_block_list(plain, repeat.MIN_BLOCKS) is not None
    # a block whose shapes differ is refused too
    net = Net()
    net.blocks[4].fc = torch.nn.Linear(16, 16, bias=False)
    assert block_list.find_block_list(net, repeat.MIN_BLOCKS) is None
