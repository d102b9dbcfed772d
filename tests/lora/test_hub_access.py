"""What the Hub answers besides a public repo, through the stand-in (tests/hubstandin.py) over real HTTP:

- huggingface_hub's own downloads: a tag, a short commit id and the full one name the same commit; a
  bare repo name (`gpt2`-style) and a renamed repo's old name (answered 307) reach the repo; with hf-xet
  installed the client takes the Xet path for a large file the Hub says Xet holds, which is why the hub
  tests pin the HTTP path (HF_HUB_DISABLE_XET);
- dtrain's loaders (`--data NAME` through `datasets`, `--model ID` through `transformers`), in one
  subprocess with the stand-in as HF_ENDPOINT: a bare model id loads through the Hub's redirect; a bare
  dataset name is refused naming owner/name (`datasets` cannot load one); a gated repo without a token
  (401), with a token it has not granted (403), and a rate-limited one (429) are each refused in one
  line that says what to do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hubstandin import Hub
from runs import isolated_env

from lora.sft_fixtures import alpaca_records, make_model_dir, make_tokenizer

pytest.importorskip("datasets", reason="needs the lora extra: pip install -e .[lora]")
huggingface_hub = pytest.importorskip("huggingface_hub", reason="needs the lora extra: pip install -e .[lora]")

PROBE_TIMEOUT_S = 240
WEIGHTS = b"\x00\x01" * 4096  # an LFS file (.bin): sent from the CDN, and the Hub says Xet holds it
JSONL = "".join(json.dumps(r) + "\n" for r in alpaca_records(12)).encode()
GRANTED = "hf_granted_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub()
    files = {"README.md": b"# tiny\n", "weights.bin": WEIGHTS}
    hub.add_model("acme/tiny", files, tags=("v1.0",), aliases=("tiny-old",))
    hub.add_model("bare", files)
    # A bare dataset name: the Hub redirects it to the repo's id now (`imdb` is `stanfordnlp/imdb`).
    hub.add_dataset("acme/tinyset", {"data/train.jsonl": JSONL}, aliases=("tinyset",))
    hub.add_dataset("acme/gated-set", {"data/train.jsonl": JSONL}, gated=True, granted=(GRANTED,))
    hub.add_dataset("acme/busy-set", {"data/train.jsonl": JSONL}, rate_limited=True)
    model = make_model_dir(tmp_path_factory.mktemp("model"), make_tokenizer())
    model_files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    hub.add_model("acme/gated-model", model_files, gated=True, granted=(GRANTED,))
    hub.add_model("acme/tinymodel", model_files, aliases=("tinymodel",))  # `gpt2` is openai-community/gpt2
    hub.add_model("acme/busy-model", model_files, rate_limited=True)
    hub.start()
    yield hub
    hub.stop()


def download(hub: Hub, tmp_path: Path, monkeypatch, repo_id: str, filename: str, **kw) -> bytes:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    path = huggingface_hub.hf_hub_download(
        repo_id, filename, endpoint=hub.url, cache_dir=tmp_path / "cache", token=False, **kw
    )
    return Path(path).read_bytes()


def test_tags_and_short_commit_ids_name_the_commit(hub, tmp_path, monkeypatch):
    sha = hub.repos["models/acme/tiny"].sha
    for rev in ("v1.0", sha[:7], sha[:12], sha, "main"):
        assert download(hub, tmp_path / rev, monkeypatch, "acme/tiny", "weights.bin", revision=rev) == WEIGHTS
    with pytest.raises(huggingface_hub.errors.RevisionNotFoundError):
        download(hub, tmp_path / "v2", monkeypatch, "acme/tiny", "weights.bin", revision="v2.0")
    with pytest.raises(huggingface_hub.errors.RevisionNotFoundError):  # too short to be a commit id
        download(hub, tmp_path / "six", monkeypatch, "acme/tiny", "weights.bin", revision=sha[:6])


def test_bare_names_and_renamed_repos(hub, tmp_path, monkeypatch):
    assert download(hub, tmp_path / "bare", monkeypatch, "bare", "weights.bin") == WEIGHTS
    start = len(hub.requests)
    assert download(hub, tmp_path / "old", monkeypatch, "tiny-old", "README.md") == b"# tiny\n"
    asked = [p for _, p in hub.requests[start:]]
    assert any(p.startswith("/tiny-old/resolve/") for p in asked) and any("/acme/tiny/resolve/" in p for p in asked)


def test_the_client_takes_the_xet_path_unless_it_is_disabled(hub, tmp_path, monkeypatch):
    # The Hub's headers for a large file say Xet holds it; huggingface_hub with hf-xet then asks for a
    # Xet token, which the stand-in does not serve: the path real users take is Xet's, not the one the
    # hub tests exercise, and they say so by setting HF_HUB_DISABLE_XET.
    pytest.importorskip("hf_xet", reason="needs hf-xet (a huggingface_hub dependency)")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)
    start = len(hub.requests)
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError, match="501"):
        huggingface_hub.hf_hub_download(
            "acme/tiny", "weights.bin", endpoint=hub.url, cache_dir=tmp_path / "xet", token=False
        )
    assert any("/xet-read-token/" in p for _, p in hub.requests[start:])
    assert not any(p.startswith("cdn:") for _, p in hub.requests[start:])
    assert download(hub, tmp_path / "http", monkeypatch, "acme/tiny", "weights.bin") == WEIGHTS


PROBE = r"""
import json, sys
import torch
from dtrain.common.errors import UserError
from dtrain.lora import data, model

