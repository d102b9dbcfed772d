"""dtrain.mnist.data: the IDX reader, the order of data sources, verified downloads, real files.

Every test runs with the cache, the system paths and the mirrors pointed at temporary or local
places, so nothing here reads the user's cache or reaches the internet.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import IMAGE_STEMS, LABEL_STEMS, idx_bytes, image_bytes, label_bytes, write_idx, write_split
from shared_data import SHARED_MNIST, SHARED_SKIP_REASON

from dtrain.common.errors import ExitCode, UserError
from dtrain.mnist import data
from dtrain.mnist.config import Dataset
from dtrain.mnist.data import DataError, load_split, locate, read_idx

CPU = torch.device("cpu")
# Real files: the MNIST test split kept beside this repository's checkout on the project's machines,
# and Debian's dataset-fashion-mnist package.
DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user settings, a private cache, system paths that do not exist, offline, and mirrors
    that refuse connections; tests that download say so. Returns the cache root."""
    for var in [v for v in os.environ if v.startswith("DTRAIN_") or v == "HF_HUB_OFFLINE"]:
        monkeypatch.delenv(var)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DTRAIN_CACHE_DIR", str(cache))
    monkeypatch.setenv("DTRAIN_OFFLINE", "1")
    for ds in Dataset:
        monkeypatch.setitem(data.SYSTEM_DIRS, ds, [str(tmp_path / "system" / ds.value)])
        monkeypatch.setitem(data.MIRRORS, ds, ["http://127.0.0.1:9/"])  # discard port: refused
    return cache


def error_of(fn, *args, **kw) -> str:
    with pytest.raises(DataError) as e:
        fn(*args, **kw)
    assert isinstance(e.value, UserError) and e.value.exit_code == ExitCode.USAGE
    return str(e.value)


# ---------------------------------------------------------------------------------------------
# read_idx


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_read_idx_roundtrip(tmp_path, gz):
    pixels = image_bytes(5, seed=1, h=3, w=4)
    labels = bytes([0, 9, 3, 3, 7])
    img = read_idx(write_idx(tmp_path / "img", (5, 3, 4), pixels, gz=gz))
    lbl = read_idx(write_idx(tmp_path / "lbl", (5,), labels, gz=gz))
    assert img.dtype == torch.uint8 and img.shape == (5, 3, 4)
    assert img.flatten().tolist() == list(pixels)
    assert img[2, 1, 3].item() == pixels[2 * 12 + 1 * 4 + 3]  # row-major, as IDX stores it
    assert lbl.dtype == torch.uint8 and lbl.shape == (5,)
    assert lbl.tolist() == [0, 9, 3, 3, 7]


def test_read_idx_gzip_detected_by_content_not_name(tmp_path):
    # A gzip file without .gz, and a raw file named .gz, are both read.
    gz_no_suffix = tmp_path / "labels"
    gz_no_suffix.write_bytes(gzip.compress(idx_bytes((3,), b"\x01\x02\x03")))
    raw_with_suffix = write_idx(tmp_path / "labels.gz", (3,), b"\x04\x05\x06")
    assert read_idx(gz_no_suffix).tolist() == [1, 2, 3]
    assert read_idx(raw_with_suffix).tolist() == [4, 5, 6]


@pytest.mark.parametrize(
    "content, magic",
    [
        (b"train images, one per line\n", "74726169"),  # a text file: 't' 'r' 'a' 'i'
        (bytes([1, 0, 8, 3]) + bytes(16), "01000803"),  # first byte not 00
        (bytes([0, 1, 8, 1]) + bytes(8), "00010801"),  # second byte not 00
        (b"", "empty"),
    ],
    ids=["text", "first-byte", "second-byte", "empty"],
)
def test_read_idx_bad_magic(tmp_path, content, magic):
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(content)
    msg = error_of(read_idx, path)
    assert msg.startswith(f"{path}: not an IDX file")
    assert f"bad magic {magic}" in msg


