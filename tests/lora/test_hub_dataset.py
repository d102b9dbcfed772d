"""`dtrain train lora --data <Hugging Face dataset name>` end to end: the real `dtrain` command in a
subprocess, whose real `datasets` and `huggingface_hub` clients talk to a stand-in of the Hub over
HTTP (tests/hubstandin.py, HF_ENDPOINT), with every Hugging Face cache under the test's directory.

- a chat dataset by name, as `push_to_hub` lays it out (README.md with its configs, Parquet shards
  under data/, kept in LFS and sent from another origin as the Hub's CDN does), trains with its
  `validation` split as the eval set;
- a second run reads the datasets cache: offline, it sends the Hub nothing and trains the same;
  online, it asks only for metadata and downloads no data file again;
- a name that does not exist, a split that does not exist, and a name offline with nothing cached
  are each refused in one line, exit 2, with no run left behind;
- a dataset with subsets (configs) and other split names, laid out like openai/gsm8k (main, socratic)
  with ultrachat_200k's train_sft/test_sft: `--data-subset` and `--data-split` pick them, offline from
  the cache too; an unknown or missing subset or split is one line naming those that exist.

The training runs and the unknown split are marked slow; the default suite reads the data through
`--show-example` (the same read, no training).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hubstandin import LFS_SUFFIXES, Hub
from runs import Result, cli, isolated_env, metrics, only_run

from dtrain.common.errors import ExitCode
from lora.sft_fixtures import alpaca_records, chat_records, make_model_dir, make_tokenizer

pytest.importorskip("datasets", reason="needs the lora extra: pip install -e .[lora]")
pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

CHAT = "acme/tiny-chat"
ALPACA = "acme/tiny-alpaca"
TRAIN = chat_records(48)
VALIDATION = chat_records(8, seed=9)
ARGS = ["--seq-len", "96", "--batch-size", "4", "--max-steps", "4", "--lr", "5e-3", "--log-every", "1",
        "--eval-every", "4", "--nproc", "1", "--output", "runs"]  # fmt: skip

# The card `push_to_hub` writes: one config whose splits name their files.
README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: validation
    path: data/validation-*
---
# tiny-chat
"""


NAME = "acme/chat-subsets"
MAIN, MAIN_TEST, SOCRATIC = chat_records(24, seed=1), chat_records(6, seed=2), chat_records(24, seed=3)
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train_sft
    path: main/train_sft-*
  - split: test_sft
    path: main/test_sft-*
- config_name: socratic
  data_files:
  - split: train_sft
    path: socratic/train_sft-*
---
"""


def parquet(records: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def hub():
    hub = Hub()
    hub.add_dataset(
        CHAT,
        {
            "README.md": README.encode(),
            "data/train-00000-of-00001.parquet": parquet(TRAIN),
            "data/validation-00000-of-00001.parquet": parquet(VALIDATION),
        },
    )
    # No card: `datasets` finds the split from the file name, as on the Hub.
    jsonl = "".join(json.dumps(r) + "\n" for r in alpaca_records(40)).encode()
    hub.add_dataset(ALPACA, {"data/train.jsonl": jsonl})
    hub.add_dataset(
        NAME,
        {
            "README.md": CARD.encode(),
            "main/train_sft-00000-of-00001.parquet": parquet(MAIN),
            "main/test_sft-00000-of-00001.parquet": parquet(MAIN_TEST),
            "socratic/train_sft-00000-of-00001.parquet": parquet(SOCRATIC),
        },
    )
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "m", make_tokenizer())


def online(hub: Hub, cwd: Path, hf_home: Path, **extra: str) -> dict[str, str]:
    """dtrain's test environment with the stand-in as the Hub: online (no DTRAIN_OFFLINE) unless `extra`
    says otherwise, caches under `hf_home`, no download counter sent to the Hub's S3 bucket, and the
    HTTP download path, not Xet's (Hub.client_env: the stand-in does not serve Xet)."""
    env = isolated_env(cwd, HF_HOME=str(hf_home), **hub.client_env())
    del env["DTRAIN_OFFLINE"]
    return {**env, **extra}


def train(cwd: Path, env: dict[str, str], model: Path, data: str, *extra: str) -> Result:
    return cli(cwd, "train", "lora", "--model", str(model), "--data", data, *ARGS, *extra, env=env)


def show_example(cwd: Path, env: dict[str, str], model: Path, data: str) -> Result:
    """`--show-example`: --data read as a run reads it, and its first example printed; no training."""
    return cli(cwd, "train", "lora", "--model", str(model), "--data", data, "--seq-len", "96", "--nproc", "1",
               "--show-example", env=env)  # fmt: skip


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run) if "loss" in m}


