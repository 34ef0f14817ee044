"""What `partita run`, `rehearse` and `report` check before they start: the program file is whole, a
`--resume` has a checkpoint, a `--data-fn` has the right signature, a run log is whole JSON.

Called by ``driver.py``; each refusal is one paragraph (``errors``), exit code 2.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from partita.errors import ConfigError, PlanError
from partita.outputs import _user_frame, user_code

if TYPE_CHECKING:
    from partita.plan import Plan


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last one wins), or None."""
    got = None
    for k, a in enumerate(args):
        if a == flag and k + 1 < len(args):
            got = args[k + 1]
        elif a.startswith(flag + "="):
            got = a[len(flag) + 1 :]
    return got


def _check_program(plan_dir: str | Path, plan: Plan) -> None:
    """The generated program beside the plan must be whole Python: a truncated or damaged one is named
    here, before any launch (the ranks' tracebacks would not say what is wrong)."""
    d = Path(plan_dir) if Path(plan_dir).is_dir() else Path(plan_dir).parent
    name = "program_jax.py" if plan.model.get("framework") == "jax" else "program_torch.py"
    path = d / name
    if path.exists() and not path.is_file():
        raise PlanError(
            f"{path} is not a file.",
            f"remove it and recompile: `partita compile ... --out {d} --force` writes it again.",
        )
    if not path.is_file():
        return  # the launcher names a missing program
    try:
        compile(path.read_bytes(), str(path), "exec")
    except (SyntaxError, ValueError) as e:
        line = f" (line {e.lineno}: {e.msg})" if isinstance(e, SyntaxError) else ""
        raise PlanError(
            f"{path} is not valid Python{line}; it is truncated or damaged.",
            f"recompile: `partita compile ... --out {d} --force` writes it again.",
        ) from None


def _check_resume(plan_dir: str | Path, extra_args: Sequence[str]) -> None:
    """``--resume`` needs a published checkpoint (``step-NNNNNN/partita_step.json``) to resume from."""
    import re

    d = Path(plan_dir) if Path(plan_dir).is_dir() else Path(plan_dir).parent
    root = Path(_flag_value(extra_args, "--checkpoint-dir") or d / "checkpoints")
    found = root.is_dir() and any(
        re.fullmatch(r"step-\d{6}", p.name) and (p / "partita_step.json").is_file() for p in root.iterdir()
    )
    if not found:
        raise PlanError(
            f"--resume: there is no checkpoint under {root} to resume from.",
            "drop --resume to start at step 1 (with --checkpoint-every N to write checkpoints), or pass the run's "
            "checkpoint directory after `--`: `-- --checkpoint-dir DIR`.",
        )


def check_data_fn(spec: str) -> None:
    """``--data-fn module:function``: importable, callable, and callable as ``function(step, rows, seq_len)``,
    checked here before any rank starts (each rank would otherwise fail with its own traceback)."""
    import importlib
    import inspect

    if ":" not in spec:
        raise ConfigError(f"--data-fn {spec!r} is not module:function.", "pass e.g. --data-fn mydata:batch.")
    with user_code(spec, "--data-fn"):
        mod_name, _, fn_name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            if isinstance(e, ImportError) and _user_frame(e, mod_name) is not None:
                raise
            raise ConfigError(
                f"--data-fn {spec!r} cannot be loaded ({e}).", "pass module:function importable here."
            ) from None
    if not callable(fn):
        raise ConfigError(f"--data-fn {spec!r} is {type(fn).__name__}, not a function.", "pass module:function.")
    try:
        inspect.signature(fn).bind(0, [0], 1)
    except TypeError as e:
        raise ConfigError(
            f"--data-fn {spec!r} cannot be called as function(step, rows, seq_len): {e}.",
            "give it the signature (step, rows, seq_len) -> (inputs, labels).",
        ) from None
    except ValueError:
        pass  # no signature to read (a builtin): called as it is