def test_read_idx_bad_magic_inside_gzip(tmp_path):
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(b"<html>404 Not Found</html>"))
    msg = error_of(read_idx, path)
    assert msg.startswith(f"{path}: not an IDX file (bad magic 3c68746d")


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_read_idx_truncated_data(tmp_path, gz):
    # The header says 10 images of 28x28; the file holds 9.5 of them.
    path = tmp_path / "images"
    path.write_bytes(idx_bytes((10, 28, 28), bytes(784 * 9 + 392)))
    if gz:
        path.write_bytes(gzip.compress(path.read_bytes()))
    msg = error_of(read_idx, path)
    assert msg == f"{path}: truncated or padded: shape 10x28x28 needs 7840 bytes of data, the file has 7448"


def test_read_idx_padded_data(tmp_path):
    path = write_idx(tmp_path / "labels", (4,), b"\x01\x02\x03\x04\x05")
    assert "needs 4 bytes of data, the file has 5" in error_of(read_idx, path)


def test_read_idx_truncated_header(tmp_path):
    path = tmp_path / "images"
    path.write_bytes(bytes([0, 0, 8, 3, 0, 0, 0, 10, 0, 0]))  # 3 dims announced, 1.5 given
    assert error_of(read_idx, path) == f"{path}: truncated IDX header"


def _gz_images(n: int = 10) -> bytes:
    return gzip.compress(idx_bytes((n, 28, 28), image_bytes(n, seed=3)), mtime=0)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda gz: gz[: len(gz) // 2],  # download cut in half
        lambda gz: gz[:10] + bytes(range(256)) * 4,  # a valid gzip header, then garbage
        lambda gz: gz[:-8] + bytes(8),  # CRC and length zeroed
        lambda gz: b"\x1f\x8b",  # the gzip magic and nothing else
    ],
    ids=["cut-in-half", "header-then-garbage", "bad-crc", "magic-only"],
)
def test_read_idx_corrupt_gzip(tmp_path, corrupt):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(corrupt(_gz_images()))
    msg = error_of(read_idx, path)
    assert msg.startswith(f"{path}: truncated or corrupt gzip (")
    assert "Traceback" not in msg and msg.count("\n") == 0


@pytest.mark.parametrize(
    "dtype, dims, shown",
    [(0x0D, (2, 2, 2), "0x0d with 3 dims"), (0x09, (4,), "0x09 with 1 dims"), (0x08, (2, 4), "0x08 with 2 dims")],
    ids=["float32", "signed-byte", "2-dim-ubyte"],
)
def test_read_idx_unsupported_type(tmp_path, dtype, dims, shown):
    n = 1
    for d in dims:
        n *= d
    path = write_idx(tmp_path / "weird", dims, bytes(n * (4 if dtype == 0x0D else 1)), dtype=dtype)
    msg = error_of(read_idx, path)
    assert msg.startswith(f"{path}: unsupported IDX type {shown}")
    assert "unsigned bytes" in msg


def test_read_idx_missing_file(tmp_path):
    path = tmp_path / "nope" / "train-images-idx3-ubyte"
    assert error_of(read_idx, path) == f"{path}: cannot read: No such file or directory"


# ---------------------------------------------------------------------------------------------
# load_split


def test_load_split_whole_file(tmp_path):
    img_path, lbl_path = write_split(tmp_path, "train", 20, seed=5)
    split = load_split(Dataset.MNIST, "train", str(tmp_path), False, CPU)
    assert split.images.dtype == torch.uint8 and split.images.shape == (20, 28, 28)
    assert split.labels.dtype == torch.int64 and split.labels.shape == (20,)
    assert torch.equal(split.images, read_idx(img_path))
    assert split.labels.tolist() == list(label_bytes(20, seed=6))
    assert split.source == str(tmp_path)


@pytest.mark.parametrize(
    "spec, rows",
    [
        ("test", slice(None)),
        ("test[:30]", slice(0, 30)),
        ("test[30:]", slice(30, None)),
        ("test[10:25]", slice(10, 25)),
        ("test[-7:]", slice(-7, None)),
        ("test[:-7]", slice(None, -7)),
        (" test[:30] ", slice(0, 30)),
    ],
)
def test_load_split_slices(tmp_path, spec, rows):
    img_path, lbl_path = write_split(tmp_path, "test", 40, seed=9)
    split = load_split(Dataset.MNIST, spec, str(tmp_path), False, CPU)
    want_images, want_labels = read_idx(img_path)[rows], read_idx(lbl_path)[rows]
    assert split.images.shape[0] == want_labels.shape[0] == len(range(40)[rows])
    assert torch.equal(split.images, want_images)
    assert torch.equal(split.labels, want_labels.long())


