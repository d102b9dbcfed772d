"""LoRA user mistakes, end to end through the real `dtrain` command in a subprocess: each one ends
with exit code 2 (ExitCode.USAGE), one `error:` line on stderr that says what was wrong and what
to do, and no Python traceback. A fresh run refused for bad input leaves no run directory behind.

Each run is offline (DTRAIN_OFFLINE=1) with its caches (dtrain's and the Hugging Face hub's) under
the test's directory, so no test reads the user's models or data or reaches the internet.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runs import RefusedResume, Result, cli, snapshot

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.storage import open_store
from dtrain.lora.data import read_documents
from dtrain.lora.model import PRESETS

TINY = ["--seq-len", "64", "--batch-size", "4", "--max-steps", "2", "--nproc", "1", "--output", "runs"]


dtrain = cli  # these tests read as `dtrain <args>`


def train(cwd: Path, *args: str) -> Result:
    return dtrain(cwd, "train", "lora", *TINY, *args)


def assert_refused(r: Result, cwd: Path) -> str:
    """Exit 2, and no run left under runs/ (bad input before any checkpoint leaves no debris)."""
    line = r.error_line()
    assert r.code == ExitCode.USAGE, r.err
    runs = cwd / "runs"
    assert not runs.exists() or not list(runs.iterdir())
    return line


def refused_data(cwd: Path, data: Path | str) -> str:
    """The error line of a tiny-llama run on `data`, after assert_refused's checks."""
    return assert_refused(train(cwd, "--model", "tiny-llama", "--data", str(data)), cwd)


# ---------------------------------------------------------------------------------------------
# the model


def test_unknown_model_offline(tmp_path, corpus):
    r = train(tmp_path, "--model", "some-org/not-a-model", "--data", str(corpus))
    line = assert_refused(r, tmp_path)
    assert line.startswith("error: cannot load model id 'some-org/not-a-model': ")
    assert f"a preset ({', '.join(PRESETS)})" in line
    assert line.endswith("or a hub id on a machine with internet (HF_TOKEN for gated models)")


def test_unknown_target_module(tmp_path, corpus):
    r = train(tmp_path, "--model", "tiny-llama", "--data", str(corpus), "--target-modules", "qq_proj")
    line = assert_refused(r, tmp_path)
    assert line == (
        "error: --target-modules qq_proj match no layer of 'tiny-llama'; its linear layers are: "
        "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
    )


# ---------------------------------------------------------------------------------------------
# the data


def test_empty_dataset(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    line = refused_data(tmp_path, empty)
    assert line == f"error: --data {empty} holds no text"


def test_dataset_too_short_for_two_blocks(tmp_path):
    short = tmp_path / "short.txt"
    short.write_bytes(b"0123456789")
    line = refused_data(tmp_path, short)
    # 10 bytes and the end-of-text token.
    assert line == (
        f"error: --data {short} gives 11 tokens: too short for two blocks of --seq-len 64 "
        "(one to train on, one to evaluate); add text or lower --seq-len"
    )


def test_data_path_that_does_not_exist_offline(tmp_path):
    missing = tmp_path / "nope.txt"
    line = refused_data(tmp_path, missing)
    assert line == (
        f"error: --data {missing}: no such file or directory, and the Hugging Face hub is out of reach "
        "to load it as a dataset name (offline)"
    )


# Binary data: refused before training with the file and the byte offset. Each file below would
# train if read leniently: the invalid bytes would become U+FFFD, the control bytes tokens.

TEXT = "A line of ordinary text, with\ttabs and\r\nline ends.\f\n" * 40  # 2,080 bytes
NOT_UTF8 = (
    "not UTF-8 text (byte {byte} at offset {offset}): --data takes UTF-8 text; "
    "convert the file (iconv -t UTF-8) or leave it out"
)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            TEXT.encode() + "café au lait\n".encode("latin-1") + TEXT.encode(),
            NOT_UTF8.format(byte="0xe9", offset=2083),
        ),
        (
            # UTF-16 without a byte-order mark is valid UTF-8, byte for byte: every other byte is NUL.
            TEXT.encode("utf-16-le"),
            "binary, not text: 2,080 of its 4,160 bytes (50.0%) are control bytes, the first (0x00) at offset 1; "
            "--data takes text with at most 30% control bytes",
        ),
    ],
    ids=["latin-1", "utf-16"],
)
def test_data_file_that_is_not_text(tmp_path, content, message):
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    assert refused_data(tmp_path, path) == f"error: {path}: {message}"


def test_directory_with_a_binary_jsonl(tmp_path, corpus):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_bytes(corpus.read_bytes())
    bad = data / "b.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "\xc3\x28 is no UTF-8 sequence"}\n')
    line = refused_data(tmp_path, data)
    assert line == f"error: {bad}: {NOT_UTF8.format(byte='0xc3', offset=27)}"


def test_binary_object_in_a_bucket(tmp_path, gcs_bucket):
    url = f"{gcs_bucket}/weights.txt"
    open_store(url).write_bytes("", bytes(4096))  # 4 KiB of zeros: valid UTF-8, and no text
    line = refused_data(tmp_path, url)
    assert line == (
        f"error: {url}: binary, not text: 4,096 of its 4,096 bytes (100.0%) are control bytes, the first "
        "(0x00) at offset 0; --data takes text with at most 30% control bytes"
    )