def check_program_args(extra_args: Sequence[str]) -> None:
    """The arguments `partita run` hands the training program (``--data-file``, ``--data-fn`` and what the
    user wrote after ``--``): parsed here with the program's own parser, and the files and directories
    they name checked, before any rank starts (each rank would otherwise fail with its own traceback,
    or a rank would block on a named pipe)."""
    import contextlib
    import io

    from partita.backends.torch.train import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(list(extra_args))
    except SystemExit:
        said = (err.getvalue().strip().splitlines() or ["its parser refused them"])[-1]
        said = said.split("error: ", 1)[-1]
        raise ConfigError(
            f"the training program does not take the arguments given after `--` ({said}).",
            "see `python DIR/program_torch.py --help` for the options it takes, or drop them.",
        ) from None
    from partita.user_files import check_regular

    if args.data_file:
        check_regular(args.data_file, "token file", "pass --data-file with the path of a flat .bin file.", ConfigError)
    from partita.outputs import _check_writable_target

    for flag in ("--checkpoint-dir", "--dump-grads", "--dump-params"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:
            _check_writable_target(value, flag, want_dir=True)


def _check_run_log(plan_dir: str) -> None:
    """A run log beside the plan that is not whole JSON is named, not silently left out of the report."""
    from partita.report.run_log import RUN_LOG_FILE

    d = Path(plan_dir) if Path(plan_dir).is_dir() else Path(plan_dir).parent
    path = d / RUN_LOG_FILE
    if not path.exists():
        return
    fix = f"remove it, or run `partita run {d}` again to write it anew."
    try:
        log = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise PlanError(f"{path} is not a whole run log ({type(e).__name__}); it may be truncated.", fix) from None
    except OSError as e:
        raise PlanError(f"{path} cannot be read ({e.strerror or e}).", fix) from None
    from partita.report.run_log import FORMAT

    if not isinstance(log, dict) or log.get("format") != FORMAT:
        raise PlanError(f"{path} is not a Partita run log (no format={FORMAT!r}).", fix)
    bad = _run_log_field(log)
    if bad is not None:
        raise PlanError(f"{path} is not a whole run log: {bad}.", fix)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _run_log_field(log: dict) -> str | None:
    """The first field of a run log that is missing or not what ``report/run_log_view`` reads, or None."""
    for key in ("version", "steps", "stages", "losses"):
        if key not in log:
            return f"{key!r} is missing"
    if not isinstance(log["steps"], int) or isinstance(log["steps"], bool):
        return f"'steps' is {log['steps']!r}, not an integer"
    for key in ("losses", "reference_losses"):
        v = log.get(key)
        if v is not None and not (isinstance(v, list) and all(_is_num(x) for x in v)):
            return f"{key!r} is not a list of numbers"
    st = log.get("step_time_s")
    if st is not None:
        if not isinstance(st, dict):
            return "'step_time_s' is not a mapping"
        for k in ("predicted", "measured_median", "error"):
            if st.get(k) is not None and not _is_num(st[k]):
                return f"'step_time_s.{k}' is {st[k]!r}, not a number"
        if st.get("measured") is not None and not (
            isinstance(st["measured"], list) and all(_is_num(x) for x in st["measured"])
        ):
            return "'step_time_s.measured' is not a list of numbers"
    if not isinstance(log["stages"], list):
        return "'stages' is not a list"
    for n, stage in enumerate(log["stages"]):
        if not isinstance(stage, dict) or not isinstance(stage.get("index"), int):
            return f"stages[{n}] is not a stage record with an index"
        for key in ("measured_time_s", "predicted_time_s"):
            if stage.get(key) is not None and not _is_num(stage[key]):
                return f"stages[{n}].{key} is {stage[key]!r}, not a number"
        if not isinstance(stage.get("collectives", {}), dict):
            return f"stages[{n}].collectives is not a mapping"
    return None
