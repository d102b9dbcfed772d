"""A new way of running jobs is one backend module, one launcher module and their two REGISTRY lines: the
kubernetes pair shows it (docs/architecture.md, "Where to add things"). Outside tests/ and docs/, no code names it
but those two modules and the two REGISTRY dicts (docstrings and comments may mention it), and no other file of
what is packaged or built (the Dockerfiles, setup.py, infra/) does; pyproject.toml names only the SDK its tests
check the manifests with, in the dev extras."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from test_one_place import code_words

from dtrain.control import backends, launchers

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
MODULES = {"packages/control/backends/kubernetes.py", "packages/control/launchers/kubernetes.py"}
REGISTRIES = {"packages/control/backends/__init__.py", "packages/control/launchers/__init__.py"}
WORDS = {"kubernetes", "Kubernetes", "kubeflow", "PyTorchJob", "k8s", "kubectl"}


def registry_words(path: Path) -> set[str]:
    """The words of the string literals in `path`'s REGISTRY dict."""
    for node in ast.parse(path.read_text()).body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "REGISTRY":
            return {w for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    for w in re.findall(r"\w+", c.value)}  # fmt: skip
    raise AssertionError(f"{path}: no REGISTRY")


def test_only_its_two_modules_and_two_registry_lines_name_it():
    found = {}
    for root in ("cli", "packages"):
        for path in (REPO / root).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if rel in MODULES:
                continue
            words = code_words(path)
            if rel in REGISTRIES:
                words -= registry_words(path)
            if words & WORDS:
                found[rel] = sorted(words & WORDS)
    assert found == {}
    # and the two lines are there: the registries resolve the name to the two modules
    assert backends.REGISTRY["kubernetes"] == "dtrain.control.backends.kubernetes"
    assert launchers.REGISTRY["kubernetes"] == "dtrain.control.launchers.kubernetes"
    assert backends.get("kubernetes").name == launchers.get("kubernetes").name == "kubernetes"


def test_nothing_packaged_or_built_names_it():
    files = [REPO / n for n in ("Dockerfile.train", "Dockerfile.train.gpu", ".dockerignore", "setup.py")]
    files += [p for p in (REPO / "infra").rglob("*") if p.is_file() and ".terraform" not in p.parts]
    named = [str(p.relative_to(REPO)) for p in files if set(re.findall(r"\w+", p.read_text(errors="replace"))) & WORDS]
    assert named == []
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = {k: v for k, v in project["optional-dependencies"].items() if any("kube" in d for d in v)}
    assert extras == {"dev": project["optional-dependencies"]["dev"]}
    assert [d for d in extras["dev"] if "kube" in d] == [
        "kubeflow-training==1.9.4"
    ]  # pinned: the tests read its models
    assert not [d for d in project["dependencies"] if "kube" in d]
