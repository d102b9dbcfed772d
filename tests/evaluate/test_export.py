"""`dtrain export --onnx`: the ONNX model gives torch's logits (within 1e-4) and its predictions on the
run's test images, checked here with onnxruntime directly, at several batch sizes (the batch axis is
dynamic), and the command prints both figures."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
from runs import isolated_env
from safetensors.torch import load_file

from dtrain.mnist.config import Dataset
from dtrain.mnist.data import MEAN_STD, read_idx
from dtrain.mnist.model import MnistNet

from .conftest import FASHION, cli


@pytest.fixture(scope="module")
def exported(mnist_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    copy = tmp_path_factory.mktemp("export") / "copy.onnx"
    r = cli(mnist_run.parent.parent, "export", str(mnist_run), "--onnx", "-o", str(copy),
            env=isolated_env(mnist_run.parent.parent))  # fmt: skip
    assert r.code == 0, r.out + r.err
    return copy, r.out


def test_onnx_matches_torch_on_the_test_set(mnist_run: Path, exported: tuple[Path, str]):
    copy, _out = exported
    model_bytes = (mnist_run / "final" / "model.onnx").read_bytes()
    assert copy.read_bytes() == model_bytes
    onnx.checker.check_model(onnx.load_from_string(model_bytes))

    net = MnistNet(16)
    net.load_state_dict(load_file(str(mnist_run / "final" / "model.safetensors")))
    net.eval()
    mean, std = MEAN_STD[Dataset.FASHION_MNIST]
    images = read_idx(FASHION / "t10k-images-idx3-ubyte.gz")[:1000]
    x = ((images.float() / 255 - mean) / std).unsqueeze(1)
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        reference = net(x)
    for batch in (1, 7, 256, 1000):
        got = torch.cat([torch.from_numpy(session.run(None, {"images": x[i : i + batch].numpy()})[0])
                         for i in range(0, 1000 if batch > 1 else 64, batch)])  # fmt: skip
        ref = reference[: got.shape[0]]
        assert (got - ref).abs().max().item() <= 1e-4, batch
        assert torch.equal(got.argmax(1), ref.argmax(1)), batch


def test_export_reports_its_check(mnist_run: Path, exported: tuple[Path, str]):
    _copy, out = exported
    check = json.loads((mnist_run / "final" / "model.onnx.json").read_text())
    assert check["images"] == 1000 and check["predictions_equal"] is True and check["mismatched_predictions"] == 0
    assert 0 <= check["max_abs_diff"] <= 1e-4
    # Both figures are printed.
    assert f"max |logit difference| {check['max_abs_diff']:.3g}, predictions equal: yes" in out
    meta = {p.key: p.value for p in onnx.load(str(mnist_run / "final" / "model.onnx")).metadata_props}
    assert meta["dtrain.run_id"] == mnist_run.name and meta["dtrain.dataset"] == "fashion-mnist"
    assert float(meta["dtrain.normalize.mean"]) == MEAN_STD[Dataset.FASHION_MNIST][0]


def test_export_of_a_checkpoint_goes_beside_it(mnist_run: Path):
    r = cli(mnist_run.parent.parent, "export", str(mnist_run), "--onnx", "--checkpoint", "16", "--json",
            env=isolated_env(mnist_run.parent.parent))  # fmt: skip
    assert r.code == 0, r.out + r.err
    check = json.loads(r.out)
    assert check["path"] == str(mnist_run / "export" / "step-00000016" / "model.onnx")
    assert check["predictions_equal"] and check["max_abs_diff"] <= 1e-4
    # Another model than the final one.
    assert Path(check["path"]).read_bytes() != (mnist_run / "final" / "model.onnx").read_bytes()
