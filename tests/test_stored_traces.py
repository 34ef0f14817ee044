"""Stored traces (``frontends/stored.py``, issue 20): a shipped graph is used only when it is what a
fresh ``torch.export`` trace gives, and loading it imports no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from partita.frontends import stored
from partita.frontends.trace import TRACE_BATCH

SHIPPED = sorted(stored.TRACES.glob("*.json.gz"))
FIX = (
    "install the versions in scripts/constraints.txt (bash scripts/install.sh), or move that pin and "
    "regenerate them: python -m partita.frontends.stored"
)


def test_every_benchmark_model_is_shipped() -> None:
    names = {p.name for p in SHIPPED}
    assert {f"{m}.s{stored.STORED_SEQ}.json.gz" for m in stored.STORED_MODELS} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_traces_are_current(path) -> None:  # type: ignore[no-untyped-def]
    """Fails when a tracer, pass, model config, the IR or torch / transformers changed since the file
    was written (the driver would silently trace afresh, slower)."""
    model, seq = path.name[: -len(".json.gz")].rsplit(".s", 1)
    assert stored.stored_is_current(model, int(seq), TRACE_BATCH), f"{path.name} is stale: {FIX}"


# one model here (a fresh 7B trace is seconds; the suite is at its budget); bench/search_speed.py compares
# every shipped one (exact_stored), and each was written by a fresh trace of these same sources
@pytest.mark.parametrize("model", ["llama-7b"])
def test_stored_graph_equals_a_fresh_trace(model: str) -> None:
    from partita.frontends.trace import trace_handle
    from partita.models import resolve_model

    got = stored.load_stored(model, stored.STORED_SEQ, TRACE_BATCH)
    assert got is not None, f"no current stored trace of {model}: {FIX}"
    fresh = trace_handle(resolve_model(model), batch=TRACE_BATCH, seq=stored.STORED_SEQ)
    assert got.hash() == fresh.hash()
    assert got.num_params() == fresh.num_params() and len(got.layers) == len(fresh.layers)


def test_stale_or_unknown_traces_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    assert stored.load_stored("llama-7b", stored.STORED_SEQ + 1, TRACE_BATCH) is None  # no file
    assert stored.load_stored("llama-7b", stored.STORED_SEQ, TRACE_BATCH + 1) is None  # another batch
    assert stored.load_stored("../traces/llama-7b", stored.STORED_SEQ, TRACE_BATCH) is None  # a path, not a name
    monkeypatch.setattr(stored, "trace_fingerprint", lambda: "0" * 16)  # a source changed
    assert stored.load_stored("llama-7b", stored.STORED_SEQ, TRACE_BATCH) is None
    monkeypatch.undo()
    monkeypatch.setenv("PARTITA_STORED_TRACES", "off")
    assert stored.load_stored("llama-7b", stored.STORED_SEQ, TRACE_BATCH) is None


def test_loading_imports_no_framework() -> None:
    code = (
        "import sys; from partita.frontends.stored import load_stored; "
        f"g = load_stored('llama-7b', {stored.STORED_SEQ}, {TRACE_BATCH}); assert g is not None; "
        "print(sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cold_compile_of_a_stored_model_imports_no_framework(tmp_path) -> None:
    """A compile of llama-7b from its stored trace (empty compile cache) searches, and emits a
    tensor-parallel program from the plan's own tp roles (``Stage.tp_plan``), without importing torch or
    transformers: the emitter builds the model on meta only for a tp stage without roles."""
    out = tmp_path / "out"
    code = (
        "import sys; from partita.driver import compile_to_dir; from partita.search.pricing.config import TrainingConfig; "
        f"compile_to_dir('llama-7b', '64xH100-80G', TrainingConfig(global_batch=8, seq_len={stored.STORED_SEQ}), "
        f"{str(out)!r}); print(sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules))"
    )
    env = {**os.environ, "PARTITA_CACHE_DIR": str(tmp_path / "cache")}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert got.stdout.strip().splitlines()[-1] == "[]"
    program = (out / "program_torch.py").read_text()
    plan = json.loads((out / "plan.json").read_text())
    assert any(s["tp"] > 1 for s in plan["stages"]) and "colwise" in program
