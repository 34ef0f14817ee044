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

Rehearsals (``partita rehearse``, ``rehearse.rehearse_dir``) go to one rehearsal server per test process
(``backends/torch/rehearse_server.py``): started before the first test of a file that rehearses, it imports
torch, transformers and Partita once and forks each rehearsal, where each would otherwise start a fresh
process that imports them (4-5 s of CPU, half of a tiny plan's rehearsal). The fork runs the same body in
the caller's directory, environment and output; ``PARTITA_REHEARSE_SERVER`` names it to the test process
and its subprocesses. Not for tests marked ``serial`` (a server importing beside a timed test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

COST_S: dict[str, float] = {
    # its searched plans from the plan cache of an earlier run (cold: + the searches, gpt3-13b's ~15 s); 164
    # measured on this branch with cold searches (the code fingerprint changed), 167 before it
    "tests/runtime/test_rehearse_real_size.py": 164.0,
    "tests/runtime_jax/test_jax_train_gpt.py": 124.0,
    "tests/runtime/test_model_matrix.py": 150.0,  # 112 before tp2 x pp2 and tp2 x dp2 per family
    "tests/runtime/test_rehearse_schedules.py": 61.0,  # 97 measured before the rehearsal server (s40)
    "tests/runtime_jax/test_jax_train.py": 95.0,
    "tests/runtime/test_rehearse.py": 42.0,  # 77 before the rehearsal server (s40)
    "tests/test_models.py": 69.0,
    "tests/runtime/test_run_reference.py": 67.0,
    "tests/runtime/test_rehearse_hetero.py": 55.0,  # s40, with the rehearsal server
    "tests/runtime/test_parity_matrix.py": 56.0,
    "tests/runtime_jax/test_jax_train_mlp.py": 40.0,
    # measured alone in s40 (with the rehearsal server; before it: world 37)
    "tests/runtime/test_rehearse_world.py": 32.0,
    "tests/runtime/test_rehearse_pipeline_memory.py": 35.0,
    "tests/runtime/test_context_parallel_program.py": 58.0,  # 150 was its author's wall time
    # files added on the same day, from their authors' wall times on the loaded machine (not measured alone)
    "tests/runtime/test_fp8_multiprocess.py": 110.0,  # 108 s wall with the fp8-on-one-stage launch (loaded)
    "tests/runtime/test_launch_files.py": 80.0,
}


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: the usual order
        return
    # a stable sort: the tests of a file keep their order, unlisted files theirs
    items.sort(key=lambda item: -COST_S.get(_file(item), 0.0))


_SERVER: dict[str, Any] = {}
_REHEARSES: dict[str, bool] = {}


def _rehearses(item: pytest.Item) -> bool:
    """Whether ``item``'s file rehearses (its text names ``rehearse``)."""
    path = str(item.path)
    if path not in _REHEARSES:
        _REHEARSES[path] = "rehearse" in Path(path).read_text(errors="replace")
    return _REHEARSES[path]


def pytest_runtest_setup(item: pytest.Item) -> None:
    from partita.backends.torch.rehearse import SERVER_ENV, SERVER_PATH_ENV

    if _SERVER or not hasattr(os, "fork") or SERVER_ENV in os.environ:
        return
    if item.get_closest_marker("serial") is not None or not _rehearses(item):
        return
    where = tempfile.mkdtemp(prefix="partita-rs-")
    path = os.path.join(where, "socket")
    cmd = [sys.executable, "-m", "partita.backends.torch.rehearse_server", path]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    _SERVER["proc"] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
    _SERVER["dir"] = where
    os.environ[SERVER_ENV] = path  # until it listens, a rehearsal starts its own process (request)
    os.environ[SERVER_PATH_ENV] = env.get("PYTHONPATH", "")  # a caller on another PYTHONPATH starts its own


def pytest_sessionfinish(session: pytest.Session) -> None:
    import shutil

    proc = _SERVER.pop("proc", None)
    if proc is not None:
        proc.terminate()
        proc.wait()
        os.environ.pop("PARTITA_REHEARSE_SERVER", None)
        os.environ.pop("PARTITA_REHEARSE_SERVER_PYTHONPATH", None)
        shutil.rmtree(_SERVER.pop("dir"), ignore_errors=True)
