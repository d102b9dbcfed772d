"""What dtrain knows about each GPU model: its memory, whether it has bf16, and its dense peak FLOP/s.

One table, read by the memory plan (`dtrain plan`, dtrain.lora.plan) and by the MFU figure of
benchmarks/lora_throughput.py. How a card attaches to a VM is not here: that is a rule, in
infra/modules/plan/rules.json; `gcp` links a card to its entry there.

Memory. `capacity_gib` is what torch.cuda.get_device_properties(i).total_memory reports (and what a
CUDA out-of-memory message calls "total capacity"): the board's memory less what the driver keeps
(ECC on a T4, V100 and A100 included). A T4 shows 15360 MiB in nvidia-smi and 14.56-14.58 GiB to torch
with the 535 driver (github.com/Zheng-Chong/CatVTON/issues/133, a T4 on GCP;
github.com/mbzuai-oryx/GeoPixel/issues/5; older drivers showed 14.73-14.76). The other figures are
nvidia-smi's memory.total less the same ~2-3% driver reservation, rounded down: L4 23034 MiB, V100
SXM2 16160 MiB, A100 40GB 40960 MiB, A100 80GB 81920 MiB, H100 80GB HBM3 81559 MiB. Not all of it is
torch's: the CUDA context (driver state, the kernels loaded so far, cuBLAS/cuDNN handles) lives in the
same memory but outside torch's allocator. With CUDA's lazy module loading (the default since CUDA
11.7) it is a few hundred MiB once training kernels are loaded (the GeoPixel message above: 0.1 GiB
for inference); CUDA_CONTEXT_GIB is the planning figure, so `usable_gib` is what torch's allocator
can hand out.

Peaks. Dense (no 2:4 sparsity) FLOP/s from NVIDIA's datasheets, which quote the tensor-core figures
with sparsity (twice these): H100/H200 (nvidia.com/en-us/data-center/h100, /h200: SXM 1,979 TFLOPS
bf16 and 989 TF32 with sparsity, 67 fp32; PCIe 1,513 / 756 / 51; NVL 1,671 / 835 / 60), A100
(nvidia.com/en-us/data-center/a100: 312 bf16/fp16, 156 TF32 dense, 19.5 fp32, the same for 40 and
80 GB, SXM and PCIe), L4 (nvidia.com/en-us/data-center/l4: 242 bf16/fp16 and 120 TF32 with sparsity,
30.3 fp32), V100 (nvidia.com/en-us/data-center/v100: SXM2 125 fp16 tensor, 15.7 fp32; PCIe 112 / 14;
no bf16, no TF32) and T4 (nvidia.com/en-us/data-center/tesla-t4: 65 fp16 mixed, 8.1 fp32; no bf16,
no TF32). "tf32" is the tensor-core TF32 rate and "fp32" the CUDA cores' IEEE rate; `peak_flops(name,
"fp32")` gives TF32 where the card has it, since dtrain runs fp32 matrix products in TF32 on CUDA
(dtrain.common.precision).

Nothing here imports torch: the CLI reads it.
"""

from __future__ import annotations

import dataclasses
import re

# The CUDA context and the libraries' handles, outside torch's allocator (see the docstring).
CUDA_CONTEXT_GIB = 0.4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Card:
    key: str  # matched as words in the name nvidia-smi / torch report (case and '-' ignored)
    label: str
    gcp: str | None  # GCP accelerator type (rules.json), None for a card dtrain does not provision
    capacity_gib: float
    bf16: bool
    peaks: dict[str, float]  # dense FLOP/s by "bf16", "fp16", "tf32", "fp32" (CUDA cores)

    @property
    def usable_gib(self) -> float:
        """What torch's allocator can hand out: the capacity less the CUDA context."""
        return self.capacity_gib - CUDA_CONTEXT_GIB

    @property
    def compute_precision(self) -> str:
        """What `--precision auto` trains in on this card: bf16 where it has it, else fp16."""
        return "bf16" if self.bf16 else "fp16"

    def peak(self, precision: str) -> float | None:
        """Dense peak FLOP/s in `precision`; "fp32" is TF32 where the card has it (dtrain's policy)."""
        if precision == "fp32" and "tf32" in self.peaks:
            return self.peaks["tf32"]
        return self.peaks.get(precision)


