"""The trace of a named model in a forked child, while this process imports the search (issue 35 item 10).

Beside ``driver.py`` (it runs the capture stage, ``frontends/``, in another process), called by
``driver._compile_to_dir`` for a model named by a zoo name or a ``config.json`` that has no stored
trace. A cold compile of such a model is one chain: import torch and transformers (~5 CPU seconds), build on meta, ``torch.export`` a few blocks,
the passes; then the search, which forks workers on every CPU. The compiling process needs none of
the framework after the trace (the graph is plain IR; the torch emitter imports no torch), so here
a forked child resolves the model and traces it (``trace.trace_handle``, the same call the driver
makes) and sends the graph back pickled, while this process imports the search, the report and the
emitter on the other CPU. The graph is the one the driver would have traced (the same code, in a
copy of this process), so the plan is byte-identical (``bench/compile_speed.py`` checks it); and this
process never holds torch, so the search's forked workers copy a smaller heap.

What the child writes to stdout and stderr (a library's warnings) is kept in files and replayed here
once the graph has come back. A child that fails for any reason (an error in the model, a signal,
a graph that cannot be pickled) is discarded with what it wrote, and ``None`` tells the caller to
trace here as before: the error and its message are then the ones a user always got. Not used where
``fork`` is missing, where torch or JAX is already imported (a test process, ``partita.parallelize``:
nothing left to overlap, and a fork of a process with their threads is unsafe), or with
``PARTITA_TRACE_CHILD=off``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import tempfile
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partita.ir import Graph

# what the compiling process imports while the child traces: the search, its yardstick, the report and
# the torch emitter (none of them imports torch); not the MIP solver, which is loaded in the search's
# workers (a solver loaded before their fork once hung them)
WARM = (
    "partita.ir",
    "partita.search.entry.planner",
    "partita.search.entry.hand_best",
    "partita.search.layer.memo",
    "partita.report",
    "partita.backends.torch.emit",
    "partita.backends.torch.launch",
)


def wanted() -> bool:
    """Whether :func:`trace_in_child` may fork (module docstring)."""
    if os.environ.get("PARTITA_TRACE_CHILD", "").strip().lower() in ("off", "0", "false"):
        return False
    return hasattr(os, "fork") and "torch" not in sys.modules and "jax" not in sys.modules


def named_trace(model: str, seq: int, batch: int, progress: bool) -> tuple[Graph, float, float] | None:
    """:func:`trace_in_child`, with the progress line the driver's own trace would have said."""
    if progress and wanted():
        from partita.progress import say

        say(f"tracing {model} on the meta device (no weights), the search imported beside it")
    return trace_in_child(model, seq, batch)


def trace_in_child(model: str, seq: int, batch: int) -> tuple[Graph, float, float] | None:
    """``(graph, wall seconds, CPU seconds)`` of ``trace_handle(resolve_model(model), batch=batch,
    seq=seq)`` run in a forked child while this process imports :data:`WARM`; ``None`` where the
    child is not wanted or did not deliver (the caller then traces here)."""
    if not wanted():
        return None
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (coverage does not follow a fork that ends in _exit)
        os.close(r)
        _child(model, seq, batch, w, out, err)
    os.close(w)
    try:
        for name in WARM:
            importlib.import_module(name)
        chunks = []
        while chunk := os.read(r, 1 << 20):
            chunks.append(chunk)
        _, status, usage = os.wait4(pid, 0)
    except BaseException:  # Ctrl-C or an error here: the child goes too
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        os.close(r)
    wall, cpu = time.perf_counter() - t0, usage.ru_utime + usage.ru_stime
    try:
        graph = pickle.loads(b"".join(chunks)) if os.waitstatus_to_exitcode(status) == 0 and chunks else None
    except Exception:  # noqa: BLE001 - a graph that does not come back whole: trace here
        graph = None
    if graph is not None:
        _replay(out, sys.stdout)
        _replay(err, sys.stderr)
    out.close()
    err.close()
    return None if graph is None else (graph, wall, cpu)


def _child(model: str, seq: int, batch: int, w: int, out: IO[bytes], err: IO[bytes]) -> None:  # pragma: no cover
    code = 1
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent's Ctrl-C handling is not the child's
        from partita.gc_freeze import throwaway

        throwaway()  # the collector off: this process ends with the trace (gc_freeze.py)
        from partita.frontends.trace import trace_handle
        from partita.models import resolve_model

        handle = resolve_model(model)
        graph = trace_handle(handle, batch=batch, seq=seq)
        data = pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(w, "wb") as pipe:
            pipe.write(data)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent traces again and shows the error itself
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _replay(f: IO[bytes], to: Any) -> None:
    """What the child wrote to ``f``, onto ``to`` (its bytes where ``to`` has a buffer, else decoded)."""
    f.seek(0)
    data = f.read()
    if not data:
        return
    buffer = getattr(to, "buffer", None)
    if buffer is not None:
        to.flush()
        buffer.write(data)
        buffer.flush()
    else:  # a StringIO (a test's redirect)
        to.write(data.decode(errors="replace"))
