"""CLI front door: listing commands, and bad input -> one paragraph, exit code 2, no traceback."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from partita.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partita.cli", *args], capture_output=True, text=True, timeout=300)


def test_clusters_json(capsys) -> None:
    assert main(["clusters", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "A100-80G" in out["device_types"] and "mixed-lab" in out["clusters"]


def test_clusters_text(capsys) -> None:
    assert main(["clusters"]) == 0
    assert "V100-32G" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["evaluate", "gpt2", "--cluster", "8xB200", "--global-batch", "8", "--seq", "128"],
            "unknown device type 'B200'",
        ),
        (["compile", "gpt2", "--cluster", "8xA100", "--global-batch", "0", "--out", "x"], "--global-batch is 0"),
        (["run", "/nonexistent/dir"], "no plan at"),
    ],
)
def test_bad_input_exit_2(argv: list[str], match: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and err.startswith("partita: error:")


def test_bad_cluster_file_subprocess(tmp_path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes: [ {device: A100")
    r = run_cli("compile", "mlp", "--cluster", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    err = " ".join(r.stderr.split())
    assert "not valid YAML" in err and "line " in err and "Traceback" not in err


@pytest.mark.parametrize(
    "model, match",
    [
        ("gpt-17", "unknown model 'gpt-17'"),
        ("tests.model_fixtures:branchy", "Branchy"),
        ("no.such.module:factory", "cannot load model factory"),
    ],
)
def test_bad_model_subprocess(model: str, match: str) -> None:
    r = run_cli("trace", model)
    assert r.returncode == 2, r.stderr[-3000:]
    err = " ".join(r.stderr.split())
    assert match in err and "Traceback" not in err and "partita: error:" in err


# ---- the newcomer's first hour (issue 21): readable output, quiet third parties, Ctrl-C ----------
def test_trace_names_layer_kinds_readably() -> None:
    """`partita trace` shows what a layer kind contains, not its structural hash; --json keeps the hash."""
    import re

    r = run_cli("trace", "gpt2-tiny")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "attention, 4 matmuls, 2 norms" in r.stdout and "Repeated layers" in r.stdout
    assert not re.search(r"\b[0-9a-f]{12}\b", r.stdout), r.stdout
    # transformers' config warnings are held back and summarized in one line
    assert "bos_token_id" not in r.stderr and "loss_type" not in r.stderr
    assert re.search(r"partita: \d+ third-party warnings? hidden; --verbose shows them", r.stderr), r.stderr
    loud = run_cli("trace", "gpt2-tiny", "--verbose", "--json")
    assert loud.returncode == 0 and "bos_token_id" in loud.stderr and "hidden" not in loud.stderr
    kinds = {lay["kind"] for lay in json.loads(loud.stdout)["layers"]}
    assert all(re.fullmatch(r"[0-9a-f]{12}", k) for k in kinds)


def test_third_party_noise_is_held_and_partita_warnings_pass(capsys) -> None:
    import logging
    import warnings

    from partita.cli import _ThirdPartyNoise

    lib = logging.getLogger("somelib.sub")
    handler = logging.StreamHandler(sys.stderr)
    lib.addHandler(handler)
    try:
        noise = _ThirdPartyNoise(verbose=False)
        with noise:
            lib.warning("library chatter")
            lib.error("a real library error")
            warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
            warnings.warn("partita: one of ours", UserWarning, stacklevel=1)
        noise.summarize()
        err = capsys.readouterr().err
        assert "library chatter" not in err and "deprecated thing" not in err
        assert "a real library error" in err and "partita: warning: one of ours" in err
        assert "partita: 2 third-party warnings hidden; --verbose shows them" in err
        assert len(noise.held) == 2
        lib.warning("after the command")  # the patch is undone when the command ends
        assert "after the command" in capsys.readouterr().err
    finally:
        lib.removeHandler(handler)


def test_child_process_quieting_is_undone(monkeypatch) -> None:
    """`partita run` / `profile` quiet transformers in their ranks for the command only."""
    import os

    from partita.cli import _ThirdPartyNoise

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    with _ThirdPartyNoise(verbose=False, children=True):
        assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    assert "TRANSFORMERS_VERBOSITY" not in os.environ
    with _ThirdPartyNoise(verbose=True, children=True):
        assert "TRANSFORMERS_VERBOSITY" not in os.environ


def _torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` or a process it forked has torch's library mapped (a command imports torch
    only once inside its work: a cold compile in the child that traces, ``partita/trace_child.py``)."""
    try:
        if "libtorch" in Path(f"/proc/{pid}/maps").read_text():
            return True
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return False
    return any(_torch_loaded(int(c)) for c in children)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to see what the command loaded")
