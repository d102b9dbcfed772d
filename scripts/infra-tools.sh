#!/usr/bin/env bash
# Tools for checking infra/ that do not belong in the project's own virtualenv: checkov pins dozens
# of packages (boto3, networkx, ...) that would fight with the dev extra, so it lives in .venv-tools.
# Safe to run again: an existing .venv-tools with the pinned checkov is left as it is.
#
#   scripts/infra-tools.sh        # prints the path of the checkov executable on its last line
#
# tests/infra looks for .venv-tools/bin/checkov and skips its checkov test when it is absent.
set -euo pipefail
cd "$(dirname "$0")/.."

CHECKOV_VERSION="3.3.30"
PYTHON="${PYTHON:-python3}"
VENV=.venv-tools

if [ ! -x "$VENV/bin/python" ]; then
  echo "infra-tools: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
installed="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("checkov"))' 2>/dev/null || true)"
if [ "$installed" != "$CHECKOV_VERSION" ]; then
  echo "infra-tools: pip install checkov==$CHECKOV_VERSION into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q "checkov==$CHECKOV_VERSION" >&2
fi
echo "$PWD/$VENV/bin/checkov"
