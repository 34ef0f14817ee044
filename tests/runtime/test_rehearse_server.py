"""The rehearsal server (``backends/torch/rehearse_server.py``, which the test suite's rehearsals go to:
``tests/conftest.py``) gives what a fresh rehearsal process gives: the same result of every role, field by
field (but its CPU seconds and host peak, which are the process's own), and where it does not answer, the
rehearsal starts its own process as before."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partita.backends.torch import rehearse
from partita.backends.torch.emit import emit_torch
from tests.runtime.plans import layout


def _results(plan_dir: Path) -> dict[int, dict]:
    got = rehearse.run_roles(plan_dir, [0, 2])
    out = {}
    for rank, r in got.items():
        assert isinstance(r, rehearse.RankResult), r
        out[rank] = {k: v for k, v in dataclasses.asdict(r).items() if k not in ("seconds", "host_peak_bytes")}
    return out


def test_server_rehearses_what_a_fresh_process_rehearses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt2-tiny's hetero layout (a tp 2 stage feeding a tp 1 stage over p2p, a tied parameter), roles 0 and
    2: collectives, p2p transfers with their schedule actions, peak memory by category and FLOPs equal."""
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    (plan_dir / "plan.json").write_text(layout("gpt2-tiny", "hetero").to_json())
    (plan_dir / "program_torch.py").write_text(emit_torch(layout("gpt2-tiny", "hetero"), "gpt2-tiny"))
    socket_path = str(tmp_path / "socket")
    # no server answers there yet: the rehearsal starts its own process (request gives None)
    monkeypatch.setenv(rehearse.SERVER_ENV, socket_path)
    monkeypatch.setenv(rehearse.SERVER_PATH_ENV, os.environ.get("PYTHONPATH", ""))  # started on this path
    assert rehearse.ask_server(socket_path, (str(plan_dir), [0]), dict(os.environ), (1, 2)) is None
    fresh = _results(plan_dir)
    cmd = [sys.executable, "-m", "partita.backends.torch.rehearse_server", socket_path]
    with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL) as server:
        try:
            deadline = time.monotonic() + 300  # its imports, on a loaded machine
            while not os.path.exists(socket_path) and server.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert os.path.exists(socket_path), "the rehearsal server never listened"
            answered = []
            real_request = rehearse.ask_server

            def request(*args: object, **kwargs: object) -> object:
                sock = real_request(*args, **kwargs)  # type: ignore[arg-type]
                answered.append(sock is not None)
                return sock

            monkeypatch.setattr(rehearse, "ask_server", request)
            served = _results(plan_dir)
            assert answered == [True]  # the server ran it, not a process of its own
            assert server.poll() is None  # it served and is still there for the next one
        finally:
            server.terminate()
    assert served == fresh
    assert served[0]["p2p"] and served[0]["flops"] > 0 and served[0]["peak_memory_bytes"] > 0


def test_a_caller_on_another_pythonpath_starts_its_own_process() -> None:
    """The server's forks keep its ``sys.path``: a rehearsal whose environment adds a directory (the fp8
    tests hand torchao's to their subprocesses) is not sent there. Failed as the fp8 rehearsal's "torchao
    cannot be imported" when every caller was sent to the server."""
    base = {rehearse.SERVER_ENV: "/tmp/sock", rehearse.SERVER_PATH_ENV: "/a"}
    assert rehearse.server_for({**base, "PYTHONPATH": "/a"}) == "/tmp/sock"
    assert rehearse.server_for({**base, "PYTHONPATH": "/a:/fp8-site"}) == ""
    assert rehearse.server_for({"PYTHONPATH": "/a"}) == ""  # no server at all
