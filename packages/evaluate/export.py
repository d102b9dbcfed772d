"""The MNIST model as ONNX, checked against torch before it is kept.

The exporter is torch.export's (`torch.onnx.export(..., dynamo=True)`, torch's default since 2.9;
the TorchScript-based one is deprecated), at a fixed opset so an export does not change when torch
changes its default, with the batch axis dynamic. BatchNorm is folded into the convolutions by the
exporter's optimiser, so the graph is Conv, Relu, MaxPool, Reshape and Gemm.

The ONNX model takes what the network takes: float32 images N x 1 x 28 x 28, already normalised
((pixel / 255 - mean) / std, mean and std in the model's metadata), and returns N x 10 logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.storage import Store
from dtrain.evaluate import mnist
from dtrain.evaluate.records import onnx_paths
from dtrain.mnist.data import MEAN_STD, Split

OPSET = 18  # onnxruntime >= 1.14 runs it; the ops this model needs are all older than that
TOLERANCE = 1e-4  # largest absolute logit difference from torch (fp32) that counts as the same model
CHECK_BATCH = 1000


def to_onnx(net: torch.nn.Module, metadata: dict[str, str]) -> bytes:
    """The serialised ONNX model of `net` (eval mode, fp32, CPU), batch axis dynamic."""
    import logging
    import warnings

    example = torch.zeros(2, 1, 28, 28)
    # The exporter logs a warning per torchvision op it cannot register (torchvision is not a
    # dependency) and torch.export some deprecation chatter: neither is about this model.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.onnx.export(
            net,
            (example,),
            dynamo=True,
            opset_version=OPSET,
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            input_names=["images"],
            output_names=["logits"],
            verbose=False,
        )
    proto = program.model_proto
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    return proto.SerializeToString()


def session(model: bytes, providers: list[str] | None = None, threads: int = 0) -> Any:
    """An ONNX Runtime session for `model` (CPU unless `providers` say otherwise; `threads`: its intra-op
    threads, 0 for ONNX Runtime's default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its warnings about unused initialisers are noise here
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=providers or ["CPUExecutionProvider"])


def normalised(images: torch.Tensor, dataset: Any) -> torch.Tensor:
    """uint8 N x 28 x 28 -> the network's float input, N x 1 x 28 x 28 (contiguous, as ONNX Runtime wants)."""
    mean, std = MEAN_STD[dataset]
    return ((images.float() / 255 - mean) / std).unsqueeze(1).contiguous()


@torch.no_grad()
def compare(net: torch.nn.Module, model: bytes, data: Split, dataset: Any) -> dict[str, Any]:
    """torch eager (fp32, CPU) against ONNX Runtime on every image of `data`."""
    sess = session(model)
    worst, mismatched = 0.0, 0
    n = int(data.labels.shape[0])
    for i in range(0, n, CHECK_BATCH):
        x = normalised(data.images[i : i + CHECK_BATCH].cpu(), dataset)
        ref = net(x)
        got = torch.from_numpy(sess.run(["logits"], {"images": x.numpy()})[0])
        worst = max(worst, (got - ref).abs().max().item())
        mismatched += int((got.argmax(1) != ref.argmax(1)).sum())
    return {
        "images": n,
        "max_abs_diff": worst,
        "predictions_equal": mismatched == 0,
        "mismatched_predictions": mismatched,
    }


def export(
    run: Store,
    saved: dict[str, Any],
    step: int | None,
    *,
    data_dir: str = "",
    split: str = "",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Export, check against torch on the evaluation split, and write the model and its check under
    the run. Refuses (writing nothing) if the logits differ by more than TOLERANCE."""
    import onnxruntime

    net, cfg = mnist.load_model(run, saved, step)
    run_id = saved.get("run_id", run.url.rstrip("/").rsplit("/", 1)[-1])
    mean, std = MEAN_STD[cfg.dataset]
    log(f"exporting {run_id} ({'final model' if step is None else f'checkpoint step {step}'}) at opset {OPSET}")
    model = to_onnx(
        net,
        {
            "dtrain.run_id": run_id,
            "dtrain.step": "final" if step is None else str(step),
            "dtrain.dataset": cfg.dataset.value,
            "dtrain.normalize.mean": str(mean),
            "dtrain.normalize.std": str(std),
        },
    )
    data = mnist.eval_data(cfg, data_dir, split, torch.device("cpu"), log)
    check = compare(net, model, data, cfg.dataset)
    check.update(
        split=split or cfg.eval_split,
        opset=OPSET,
        exporter="torch.onnx.export(dynamo=True)",
        torch=torch.__version__,
        onnxruntime=onnxruntime.__version__,
        tolerance=TOLERANCE,
        bytes=len(model),
    )
    if check["max_abs_diff"] > TOLERANCE:
        raise UserError(
            f"the ONNX model's logits differ from torch's by up to {check['max_abs_diff']:.3g} (> {TOLERANCE}) on "
            f"{check['images']} images: not written. Report it with your torch and onnxruntime versions",
            exit_code=ExitCode.FAILURE,
        )
    path, check_path = onnx_paths(step)
    check["path"] = run.join(path)
    run.write_bytes(path, model)
    run.write_bytes(check_path, (json.dumps(check, indent=2) + "\n").encode())
    return check