T = 1e12
# First match wins: the more specific names come first.
CARDS: tuple[Card, ...] = (
    Card(
        key="H200",
        label="NVIDIA H200 141GB",
        gcp=None,
        capacity_gib=139.8,
        bf16=True,
        peaks={"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T, "fp32": 67 * T},
    ),
    Card(
        key="H100 NVL",
        label="NVIDIA H100 NVL 94GB",
        gcp=None,
        capacity_gib=93.1,
        bf16=True,
        peaks={"bf16": 835 * T, "fp16": 835 * T, "tf32": 417 * T, "fp32": 60 * T},
    ),
    Card(
        key="H100 PCIe",
        label="NVIDIA H100 PCIe 80GB",
        gcp=None,
        capacity_gib=79.1,
        bf16=True,
        peaks={"bf16": 756 * T, "fp16": 756 * T, "tf32": 378 * T, "fp32": 51 * T},
    ),
    Card(
        key="H100",
        label="NVIDIA H100 80GB (SXM)",
        gcp="nvidia-h100-80gb",
        capacity_gib=79.1,
        bf16=True,
        peaks={"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T, "fp32": 67 * T},
    ),
    Card(
        key="A100 80GB",
        label="NVIDIA A100 80GB",
        gcp="nvidia-a100-80gb",
        capacity_gib=79.1,
        bf16=True,
        peaks={"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
    ),
    Card(
        key="A100",
        label="NVIDIA A100 40GB",
        gcp="nvidia-tesla-a100",
        capacity_gib=39.3,
        bf16=True,
        peaks={"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
    ),
    Card(
        key="L4",
        label="NVIDIA L4 24GB",
        gcp="nvidia-l4",
        capacity_gib=22.0,
        bf16=True,
        peaks={"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T},
    ),
    Card(
        key="V100 PCIe",
        label="NVIDIA V100 16GB (PCIe)",
        gcp=None,
        capacity_gib=15.7,
        bf16=False,
        peaks={"fp16": 112 * T, "fp32": 14 * T},
    ),
    Card(
        key="V100",
        label="NVIDIA V100 16GB (SXM2)",
        gcp="nvidia-tesla-v100",
        capacity_gib=15.7,
        bf16=False,
        peaks={"fp16": 125 * T, "fp32": 15.7 * T},
    ),
    Card(
        key="T4",
        label="NVIDIA T4 16GB",
        gcp="nvidia-tesla-t4",
        capacity_gib=14.56,
        bf16=False,
        peaks={"fp16": 65 * T, "fp32": 8.1 * T},
    ),
)
# The datasheet table by key, for reports that print it.
PEAK_FLOPS = {c.key: dict(c.peaks) for c in CARDS}


def _words(name: str) -> str:
    return " ".join(re.split(r"[\s_-]+", name.upper()))


def by_name(gpu_name: str) -> Card | None:
    """The card whose key appears as words in `gpu_name` ("Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-80GB")."""
    name = _words(gpu_name)
    for c in CARDS:
        if re.search(rf"\b{re.escape(_words(c.key))}\b", name):
            return c
    return None


def peak_flops(gpu_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of the card `gpu_name` names in `precision` (bf16, fp16, fp32 or tf32), or
    None for a card or precision the table does not have. fp32 is TF32 where the card has it."""
    c = by_name(gpu_name)
    return c.peak(precision) if c else None


def card(accelerator: str) -> Card:
    """The card of a GCP accelerator type (rules.json's names); KeyError for one not in the table."""
    for c in CARDS:
        if c.gcp == accelerator:
            return c
    raise KeyError(accelerator)
