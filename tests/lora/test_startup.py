"""Start-up on several GPUs and nodes, from what a CPU can show: DDP broadcasts only the LoRA weights
(the frozen base is read alike by every rank), and forking the RNG names no GPU, so a node with
several of them neither warns on every rank nor touches every GPU from every rank."""

from __future__ import annotations

import warnings

import pytest
import torch
from runs import free_port, in_process, rank_env

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.lora import train as lora_train  # noqa: E402 - after the skip
from dtrain.lora.model import apply_lora, load_base  # noqa: E402


def test_ddp_broadcasts_only_the_lora_weights_at_start(tmp_path, corpus, micro_llama, monkeypatch):
    """A one-rank gloo group in this process, as torchrun would set it up; every tensor DDP's
    constructor broadcasts is recorded."""
    broadcast: list[torch.Tensor] = []
    stock = torch.distributed._broadcast_coalesced

    def spy(group, tensors, *args, **kwargs):
        broadcast.extend(tensors)
        return stock(group, tensors, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "_broadcast_coalesced", spy)
    argv = ["--model", micro_llama, "--data", str(corpus), "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "2", "--eval-batches", "1", "--output", str(tmp_path / "runs")]  # fmt: skip
    assert in_process(lora_train.main, argv, monkeypatch, **rank_env(0, 1, free_port())) == 0
    # LoRA r 8 on 2 layers of width 32 (MLP 64): q, k, v, o 8 x (32 + 32) each; gate, up and down
    # 8 x (32 + 64) each. The base model (word embeddings alone are 258 x 32) is not broadcast.
    lora = 2 * (4 * 8 * (32 + 32) + 3 * 8 * (32 + 64))
    assert [t.numel() for t in broadcast] and sum(t.numel() for t in broadcast) == lora == 8704
    assert all(t.dtype == torch.float32 for t in broadcast)


def test_forking_the_rng_names_no_gpu(micro_llama, monkeypatch):
    """torch.random.fork_rng() with no devices touches every GPU (a context on each, from every rank)
    and warns once per process where there are several. Faked here: two GPUs."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_base(micro_llama, torch.float32, seed=0)
        model, targets = apply_lora(model, micro_llama, r=4, alpha=8, dropout=0.0, targets=[], seed=0)
    assert len(targets) == 7
    assert not [w for w in caught if "fork_rng" in str(w.message)]


class OneNodeOfTwo:
    """A Dist stand-in: this process is a node's second rank (local rank 1); node_first runs `fn` as
    the real one does on such a rank, after the node's first rank, and records how it was asked."""

    local_rank = 1

    def __init__(self) -> None:
        self.asked: list[tuple[str, float]] = []

    def node_first(self, tag, fn, timeout):
        self.asked.append((tag, timeout))
        return fn()


def test_a_hub_model_is_downloaded_by_each_nodes_first_rank_and_read_onto_the_gpu(monkeypatch):
    """What load_base asks of transformers for a hub id, on a node's second rank: the cache only (its
    first rank downloaded), the weights placed on the GPU as they are read. No hub and no GPU here:
    transformers' loaders are stand-ins that record their arguments."""
    import transformers

    from dtrain.lora import model as lora_model

    calls = []

    def record(kind):
        return lambda name, **kw: calls.append((kind, name, kw)) or torch.nn.Linear(1, 1)

    monkeypatch.setattr(lora_model, "hub_reachable", lambda: True)
    monkeypatch.delenv("DTRAIN_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(lora_model, "HFTokenizer", lambda tok: tok)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record("model"))
    d, gpu = OneNodeOfTwo(), torch.device("cuda", 1)
    load_base("org/some-7b", torch.bfloat16, seed=0, device=gpu, d=d)
    assert d.asked == [("model download", lora_model.MODEL_DOWNLOAD_TIMEOUT_S)]
    assert [(kind, name, kw["local_files_only"]) for kind, name, kw in calls] == [
        ("tokenizer", "org/some-7b", True),
        ("model", "org/some-7b", True),
    ]
    assert calls[1][2]["device_map"] == {"": gpu} and calls[1][2]["dtype"] == torch.bfloat16
