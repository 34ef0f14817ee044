"""Reading a file the user named (a cluster file, a config.json, a plan, a hostfile), one way everywhere.

At the bottom of the flow beside ``errors.py`` (no framework imports). :func:`read_user_text` refuses
what is not a regular file before opening it: a named pipe or a terminal would block the command
for ever, ``/dev/zero`` would read without end, a directory or a symlink loop fails with an errno the
caller must not have to sort. The text is decoded as UTF-8 (a leading byte-order mark is allowed, as
editors on Windows write one). :func:`loads_json` parses with duplicate keys refused (the last one
would silently win) and NaN / Infinity refused (no Partita input holds them); :func:`yaml_loader` is
PyYAML's safe loader with duplicate keys refused as well.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from partita.errors import PartitaError

MAX_BYTES = 256 << 20  # a text input larger than this is not one a user wrote (or a device file)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: str | os.PathLike[str], what: str, fix: str, error: type[PartitaError]) -> os.stat_result:
    """The file's ``stat`` when ``path`` names a regular file (through symlinks); else ``error`` naming
    the path, what it is, and ``fix``."""
    try:
        st = os.stat(path)
    except OSError as e:
        why = "does not exist" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror or e})"
        raise error(f"{what} {os.fspath(path)} {why}.", fix) from None
    except ValueError as e:  # a NUL byte in the name
        raise error(f"{what} {os.fspath(path)!r} is not a usable path ({e}).", fix) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {os.fspath(path)} cannot be read: it is {_kind(st.st_mode)}, not a regular file.", fix)
    return st


def read_user_text(
    path: str | os.PathLike[str], what: str, fix: str, error: type[PartitaError], max_bytes: int = MAX_BYTES
) -> str:
    """The UTF-8 text of the user's file ``path`` (module docstring); every failure is ``error`` naming
    ``what`` and the path, with ``fix``."""
    st = check_regular(path, what, fix, error)
    if st.st_size > max_bytes:
        raise error(f"{what} {os.fspath(path)} holds {st.st_size:,} bytes, more than {max_bytes:,}.", fix)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{what} {os.fspath(path)} cannot be read ({e.strerror or e}).", fix) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise error(f"{what} {os.fspath(path)} is not UTF-8 text (a binary file?).", fix) from None


class DuplicateKey(ValueError):
    """A mapping names one key twice: ``args[0]`` is the key."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


class NonFinite(ValueError):
    """The text holds NaN or Infinity: ``args[0]`` is the constant."""


def _constant(name: str) -> Any:
    raise NonFinite(name)


def loads_json(text: str) -> Any:
    """``json.loads`` refusing duplicate keys (:class:`DuplicateKey`) and NaN / Infinity (:class:`NonFinite`)."""
    return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)


def yaml_loader() -> Any:
    """PyYAML's ``SafeLoader`` that raises :class:`DuplicateKey` for a key written twice in one mapping."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise DuplicateKey(key)
                    seen.add(key)
                except TypeError:  # an unhashable key: the safe loader names it
                    pass
            return super().construct_mapping(node, deep=deep)

    return Loader