def data_downloads(hub: Hub, start: int = 0) -> list[str]:
    """The data files the clients fetched since request number `start` (LFS blobs from the CDN, other
    files through resolve), leaving out the metadata (card, yaml, dataset_infos.json). An LFS file's
    resolve GET is the redirect to its blob, not a second download."""
    return [
        path
        for method, path in hub.requests[start:]
        if method == "GET"
        and (path.startswith("cdn:") or ("/resolve/" in path and "/data/" in path and not path.endswith(LFS_SUFFIXES)))
    ]


def first_assistant_turn(record: dict) -> str:
    return next(m["content"] for m in record["messages"] if m["role"] == "assistant")


@pytest.mark.slow  # three runs of the CLI, two of them training: ~25 s
def test_chat_dataset_by_name_trains_and_a_second_run_reads_the_cache(tmp_path, hub, model_dir):
    hf_home = tmp_path / "hf"
    start = len(hub.requests)
    r = train(tmp_path, online(hub, tmp_path, hf_home), model_dir, CHAT, "--eval-data", "validation")
    assert r.code == ExitCode.OK, r.err[-3000:]
    run = only_run(tmp_path / "runs")

    # It came from the Hub: both Parquet shards were downloaded, through the CDN the Hub redirects to.
    assert len(data_downloads(hub, start)) == 2 and all(
        p.startswith("cdn:/lfs-blobs/") for p in data_downloads(hub, start)
    )
    # All 48 train records train (none held out: the validation split is the eval set), the first shown.
    assert f"data {CHAT}: 48 documents" in r.out, r.out
    assert "chat data: loss on completions only" in r.out and first_assistant_turn(TRAIN[0]) in r.out
    first = losses(run)
    assert sorted(first) == [1, 2, 3, 4] and first[4] < first[1], first
    assert [m for m in metrics(run) if "eval_loss" in m], "no evaluation on the validation split"

    # Offline (the server still up, to count): nothing is asked of the Hub, and the run trains the same.
    mark = len(hub.requests)
    again = tmp_path / "again"
    again.mkdir()
    r = train(again, online(hub, again, hf_home, HF_HUB_OFFLINE="1"), model_dir, CHAT, "--eval-data", "validation")
    assert r.code == ExitCode.OK, r.err[-3000:]
    assert hub.requests[mark:] == []
    assert losses(only_run(again / "runs")) == first

    # Online again (--show-example reads the data the same way, without training): the client checks
    # the card and the commit, but downloads no data file again.
    mark = len(hub.requests)
    r = show_example(tmp_path, online(hub, tmp_path, hf_home), model_dir, CHAT)
    assert r.code == ExitCode.OK, r.err[-3000:]
    assert first_assistant_turn(TRAIN[0]) in r.out
    assert hub.requests[mark:] and data_downloads(hub, mark) == []


def test_instruction_dataset_without_a_card_then_from_the_cache(tmp_path, hub, model_dir):
    """No README.md on the Hub (404 EntryNotFound): `datasets` lists the tree and finds data/train.jsonl.
    Then offline, from the cache alone: the same example, and no request to the Hub."""
    start = len(hub.requests)
    r = show_example(tmp_path, online(hub, tmp_path, tmp_path / "hf"), model_dir, ALPACA)
    assert r.code == ExitCode.OK, r.err[-3000:]
    shown = r.out[r.out.index("instruction data, loss on completions only: ") :]
    assert alpaca_records(40)[0]["output"] in shown
    assert [p for p in data_downloads(hub, start) if p.endswith("/data/train.jsonl")], hub.requests[start:]

    mark = len(hub.requests)
    # DTRAIN_OFFLINE alone (HF_HUB_OFFLINE is the slow test's): dtrain tells `datasets` to stay offline.
    r = show_example(tmp_path, online(hub, tmp_path, tmp_path / "hf", DTRAIN_OFFLINE="1"), model_dir, ALPACA)
    assert r.code == ExitCode.OK, r.err[-3000:]
    assert r.out[r.out.index("instruction data, loss on completions only: ") :] == shown
    assert hub.requests[mark:] == [], hub.requests[mark:]


def assert_refused(r: Result, cwd: Path) -> str:
    line = r.error_line()
    assert r.code == ExitCode.USAGE, r.err
    assert not (cwd / "runs").exists() or not list((cwd / "runs").iterdir())
    return line


def test_a_dataset_that_does_not_exist(tmp_path, hub, model_dir):
    start = len(hub.requests)
    line = assert_refused(train(tmp_path, online(hub, tmp_path, tmp_path / "hf"), model_dir, "acme/nope"), tmp_path)
    assert line == (
        "error: --data acme/nope: no such file or directory, and not a dataset on the Hugging Face hub "
        "(Dataset 'acme/nope' doesn't exist on the Hub or cannot be accessed.); check the name, or set HF_TOKEN "
        "for a private or gated dataset"
    )
    assert any("acme/nope" in path for _, path in hub.requests[start:])  # the Hub was asked, and said no


