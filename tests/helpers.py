"""Helpers shared by tests: IDX files written byte by byte, as the MNIST files are published."""

from __future__ import annotations

import gzip
import random
import struct
from pathlib import Path

IDX_UBYTE = 0x08
IMAGE_STEMS = {"train": "train-images-idx3-ubyte", "test": "t10k-images-idx3-ubyte"}
LABEL_STEMS = {"train": "train-labels-idx1-ubyte", "test": "t10k-labels-idx1-ubyte"}


def idx_bytes(dims: tuple[int, ...], data: bytes, *, dtype: int = IDX_UBYTE) -> bytes:
    """An IDX file's bytes: 00 00, the type byte, the number of dims, big-endian dims, then data."""
    return bytes([0, 0, dtype, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + data


def write_idx(path: Path, dims: tuple[int, ...], data: bytes, *, gz: bool = False, dtype: int = IDX_UBYTE) -> Path:
    raw = idx_bytes(dims, data, dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    return path


def image_bytes(n: int, seed: int, h: int = 28, w: int = 28) -> bytes:
    return random.Random(seed).randbytes(n * h * w)


def label_bytes(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(10) for _ in range(n))


def write_split(
    directory: Path, split: str, n: int, *, seed: int = 0, gz: bool = True, h: int = 28, w: int = 28
) -> tuple[Path, Path]:
    """The images and labels files of `split` ("train" or "test") with `n` random examples."""
    suffix = ".gz" if gz else ""
    images = write_idx(directory / (IMAGE_STEMS[split] + suffix), (n, h, w), image_bytes(n, seed, h, w), gz=gz)
    labels = write_idx(directory / (LABEL_STEMS[split] + suffix), (n,), label_bytes(n, seed + 1), gz=gz)
    return images, labels


def write_dataset(directory: Path, n_train: int, n_test: int, *, seed: int = 0, gz: bool = True) -> Path:
    """A directory holding all four MNIST-named IDX files."""
    write_split(directory, "train", n_train, seed=seed, gz=gz)
    write_split(directory, "test", n_test, seed=seed + 100, gz=gz)
    return directory
