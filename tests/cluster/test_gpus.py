"""`dtrain gpus` parsing of nvidia-smi's CSV query output (the format of
`nvidia-smi --query-gpu=... --format=csv,noheader,nounits`), and how a node without a GPU or with a
broken driver is reported. The test bed's end-to-end test covers the CPU-only nodes over SSH."""

from __future__ import annotations

import pytest

from dtrain.control.nodes import GpuRow, _gpu_result, parse_gpus

TWO_GPUS = """0, NVIDIA H100 80GB HBM3, 1, 81559, 0, 31, 550.54.15
1, NVIDIA H100 80GB HBM3, 40213, 81559, 97, 64, 550.54.15
"""


def test_parse_two_gpus():
    rows = parse_gpus(TWO_GPUS)
    assert rows == [
        GpuRow("0", "NVIDIA H100 80GB HBM3", "1", "81559", "0", "31", "550.54.15"),
        GpuRow("1", "NVIDIA H100 80GB HBM3", "40213", "81559", "97", "64", "550.54.15"),
    ]


def test_unexpected_line_is_refused():
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        parse_gpus("0, NVIDIA L4, 22\n")


@pytest.mark.parametrize(
    ("code", "out", "err", "expected"),
    [
        (0, "dtrain: no nvidia-smi\n", "", "no GPU (CPU only: nvidia-smi not found)"),
        (
            9,
            "",
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\nMore text",
            "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
        ),
        (0, "", "", "no GPU (nvidia-smi lists none)"),
    ],
)
def test_nodes_without_a_usable_gpu_say_why(code, out, err, expected):
    assert _gpu_result(code, out, err) == expected