def test_load_split_halves_partition_the_file(tmp_path):
    write_split(tmp_path, "test", 40, seed=9)
    head = load_split(Dataset.MNIST, "test[:32]", str(tmp_path), False, CPU)
    tail = load_split(Dataset.MNIST, "test[32:]", str(tmp_path), False, CPU)
    whole = load_split(Dataset.MNIST, "test", str(tmp_path), False, CPU)
    assert (len(head.labels), len(tail.labels)) == (32, 8)
    assert torch.equal(torch.cat([head.images, tail.images]), whole.images)
    assert torch.equal(torch.cat([head.labels, tail.labels]), whole.labels)


@pytest.mark.parametrize("spec", ["test[40:]", "test[5:5]", "test[10:3]", "test[100:200]"])
def test_load_split_empty_selection(tmp_path, spec):
    write_split(tmp_path, "test", 40)
    msg = error_of(load_split, Dataset.MNIST, spec, str(tmp_path), False, CPU)
    assert msg == f"split {spec!r} selects no images (the file has 40)"


def test_load_split_count_mismatch(tmp_path):
    img = write_idx(tmp_path / f"{IMAGE_STEMS['train']}.gz", (12, 28, 28), image_bytes(12, 0), gz=True)
    lbl = write_idx(tmp_path / f"{LABEL_STEMS['train']}.gz", (11,), label_bytes(11, 0), gz=True)
    msg = error_of(load_split, Dataset.MNIST, "train", str(tmp_path), False, CPU)
    assert msg == f"{img} has 12 images but {lbl} has 11 labels"


def test_load_split_label_out_of_range(tmp_path):
    write_idx(tmp_path / IMAGE_STEMS["train"], (4, 28, 28), image_bytes(4, 0))
    lbl = write_idx(tmp_path / LABEL_STEMS["train"], (4,), bytes([1, 2, 10, 3]))
    msg = error_of(load_split, Dataset.MNIST, "train", str(tmp_path), False, CPU)
    assert msg == f"{lbl}: label 10 is out of range 0-9"


def test_load_split_swapped_files(tmp_path):
    # Images saved under the labels' name and the other way round.
    img = write_idx(tmp_path / IMAGE_STEMS["train"], (4,), bytes([1, 2, 3, 4]))
    write_idx(tmp_path / LABEL_STEMS["train"], (4, 28, 28), image_bytes(4, 0))
    msg = error_of(load_split, Dataset.MNIST, "train", str(tmp_path), False, CPU)
    assert msg.startswith(f"{img}: expected images (N x H x W) and labels (N), got shapes (4,) and (4, 28, 28)")
    assert "swapped" in msg


def test_load_split_other_image_sizes(tmp_path):
    # The reader takes the shape from the header; nothing assumes 28x28 before the model.
    write_split(tmp_path, "train", 6, h=8, w=5)
    assert load_split(Dataset.MNIST, "train", str(tmp_path), False, CPU).images.shape == (6, 8, 5)


def test_load_split_corrupt_file_named(tmp_path):
    img, _ = write_split(tmp_path, "train", 6)
    img.write_bytes(img.read_bytes()[:100])
    msg = error_of(load_split, Dataset.MNIST, "train", str(tmp_path), False, CPU)
    assert msg.startswith(f"{img}: truncated or corrupt gzip")


# ---------------------------------------------------------------------------------------------
# locate: the order of sources


