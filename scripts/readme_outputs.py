"""Regenerate or check every command output the README shows, so the README cannot drift.

Each output block in README.md sits under a marker line ``<!-- readme-output: NAME -->`` and is the
fenced block right after it. ``BLOCKS`` below says which commands make block NAME. The commands run
in a fresh temporary directory (``examples/`` linked in) with a fresh compile cache there
(``PARTITA_CACHE_DIR=.cache/partita``), so a cache left by earlier runs cannot serve them.

    python scripts/readme_outputs.py --write            # run everything, rewrite the README blocks
    python scripts/readme_outputs.py --check            # run everything, exit 1 with a diff on drift
    python scripts/readme_outputs.py --check clusters   # only the named blocks

``tests/test_readme.py`` runs ``--check`` logic per block. Comparison ignores what legitimately
varies between runs (wall times, cache-entry hashes, the last digits of long floats); everything
else, plan numbers included, must match. ``scripts/readme_outputs.sh`` is the same with a shell
entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"^<!-- readme-output: ([\w-]+) -->$")


@dataclasses.dataclass(frozen=True)
class Cmd:
    """One shell command of a block. To abridge its output to a head, a ``...`` line and a tail:
    ``head_until`` (the head ends before the first line matching this regex; "" = no head) and
    ``tail_from`` (the tail starts at the first line after the head matching it; None = no tail).
    Without ``head_until`` the whole output is kept. ``subs``: (regex, replacement) applied to the
    fresh output before it is shown (to abridge a long JSON line)."""

    line: str
    head_until: str | None = None
    tail_from: str | None = None
    subs: tuple[tuple[str, str], ...] = ()
    drop: str | None = None  # lines matching this regex are left out (per-step progress with timings)


_DONE = r"^(wrote |cache hit: )"  # the last lines of `partita compile`: what it wrote or where it loaded from
BLOCKS: dict[str, tuple[Cmd, ...]] = {
    "clusters": (Cmd("partita clusters"),),
    "train-torch": (
        Cmd("python examples/train_torch.py --model mlp"),
        Cmd(
            "torchrun --standalone --nproc-per-node 4 examples/train_torch.py --model mlp",
            subs=((r', "step_time_s": .*\}$', ", ...}"),),
        ),
    ),
    "compile-default": (
        Cmd("partita compile --out out/default", head_until=r"^\s*Search statistics$", tail_from=_DONE),
        Cmd("partita compile --out out/default2", head_until="", tail_from=_DONE),
    ),
    "run-mlp": (
        Cmd(
            "partita compile mlp --cluster 4xCPU --global-batch 64 --seq 32 --out out/mlp",
            head_until="",
            tail_from=_DONE,
        ),
        Cmd("partita run out/mlp --steps 3 --reference", drop=r"^partita: \[[#.]+\] step "),
    ),
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("COLUMNS", "LINES", "PARTITA_CALIBRATION"):
        env.pop(k, None)
    env.update(PARTITA_CACHE_DIR=".cache/partita", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _trim(text: str, cmd: Cmd) -> list[str]:
    lines = [ln for ln in text.rstrip("\n").splitlines() if not (cmd.drop and re.search(cmd.drop, ln))]
    for pat, repl in cmd.subs:
        lines = [re.sub(pat, repl, ln) for ln in lines]
    if cmd.head_until is None:
        return lines
    head = next((k for k, ln in enumerate(lines) if cmd.head_until and re.search(cmd.head_until, ln)), len(lines))
    head = 0 if cmd.head_until == "" else head
    tail = len(lines)
    if cmd.tail_from is not None:
        tail = next((k for k in range(head, len(lines)) if re.search(cmd.tail_from, lines[k])), len(lines))
    return lines[:head] + (["..."] if tail > head else []) + lines[tail:]


def run_block(name: str, workdir: Path) -> list[str]:
    """The transcript of block ``name``: ``$ command`` then its output (stdout and stderr, in order)."""
    out: list[str] = []
    for cmd in BLOCKS[name]:
        r = subprocess.run(
            cmd.line, shell=True, cwd=workdir, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        if r.returncode != 0:
            raise RuntimeError(f"{name}: `{cmd.line}` exited {r.returncode}:\n{r.stdout[-3000:]}")
        out += [f"$ {cmd.line}", *_trim(r.stdout, cmd)]
    return out


def workdir() -> tempfile.TemporaryDirectory[str]:
    tmp = tempfile.TemporaryDirectory(prefix="partita-readme-")
    (Path(tmp.name) / "examples").symlink_to(ROOT / "examples")
    return tmp


def readme_blocks(text: str) -> dict[str, tuple[int, int]]:
    """Block name -> (first, end) line indices of its fenced content in the README."""
    lines = text.splitlines()
    found: dict[str, tuple[int, int]] = {}
    for i, ln in enumerate(lines):
        m = MARKER.match(ln.strip())
        if not m:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"README line {i + 1}: the marker {m.group(1)!r} is not followed by a ``` block")
        end = next(k for k in range(i + 2, len(lines)) if lines[k].startswith("```"))
        found[m.group(1)] = (i + 2, end)
    return found


_TIME = re.compile(r"\b(in|took) \d+(\.\d+)? s\b")
_HASH = re.compile(r"\b[0-9a-f]{12,}\b")
_LONG_FLOAT = re.compile(r"-?\d+\.\d{6,}")


def normalize(lines: list[str]) -> list[str]:
    """What may differ between two honest runs: wall times, cache-entry hashes, float noise."""
    out = []
    for ln in lines:
        ln = _TIME.sub(r"\1 <t> s", ln)
        ln = _HASH.sub("<hash>", ln)
        ln = _LONG_FLOAT.sub(lambda m: f"{float(m.group()):.5f}", ln)
        out.append(ln.rstrip())
    return out


def check(name: str, fresh: list[str], text: str | None = None) -> str:
    """A unified diff between the README's block ``name`` and ``fresh`` (empty when they agree)."""
    text = README.read_text() if text is None else text
    first, end = readme_blocks(text)[name]
    shown = text.splitlines()[first:end]
    a, b = normalize(shown), normalize(fresh)
    if a == b:
        return ""
    return "\n".join(difflib.unified_diff(a, b, f"README.md [{name}]", "fresh run", lineterm=""))


def write(name: str, fresh: list[str]) -> None:
    text = README.read_text()
    first, end = readme_blocks(text)[name]
    lines = text.splitlines()
    lines[first:end] = fresh
    README.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the README's output blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block differs from a fresh run")
    p.add_argument("names", nargs="*", help=f"blocks (default: all of {', '.join(BLOCKS)})")
    args = p.parse_args(argv)
    names = args.names or list(BLOCKS)
    missing = [n for n in names if n not in BLOCKS or n not in readme_blocks(README.read_text())]
    if missing:
        print(f"readme_outputs: no block {missing} (markers in README.md, BLOCKS in this script)", file=sys.stderr)
        return 2
    failed = 0
    tmp = workdir()  # one directory for all blocks, in BLOCKS order (a later block may use an earlier's output)
    with tmp:
        for name in [n for n in BLOCKS if n in names]:
            print(f"readme_outputs: {name} ...", file=sys.stderr, flush=True)
            fresh = run_block(name, Path(tmp.name))
            if args.write:
                write(name, fresh)
            elif diff := check(name, fresh):
                print(diff)
                failed += 1
    if args.check:
        print(f"readme_outputs: {len(names) - failed} of {len(names)} blocks match", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
