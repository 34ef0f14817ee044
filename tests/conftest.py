"""The order in which ``scripts/test.sh``'s parallel phase hands test files to its workers.

``pytest -n 2 --dist loadfile`` keeps a file on one worker and, by default, queues the files with the
most tests first (xdist's ``loadscope`` reorder). Many of the costliest files have few tests (the
real-size rehearsals, the model matrix and ``run --reference``: one test each or a few), so they would
come last, where one worker can be left running them alone after the other has finished. ``scripts/test.sh`` passes ``--no-loadscope-reorder``, and here, on
xdist workers only (a plain ``pytest`` run keeps its usual order), the files of ``COST_S`` go first,
costliest first, then every other file in its usual order: the longest jobs start while the short ones
are still there to fill in around them.

``COST_S`` is CPU seconds (user + sys, children included) of each file run alone with
``OMP_NUM_THREADS=1``, niced (``/usr/bin/time pytest FILE``, December 2026, on the shared 2-core machine;
a file that launches several processes uses more CPU than wall time). Only the order depends on it, never
what runs or passes; a file missing from it runs after the listed ones (list a new file that takes over a
minute of CPU).
"""

from __future__ import annotations

import pytest

COST_S: dict[str, float] = {
    # its searched plans from the plan cache of an earlier run (cold: + the searches, gpt3-13b's ~15 s)
    "tests/runtime/test_rehearse_real_size.py": 161.0,
    "tests/runtime_jax/test_jax_train_gpt.py": 124.0,
    "tests/runtime/test_model_matrix.py": 150.0,  # 112 before tp2 x pp2 and tp2 x dp2 per family
    "tests/runtime/test_rehearse_schedules.py": 107.0,
    "tests/runtime_jax/test_jax_train.py": 95.0,
    "tests/runtime/test_rehearse.py": 87.0,
    "tests/test_models.py": 69.0,
    "tests/runtime/test_run_reference.py": 67.0,
    "tests/runtime/test_rehearse_hetero.py": 65.0,
    "tests/runtime/test_parity_matrix.py": 56.0,
    "tests/runtime_jax/test_jax_train_mlp.py": 40.0,
    # files added on the same day, from their authors' wall times on the loaded machine (not measured alone)
    "tests/runtime/test_context_parallel_program.py": 150.0,
    "tests/runtime/test_rehearse_world.py": 100.0,
    "tests/runtime/test_fp8_multiprocess.py": 110.0,  # 108 s wall with the fp8-on-one-stage launch (loaded)
    "tests/runtime/test_launch_files.py": 80.0,
    "tests/runtime/test_rehearse_pipeline_memory.py": 70.0,
}


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: the usual order
        return
    # a stable sort: the tests of a file keep their order, unlisted files theirs
    items.sort(key=lambda item: -COST_S.get(_file(item), 0.0))
