"""python-hcl2 (8.x) parsing of infra/, normalised for assertions.

python-hcl2 8 keeps the quotes of string literals and block labels ('"google_compute_instance"',
'"TRUE"') and adds __is_block__ and __comments__ keys; `normalise` drops them, so a literal reads as its
value and an expression stays as "${...}".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hcl2

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
PLAN = INFRA / "modules" / "plan"
STARTUP_SCRIPT = INFRA / "node-startup.sh"


def unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == '"' and s[-1] == '"' else s


def normalise(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {unquote(k): normalise(v) for k, v in obj.items() if not k.startswith("__")}
    if isinstance(obj, list):
        return [normalise(v) for v in obj]
    if isinstance(obj, str):
        return unquote(obj)
    return obj


class Module:
    """The top-level blocks of one Terraform module directory (its *.tf files merged)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.resources: dict[tuple[str, str], dict] = {}
        self.variables: dict[str, dict] = {}
        self.outputs: dict[str, dict] = {}
        self.locals: dict[str, Any] = {}
        self.modules: dict[str, dict] = {}
        self.terraform: list[dict] = []
        self.imports: list[dict] = []
        self.text = ""
        for path in sorted(directory.glob("*.tf")):
            text = path.read_text()
            self.text += text
            doc = normalise(hcl2.loads(text))
            for block in doc.get("resource", []):
                for rtype, named in block.items():
                    for name, body in named.items():
                        self.resources[(rtype, name)] = body
            for block in doc.get("variable", []):
                self.variables.update(block)
            for block in doc.get("output", []):
                self.outputs.update(block)
            for block in doc.get("locals", []):
                self.locals.update(block)
            for block in doc.get("module", []):
                self.modules.update(block)
            self.terraform.extend(doc.get("terraform", []))
            self.imports.extend(doc.get("import", []))

    def resource(self, rtype: str, name: str) -> dict:
        assert (rtype, name) in self.resources, f"{self.directory}: no resource {rtype}.{name}"
        return self.resources[(rtype, name)]

    def of_type(self, rtype: str) -> dict[str, dict]:
        return {name: body for (t, name), body in self.resources.items() if t == rtype}


def block(body: dict, key: str) -> dict:
    """The single nested block `key` of a resource body."""
    value = body.get(key)
    assert isinstance(value, list) and len(value) == 1, f"expected one {key} block, got {value!r}"
    return value[0]
