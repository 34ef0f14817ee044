"""partita/gc_freeze.py: the collector kept off a compile's long-lived heap (issue 35 item 10)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from partita import gc_freeze
from partita.gc_freeze import frozen_heap, settle


@pytest.fixture(autouse=True)
def _restore_gc():
    yield
    gc.unfreeze()
    gc.enable()


def test_compile_collects_no_full_heap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every full collection during a cold compile scans only what the compile made after the
    imports and the model (the rest is frozen); afterwards the process is as it was: nothing frozen,
    the collector on. On the old code the first full collection scanned everything (nothing frozen)."""
    from partita.driver import compile_to_dir
    from partita.search.pricing.config import TrainingConfig

    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    seen: list[int] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(gc.get_freeze_count())

    gc.callbacks.append(watch)
    try:
        gc.collect()  # a full collection is due soon after the imports of the other tests
        got = compile_to_dir("mlp", "4xCPU", TrainingConfig(global_batch=16, seq_len=32, dtype="f32"), tmp_path / "o")
        gc.collect()  # after the compile: scans the whole heap again
    finally:
        gc.callbacks.remove(watch)
    assert not got.cache_hit
    assert seen[0] == 0 and seen[-1] == 0  # before and after: nothing frozen
    assert all(n > 0 for n in seen[1:-1])  # during: the heap as it was frozen
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_collector_off_until_settle_then_frozen() -> None:
    with frozen_heap():
        assert not gc.isenabled()  # imports and the model build: no collections
        settle(collect=False)
        assert gc.isenabled() and gc.get_freeze_count() > 0
        with frozen_heap():  # an inner one (plan_handle inside the command's) changes nothing
            assert gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    settle()  # outside any: nothing
    assert gc.get_freeze_count() == 0


def test_process_ends_keeps_frozen_and_own_freeze_respected() -> None:
    """The ``partita`` command leaves the heap frozen (the interpreter's last collection skips it);
    a process that froze objects itself keeps its collector and its freeze untouched."""
    with frozen_heap(process_ends=True):
        settle()
    assert gc.isenabled() and gc.get_freeze_count() > 0 and not gc_freeze._OPEN[0]
    frozen = gc.get_freeze_count()
    with frozen_heap():
        assert gc.isenabled()
        settle()
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen


def test_an_in_process_cli_compile_leaves_nothing_frozen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cli.main([...])`` called in a process (the tests, a user's script) leaves the heap as it was; only
    the ``partita`` command, whose process ends next, keeps it frozen. Failed once the CLI froze for every
    caller: a later compile in the same test worker found the heap frozen and froze nothing itself."""
    from partita import cli

    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    assert gc.get_freeze_count() == 0
    argv = ["compile", "mlp", "--cluster", "4xCPU", "--global-batch", "16", "--seq", "32", "--out", str(tmp_path / "o")]
    assert cli.main([*argv, "--json"]) == 0
    assert gc.get_freeze_count() == 0 and gc.isenabled()
