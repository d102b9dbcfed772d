"""The development machines' shared data beside the checkout (../shared), and the one reason a test may give for
skipping where it is absent (tests/conftest.py's strict-skip check allows that exact text and nothing like it). A
module of its own: test modules import it, and `conftest` is a different module in each test folder."""

from __future__ import annotations

from pathlib import Path

SHARED_MNIST = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"

SHARED_SKIP_REASON = (
    "needs the official MNIST test split in ../shared/data/mnist, which sits beside the project's own checkout on "
    "its development machines; users' clones do not have it"
)
