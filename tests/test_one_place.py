"""A new built-in example is its package under packages/ and one entry in the registry (workloads.WORKLOADS):
the wheel (setup.py finds the packages), the training images (the Dockerfiles copy packages/ as .dockerignore
lets it in) and the build context an installed dtrain assembles (assets.image_packages) all follow from
those two. docs/architecture.md, "Where to add things"; the launch path's side is
tests/control/test_builtin_registry.py's."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from dtrain.control.assets import image_packages
from dtrain.control.images import context_files
from dtrain.control.workloads import WORKLOADS, builtin_packages

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = ("Dockerfile.train", "Dockerfile.train.gpu")
# What a wheel is built from (as tests/test_setup_and_ci.py copies it).
SOURCES = ("cli", "packages", "infra", "docker")
SOURCE_FILES = (*DOCKERFILES, ".dockerignore", "pyproject.toml", "setup.py", "README.md")


def own_builtins() -> list[str]:
    """dtrain's own built-ins' names and package names (not a plug-in's that this environment may hold)."""
    return sorted({*builtin_packages(), *(n for n, b in WORKLOADS.items() if b.module.startswith("dtrain."))})


def code_words(path: Path) -> set[str]:
    """The names and string literals of a Python file, its docstrings and comments left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words |= set(re.findall(r"\w+", node.value))
        elif isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
    return words


def instruction_words(path: Path) -> set[str]:
    """The words of a Dockerfile's or .dockerignore's lines, comments left out."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    return set(re.findall(r"\w+", "\n".join(lines)))


def test_no_list_of_what_is_packaged_or_copied_names_a_builtin():
    names = set(own_builtins())
    assert {"mnist", "lora"} <= names, names
    found = {}
    for name in (*DOCKERFILES, ".dockerignore"):
        found[name] = instruction_words(REPO / name) & names
    for name in ("setup.py", "packages/control/assets.py"):
        found[name] = code_words(REPO / name) & names
    # The extras may name a workload (its own dependencies); the packaging's tables may not.
    packaging = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found["pyproject.toml [tool.setuptools]"] = set(re.findall(r"\w+", json.dumps(packaging))) & names
    assert {k: v for k, v in found.items() if v} == {}


def test_the_checkout_context_holds_exactly_the_image_packages():
    """.dockerignore keeps dtrain's CLI-side packages out of packages/ by name: a new package that is neither
    dtrain.common nor a built-in's would reach the images unless it is added there."""
    wanted = set(image_packages())
    assert "packages/common" in wanted and {f"packages/{n}" for n in builtin_packages()} <= wanted
    for dockerfile in DOCKERFILES:
        assert "COPY packages/ /opt/dtrain/dtrain/" in (REPO / dockerfile).read_text().splitlines(), dockerfile
        files = [f for f in context_files(REPO, dockerfile) if f.startswith("packages/")]
        assert {"/".join(f.split("/")[:2]) for f in files} == wanted, dockerfile
        on_disk = {p.relative_to(REPO).as_posix() for d in wanted for p in (REPO / d).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip
        assert set(files) == on_disk, dockerfile


def add_toy(src: Path) -> None:
    """A third built-in, added the way docs/architecture.md says: its package and one registry entry."""
    toy = src / "packages" / "toy"
    toy.mkdir()
    (toy / "__init__.py").write_text('"""A toy built-in."""\n')
    (toy / "config.py").write_text(
        "import dataclasses\n\n"
        "from dtrain.common.config import RunConfig, opt\n\n\n"
        "@dataclasses.dataclass(kw_only=True)\n"
        "class ToyConfig:\n"
        '    """Train the toy."""\n\n'
        "    run: RunConfig = dataclasses.field(default_factory=RunConfig)\n"
        "    width: int = opt(8, 'hidden width of the toy')\n"
    )
    (toy / "train.py").write_text('print("toy trains")\n')
    workloads = src / "packages" / "control" / "workloads.py"
    text = workloads.read_text()
    registry = "WORKLOADS: dict[str, Builtin] = {\n"
    assert text.count(registry) == 1
    entry = '    "toy": Builtin("dtrain.toy.config:ToyConfig", "dtrain.toy.train"),\n'
    workloads.write_text(text.replace(registry, registry + entry))


def test_a_third_builtin_is_its_package_and_one_registry_entry(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", ".terraform*"))
    for name in SOURCE_FILES:
        shutil.copy(REPO / name, src / name)
    add_toy(src)
    toy_files = ["packages/toy/__init__.py", "packages/toy/config.py", "packages/toy/train.py"]

    # The images, built from this checkout: the context `dtrain build` sends holds the toy.
    for dockerfile in DOCKERFILES:
        assert set(toy_files) <= set(context_files(src, dockerfile)), dockerfile

    # The wheel carries it, with no setuptools warning.
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Warning" not in p.stdout + p.stderr, p.stdout + p.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f.replace("packages/", "dtrain/") for f in toy_files} <= names
    assert not [n for n in names if n.startswith("dtrain/bundle/") and n.endswith(".py")
                and not n.startswith("dtrain/bundle/docker/")], "the bundle is data only"  # fmt: skip

    # Installed from that wheel: `dtrain train toy` exists, and the build context dtrain assembles (no
    # checkout to build from) holds the toy's code beside dtrain.common's.
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(site),
           "DTRAIN_CACHE_DIR": str(tmp_path / "cache"), "DTRAIN_OFFLINE": "1"}  # fmt: skip
    code = (
        "import json, dtrain.control.assets as a\n"
        "from dtrain.control.images import context_files\n"
        "root = a.build_context()\n"
        "print(json.dumps({'module': a.__file__, 'root': str(root), 'packages': a.image_packages(),"
        " 'files': context_files(root, 'Dockerfile.train')}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["module"].startswith(str(site)), got["module"]
    assert got["root"] == str(tmp_path / "cache" / "build-context")
    assert got["packages"] == {**image_packages(), "packages/toy": "dtrain.toy"}
    assert set(toy_files) <= set(got["files"]) and "packages/common/launch.py" in got["files"]
    assert not [f for f in got["files"] if f.startswith(("packages/control/", "packages/dashboard/"))]
    r = subprocess.run([sys.executable, "-c", "from dtrain.cli.main import main; main()", "train", "toy", "--help"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--width" in r.stdout and "hidden width of the toy" in r.stdout, r.stdout


def test_the_stop_grace_has_one_home() -> None:
    """SIGTERM, then the grace, then SIGKILL: every launcher and agent takes the grace from dtrain.common.jobenv.
    The node agent, which also runs copied alone (it imports no sibling), keeps a copy that must agree."""
    import re

    from dtrain.common import jobenv, nodeagent

    assert nodeagent.DEFAULT_GRACE_S == jobenv.STOP_GRACE_S
    # and no module gives it a second name of its own (`SHUTDOWN_GRACE_S = jobenv.STOP_GRACE_S`, as three did)
    copies = []
    for path in (REPO / "packages").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and ast.unparse(node.value or ast.Constant(None)) in (
                "STOP_GRACE_S",
                "jobenv.STOP_GRACE_S",
            ):
                copies.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert copies == [], copies
    literal = re.compile(r"\b45\.0\b")  # the grace as a float literal
    for path in [*(REPO / "packages" / "control").rglob("*.py"), REPO / "packages" / "common" / "slurmstep.py"]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            assert not literal.search(code), f"{path.relative_to(REPO)}:{n}: {line.strip()}"
