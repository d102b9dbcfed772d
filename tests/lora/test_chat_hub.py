"""A Hugging Face dataset's subset (config) and split: `--data NAME --data-subset S --data-split P`,
through the real `datasets` client against the Hub stand-in (tests/hubstandin.py), as
test_hub_dataset.py does. Laid out like openai/gsm8k (subsets main and socratic) with
HuggingFaceH4/ultrachat_200k's split names (train_sft, test_sft). An unknown subset or split, or none
where the dataset has several subsets, is one line naming those that exist, exit 2, no run."""

from __future__ import annotations

from pathlib import Path

import pytest
from hubstandin import Hub
from runs import Result, cli, only_run

from dtrain.common.errors import ExitCode
from lora.sft_fixtures import chat_records, make_model_dir, make_tokenizer
from lora.test_hub_dataset import assert_refused, first_assistant_turn, online, parquet

pytest.importorskip("datasets", reason="needs the lora extra: pip install -e .[lora]")

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


@pytest.fixture(scope="module")
def hub():
    hub = Hub()
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
