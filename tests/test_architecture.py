"""docs/architecture.md's layering rules, read off the source (every import and call, at module level or
inside functions): the first rule (no heavy imports in cli/ and control/) is tests/cli/test_cli_imports.py's,
which runs the commands."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from dtrain.control.workloads import builtin_packages

REPO = Path(__file__).resolve().parents[1]
# What runs under torchrun: the built-ins' packages (the registry's, so a new one is checked too) and theirs.
WORKLOADS = (*(f"packages/{n}" for n in builtin_packages()), "packages/common", "packages/evaluate", "packages/sdk")
# `dtrain plan`'s cluster search prices dtrain's own machine types (rules.json, prices.py); those functions
# run in the CLI, never under torchrun (docs/architecture.md names this exception).
WORKLOAD_IMPORT_EXCEPTIONS = {("packages/lora/plan.py", "dtrain.control.gcp"),
                              ("packages/lora/plan.py", "dtrain.control.gcp.prices")}  # fmt: skip
# `python -m dtrain.control.gcp.tfexec` is a program of its own (the child process that runs Terraform):
# its output is Terraform's, read by dtrain.control.gcp.terraform, not a terminal's.
TERMINAL_EXCEPTIONS = {"packages/control/gcp/tfexec.py"}
BACKEND_NAMES = {"local", "hosts", "gcp", "slurm"}


def sources(*dirs: str) -> Iterator[tuple[str, ast.Module]]:
    for d in dirs:
        for f in sorted((REPO / d).rglob("*.py")):
            yield f.relative_to(REPO).as_posix(), ast.parse(f.read_text(), str(f))


def imports(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def test_the_workloads_never_import_cli_or_control():
    found = [(path, line, module) for path, tree in sources(*WORKLOADS) for line, module in imports(tree)
             if module.startswith(("dtrain.cli", "dtrain.control"))
             and (path, module) not in WORKLOAD_IMPORT_EXCEPTIONS]  # fmt: skip
    assert not found, found
    # and the exception stays inside functions: importing dtrain.lora.plan imports no control/ module
    (plan,) = [tree for path, tree in sources("packages/lora") if path == "packages/lora/plan.py"]
    top = [m for n in plan.body if isinstance(n, (ast.Import, ast.ImportFrom)) for _, m in imports(ast.Module([n], []))]
    assert not [m for m in top if m.startswith(("dtrain.cli", "dtrain.control"))], top


def test_control_never_prints_reads_the_terminal_or_handles_signals():
    banned_calls = {"print", "input", "breakpoint", "signal.signal", "signal.pthread_sigmask", "getpass.getpass",
                    "sys.stdout.write", "sys.stderr.write", "sys.stdin.read", "sys.stdin.readline",
                    "os.isatty"}  # fmt: skip
    banned_modules = {"rich", "typer", "click", "getpass", "readline"}
    found = []
    for path, tree in sources("packages/control"):
        if path in TERMINAL_EXCEPTIONS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = ast.unparse(node.func)
                if name in banned_calls:
                    found.append((path, node.lineno, name))
        found += [(path, line, m) for line, m in imports(tree) if m.split(".")[0] in banned_modules]
    assert not found, found


def test_nothing_outside_the_backends_branches_on_a_backend_name():
    """A comparison of something named *backend* with a backend's name (`cfg.backend == "gcp"`,
    `backend in ("slurm", ...)`), or a `match` on it, anywhere but control/backends/."""
    found = []
    for path, tree in sources("cli", "packages"):
        if path.startswith("packages/control/backends/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                text = ast.unparse(node)
                literals = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
                if "backend" in text and literals & BACKEND_NAMES:
                    found.append((path, node.lineno, text))
            elif isinstance(node, ast.Match) and "backend" in ast.unparse(node.subject):
                found.append((path, node.lineno, ast.unparse(node.subject)))
    assert not found, found


def _emitted_kind(node: ast.AST) -> str | None:
    """The literal kind of `events.emit("kind", ...)` or `Note("kind", ...)`."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    first = node.args[0]
    if name in ("emit", "Note") and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def test_the_events_docstring_lists_every_kind_emitted():
    """Every kind passed as a literal to `emit` (and the service's Note kinds) is in dtrain.control.events'
    list, and every kind listed is emitted somewhere."""
    from dtrain.control import events

    table = (events.__doc__ or "").split("Event kinds", 1)[1]
    listed = set()
    for line in table.splitlines():
        if line.startswith("    ") and not line.startswith("     "):  # a row: kinds, then 2+ spaces, its data
            listed |= {k.strip() for k in line.strip().split("  ")[0].split("/")}
    emitted = {"info", "warning", "check"}  # Events.info(), .warning() and .check()
    # through an expression: the Terraform runner's `kind`, logic's Note(kind, ...) and start_failed's choice
    emitted |= {"terraform", "autostop", "waiting-capacity", "start-failed"}
    for _, tree in sources("cli", "packages"):
        emitted |= {k for node in ast.walk(tree) if (k := _emitted_kind(node))}
    assert emitted - listed == set(), "emitted, not in the docstring"
    assert listed - emitted == set(), "in the docstring, never emitted"


# The Slurm launcher's own package (launchers/slurm.py hands it its work): it may read the cluster's Slurm.
KIND_EXEMPT = ("packages/control/launchers/", "packages/control/backends/", "packages/control/slurm/")


def test_nothing_outside_the_launchers_asks_which_kind_a_cluster_is():
    """A command asks for a feature (launchers.has / require), never whether a cluster has Slurm
    (`cluster.slurm is None`, `if c.slurm`), which launcher it has (`cluster.launcher == ...`) or whether its
    nodes are over SSH (`over_ssh`), anywhere but launchers/, backends/ and the Slurm launcher's slurm/."""
    kinds = {"slurm", "launcher"}
    found = []
    for path, tree in sources("cli", "packages"):
        if path.startswith(KIND_EXEMPT):
            continue
        for node in ast.walk(tree):
            tested: list[ast.AST] = []
            if isinstance(node, ast.Compare):
                tested = [node.left, *node.comparators]
            elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
                tested = [node.test]
            elif isinstance(node, ast.BoolOp):
                tested = list(node.values)
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                tested = [node.operand]
            if any(isinstance(t, ast.Attribute) and t.attr in kinds for t in tested):
                found.append((path, node.lineno, ast.unparse(node)[:80]))
            if (isinstance(node, ast.Attribute) and node.attr == "over_ssh") or (
                isinstance(node, ast.Name) and node.id == "over_ssh"
            ):
                found.append((path, node.lineno, "over_ssh"))
    assert not found, found