out = {}
for case, kind, name in json.loads(sys.argv[1]):
    try:
        if kind == "data":
            rows = data.read_rows(name, "text")
            out[case] = ["ok", len(rows)]
        else:
            model.load_base(name, torch.float32, seed=0)
            out[case] = ["ok", name]
    except UserError as e:
        out[case] = ["refused", str(e)]
    except Exception as e:  # a crash, not a refusal: the test shows it
        out[case] = ["crash", repr(e)[:800]]
print(json.dumps(out))
"""


def probe(hub: Hub, tmp_path: Path, cases: list[tuple[str, str, str]], **env: str) -> dict[str, list]:
    tmp_path.mkdir(parents=True)
    full = {**isolated_env(tmp_path, HF_HOME=str(tmp_path / "hf"), **hub.client_env()), **env}
    full.pop("DTRAIN_OFFLINE", None)
    if "HF_TOKEN" not in env:
        full.pop("HF_TOKEN", None)
    r = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cases)],
        env=full,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three subprocesses importing torch, transformers and datasets; the 429 answers are retried 5 times
def test_loaders_refuse_gated_and_rate_limited_repos_in_one_line(hub, tmp_path):
    cases = [
        ("bare dataset", "data", "tinyset"),
        ("bare model", "model", "tinymodel"),
        ("gated dataset", "data", "acme/gated-set"),
        ("gated model", "model", "acme/gated-model"),
        ("busy dataset", "data", "acme/busy-set"),
        ("busy model", "model", "acme/busy-model"),
    ]
    anonymous = probe(hub, tmp_path / "anon", cases)
    gated = [c for c in cases if c[0].startswith("gated")]
    tokened = probe(hub, tmp_path / "token", gated, HF_TOKEN="hf_someone_else")
    granted = probe(hub, tmp_path / "granted", gated, HF_TOKEN=GRANTED)
    # A bare model id loads through the Hub's redirect; a bare dataset name does not: `datasets` (5.x)
    # builds hf:// paths from the name as given, and huggingface_hub refuses an id without an owner. dtrain
    # says so in one line, naming the fix.
    assert anonymous["bare model"] == ["ok", "tinymodel"]
    kind, line = anonymous["bare dataset"]
    assert kind == "refused" and "\n" not in line and "owner/name" in line and "--data OWNER/tinyset" in line, line
    assert granted == {"gated dataset": ["ok", 12], "gated model": ["ok", "acme/gated-model"]}
    for results in (anonymous, tokened):  # 401 without a token, 403 with one not granted
        for case in ("gated dataset", "gated model"):
            kind, line = results[case]
            assert kind == "refused" and "\n" not in line, (case, results[case])
            assert "gated" in line and "HF_TOKEN" in line and "accept" in line, (case, line)
    for case in ("busy dataset", "busy model"):
        kind, line = anonymous[case]
        assert kind == "refused" and "\n" not in line, (case, anonymous[case])
        assert "429" in line and "rate" in line and "retry" in line, (case, line)
