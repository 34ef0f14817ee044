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


def _in_child(code: str) -> list[str]:
    """``code`` run by a fresh interpreter (no torch imported, so :func:`trace_in_child` forks)."""
    env = {**os.environ, "PARTITA_TRACE_CHILD": "on", "PARTITA_WORKERS": "2"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return got.stdout.strip().splitlines()


def test_the_trace_child_runs_without_the_cyclic_collector() -> None:
    """The child ends with its trace: the collector's passes over the objects torch.export makes are
    wasted time on the compile's critical path (``gc_freeze.throwaway``). The compiling process keeps it."""
    code = (
        "import gc, partita.frontends.trace as tr, partita.models as models, partita.trace_child as tc; "
        "models.resolve_model = lambda name: name; "
        "tr.trace_handle = lambda handle, batch, seq: {'collector_on': gc.isenabled(), 'model': handle}; "
        "got = tc.trace_in_child('m', 32, 2); print(got and got[0]); print(gc.isenabled())"
    )
    assert _in_child(code) == ["{'collector_on': False, 'model': 'm'}", "True"]


def test_the_search_workers_run_without_the_cyclic_collector() -> None:
    """The search's forked workers (layer ILPs, the loops beside the search) end with their pool."""
    code = (
        "import gc; from partita.search.entry import prefetch; "
        "print(prefetch.in_background(gc.isenabled)()); print(gc.isenabled())"
    )
    assert _in_child(code) == ["False", "True"]


def test_a_search_worker_dies_on_sigterm_without_a_python_handler() -> None:
    """``Pool.terminate`` ends the workers with SIGTERM; a Python handler inherited from the command
    (``cli._on_sigterm``) can miss it when it lands just before the worker blocks on the task queue's
    lock, and the compile then waits forever (``prefetch._worker_init``). The worker takes the default
    action; the parent keeps its handler."""
    code = (
        "import signal; from partita.search.entry import prefetch; "
        "signal.signal(signal.SIGTERM, lambda s, f: None); "
        "print(prefetch.in_background(lambda: signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)()); "
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    )
    assert _in_child(code) == ["True", "False"]
