"""MNIST-format data: an IDX reader (gzip or raw), the ordered list of places to find the files,
and verified downloads. The whole dataset is then held as tensors on the training device.

A data dir the user gave (--data-dir, else $DTRAIN_MNIST_DATA_DIR) is the only source: missing
files there are an error, or, with downloads on, are downloaded into it. Without one the sources
are, in order: the cache (~/.cache/dtrain/<dataset>), well-known system paths (Debian's
dataset-fashion-mnist installs /usr/share/datasets/fashion-mnist), then the public mirrors into the
cache. Downloads are md5-checked before they are used.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import struct
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from dtrain.common import env as envmod
from dtrain.common.errors import UserError
from dtrain.mnist.config import Dataset, parse_split

# Published file names, md5s of the published .gz files, and mirrors. Sources: the MNIST database
# (Y. LeCun et al.; mirror maintained by PyTorch) and Zalando Research's Fashion-MNIST repository.
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MD5 = {
    Dataset.MNIST: {
        "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    Dataset.FASHION_MNIST: {
        "train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310",
    },
}
MIRRORS = {
    Dataset.MNIST: ["https://ossci-datasets.s3.amazonaws.com/mnist/", "https://yann.lecun.com/exdb/mnist/"],
    Dataset.FASHION_MNIST: ["https://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
}
SYSTEM_DIRS = {
    Dataset.MNIST: ["/usr/share/datasets/mnist", "/usr/local/share/datasets/mnist"],
    Dataset.FASHION_MNIST: ["/usr/share/datasets/fashion-mnist", "/usr/local/share/datasets/fashion-mnist"],
}
MEAN_STD = {Dataset.MNIST: (0.1307, 0.3081), Dataset.FASHION_MNIST: (0.2860, 0.3530)}
DOWNLOAD_TIMEOUT_S = 30

IDX_UBYTE = 0x08


class DataError(UserError):
    """Missing or corrupt data files."""


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (raw or gzip) as a uint8 tensor of its stated shape; errors name the file."""
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        with gzip.open(path, "rb") if gz else open(path, "rb") as f:
            raw = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: truncated or corrupt gzip ({e or type(e).__name__})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: not an IDX file (bad magic {raw[:4].hex() or 'empty'}; expected 0000 08 01|03)")
    dtype, ndim = raw[2], raw[3]
    if dtype != IDX_UBYTE or ndim not in (1, 3):
        raise DataError(
            f"{path}: unsupported IDX type 0x{dtype:02x} with {ndim} dims "
            "(MNIST files hold unsigned bytes, 1 dim for labels, 3 for images)"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    want = 1
    for n in dims:
        want *= n
    have = len(raw) - header
    if have != want:
        raise DataError(
            f"{path}: truncated or padded: shape {'x'.join(map(str, dims))} needs {want} bytes "
            f"of data, the file has {have}"
        )
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).reshape(dims)


@dataclasses.dataclass
class Split:
    images: torch.Tensor  # uint8, N x 28 x 28, on the training device
    labels: torch.Tensor  # int64, N
    source: str


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx")):
        if (directory / name).is_file():
            return directory / name
    return None


def locate(
    dataset: Dataset, split: str, data_dir: str, download: bool, log: Callable[[str], None] = lambda _m: None
) -> tuple[Path, Path]:
    """Paths of the images and labels of `split` ("train" or "test").

    A data dir the user gave (--data-dir, which also carries dtrain.toml's data_dir and
    $DTRAIN_MNIST_DATA_DIR when the CLI launches; or $DTRAIN_MNIST_DATA_DIR read here when the
    workload runs without the CLI) is the only place looked at: files found anywhere else would
    be other data than the data asked for. Only without one are the cache and the system paths
    searched, then the mirrors downloaded into the cache. Raises DataError saying where it looked."""
    stems = FILES[split]
    for label, given in (("--data-dir", data_dir), ("$DTRAIN_MNIST_DATA_DIR", envmod.data_dir("mnist"))):
        if given:
            return _in_given_dir(dataset, stems, f"{label} {given}", Path(given), download, log)
    tried = ["--data-dir (not set)", "$DTRAIN_MNIST_DATA_DIR (not set)"]
    cache = envmod.cache_dir() / dataset.value
    for label, directory in (("cache", str(cache)), *(("system path", p) for p in SYSTEM_DIRS[dataset])):
        found = [_find(Path(directory), s) for s in stems]
        if all(found):
            return found[0], found[1]  # type: ignore[return-value]
        missing = [s for s, p in zip(stems, found, strict=True) if p is None]
        why = "missing " + ", ".join(missing) if Path(directory).is_dir() else "no such directory"
        tried.append(f"{label} {directory} ({why})")
    off = _downloads_off(download)
    if off:
        tried.append(f"download (disabled: {off})")
    else:
        try:
            paths = [_download(dataset, s, cache, log) for s in stems]
            return paths[0], paths[1]
        except DataError as e:
            tried.append(f"download ({e})")
    hint = " or `apt-get install dataset-fashion-mnist`" if dataset == Dataset.FASHION_MNIST else ""
    raise DataError(
        f"no {dataset.value} {split} data found; tried: {'; '.join(tried)}. "
        f"Pass --data-dir DIR holding the IDX files{hint}"
    )


