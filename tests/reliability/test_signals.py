"""SIGINT / SIGTERM sent to the main ``partita`` process alone (as ``timeout -s INT`` or a job scheduler
sends it), not to its process group, while the search's forked workers run: the command ends as
Ctrl-C at the terminal ends it (exit 130 / 143, one line, no traceback), its workers end with it, and
nothing is written to ``--out`` or the cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to see the workers")
@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_signal_to_main_process_alone_during_forked_search(tmp_path: Path, sig: int, code: int, word: str) -> None:
    env = {**os.environ, "PARTITA_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PARTITA_WORKERS"] = "2"  # the search forks its workers even where one CPU is free
    argv = ["compile", "--force"]  # the bundled model on mixed-lab: its search forks workers
    p = subprocess.Popen(
        [sys.executable, "-m", "partita.cli", *argv, "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: the signal below reaches the main process only
    )
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline and not workers:
        workers = _children(p.pid)
        time.sleep(0.02)
    assert workers, "the compile ended before its search forked workers: " + str(p.communicate()[1][-2000:])
    time.sleep(0.2)  # inside the forked search
    os.kill(p.pid, sig)  # the main process alone, not its group
    out, err = p.communicate(timeout=120)
    assert p.returncode == code, (p.returncode, err[-3000:])
    assert "Traceback" not in err and [ln for ln in err.splitlines() if ln.strip()][-1].startswith(
        f"partita: {word}"
    ), err[-3000:]
    time.sleep(0.5)
    assert not [w for w in workers if _alive(w)], "a forked worker outlived the command"
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").rglob("*.json")) if (tmp_path / "cache").exists() else True


@pytest.mark.parametrize("cmd", ["models --json"])
def test_stdout_closed_by_its_reader_ends_quietly(tmp_path: Path, cmd: str) -> None:
    """``partita models --json | true``: the reader is gone before the first write. Before: a
    BrokenPipeError traceback (exit 1). Now: nothing on stderr but Partita's own lines, exit 141
    (128 + SIGPIPE, as ``cat`` ends), and no "Exception ignored" from the interpreter's last flush."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = f"set -o pipefail; {sys.executable} -m partita.cli {cmd} 2>{tmp_path}/err | true"
    p = subprocess.run(["bash", "-c", script], env=env, timeout=120)
    err = (tmp_path / "err").read_text()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert all(ln.startswith("partita: ") for ln in err.splitlines()), err
    assert p.returncode in (0, 141), p.returncode  # 0 when the write won the race against the reader's exit


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_signal_while_the_command_is_still_importing(tmp_path: Path, sig: int, code: int, word: str) -> None:
    """A signal before ``main`` takes over (the command still importing: under load, seconds) ends the command
    with its one line, not an import's traceback, and never goes unnoticed. Before: a KeyboardInterrupt
    traceback from whatever module was importing (exit 1, or -2), and once in a sweep of early SIGINTs the
    compile went on to exit 0 (the flaky `test_ctrl_c_is_one_line_and_exit_130`). Here the signal is sent
    by the process itself right after ``partita.cli`` is imported as the command, before ``main`` runs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = (
        "import os, signal, sys, time; sys.argv = ['partita', 'models']; import partita.cli; "
        f"os.kill(os.getpid(), {int(sig)}); time.sleep(10); print('went on')"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    assert "went on" not in p.stdout and p.stderr.splitlines() == [
        f"partita: {word} "
        + ("(Ctrl-C)" if sig == signal.SIGINT else "(SIGTERM)")
        + "; files already written are complete, nothing was half-written."
    ], p.stderr


def test_the_package_root_imports_nothing_heavy() -> None:
    """``import partita`` (which the command runs before ``main``) loads neither the API nor the cluster model:
    the window before ``main`` handles Ctrl-C stays the interpreter's own start."""
    code = "import sys, partita.cli; print(sorted(m for m in sys.modules if m.startswith('partita')))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    loaded = json.loads(p.stdout.replace("'", '"'))
    assert "partita.api" not in loaded and "partita.cluster" not in loaded, loaded
