"""A cold compile of a model with no stored trace traces it in a forked child (``partita/trace_child.py``).

The compiling process then never imports torch or transformers (the child does, and sends the graph
back), and the plan is byte-identical to the one the in-process trace gives (``PARTITA_TRACE_CHILD=off``).
Each compile runs in a fresh interpreter: this test process has torch imported, where no child is forked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HEAVY = "print(sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules))"


def _tiny_config(tmp_path: Path) -> Path:
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _compile(model: Path, out: Path, cache: Path, child: str) -> tuple[list[str], bytes]:
    code = (
        "import sys; from partita.driver import compile_to_dir; "
        "from partita.search.pricing.config import TrainingConfig; "
        f"compile_to_dir({str(model)!r}, '8xA100-80G', TrainingConfig(global_batch=8, seq_len=64), {str(out)!r}); "
        + HEAVY
    )
    env = {
        **os.environ,
        "PARTITA_CACHE_DIR": str(cache),
        "PARTITA_STORED_TRACES": "off",
        "PARTITA_TRACE_CHILD": child,
        "OMP_NUM_THREADS": "1",
    }
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert got.returncode == 0, got.stderr[-2000:]
    return got.stdout.strip().splitlines(), (out / "plan.json").read_bytes()


def test_a_config_json_compile_traces_in_a_child_and_plans_the_same(tmp_path: Path) -> None:
    model = _tiny_config(tmp_path)
    said, plan = _compile(model, tmp_path / "out", tmp_path / "cache", "on")
    assert said[-1] == "[]"  # the compiling process imported no framework: the child traced
    said_here, plan_here = _compile(model, tmp_path / "out_here", tmp_path / "cache_here", "off")
    assert "'torch'" in said_here[-1]  # traced in this process, as before
    assert plan == plan_here


def test_a_child_that_fails_returns_nothing_and_its_output_is_dropped() -> None:
    """The caller then traces in its own process and shows the error a user always got."""
    code = (
        "import sys; from partita.trace_child import trace_in_child; "
        "print(trace_in_child('no-such-model-anywhere', 32, 2)); " + HEAVY
    )
    env = {**os.environ, "PARTITA_TRACE_CHILD": "on"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert got.stdout.strip().splitlines() == ["None", "[]"]
    assert got.stderr == ""
