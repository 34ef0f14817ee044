"""Files written whole or not at all, the compile cache's content hashes, and the guard around user code.

Beside ``driver.py`` (which calls these): ``_atomic_write`` / ``_write_all`` write an output directory's
files under temporary names and rename them once all are written; ``store_cache_entry`` /
``verified_entry`` keep a sha256 of every cached file and serve an entry only when each one matches;
``user_code`` runs a user's factory or data function and names its error in one paragraph.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.errors import ConfigError, ModelError


def _is_factory_spec(spec: str) -> bool:
    return ":" in spec and not Path(spec.rpartition("#")[0] or spec).exists()


@contextlib.contextmanager
def user_code(spec: str, what: str = "model factory") -> Any:
    """The guard around a user's ``package.module:function`` (a model factory and its example inputs, a
    data function): importing it, calling it. An error the user's code raised (a syntax error, an
    exception at import or in the call, ``sys.exit``) becomes one ``ModelError`` naming the function and
    its error, its traceback kept for ``--verbose``; an error of Partita's own keeps its traceback."""
    if not _is_factory_spec(spec):
        yield
        return
    mod_name, _, fn_name = spec.partition("#")[0].partition(":")
    if not all(p.isidentifier() for p in mod_name.split(".")) or not fn_name.isidentifier():
        raise ModelError(
            f"{what} {spec!r} is not of the form package.module:function.",
            "write the module's import path, a colon and the function's name, e.g. mymodels:build.",
        )
    from partita.errors import PartitaError

    try:
        yield
    except (PartitaError, KeyboardInterrupt, GeneratorExit):
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - sorted below: the user's, or re-raised
        where = _user_frame(e, mod_name)
        if where is None:
            raise
        import traceback

        detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        said = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
        raise ModelError(
            f"{what} {spec!r} {said} ({where}).",
            "fix that code so the function runs on its own (`python -c 'import ...'`); --verbose shows its traceback.",
            detail,
        ) from None


def _user_frame(e: BaseException, mod_name: str) -> str | None:
    """Where in the user's module ``e`` came from (``file.py:LINE``), or None when it did not."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(mod_name)
        origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else None
    except (ImportError, ValueError, SyntaxError, AttributeError):
        origin = None
    if isinstance(e, SyntaxError) and e.filename and (origin is None or os.path.realpath(e.filename) == origin):
        return f"{Path(e.filename).name}:{e.lineno}"
    frames = traceback.extract_tb(e.__traceback__)
    for fr in reversed(frames):
        if origin is not None and os.path.realpath(fr.filename) == origin:
            return f"{Path(fr.filename).name}:{fr.lineno}"
    # calling what the factory returned as its example inputs, when that is not a function
    last = frames[-1] if frames else None
    if isinstance(e, TypeError) and "not callable" in str(e) and last and last.filename.endswith("zoo.py"):
        return "its example inputs are not a function"
    return None


def _atomic_write(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary name and a rename; the temporary file is removed on
    any failure (a full disk, a read-only directory), so nothing half-written is left behind."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_all(out: Path, contents: Mapping[str, str]) -> None:
    """Every file of ``contents`` into ``out``, whole or not at all: all are written to temporary names
    first and renamed only once every one is written; on a failure the temporary files are removed, and
    ``out`` too when this call created it."""
    created = [d for d in (out, *out.parents) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    tmps: list[tuple[Path, Path]] = []
    try:
        for name, text in contents.items():
            tmp = out / f".{name}.tmp{os.getpid()}"
            tmps.append((tmp, out / name))
            tmp.write_text(text)
        for tmp, final in tmps:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in tmps:
            with contextlib.suppress(OSError):
                tmp.unlink()
        for d in created:  # innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def file_hashes(contents: Mapping[str, str]) -> dict[str, str]:
    return {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(contents.items())}


HASH_FILE = "hashes.json"


def store_cache_entry(entry: Path, contents: Mapping[str, str]) -> None:
    """A compile-cache entry, whole or not at all: the files and ``hashes.json`` (the sha256 of each)
    are written into a temporary directory beside it, which is then renamed into place. A cache that
    cannot be written leaves the compile's ``--out`` as it is, and says so in a warning."""
    import shutil
    import warnings

    tmp = entry.with_name(f".{entry.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for name, text in contents.items():
            (tmp / name).write_text(text)
        (tmp / HASH_FILE).write_text(json.dumps(file_hashes(contents), indent=1, sort_keys=True) + "\n")
        if entry.exists():  # a damaged or older entry: replaced
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / HASH_FILE).exists():  # not a concurrent compile's finished entry
                raise
    except OSError as e:
        warnings.warn(
            f"partita: the compile cache entry {entry} could not be written ({e.strerror or e}); the outputs are "
            "complete, the next compile searches again. Set PARTITA_CACHE_DIR to a writable directory.",
            stacklevel=2,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def verified_entry(entry: Path, names: Sequence[str]) -> dict[str, str] | None:
    """The named files of a cache entry when every one matches the content hash stored with it; None
    (and a warning saying why, when the entry exists) otherwise: the caller recompiles."""
    import warnings

    if not entry.is_dir():
        return None
    try:
        hashes = json.loads((entry / HASH_FILE).read_text())
        got = {name: (entry / name).read_text() for name in names}
    except (OSError, ValueError) as e:
        why = f"{HASH_FILE} or a file is missing or unreadable ({type(e).__name__})"
        got, hashes = {}, None
    else:
        bad = [n for n in names if not isinstance(hashes, dict) or hashes.get(n) != file_hashes({n: got[n]})[n]]
        why = f"{', '.join(bad)} do{'es' if len(bad) == 1 else ''} not match the content hash stored with it"
        if not bad:
            return got
    warnings.warn(
        f"partita: the compile cache entry {entry} is damaged ({why}); recompiling.",
        stacklevel=2,
    )
    import shutil

    shutil.rmtree(entry, ignore_errors=True)  # never served again; the recompile writes it anew
    return None


# ---- output paths checked before any work (`partita compile --out`, `--html`, `profile --out`, the cache) ----
def _probe_dir(d: Any, what: str) -> None:
    """Create directory ``d`` (and its parents) and a file in it, then remove what was created: an output
    place that cannot be written is refused before any work, and nothing is left behind."""
    import tempfile
    from pathlib import Path

    d = Path(d)
    created = [q for q in (d, *d.parents) if not q.exists()]
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=d, prefix=".partita-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ConfigError(
            f"{what} {d} cannot be written ({e.strerror or e}).",
            "pick a directory this user can write (not under /proc or /sys, not on a read-only file system).",
        ) from None
    finally:
        for q in created:  # innermost first
            try:
                q.rmdir()
            except OSError:
                pass


