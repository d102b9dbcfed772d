"""The checkpointer in one process: what a save contains, when it becomes visible, retention,
background writes, and refusal of a checkpoint from another model config."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from helpers import write_dataset
from runs import cli

from dtrain.common.checkpoint import LATEST, Checkpointer, find_latest, step_dir
from dtrain.common.dist import distributed
from dtrain.common.errors import ExitCode, UserError
from dtrain.common.storage import DiskFull, LocalStore, open_store

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


# --- a full disk ---


class FullStore(LocalStore):
    """Runs out of space writing one file; says how big that write was."""

    def __init__(self, root, full_at: str) -> None:
        super().__init__(root)
        self.full_at = full_at
        self.needed = 0

    def write_bytes(self, rel, data):
        if rel == self.full_at:
            self.needed = len(data)
            raise DiskFull(self.join(rel), len(data), 4096)
        super().write_bytes(rel, data)


def test_disk_full_names_the_file_the_bytes_and_the_intact_step(tmp_path, d):
    # Step 2's state is written, its manifest is not: the step directory is removed, step 1 stays.
    store = FullStore(tmp_path, full_at=f"{step_dir(2)}/meta.json")
    ck = make(store, d)
    ck.save(1, lambda: {"x": torch.zeros(1)}, last=True)
    assert ck.save(2, lambda: {"x": torch.ones(1)}, epoch_end=True)  # the write fails in the background
    with pytest.raises(UserError) as e:
        ck.save(3, lambda: {"x": torch.ones(1)}, epoch_end=True)
    assert e.value.exit_code == ExitCode.FAILURE
    assert str(e.value) == (
        f"disk full: writing {tmp_path / step_dir(2) / 'meta.json'} needed {store.needed:,} bytes, 4,096 were free; "
        f"checkpoint step 1 ({tmp_path / step_dir(1)}) is intact: free space and resume from it"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, step_dir(1)]
    assert (tmp_path / LATEST).read_text() == step_dir(1)
    assert make(LocalStore(tmp_path), d).load()["x"].item() == 0.0


def test_disk_full_on_the_first_checkpoint(tmp_path, d):
    store = FullStore(tmp_path, full_at=f"{step_dir(4)}/state.pt")
    with pytest.raises(UserError) as e:
        make(store, d).save(4, lambda: {"x": torch.zeros(1)}, last=True)
    assert str(e.value) == (
        f"disk full: writing {tmp_path / step_dir(4) / 'state.pt'} needed {store.needed:,} bytes, 4,096 were free; "
        "no earlier checkpoint: free space and start again"
    )
    assert list(tmp_path.iterdir()) == []


def test_disk_full_while_flushing_the_metrics(tmp_path, d):
    store = LocalStore(tmp_path)
    make(store, d).save(1, lambda: {"x": torch.zeros(1)}, last=True)

    def flush():
        raise DiskFull(str(tmp_path.parent / "metrics.jsonl"), 70, 0)

    with pytest.raises(UserError) as e:
        make(store, d, before_save=flush).save(2, lambda: {"x": torch.ones(1)}, last=True)
    assert str(e.value) == (
        f"disk full: writing {tmp_path.parent / 'metrics.jsonl'} needed 70 bytes, 0 were free; "
        f"checkpoint step 1 ({tmp_path / step_dir(1)}) is intact: free space and resume from it"
    )
    assert not (tmp_path / step_dir(2)).exists()


# A real run on a real disk that fills: 2 processes (gloo), 3 epochs of 8 steps, a checkpoint at
# the end of each. The first checkpoint (about 1.2 MB) fits on a 2 MiB tmpfs, the second does not.
MNIST = ["train", "mnist", "--nproc", "2", "--epochs", "3", "--batch-size", "64"]


@pytest.mark.root
@pytest.mark.slow  # two CLI runs of 2 processes: 28-38 s here
def test_a_run_whose_disk_fills_stops_in_one_line_and_resumes(tmp_path, tmpfs):
    data = write_dataset(tmp_path / "data", 512, 128)
    disk = tmpfs("2m")
    out = disk.path / "runs"
    r = cli(tmp_path, *MNIST, "--data-dir", str(data), "--output", str(out))
    assert r.code == ExitCode.FAILURE, r.err
    (run,) = out.iterdir()
    ckpts = run / "checkpoints"
    step8 = (ckpts / step_dir(8) / "state.pt").stat().st_size
    assert "Traceback" not in r.err
    errors = [ln for ln in r.err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.err
    m = re.fullmatch(
        re.escape(f"error: disk full: writing {ckpts / step_dir(16) / 'state.pt'} needed ")
        + r"([\d,]+) bytes, ([\d,]+)"
        + re.escape(f" were free; checkpoint step 8 ({ckpts / step_dir(8)}) is intact: free space and resume from it"),
        errors[0],
    )
    assert m, errors[0]
    needed, free = (int(g.replace(",", "")) for g in m.groups())
    # Step 16's state is step 8's but for a few bytes: Python's RNG state pickles to a varying
    # length, and torch.save pads to 64 bytes. (The exact figure is tested with FullStore above.)
    assert abs(needed - step8) <= 1024 and free < needed
    assert "rank 1" not in r.err  # the other rank stopped with rank 0, without a word
    # The partial step is gone, LATEST still names step 8, and the run says it failed.
    assert sorted(p.name for p in ckpts.iterdir()) == [LATEST, step_dir(8)]
    assert (ckpts / LATEST).read_text() == step_dir(8)
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("failed", 1)

    disk.resize("16m")
    resumed = cli(tmp_path, *MNIST, "--resume", run.name, "--output", str(out))
    assert resumed.code == ExitCode.OK, resumed.err
    assert f"resuming from {ckpts / step_dir(8)} (step 8)" in resumed.out
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["result"]["steps"]) == ("completed", 24)
    assert (ckpts / LATEST).read_text() == step_dir(24)
