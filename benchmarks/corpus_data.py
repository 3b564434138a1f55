"""The calibration corpus' data sources: a synthetic language and two real texts, offline.

- ``bigram``: the reference model's synthetic bigram (Markov) language
  (:func:`jvitals.reference_model.make_batch`), vocabulary ``vocab``.
- ``pystdlib``: byte-level tokens of the Python standard library's ``.py`` files
  (this interpreter's ``sysconfig`` ``stdlib`` path, ``site-packages`` excluded).
- ``pydocs``: byte-level tokens of the documentation shipped with the installed
  packages: every ``*.md``, ``*.rst``, ``*.txt`` of at least 1 KiB and every
  ``*.dist-info/METADATA`` (the packages' long descriptions) under ``site-packages``
  (``sysconfig`` ``purelib``), duplicates (same bytes) kept once.

Byte tokens: id = byte + 2 (0 = pad, 1 = BOS), vocabulary 258. File lists are
sorted by relative path; each file contributes at most its first 64 KiB; the
train/val split is by file (``crc32(relative path) % 10 == 0``: validation). A row
is ``[BOS, b_0 .. b_{T-2}]`` with labels ``[b_0 .. b_{T-1}]`` from a window at a
position drawn from the step's own seed, right-padded like ``make_batch``
(``pad_fraction`` of the positions on average).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np

BYTE_VOCAB = 258          # 256 bytes + pad (0) + BOS (1)
PAD_ID, BOS_ID = 0, 1
MAX_FILE_BYTES = 65_536
VAL_MOD = 10              # crc32(relpath) % VAL_MOD == 0: validation file
TEXT_SOURCES = ("pystdlib", "pydocs")


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """A byte-token text source split by file.

    Attributes:
      name: ``pystdlib`` or ``pydocs``.
      train, val: uint16 token ids (byte + 2), the files of each split concatenated.
      n_files: files read (train + val).
      n_val_files: validation files.
      list_sha1: SHA-1 of the sorted relative paths and sizes (what was read).
    """

    name: str
    train: np.ndarray
    val: np.ndarray
    n_files: int
    n_val_files: int
    list_sha1: str

    def describe(self) -> dict[str, Any]:
        """The source's figures for a stream's metadata."""
        return dict(source=self.name, n_files=self.n_files, n_val_files=self.n_val_files,
                    train_tokens=int(self.train.size), val_tokens=int(self.val.size), list_sha1=self.list_sha1)


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
    return root, files


def _doc_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["purelib"])
    files = [p for ext in ("md", "rst", "txt") for p in root.rglob(f"*.{ext}") if p.stat().st_size >= 1024]
    files += list(root.glob("*.dist-info/METADATA"))
    return root, files


@functools.lru_cache(maxsize=2)
def load_text(name: str) -> TextCorpus:
    """Read, split and tokenize one text source (cached per process).

    Args:
      name: ``pystdlib`` or ``pydocs``.

    Returns:
      The :class:`TextCorpus`.
    """
    if name == "pystdlib":
        root, files = _stdlib_files()
    elif name == "pydocs":
        root, files = _doc_files()
    else:
        raise KeyError(f"unknown text source {name!r}; known: {TEXT_SOURCES}")
    rels = sorted((str(p.relative_to(root)), p) for p in files)
    seen: set[bytes] = set()
    parts: dict[bool, list[np.ndarray]] = {True: [], False: []}
    listing = hashlib.sha1()
    n = n_val = 0
    for rel, p in rels:
        data = p.read_bytes()[:MAX_FILE_BYTES]
        digest = hashlib.sha1(data).digest()
        if digest in seen or len(data) < 64:
            continue
        seen.add(digest)
        is_val = zlib.crc32(rel.encode()) % VAL_MOD == 0
        parts[is_val].append(np.frombuffer(data, np.uint8).astype(np.uint16) + 2)
        listing.update(f"{rel}\0{len(data)}\n".encode())
        n += 1
        n_val += is_val
    return TextCorpus(name, np.concatenate(parts[False]), np.concatenate(parts[True]), n, n_val,
                      listing.hexdigest())


def _pad(rows: np.ndarray, rng: np.random.Generator, pad_fraction: float) -> tuple[np.ndarray, ...]:
    """``make_batch``'s right padding of ``rows`` ``[B, T + 1]``: tokens, labels, mask."""
    b, t1 = rows.shape
    seq = t1 - 1
    max_pad = int(round(2 * pad_fraction * seq))
    n_pad = np.minimum(rng.integers(0, max_pad + 1, size=b), seq - 2)
    mask = np.arange(seq)[None, :] < (seq - n_pad)[:, None]
    return (np.where(mask, rows[:, :-1], PAD_ID), np.where(mask, rows[:, 1:], PAD_ID), mask)


def text_batch(tokens: np.ndarray, seed: int, batch: int, seq: int, pad_fraction: float,
               starts: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One batch of windows of ``tokens``.

    Args:
      tokens: the split's token ids.
      seed: this batch's seed (positions and padding).
      batch, seq: B and T.
      pad_fraction: mean fraction of padded positions.
      starts: window starts to use instead of drawing them (the repeated-shard fault).

    Returns:
      ``dict(tokens=[B, T] int32, labels=[B, T] int32, mask=[B, T] bool)`` (NumPy).
    """
    rng = np.random.default_rng(seed)
    if starts is None:
        starts = rng.integers(0, tokens.size - seq, size=batch)
    rows = np.empty((batch, seq + 1), np.int64)
    rows[:, 0] = BOS_ID
    rows[:, 1:] = tokens[starts[:, None] + np.arange(seq)[None, :]]
    tok, lab, mask = _pad(rows, rng, pad_fraction)
    return dict(tokens=tok.astype(np.int32), labels=lab.astype(np.int32), mask=mask)


def shard_starts(tokens: np.ndarray, seed: int, n_sequences: int, seq: int) -> np.ndarray:
    """The window starts of a fixed shard of ``n_sequences`` sequences (repeated-shard fault)."""
    return np.random.default_rng(seed).integers(0, tokens.size - seq, size=n_sequences)