def _check_writable_target(path: str, flag: str, want_dir: bool) -> None:
    """Refuse an output path that cannot be created before any work starts (nothing written half-way)."""
    from pathlib import Path

    p = Path(path)
    if path.strip() == "-":
        what = "a directory" if want_dir else "a file"
        raise ConfigError(
            f"{flag} is '-': Partita writes {flag} to {what}, not to standard output.", f"pass {what} name to {flag}."
        )
    if p.is_symlink() and not p.exists():
        raise ConfigError(
            f"{flag} {path} is a symbolic link to {os.readlink(p)}, which does not exist.",
            f"create the directory it points to, remove the link, or pass another path to {flag}.",
        )
    if want_dir:
        existing = next(q for q in (p, *p.parents) if q.exists() or q == Path("."))
        if existing.exists() and not existing.is_dir():
            raise ConfigError(f"{flag} {path}: {existing} is a file, not a directory.", f"pass a directory to {flag}.")
        _probe_dir(p, f"{flag} directory")
        return
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory.", f"pass a file name, e.g. {flag} {p / 'plan.html'}.")
    _check_not_users_file(p, flag)
    if not p.parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {p.parent} does not exist.", "create it or pick another path.")
    _probe_dir(p.parent, f"{flag}: directory")


# what a file this command writes begins with: another existing file at that path is the user's own
_OWN_FILE_STARTS = {"--html": (b"<!doctype html",), "--out": (b"{",)}


def _check_not_users_file(p: Any, flag: str) -> None:
    """An output file path that already holds a file of another kind (``--html`` naming the plan's own
    plan.json, a user's notes) is refused: writing would overwrite it."""
    from pathlib import Path

    p = Path(p)
    if not p.exists():
        return
    try:
        import stat

        if not stat.S_ISREG(p.stat().st_mode):
            raise ConfigError(f"{flag} {p} exists and is not a regular file.", f"pass a new file name to {flag}.")
        with open(p, "rb") as f:
            head = f.read(64).lstrip().lower()
    except OSError:
        return  # _probe_dir names what is wrong with the place
    starts = _OWN_FILE_STARTS.get(flag, ())
    if head and not any(head.startswith(s) for s in starts):
        raise ConfigError(
            f"{flag} {p} already exists and is not a file Partita wrote there (it would be overwritten).",
            f"pass a new file name to {flag}, or move that file away first.",
        )


PLAN_DIR_MARKS = ("plan.json", "cache_key.json")  # what makes a directory a Partita plan directory


def _check_out_dir(path: str, force: bool) -> None:
    """``--out`` into a non-empty directory that is not a Partita plan directory would overwrite the user's
    own files (a ``report.txt``): refused unless ``--force``."""
    from pathlib import Path

    p = Path(path)
    if force or not p.is_dir():
        return
    try:
        entries = sorted(q.name for q in p.iterdir())
    except OSError:
        return  # _probe_dir names it
    if entries and not any(m in entries for m in PLAN_DIR_MARKS):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ConfigError(
            f"--out {path} is a directory holding other files ({shown}), not a Partita plan directory; "
            "the compile would overwrite plan.json, report.txt and the program there.",
            "pass an empty or new directory to --out, or --force to write there anyway.",
        )


def _check_cache_dir(d: Path) -> None:
    if d.exists() and not d.is_dir():
        raise ConfigError(
            f"the compile cache directory {d} is a file.", "set PARTITA_CACHE_DIR to a directory (or remove the file)."
        )
    try:
        _probe_dir(d / "plans", "the compile cache directory")
    except ConfigError as e:
        raise ConfigError(e.problem, "set PARTITA_CACHE_DIR to a writable directory.") from None


def os_error_text(err: OSError) -> str:
    """An OSError as one sentence naming the path, what the system said, and the fix."""
    import errno

    path = err.filename if err.filename is not None else "a file"
    why = err.strerror or str(err)
    code = err.errno
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make it writable (or readable) for this user, or pick a path on a writable file system."
    elif code == errno.ENOENT:
        fix = "create the directory first, or fix the path."
    elif code == errno.EISDIR:
        fix = "pass a file path, not a directory."
    elif code == errno.ENOTDIR:
        fix = "a part of the path is a file, not a directory: pick another path."
    elif code == errno.ENAMETOOLONG:
        fix = "use a shorter path (at most 255 bytes per name, 4096 in all)."
    elif code in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space, or pick a path on another file system."
    else:
        fix = "check the path and its permissions, or pick another path."
    other = f" (and {err.filename2})" if getattr(err, "filename2", None) else ""
    return f"cannot use {path}{other}: {why}. Fix: {fix}"
