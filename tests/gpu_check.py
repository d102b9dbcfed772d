"""Whether this machine has a CUDA GPU, and the one skip reason a GPU test may give where it has none
(tests/conftest.py's strict-skip check allows it only there). A module of its own: test modules import it,
and `conftest` is a different module in each test folder."""

from __future__ import annotations

import shutil
import subprocess
import sys

GPU_SKIP_REASON = "needs a CUDA GPU"


def machine_has_gpu() -> bool:
    """Whether this machine has a CUDA GPU, whatever CUDA_VISIBLE_DEVICES hides from this process:
    nvidia-smi lists one, or torch (when a test already imported it) sees one."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return True
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return False
    try:
        out = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(line.startswith("GPU ") for line in out.stdout.splitlines())