GIVEN_DIR_HINT = "or leave the data dir unset to search the cache and system paths"


def _in_given_dir(
    dataset: Dataset, stems: tuple[str, str], where: str, directory: Path, download: bool, log: Callable[[str], None]
) -> tuple[Path, Path]:
    """Both files from the directory the user named. With downloads on, missing files are
    downloaded into it, as into the cache; a directory that does not exist is not created, since
    a mistyped path must fail rather than fill a new directory."""
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise DataError(
            f"{where}: {what}; name the directory holding the IDX files (an existing one to download "
            f"them into), {GIVEN_DIR_HINT}"
        )
    found = [_find(directory, s) for s in stems]
    missing = ", ".join(s for s, p in zip(stems, found, strict=True) if p is None)
    if not missing:
        return found[0], found[1]  # type: ignore[return-value]
    off = _downloads_off(download)
    if off:
        raise DataError(
            f"{where} has no {missing} (.gz or raw), and downloads are off ({off}): put them there, {GIVEN_DIR_HINT}"
        )
    try:
        got = [p or _download(dataset, s, directory, log) for s, p in zip(stems, found, strict=True)]
    except DataError as e:
        raise DataError(
            f"{where} has no {missing} (.gz or raw), and downloading them into it failed ({e}): put them there, "
            f"{GIVEN_DIR_HINT}"
        ) from None
    return got[0], got[1]


def _downloads_off(download: bool) -> str:
    """Why downloads are not tried ('' when they are)."""
    if not download:
        return "--no-download"
    return "offline mode" if envmod.offline() else ""


def _download(dataset: Dataset, stem: str, directory: Path, log: Callable[[str], None]) -> Path:
    """`stem`.gz from the first mirror that serves it with the published md5, saved in `directory`."""
    target = directory / (stem + ".gz")
    errors = []
    for mirror in MIRRORS[dataset]:
        url = mirror + stem + ".gz"
        try:
            log(f"downloading {url}")
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as r:
                data = r.read()
        except (urllib.error.URLError, OSError) as e:
            errors.append(f"{url}: {getattr(e, 'reason', e)}")
            continue
        got = hashlib.md5(data).hexdigest()
        if got != MD5[dataset][stem]:
            errors.append(f"{url}: md5 {got} != {MD5[dataset][stem]}")
            continue
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".part-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, target)  # concurrent ranks may race here; each rename is whole
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            raise DataError(f"cannot write to {target.parent}: {e.strerror or e}") from None
        return target
    raise DataError("; ".join(errors))


def load_split(
    dataset: Dataset,
    spec: str,
    data_dir: str,
    download: bool,
    device: torch.device,
    log: Callable[[str], None] = lambda _m: None,
) -> Split:
    """A split spec ("train", "test[8000:]") as tensors on `device`."""
    split, sl = parse_split(spec)
    img_path, lbl_path = locate(dataset, split, data_dir, download, log)
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.dim() != 3 or labels.dim() != 1:
        raise DataError(
            f"{img_path}: expected images (N x H x W) and labels (N), got shapes "
            f"{tuple(images.shape)} and {tuple(labels.shape)} (are the files swapped?)"
        )
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{img_path} has {images.shape[0]} images but {lbl_path} has {labels.shape[0]} labels")
    if labels.numel() and int(labels.max()) > 9:
        raise DataError(f"{lbl_path}: label {int(labels.max())} is out of range 0-9")
    images, labels = images[sl], labels[sl]
    if images.shape[0] == 0:
        raise DataError(f"split {spec!r} selects no images (the file has {read_idx(lbl_path).shape[0]})")
    return Split(images.to(device), labels.long().to(device), source=str(img_path.parent))
