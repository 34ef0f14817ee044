"""The README's first commands print each line once (issue 35 item 10: in a fresh clone pip's "new
release" notice and the compile-cache line each printed twice). The scripts are read, not run:
running them installs packages and compiles gpt3-6.7b (minutes)."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_install_calls_pip_without_its_version_notice() -> None:
    text = (SCRIPTS / "install.sh").read_text()
    calls = re.findall(r"^\s*python -m pip install .*$", text, flags=re.M)
    assert len(calls) >= 2  # torch, then the project: each call would print the notice
    exported = re.search(r"^export PIP_DISABLE_PIP_VERSION_CHECK=1$", text, flags=re.M)
    first_call = text.index(calls[0])
    assert exported and exported.start() < first_call or all("--disable-pip-version-check" in c for c in calls)


def test_demo_leaves_the_cache_line_to_compile() -> None:
    """``partita compile`` prints ``compile cache: DIR ...`` itself (tests/test_cli.py); the demo must not echo it."""
    text = (SCRIPTS / "demo.sh").read_text()
    commands = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert any(line.startswith("partita compile") for line in commands)
    assert not [line for line in commands if "compile cache" in line]