@pytest.fixture
def four_sources(tmp_path: Path, isolated: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A complete train split in each source, each with its own number of images."""
    dirs = {
        "data_dir": tmp_path / "flag",
        "env": tmp_path / "env",
        "cache": isolated / "mnist",
        "system": tmp_path / "system" / "mnist",
    }
    for i, d in enumerate(dirs.values()):
        write_split(d, "train", 3 + i, seed=i)
    monkeypatch.setenv("DTRAIN_MNIST_DATA_DIR", str(dirs["env"]))
    return dirs


def _drop(d: Path) -> None:
    for f in d.iterdir():
        f.unlink()


def test_locate_data_dir_wins(four_sources):
    got = locate(Dataset.MNIST, "train", str(four_sources["data_dir"]), False)
    assert got == (
        four_sources["data_dir"] / f"{IMAGE_STEMS['train']}.gz",
        four_sources["data_dir"] / f"{LABEL_STEMS['train']}.gz",
    )
    assert load_split(Dataset.MNIST, "train", str(four_sources["data_dir"]), False, CPU).labels.shape == (3,)


def test_locate_env_dir_without_the_flag(four_sources):
    img, lbl = locate(Dataset.MNIST, "train", "", False)
    assert img.parent == lbl.parent == four_sources["env"]
    assert load_split(Dataset.MNIST, "train", "", False, CPU).labels.shape == (4,)


def test_locate_cache_over_system_when_no_dir_given(four_sources, monkeypatch):
    monkeypatch.delenv("DTRAIN_MNIST_DATA_DIR")
    for expect, n in (("cache", 5), ("system", 6)):
        img, _ = locate(Dataset.MNIST, "train", "", False)
        assert img.parent == four_sources[expect], expect
        assert load_split(Dataset.MNIST, "train", "", False, CPU).labels.shape == (n,)
        _drop(four_sources[expect])
    msg = error_of(locate, Dataset.MNIST, "train", "", False)
    assert msg.startswith("no mnist train data found")


# A data dir the user gave is the only place looked at, even when every other source has the
# files: training on other data than the data named is worse than stopping.

HINT = "or leave the data dir unset to search the cache and system paths"


@pytest.mark.parametrize("download", [False, True], ids=["no-download", "download"])
def test_locate_given_dir_that_does_not_exist(tmp_path, four_sources, download):
    nope = tmp_path / "nope"
    msg = error_of(locate, Dataset.MNIST, "train", str(nope), download)
    assert msg == (
        f"--data-dir {nope}: no such directory; name the directory holding the IDX files "
        f"(an existing one to download them into), {HINT}"
    )
    assert not nope.exists()  # a mistyped path is not created, with downloads on or off


def test_locate_given_dir_that_is_a_file(tmp_path, four_sources):
    a_file = four_sources["data_dir"] / f"{IMAGE_STEMS['train']}.gz"
    msg = error_of(locate, Dataset.MNIST, "train", str(a_file), False)
    assert msg.startswith(f"--data-dir {a_file}: not a directory; name the directory holding the IDX files")


def test_locate_given_dir_missing_a_file(four_sources):
    # The images are there, the labels are not: no file is taken from the next source.
    (four_sources["data_dir"] / f"{LABEL_STEMS['train']}.gz").unlink()
    msg = error_of(locate, Dataset.MNIST, "train", str(four_sources["data_dir"]), False)
    assert msg == (
        f"--data-dir {four_sources['data_dir']} has no {LABEL_STEMS['train']} (.gz or raw), and downloads are "
        f"off (--no-download): put them there, {HINT}"
    )


def test_locate_given_dir_with_only_the_other_split(four_sources):
    msg = error_of(locate, Dataset.MNIST, "test", str(four_sources["data_dir"]), True)
    assert msg == (
        f"--data-dir {four_sources['data_dir']} has no {IMAGE_STEMS['test']}, {LABEL_STEMS['test']} (.gz or raw), "
        f"and downloads are off (offline mode): put them there, {HINT}"
    )


def test_locate_env_dir_is_the_only_place_too(tmp_path, four_sources, monkeypatch):
    _drop(four_sources["env"])
    msg = error_of(locate, Dataset.MNIST, "train", "", False)
    assert msg.startswith(f"$DTRAIN_MNIST_DATA_DIR {four_sources['env']} has no {IMAGE_STEMS['train']}, ")
    typo = tmp_path / "typo"
    monkeypatch.setenv("DTRAIN_MNIST_DATA_DIR", str(typo))
    assert error_of(locate, Dataset.MNIST, "train", "", False).startswith(
        f"$DTRAIN_MNIST_DATA_DIR {typo}: no such directory;"
    )


def test_locate_flag_over_env(four_sources):
    # Both given: the flag is what the user typed last (the CLI also resolves them in this order).
    _drop(four_sources["data_dir"])
    msg = error_of(locate, Dataset.MNIST, "train", str(four_sources["data_dir"]), False)
    assert msg.startswith(f"--data-dir {four_sources['data_dir']} has no ")


@pytest.mark.parametrize(
    "names",
    [
        ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        ("train-images.idx3-ubyte", "train-labels.idx1-ubyte"),
        ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte"),
    ],
    ids=["raw", "dot-idx", "mixed"],
)
def test_locate_file_name_variants(tmp_path, names):
    write_idx(tmp_path / names[0], (2, 28, 28), image_bytes(2, 0), gz=names[0].endswith(".gz"))
    write_idx(tmp_path / names[1], (2,), bytes([4, 2]))
    assert locate(Dataset.MNIST, "train", str(tmp_path), False) == (tmp_path / names[0], tmp_path / names[1])
    assert load_split(Dataset.MNIST, "train", str(tmp_path), False, CPU).labels.tolist() == [4, 2]


def test_locate_gz_preferred_over_raw(tmp_path):
    write_split(tmp_path, "test", 2, gz=True)
    write_split(tmp_path, "test", 3, gz=False)
    img, lbl = locate(Dataset.MNIST, "test", str(tmp_path), False)
    assert (img.name, lbl.name) == (f"{IMAGE_STEMS['test']}.gz", f"{LABEL_STEMS['test']}.gz")


def test_locate_nothing_found_download_disabled(tmp_path, isolated, monkeypatch):
    monkeypatch.delenv("DTRAIN_OFFLINE")
    cache = isolated / "mnist"
    write_idx(cache / IMAGE_STEMS["train"], (1, 28, 28), bytes(784))  # images without labels
    msg = error_of(locate, Dataset.MNIST, "train", "", False)
    system = tmp_path / "system" / "mnist"
    assert msg == (
        "no mnist train data found; tried: "
        "--data-dir (not set); "
        "$DTRAIN_MNIST_DATA_DIR (not set); "
        f"cache {cache} (missing train-labels-idx1-ubyte); "
        f"system path {system} (no such directory); "
        "download (disabled: --no-download). Pass --data-dir DIR holding the IDX files"
    )


def test_locate_fashion_hint(tmp_path):
    msg = error_of(locate, Dataset.FASHION_MNIST, "train", "", False)
    assert msg.startswith("no fashion-mnist train data found")
    assert f"cache {tmp_path / 'cache' / 'fashion-mnist'}" in msg
    assert msg.endswith("Pass --data-dir DIR holding the IDX files or `apt-get install dataset-fashion-mnist`")


@pytest.mark.parametrize("var", ["DTRAIN_OFFLINE", "HF_HUB_OFFLINE"])
def test_locate_offline(tmp_path, monkeypatch, mirror, var):
    monkeypatch.delenv("DTRAIN_OFFLINE")
    monkeypatch.setenv(var, "1")
    mirror.serve_dataset(Dataset.MNIST, monkeypatch)
    msg = error_of(locate, Dataset.MNIST, "train", "", True)
    assert "download (disabled: offline mode)" in msg
    assert "--data-dir DIR" in msg
    assert "and downloads are off (offline mode): put them there" in error_of(
        locate, Dataset.MNIST, "train", str(tmp_path), True
    )
    assert mirror.requests == []  # offline means not even a try


# ---------------------------------------------------------------------------------------------
# downloads, from a local server standing in for the mirrors


class Mirror:
    """A local HTTP server; `files` maps a URL path to the bytes it serves (others: 404)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[str] = []
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                mirror.requests.append(self.path)
                body = mirror.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def serve_dataset(self, ds: Dataset, monkeypatch: pytest.MonkeyPatch, n: int = 6, prefix: str = "/m/") -> dict:
        """Both splits as .gz under `prefix`, MIRRORS pointed here and MD5 set to their md5s."""
        md5s = {}
        for split in ("train", "test"):
            for stem, raw in (
                (IMAGE_STEMS[split], idx_bytes((n, 28, 28), image_bytes(n, seed=len(split)))),
                (LABEL_STEMS[split], idx_bytes((n,), label_bytes(n, seed=len(split)))),
            ):
                gz = gzip.compress(raw, mtime=0)
                self.files[prefix + stem + ".gz"] = gz
                md5s[stem] = hashlib.md5(gz).hexdigest()
        monkeypatch.setitem(data.MIRRORS, ds, [self.url + prefix])
        monkeypatch.setitem(data.MD5, ds, md5s)
        return md5s

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def mirror() -> Iterator[Mirror]:
    m = Mirror()
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DTRAIN_OFFLINE")
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def test_download_lands_in_cache_and_loads(tmp_path, isolated, monkeypatch, mirror, online):
    mirror.serve_dataset(Dataset.MNIST, monkeypatch, n=6)
    logged: list[str] = []
    split = load_split(Dataset.MNIST, "train", "", True, CPU, log=logged.append)
    cache = isolated / "mnist"
    assert split.source == str(cache)
    assert sorted(p.name for p in cache.iterdir()) == [f"{IMAGE_STEMS['train']}.gz", f"{LABEL_STEMS['train']}.gz"]
    assert (cache / f"{IMAGE_STEMS['train']}.gz").read_bytes() == mirror.files[f"/m/{IMAGE_STEMS['train']}.gz"]
    assert split.images.shape == (6, 28, 28)
    assert split.images.flatten().tolist() == list(image_bytes(6, seed=5))
    assert split.labels.tolist() == list(label_bytes(6, seed=5))
    assert mirror.requests == [f"/m/{IMAGE_STEMS['train']}.gz", f"/m/{LABEL_STEMS['train']}.gz"]
    assert logged == [
        f"downloading {mirror.url}/m/{IMAGE_STEMS['train']}.gz",
        f"downloading {mirror.url}/m/{LABEL_STEMS['train']}.gz",
    ]

    # The second time, the cache answers and the mirror is not asked.
    again = load_split(Dataset.MNIST, "train", "", True, CPU)
    assert torch.equal(again.images, split.images)
    assert len(mirror.requests) == 2


def test_download_into_a_given_dir(tmp_path, isolated, monkeypatch, mirror, online):
    # An existing data dir lacking the labels: they are downloaded into it (as torchvision's
    # `root` with download=True); the images already there are used as they are.
    mirror.serve_dataset(Dataset.MNIST, monkeypatch, n=6)
    given = tmp_path / "mine"
    img, _ = write_split(given, "train", 6, seed=5)
    (given / f"{LABEL_STEMS['train']}.gz").unlink()
    split = load_split(Dataset.MNIST, "train", str(given), True, CPU)
    assert split.source == str(given)
    assert mirror.requests == [f"/m/{LABEL_STEMS['train']}.gz"]
    assert sorted(p.name for p in given.iterdir()) == [f"{IMAGE_STEMS['train']}.gz", f"{LABEL_STEMS['train']}.gz"]
    assert torch.equal(split.images, read_idx(img))
    assert split.labels.tolist() == list(label_bytes(6, seed=5))
    assert not isolated.exists()  # nothing went to the cache


def test_download_into_a_given_dir_fails(tmp_path, isolated, online):
    given = tmp_path / "mine"
    given.mkdir()
    msg = error_of(locate, Dataset.MNIST, "test", str(given), True)
    assert msg.startswith(
        f"--data-dir {given} has no {IMAGE_STEMS['test']}, {LABEL_STEMS['test']} (.gz or raw), and downloading "
        f"them into it failed (http://127.0.0.1:9/{IMAGE_STEMS['test']}.gz: "
    )
    assert msg.endswith(f"): put them there, {HINT}")
    assert list(given.iterdir()) == []


def test_download_falls_back_to_next_mirror(isolated, monkeypatch, mirror, online):
    mirror.serve_dataset(Dataset.FASHION_MNIST, monkeypatch, n=4)
    monkeypatch.setitem(data.MIRRORS, Dataset.FASHION_MNIST, [mirror.url + "/missing/", mirror.url + "/m/"])
    img, lbl = locate(Dataset.FASHION_MNIST, "test", "", True)
    assert img == isolated / "fashion-mnist" / f"{IMAGE_STEMS['test']}.gz"
    assert read_idx(img).shape == (4, 28, 28) and read_idx(lbl).shape == (4,)
    assert mirror.requests[:2] == [f"/missing/{IMAGE_STEMS['test']}.gz", f"/m/{IMAGE_STEMS['test']}.gz"]


def test_download_wrong_md5_not_kept(tmp_path, isolated, monkeypatch, mirror, online):
    md5s = mirror.serve_dataset(Dataset.MNIST, monkeypatch)
    bad = "0" * 32
    monkeypatch.setitem(data.MD5, Dataset.MNIST, {**md5s, IMAGE_STEMS["train"]: bad})
    msg = error_of(locate, Dataset.MNIST, "train", "", True)
    url = f"{mirror.url}/m/{IMAGE_STEMS['train']}.gz"
    assert f"download ({url}: md5 {md5s[IMAGE_STEMS['train']]} != {bad})" in msg
    assert msg.startswith("no mnist train data found")
    cache = isolated / "mnist"
    assert not cache.exists() or list(cache.iterdir()) == []  # neither the file nor a partial one


def test_download_unreachable_mirror_reported(isolated, monkeypatch, online):
    # Port 9 (discard) on loopback refuses the connection.
    msg = error_of(locate, Dataset.MNIST, "test", "", True)
    assert f"download (http://127.0.0.1:9/{IMAGE_STEMS['test']}.gz: " in msg
    assert "refused" in msg.lower()
    assert not (isolated / "mnist").exists()


# ---------------------------------------------------------------------------------------------
# real files


@pytest.mark.skipif(
    not (SHARED_MNIST / f"{IMAGE_STEMS['test']}.gz").is_file(),
    reason=SHARED_SKIP_REASON,
)
def test_real_mnist_test_split():
    for stem in (IMAGE_STEMS["test"], LABEL_STEMS["test"]):
        got = hashlib.md5((SHARED_MNIST / f"{stem}.gz").read_bytes()).hexdigest()
        assert got == data.MD5[Dataset.MNIST][stem], stem
    images = read_idx(SHARED_MNIST / f"{IMAGE_STEMS['test']}.gz")
    labels = read_idx(SHARED_MNIST / f"{LABEL_STEMS['test']}.gz")
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    assert labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]  # the well-known first test digits
    assert torch.bincount(labels.long()).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    # The split used for real-data checks here: the first 8000 to train, the last 2000 to evaluate.
    head = load_split(Dataset.MNIST, "test[:8000]", str(SHARED_MNIST), False, CPU)
    tail = load_split(Dataset.MNIST, "test[8000:]", str(SHARED_MNIST), False, CPU)
    assert (len(head.labels), len(tail.labels)) == (8000, 2000)
    assert torch.equal(head.images, images[:8000]) and torch.equal(tail.images, images[8000:])
    assert torch.equal(tail.labels, labels[8000:].long())


@pytest.mark.skipif(
    not (DEBIAN_FASHION / f"{IMAGE_STEMS['train']}.gz").is_file(),
    reason=f"needs Debian's Fashion-MNIST in {DEBIAN_FASHION}: apt-get install dataset-fashion-mnist",
)
def test_real_fashion_mnist_from_system_path(monkeypatch):
    # The real system path list, found without --data-dir.
    monkeypatch.setitem(data.SYSTEM_DIRS, Dataset.FASHION_MNIST, [str(DEBIAN_FASHION)])
    train = load_split(Dataset.FASHION_MNIST, "train", "", False, CPU)
    test = load_split(Dataset.FASHION_MNIST, "test", "", False, CPU)
    assert train.source == test.source == str(DEBIAN_FASHION)
    assert train.images.shape == (60000, 28, 28) and test.images.shape == (10000, 28, 28)
    assert torch.bincount(train.labels).tolist() == [6000] * 10  # Fashion-MNIST is balanced
    assert torch.bincount(test.labels).tolist() == [1000] * 10