@pytest.mark.slow  # ~5 s, and the same path as test_a_dataset_that_does_not_exist
def test_a_split_that_does_not_exist(tmp_path, hub, model_dir):
    r = train(tmp_path, online(hub, tmp_path, tmp_path / "hf"), model_dir, CHAT, "--eval-data", "test")
    line = assert_refused(r, tmp_path)
    assert line == (
        f"error: --data {CHAT}: no split 'test'; it has train, validation: pass one with --data-split (or --eval-data)"
    )


def test_offline_with_nothing_cached(tmp_path, hub, model_dir):
    start = len(hub.requests)
    env = online(hub, tmp_path, tmp_path / "hf", HF_HUB_OFFLINE="1")
    line = assert_refused(train(tmp_path, env, model_dir, CHAT), tmp_path)
    assert line == (
        f"error: --data {CHAT}: no such file or directory, and the Hugging Face hub is out of reach to load it "
        "as a dataset name (offline: DTRAIN_OFFLINE or HF_HUB_OFFLINE is set, or the hub's host does not "
        "resolve) and the datasets cache does not hold it; load it once online, or pass a local file"
    )
    assert hub.requests[start:] == []


# A dataset's subset (config) and split: laid out like openai/gsm8k (subsets main and socratic) with
# HuggingFaceH4/ultrachat_200k's split names (train_sft, test_sft).


def show(cwd: Path, env: dict[str, str], model: Path, *args: str) -> Result:
    return cli(cwd, "train", "lora", "--model", str(model), "--data", NAME, "--seq-len", "96", "--nproc", "1",
               "--show-example", *args, env=env)  # fmt: skip


def test_subset_and_split_by_name_then_offline_from_the_cache(tmp_path, hub, model_dir):
    hf = tmp_path / "hf"
    for subset, records in (("main", MAIN), ("socratic", SOCRATIC)):
        r = show(tmp_path, online(hub, tmp_path, hf), model_dir, "--data-subset", subset, "--data-split", "train_sft")
        assert r.code == ExitCode.OK, r.err[-3000:]
        assert f"first example ({NAME}[{subset}/train_sft] row 0)" in r.out, r.out
        assert first_assistant_turn(records[0]) in r.out
    mark = len(hub.requests)
    r = show(tmp_path, online(hub, tmp_path, hf, DTRAIN_OFFLINE="1"), model_dir, "--data-subset", "main",
             "--data-split", "train_sft")  # fmt: skip
    assert r.code == ExitCode.OK, r.err[-3000:]
    assert first_assistant_turn(MAIN[0]) in r.out
    assert hub.requests[mark:] == []


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ([], f"error: --data {NAME}: the dataset has several subsets (main, socratic): pass one with --data-subset"),
        (["--data-subset", "mian"], f"error: --data {NAME}: no subset 'mian'; it has main, socratic: pass one with "
                                    "--data-subset"),
        (["--data-subset", "main"], f"error: --data {NAME}: no split 'train' in subset 'main'; it has train_sft, "
                                    "test_sft: pass one with --data-split (or --eval-data)"),
    ],
)  # fmt: skip
def test_an_unknown_or_missing_subset_or_split_names_those_that_exist(tmp_path, hub, model_dir, args, line):
    r = show(tmp_path, online(hub, tmp_path, tmp_path / "hf"), model_dir, *args)
    assert assert_refused(r, tmp_path) == line


def test_a_split_for_a_file_is_refused(tmp_path, model_dir):
    data = tmp_path / "c.jsonl"
    data.write_text("{}\n")
    r = cli(tmp_path, "train", "lora", "--model", str(model_dir), "--data", str(data), "--data-split", "test_sft",
            "--nproc", "1", "--show-example")  # fmt: skip
    assert assert_refused(r, tmp_path) == (
        f"error: --data-split test_sft: a subset or split names part of a Hugging Face dataset; --data {data} is a file"
    )


@pytest.mark.slow  # one training run of 2 steps: ~10 s
def test_a_subset_trains_with_a_split_of_it_as_the_eval_set(tmp_path, hub, model_dir):
    env = online(hub, tmp_path, tmp_path / "hf")
    r = cli(tmp_path, "train", "lora", "--model", str(model_dir), "--data", NAME, "--data-subset", "main",
            "--data-split", "train_sft", "--eval-data", "test_sft", "--seq-len", "96", "--batch-size", "4",
            "--max-steps", "2", "--nproc", "1", "--output", "runs", env=env)  # fmt: skip
    assert r.code == ExitCode.OK, r.err[-3000:]
    assert f"data {NAME}: 24 documents" in r.out, r.out
    assert (only_run(tmp_path / "runs") / "final").exists()
