"""The checkpointer in one process: what a save contains, when it becomes visible, retention,
background writes, and refusal of a checkpoint from another model config."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from dtrain.common.checkpoint import LATEST, Checkpointer, find_latest, step_dir
from dtrain.common.dist import distributed
from dtrain.common.errors import UserError
from dtrain.common.storage import LocalStore, open_store

MODEL_CFG = {"arch": "toy", "width": 4}


@pytest.fixture
def d(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    with distributed() as dist_:
        yield dist_


def make(store, d, **kw):
    opts = {"every": 0, "keep": 3, "model_config": MODEL_CFG, "run_config": {"seed": 1}, "log": lambda _m: None}
    return Checkpointer(store, d, **{**opts, **kw})


def toy_state(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_save_then_load_restores_state_rng_and_step(tmp_path, d):
    model, opt = toy_state()
    ck = make(LocalStore(tmp_path), d)
    assert ck.save(
        7, lambda: {"model": model.state_dict(), "optimizer": opt.state_dict(), "data": {"epoch": 0}}, last=True
    )
    expected_next = torch.rand(3)  # the draw right after the save must replay after load
    torch.manual_seed(123)
    state = make(LocalStore(tmp_path), d).load()
    assert state is not None and state["step"] == 7
    assert torch.equal(torch.rand(3), expected_next)
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v)
    assert state["optimizer"]["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert state["config"] == {"seed": 1} and state["model_config"] == MODEL_CFG
    assert (tmp_path / LATEST).read_text() == step_dir(7)
    meta = json.loads((tmp_path / step_dir(7) / "meta.json").read_text())
    assert meta["files"]["state.pt"]["size"] == (tmp_path / step_dir(7) / "state.pt").stat().st_size


def test_interval_logic_lives_in_the_checkpointer(tmp_path, d):
    ck = make(LocalStore(tmp_path), d, every=5)
    saved = [s for s in range(1, 13) if ck.save(s, lambda: {"x": torch.zeros(1)}, epoch_end=(s == 12))]
    ck.close()
    assert saved == [5, 10, 12]


def test_interrupted_save_is_never_picked_up(tmp_path, d):
    store = LocalStore(tmp_path)
    ck = make(store, d)
    ck.save(10, lambda: {"x": torch.ones(1)}, last=True)
    ck.save(20, lambda: {"x": torch.ones(1) * 2}, last=True)
    ck.close()
    # Step 30: files written, manifest never written (killed between the two).
    (tmp_path / step_dir(30)).mkdir()
    (tmp_path / step_dir(30) / "state.pt").write_bytes((tmp_path / step_dir(20) / "state.pt").read_bytes())
    # Step 20: its state file truncated after the fact: the manifest's size no longer matches.
    data = (tmp_path / step_dir(20) / "state.pt").read_bytes()
    (tmp_path / step_dir(20) / "state.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / LATEST).write_text(step_dir(30))
    found = find_latest(store)
    assert found is not None and found.step == 10
    state = make(store, d).load()
    assert state["step"] == 10 and state["x"].item() == 1.0


def test_keeps_the_newest_k(tmp_path, d):
    ck = make(LocalStore(tmp_path), d, keep=2)
    for s in (1, 2, 3, 4, 5):
        ck.save(s, lambda: {"x": torch.zeros(1)}, last=True)
    ck.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [step_dir(4), step_dir(5)]


def test_refuses_a_checkpoint_from_another_model_config(tmp_path, d):
    make(LocalStore(tmp_path), d).save(3, lambda: {"x": torch.zeros(1)}, last=True)
    with pytest.raises(UserError, match=r"different model config \(width: 4 in the checkpoint, 8 now\)"):
        make(LocalStore(tmp_path), d, model_config={"arch": "toy", "width": 8}).load()


class GatedStore(LocalStore):
    """Writes of state files block until the test opens the gate: a slow network, made explicit."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.started = threading.Event()

    def write_bytes(self, rel, data):
        if rel.endswith("state.pt"):
            self.started.set()
            assert self.gate.wait(30)
        super().write_bytes(rel, data)


def test_save_returns_before_the_upload_and_final_save_waits(tmp_path, d):
    store = GatedStore(tmp_path)
    ck = make(store, d)
    assert ck.save(1, lambda: {"x": torch.zeros(1)}, epoch_end=True)  # returns with the write pending
    assert store.started.wait(10)
    assert find_latest(store) is None  # nothing visible while the upload is in flight
    done = threading.Event()
    t = threading.Thread(target=lambda: (ck.save(2, lambda: {"x": torch.ones(1)}, last=True), done.set()))
    t.start()
    assert not done.wait(0.5)  # the final save waits for the upload
    store.gate.set()
    t.join(30)
    assert done.is_set() and find_latest(store).step == 2


class FailingStore(LocalStore):
    def write_bytes(self, rel, data):
        if rel.endswith("state.pt"):
            raise OSError("disk full")
        super().write_bytes(rel, data)


def test_a_failed_background_write_is_raised_not_lost(tmp_path, d):
    ck = make(FailingStore(tmp_path), d)
    ck.save(1, lambda: {"x": torch.zeros(1)}, epoch_end=True)
    with pytest.raises(RuntimeError, match="disk full"):
        ck.close()


def test_checkpoints_in_a_bucket(gcs_bucket, d):
    store = open_store(gcs_bucket).child("checkpoints")
    model, opt = toy_state(seed=3)
    ck = make(store, d)
    ck.save(5, lambda: {"model": model.state_dict()}, last=True)
    ck.close()
    assert store.read_bytes(LATEST).decode() == step_dir(5)
    state = make(open_store(gcs_bucket).child("checkpoints"), d).load()
    assert torch.equal(state["model"]["weight"], model.weight.detach())
