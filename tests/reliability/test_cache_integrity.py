"""The compile cache and ``--out`` (issue 34): every cache entry carries the sha256 of each of its files and
a hit verifies them; a damaged entry is recompiled, with a warning saying so. ``--out`` is written before
the cache, each whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
from pathlib import Path

import pytest

from partita import driver
from partita.cli import main

ARGV = ["compile", "mlp", "--cluster", "4xCPU", "--global-batch", "8", "--seq", "4", "--dtype", "f32"]


def _compile(out: Path) -> tuple[int, str]:
    so, se = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        rc = main([*ARGV, "--out", str(out)])
    return rc, so.getvalue() + se.getvalue()


def _entries(cache: Path) -> list[Path]:
    return [p for p in (cache / "plans").iterdir() if not p.name.startswith(".")]


def test_damaged_cache_entry_is_recompiled_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    rc, text = _compile(tmp_path / "a")
    assert rc == 0, text
    (entry,) = _entries(tmp_path / "cache")
    hashes = json.loads((entry / driver.HASH_FILE).read_text())
    assert sorted(hashes) == ["plan.json", "program_torch.py"]
    program = (tmp_path / "a" / "program_torch.py").read_text()
    (entry / "program_torch.py").write_text(program[: len(program) // 2])  # truncated, as a full disk leaves it

    rc, text = _compile(tmp_path / "b")  # before: served the truncated program as a hit, again and again
    assert rc == 0 and "Traceback" not in text, text
    assert "is damaged (program_torch.py does not match the content hash" in " ".join(text.split()), text
    assert "cache hit" not in text
    assert (tmp_path / "b" / "program_torch.py").read_text() == program
    assert (entry / "program_torch.py").read_text() == program  # the entry is whole again

    rc, text = _compile(tmp_path / "c")
    assert rc == 0 and "cache hit" in text and "is damaged" not in text, text
    assert (tmp_path / "c" / "program_torch.py").read_text() == program


def test_out_is_written_before_the_cache_and_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills while ``--out`` is written: no file of --out, no temporary file, no cache entry
    (before: the cache kept a plan.json with no program, and .tmp files stayed in --out)."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    real = Path.write_text
    calls = []

    def full_disk(self: Path, text: str, *a: object, **k: object) -> int:
        calls.append(self.name)
        if len(calls) == 3:  # the third file of --out
            real(self, text[:100])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", full_disk)
    rc, text = _compile(tmp_path / "out")
    monkeypatch.setattr(Path, "write_text", real)
    assert rc == 2 and "Traceback" not in text, text
    flat = " ".join(text.split())
    assert "No space left on device" in flat and "free some space" in flat, text
    assert not (tmp_path / "out").exists()
    cache = tmp_path / "cache" / "plans"
    assert not cache.exists() or not list(cache.rglob("*")), list(cache.rglob("*"))