@pytest.mark.parametrize(
    "raw, refused_at",
    [
        (b"\x00" * 30 + b"x" * 70, None),  # 30%: the most allowed
        (b"x" * 69 + b"\x01" * 31, 69),  # 31%
        (b"\t\n\r\f" * 25, None),  # whitespace is text
        (b"\x0b" * 31 + b"x" * 69, 0),  # vertical tab is not
        (b"\x1b[31mred\x1b[0m\n" * 10, None),  # colour escapes: 2 of 14 bytes
        (b"x" * 69 + b"\x7f" * 31, 69),  # DEL
    ],
    ids=["30pct", "31pct", "whitespace", "vtab", "ansi-colour", "del"],
)
def test_control_byte_threshold(tmp_path, raw, refused_at):
    path = tmp_path / "f.txt"
    path.write_bytes(raw)
    if refused_at is None:
        assert read_documents(str(path), "text") == [raw.decode()]
        return
    with pytest.raises(UserError) as e:
        read_documents(str(path), "text")
    assert str(e.value).startswith(
        f"{path}: binary, not text: 31 of its 100 bytes (31.0%) are control bytes, the first"
    )
    assert f"at offset {refused_at};" in str(e.value)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """The corpus as JSONL records {"content": paragraph, "id": n}, after a blank first line (so a
    reported line number is the file's, not the record's)."""
    paragraphs = [p for p in corpus.read_text().split("\n\n") if p.strip()]
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    path.write_text("\n" + "".join(json.dumps({"content": p, "id": i}) + "\n" for i, p in enumerate(paragraphs)))
    return path


def test_jsonl_without_the_text_field(tmp_path, jsonl):
    line = refused_data(tmp_path, jsonl)
    assert line == f"error: {jsonl}:2: record has no field 'text' (it has: content, id); pass --text-field"


# ---------------------------------------------------------------------------------------------
# a checkpoint from a different model config; the first run also shows --text-field at work


@pytest.fixture(scope="module")
def refused_resume(tmp_path_factory: pytest.TempPathFactory, jsonl: Path) -> RefusedResume:
    """A completed 2-step run on the JSONL with --text-field content and --lora-r 8, then a resume of
    it with --lora-r 4."""
    cwd = tmp_path_factory.mktemp("resume")
    first = train(cwd, "--model", "tiny-llama", "--data", str(jsonl), "--text-field", "content", "--lora-r", "8")
    assert first.code == ExitCode.OK, first.out + first.err
    (run_dir,) = (cwd / "runs").iterdir()
    before = snapshot(run_dir)
    resumed = dtrain(cwd, "train", "lora", "--resume", run_dir.name, "--lora-r", "4", "--output", "runs")
    after = snapshot(run_dir)
    runs = dtrain(cwd, "runs", "--json", "--output", "runs")
    assert runs.code == 0, runs.err
    return RefusedResume(run_dir, first, resumed, before, after, json.loads(runs.out))


def test_jsonl_with_text_field_trains(refused_resume, jsonl):
    r = refused_resume
    assert "Traceback" not in r.first.err
    records = sum(1 for ln in jsonl.read_text().splitlines() if ln.strip())
    assert f"data {jsonl}: {records} documents" in r.first.out
    status = json.loads((r.run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["result"]["steps"] == 2
    assert (r.run_dir / "final" / "adapter" / "adapter_model.safetensors").is_file()


def test_resume_with_other_lora_r(refused_resume):
    r = refused_resume
    line = r.resumed.error_line()
    assert r.resumed.code == ExitCode.USAGE, r.resumed.err
    assert line == (
        f"error: run {r.run_dir} was trained with a different model config (lora_r: 8 in the run, 4 now): "
        "resume with the run's own model settings, or start a new run without --resume"
    )
    # The refusal came before the run was touched: every file (config, status, metrics, checkpoints,
    # adapter) is as the first run left it, byte for byte.
    assert {
        "config.json",
        "status.json",
        "checkpoints/LATEST",
        "checkpoints/step-00000002/state.pt",
        "final/adapter/adapter_model.safetensors",
    } <= set(r.files_before)
    assert r.files_after == r.files_before


def test_refused_resume_keeps_run_completed(refused_resume):
    (row,) = refused_resume.runs_json
    assert row["run_id"] == refused_resume.run_dir.name
    assert row["status"] == "completed" and row["step"] == 2
    assert row["best_metric"] == "eval_loss" and row["best_value"] is not None


# ---------------------------------------------------------------------------------------------
# invalid settings: refused before anything starts


def test_lora_r_zero(tmp_path, corpus):
    r = train(tmp_path, "--model", "tiny-llama", "--data", str(corpus), "--lora-r", "0")
    assert r.error_line() == "error: invalid configuration: lora.lora_r (from --lora-r): must be >= 1, got 0"
    assert r.code == ExitCode.USAGE
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("missing, given", [("model", ["--data", "x.txt"]), ("data", ["--model", "tiny-llama"])])
def test_missing_required_option(tmp_path, missing, given):
    r = train(tmp_path, *given)
    assert r.error_line() == (
        f"error: lora.{missing} is required: set it with --{missing}, DTRAIN_LORA_{missing.upper()} "
        f"or {missing} = ... in [lora]"
    )
    assert r.code == ExitCode.USAGE
    assert not (tmp_path / "runs").exists()
