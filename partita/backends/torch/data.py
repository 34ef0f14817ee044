"""Training data for the generated program: synthetic batches, a token file, or a user callable.

Used by ``backends/torch/train.py`` (each rank asks for the rows it needs) and by
``backends/torch/launch.py`` (which checks a token file before anything starts). Three sources, one
rule: step ``t`` of a run reads global rows ``[0, global_batch)``; micro-batch ``k`` is rows
``[k*M, (k+1)*M)`` and replica ``i`` of a stage takes its share of each micro-batch, so a rank asks only
for the rows of its replica (first stage: the inputs; last stage: the labels; middle stages: nothing).

* synthetic (default): the seeded batch of ``make_batch`` (``train.py``), rows sliced after drawing:
  the reference and every rank draw the same numbers;
* a token file (``--data-file F --data-dtype uint16|uint32``): a flat binary of token ids, as
  nanoGPT's ``train.bin``, memory-mapped; global row ``b`` of step ``t`` is the window of ``seq_len``
  tokens starting at token ``((t * global_batch + b) * seq_len) mod (usable tokens)``; labels are the
  same window (the loss shifts by one). Only those windows are read; :attr:`TokenFile.reads` records
  their token offsets so a test can check that each rank read only its share. A masked LM masks each
  window (``prepare``: ``models/hf.py``'s ``mask_rows``, seeded per (data seed, step, global row), so
  every rank and the reference mask a row alike); a seq2seq model needs (source, target) pairs, which
  one token stream does not hold: ``train.make_data`` refuses it (use a callable);
* a callable (``--data-fn module:function``): ``function(step, rows, seq_len) -> (inputs, labels)``
  for the global row indices ``rows``; it must return the same values for the same arguments (a model
  with several inputs, seq2seq, takes them stacked on dim 1: ``models/hf.py``'s ``pack``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from partita.errors import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ConfigError):
    """A token file or data callable the program cannot train on (exit 2, nothing started)."""


class TokenFile:
    """A memory-mapped flat binary of token ids; reads whole ``seq_len`` windows by global row."""

    def __init__(self, path: str, dtype: str, seq_len: int, global_batch: int, vocab: int | None = None) -> None:
        check_token_file(path, dtype, seq_len, global_batch, vocab)
        self.path, self.seq_len, self.global_batch = path, seq_len, global_batch
        self.tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
        self.num_windows = len(self.tokens) // seq_len
        self.reads: list[tuple[int, int]] = []  # (first token, one past the last) of each window read

    def offset(self, step: int, row: int) -> int:
        return ((step * self.global_batch + row) % self.num_windows) * self.seq_len

    def rows(self, step: int, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = np.empty((len(rows), self.seq_len), dtype=np.int64)
        for k, r in enumerate(rows):
            lo = self.offset(step, r)
            out[k] = self.tokens[lo : lo + self.seq_len]
            self.reads.append((lo, lo + self.seq_len))
        ids = torch.from_numpy(out)
        return ids, ids.clone()


def check_token_file(path: str, dtype: str, seq_len: int, global_batch: int, vocab: int | None = None) -> int:
    """Refuse a token file that is missing, of another dtype, or too short; return its token count.

    The dtype check reads at most the first million tokens: ids at or above the model's vocabulary
    (a ``uint16`` file read as ``uint32`` gives huge ids) or, read as ``uint16``, a zero in every
    odd position (the high halves of a ``uint32`` file's small ids) mean the file has another dtype.
    """
    if dtype not in DTYPES:
        raise DataError(f"--data-dtype {dtype!r} is not a token dtype.", f"use one of {', '.join(DTYPES)}.")
    if not os.path.isfile(path):
        raise DataError(f"token file {path} does not exist.", "pass --data-file with the path of a flat .bin file.")
    size, item = os.path.getsize(path), np.dtype(DTYPES[dtype]).itemsize
    if size % item:
        raise DataError(
            f"token file {path} has {size} bytes, not a multiple of {item} ({dtype}): it was written with another dtype.",
            "pass the --data-dtype the file was written with (nanoGPT's train.bin is uint16).",
        )
    n = size // item
    need = global_batch * seq_len
    if n < need:
        raise DataError(
            f"token file {path} holds {n} tokens, fewer than one global batch ({global_batch} x {seq_len} = {need}).",
            "use a longer file, or compile for a smaller global batch or sequence length.",
        )
    head = np.memmap(path, dtype=DTYPES[dtype], mode="r")[: min(n, 1 << 20)]
    if dtype == "uint16" and len(head) >= 64 and not head[1::2].any() and head[0::2].any():
        raise DataError(
            f"token file {path} read as uint16 has a zero in every odd position: it was written as uint32.",
            "pass --data-dtype uint32.",
        )
    if vocab:
        top = int(head.max()) if len(head) else 0
        if top >= vocab:
            other = "uint32" if dtype == "uint16" else "uint16"
            raise DataError(
                f"token file {path} read as {dtype} holds id {top}, outside the model's vocabulary of {vocab}: "
                f"it was probably written as {other}, or for another tokenizer.",
                f"pass --data-dtype {other} if the file is {other}, or a file tokenized for this model.",
            )
    return n


def load_callable(spec: str) -> Callable[[int, Sequence[int], int], tuple[torch.Tensor, torch.Tensor]]:
    """``module:function`` -> the function (DataError when it cannot be imported)."""
    mod, _, fn = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), fn) if fn else None
    except (ImportError, AttributeError) as e:
        raise DataError(
            f"--data-fn {spec!r} cannot be loaded ({e}).", "pass module:function importable here."
        ) from None
    if not callable(obj):
        raise DataError(f"--data-fn {spec!r} is not a callable.", "pass module:function, e.g. mydata:batch.")
    return obj


class DataSource:
    """What a rank reads: ``rows(step, rows)`` -> (inputs, labels) for the given global rows."""

    def __init__(
        self,
        synthetic: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        token_file: TokenFile | None = None,
        fn: Callable[..., Any] | None = None,
        seq_len: int = 1,
        prepare: Callable[[int, Sequence[int], torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.synthetic, self.token_file, self.fn, self.seq_len = synthetic, token_file, fn, seq_len
        self.prepare = prepare  # token windows -> (inputs, labels) of the model's task (default: ids, ids)
        self._cache: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def kind(self) -> str:
        return "token_file" if self.token_file else "callable" if self.fn else "synthetic"

    def rows(self, step: int, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.token_file is not None:
            ids, labels = self.token_file.rows(step, rows)
            return self.prepare(step, rows, ids) if self.prepare is not None else (ids, labels)
        if self.fn is not None:
            x, y = self.fn(step, list(rows), self.seq_len)
            return torch.as_tensor(x), torch.as_tensor(y)
        if self._cache is None or self._cache[0] != step:
            self._cache = (step, self.synthetic(step))
        x, y = self._cache[1]
        idx = torch.tensor(list(rows), dtype=torch.long)
        return x.index_select(0, idx), y.index_select(0, idx)

    def reads(self) -> list[tuple[int, int]]:
        return list(self.token_file.reads) if self.token_file is not None else []


def rank_rows(num_micro: int, mb: int, lo: int, hi: int) -> list[int]:
    """Global rows of replica range ``[lo, hi)`` of each micro-batch, in micro-batch order."""
    return [k * mb + r for k in range(num_micro) for r in range(lo, hi)]