def test_ctrl_c_is_one_line_and_exit_130(tmp_path) -> None:
    import os
    import signal
    import time

    env = dict(os.environ, PARTITA_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    p = subprocess.Popen(
        [sys.executable, "-m", "partita.cli", "compile", "--out", str(tmp_path / "out"), "--force"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    # Not a fixed delay: under a full suite's load a SIGINT sent at 6 s could land while the interpreter was
    # still starting (Python's own startup, before `main` handles Ctrl-C: a traceback, or the signal lost and
    # the compile going on to exit 0). Signal once the command is inside its work: torch mapped (tracing, in
    # the command or the child it traces in: the SIGINT goes to the command, which ends that child).
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline and not _torch_loaded(p.pid):
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and [ln for ln in err.splitlines() if ln.strip()] == [
        "partita: interrupted (Ctrl-C); files already written are complete, nothing was half-written."
    ], err[-3000:]
    assert not (tmp_path / "out" / "plan.json").exists()


def test_ctrl_c_inside_a_weakref_callback_still_ends_the_command(tmp_path) -> None:
    """CI once sent the SIGINT while a weakref callback ran: the interpreter printed "Exception ignored in ..."
    and dropped the KeyboardInterrupt, and the compile went on to exit 0. Here the interrupt lands there on purpose."""
    code = textwrap.dedent(
        """
        import sys, weakref
        from partita import cli

        class Block: pass

        def interrupt():
            raise KeyboardInterrupt

        def command(argv):
            block = Block()
            ref = weakref.ref(block, lambda ref: interrupt())
            del block  # the callback runs here, and its KeyboardInterrupt is "unraisable"
            print("went on after Ctrl-C")
            return 0

        cli._main = command
        sys.exit(cli.main())
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 130, (p.stdout, p.stderr)
    assert "went on" not in p.stdout and p.stderr.strip().splitlines() == [
        "partita: interrupted (Ctrl-C); files already written are complete, nothing was half-written."
    ], p.stderr


def test_evaluate_prints_memory_readably(capsys, monkeypatch) -> None:
    import re

    monkeypatch.setenv("COLUMNS", "160")  # the per-stage table's headers unwrapped

    argv = ["evaluate", "gpt2-tiny", "--cluster", "4xA100-80G", "--global-batch", "8", "--seq", "32", "--dp", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "per step" in out and "GiB" in out and "time per micro-batch" in out
    assert not re.search(r"\d{7,}\.\d", out), out  # no raw byte counts such as 38780805152.0
    assert "memory_per_device" not in out


def test_report_html_says_what_it_wrote_and_compares_both(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    args = ["--cluster", "2xCPU", "--global-batch", "8", "--seq", "1", "--dtype", "f32"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["compile", "mlp", *args, "--out", a]) == 0
    first = capsys.readouterr().out
    assert f"compile cache: {tmp_path / 'cache'}" in first and "cache hit" not in first
    assert main(["compile", "mlp", *args, "--out", b]) == 0
    assert "cache hit" in capsys.readouterr().out
    page = tmp_path / "one.html"
    assert main(["report", a, "--html", str(page)]) == 0
    assert f"wrote {page}" in capsys.readouterr().out and 'id="timeline"' in page.read_text()
    both = tmp_path / "both.html"
    assert main(["report", a, b, "--html", str(both)]) == 0
    out = capsys.readouterr().out
    assert "Plan comparison" in out and f"wrote {both} (the comparison of both plans" in out
    text = both.read_text()
    assert 'id="A-timeline"' in text and 'id="B-timeline"' in text and 'id="compare"' in text


def test_no_calibration_does_not_outlive_its_command(tmp_path, monkeypatch) -> None:
    """`--no-calibration` sets PARTITA_CALIBRATION=off for its own command only: an in-process caller's
    next command plans calibrated again (it used to leak into every later call)."""
    monkeypatch.delenv("PARTITA_CALIBRATION", raising=False)
    rc = main(["compile", "mlp", "--cluster", "3xNoSuchGPU", "--out", str(tmp_path / "o"), "--no-calibration"])
    assert rc == 2
    import os

    assert "PARTITA_CALIBRATION" not in os.environ


def test_compile_progress_lines_go_to_stderr_and_json_stays_whole(tmp_path, capsys, monkeypatch) -> None:
    """Issue 35 item 10: a compile says what it is doing, one line per phase, on stderr (here asked for
    with PARTITA_PROGRESS=1: captured output is no terminal); stdout stays one JSON document."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PARTITA_PROGRESS", "1")
    args = ["--cluster", "2xCPU", "--global-batch", "8", "--seq", "1", "--dtype", "f32", "--json"]
    assert main(["compile", "mlp", *args, "--out", str(tmp_path / "a")]) == 0
    got = capsys.readouterr()
    json.loads(got.out)
    lines = got.err.splitlines()
    assert any(x.startswith("partita: tracing mlp") for x in lines), got.err
    assert any(x.startswith("partita: traced ") and "searching 2 devices" in x for x in lines), got.err
    monkeypatch.setenv("PARTITA_PROGRESS", "0")
    assert main(["compile", "mlp", *args, "--out", str(tmp_path / "b"), "--force"]) == 0
    assert "partita: trac" not in capsys.readouterr().err


def test_evaluate_progress_lines_when_it_traces(capsys, monkeypatch) -> None:
    """Issue 35 item 10: ``evaluate`` of a model with no stored trace says it is tracing and then pricing,
    on stderr; stdout stays one JSON document; PARTITA_PROGRESS=0 silences it."""
    monkeypatch.setenv("PARTITA_PROGRESS", "1")
    args = ["evaluate", "mlp", "--cluster", "2xCPU", "--global-batch", "8", "--seq", "1", "--dtype", "f32"]
    layout = ["--tp", "1", "--pp", "1", "--dp", "2", "--micro-batch", "4", "--json"]
    assert main([*args, *layout]) == 0
    got = capsys.readouterr()
    json.loads(got.out)
    assert any(x.startswith("partita: tracing mlp") for x in got.err.splitlines()), got.err
    assert any(x.startswith("partita: traced ") and "pricing the layout" in x for x in got.err.splitlines()), got.err
    monkeypatch.setenv("PARTITA_PROGRESS", "0")
    assert main([*args, *layout]) == 0
    assert "partita: trac" not in capsys.readouterr().err


def test_evaluate_of_a_zoo_model_reads_its_stored_trace(tmp_path) -> None:
    """Issue 35 item 10: ``evaluate`` of a shipped model reads the stored graph as ``compile`` does (it
    traced afresh before: torch and transformers imported, over a minute on a loaded machine)."""
    import subprocess
    import sys

    code = (
        "import sys, io, contextlib, json\n"
        "from partita.cli import main\n"
        "out = io.StringIO()\n"
        "argv = ['evaluate', 'llama-7b', '--cluster', '64xH100-80G', '--global-batch', '8', '--seq', '2048',\n"
        "        '--tp', '8', '--pp', '4', '--dp', '2', '--micro-batch', '1', '--json']\n"
        "with contextlib.redirect_stdout(out): rc = main(argv)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules)\n"
        "print(rc, heavy, json.loads(out.getvalue())['predicted_step_time_s'] > 0)\n"
    )
    env = {**__import__("os").environ, "PARTITA_CACHE_DIR": str(tmp_path / "cache")}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert got.stdout.splitlines()[-1:] == ["0 [] True"], got.stderr[-2000:]
