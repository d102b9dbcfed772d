#!/usr/bin/env bash
# Set up dtrain on this machine. Safe to run again.
#
#   scripts/setup.sh         what training needs: python3-venv, git and Debian's Fashion-MNIST (when run as
#                            root), a virtualenv in .venv with torch and dtrain[train]
#   scripts/setup.sh --dev   also what the tests need (scripts/test.sh runs it): the test bed's system
#                            packages (sshd, Docker, ...), dtrain's dev extras, and checkov in .venv-tools
#   DTRAIN_TORCH=torch==2.13.0 scripts/setup.sh   choose the torch build (default below)
#   DTRAIN_SETUP_DRY_RUN=1 scripts/setup.sh [--dev]   print what it would install, install nothing
#
# It prints one line per step; apt's and pip's own output goes to a log (DTRAIN_SETUP_LOG, by default
# $TMPDIR/dtrain-setup-UID.log), whose last lines it shows when a step fails.
#
# torch is pinned to 2.13.0 because the machines this project is developed and tested on carry a
# local CPU wheel of exactly that version; a looser spec pulls gigabytes of CUDA wheels. On a GPU
# machine, set DTRAIN_TORCH to the CUDA build you want (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
case "${1:-}" in
  --dev) DEV=1 ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--dev]" >&2; exit 2 ;;
esac

TORCH_SPEC="${DTRAIN_TORCH:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
APT_PACKAGES=(
  python3-venv git          # the virtualenv; git for dtrain build's tags and for contributors
  dataset-fashion-mnist     # Fashion-MNIST as IDX files: training offline, and the tests
)
DEV_APT_PACKAGES=(
  # the multi-host test bed (scripts/testbed.py, tests/cluster): netns, bridge, sshd per host
  openssh-server openssh-client iproute2 iptables procps
  shellcheck  # tests/infra: the GCP nodes' startup script (infra/node-startup.sh)
  # tests/docker: a Docker engine, a locally made base image, compose (bookworm has v1 only) and a
  # registry to push to and pull from
  docker.io debootstrap docker-compose docker-registry
  chromium  # tests/dashboard: the pages in a real headless browser (Playwright drives it; no browser download)
  slurm-wlm munge  # tests/slurm: a real Slurm across the test bed's hosts (scripts/slurmbed.py)
  sudo  # tests/service: the cluster service's `sudo -n scontrol` rule, run as its own user
)
EXTRAS="train"
[ "$DEV" = 1 ] && APT_PACKAGES+=("${DEV_APT_PACKAGES[@]}") && EXTRAS="dev,lora,tensorboard"

if [ "${DTRAIN_SETUP_DRY_RUN:-0}" = 1 ]; then
  echo "apt: ${APT_PACKAGES[*]}"
  echo "pip: $TORCH_SPEC -e .[$EXTRAS]"
  [ "$DEV" = 1 ] && echo "tools: checkov (.venv-tools)"
  exit 0
fi

# One line per step on the terminal; what apt and pip print (hundreds of lines on a fresh machine, their
# warnings included) goes to the log, whose last lines are shown if a step fails.
LOG="${DTRAIN_SETUP_LOG:-${TMPDIR:-/tmp}/dtrain-setup-$(id -u).log}"
: >"$LOG"
step() {  # step WHAT COMMAND...
  local what=$1 t0=$SECONDS rc=0
  shift
  printf 'setup: %s ... ' "$what"
  "$@" >>"$LOG" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    echo "done ($((SECONDS - t0)) s)"
  else
    echo "FAILED (exit $rc)"
    echo "setup: the last lines of $LOG:" >&2
    tail -n 25 "$LOG" >&2
    exit "$rc"
  fi
}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    step "apt-get update" apt-get update -qq
    step "apt-get install ${missing[*]}" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
elif ! [ -d /usr/share/datasets/fashion-mnist ]; then
  echo "setup: not root, skipping apt; for offline Fashion-MNIST run: sudo apt-get install dataset-fashion-mnist" >&2
fi

if [ ! -x .venv/bin/python ]; then
  step "creating .venv" "$PYTHON" -m venv .venv
fi
# What was installed, and from which inputs: a second run with the same ones installs nothing.
stamp=".venv/.dtrain-setup-$EXTRAS-$(cat pyproject.toml setup.py | sha256sum | cut -c1-12)-$(echo "$TORCH_SPEC" | tr -c 'a-zA-Z0-9.=+' _)"
if [ ! -e "$stamp" ]; then
  step "pip install --upgrade pip" .venv/bin/python -m pip install -q --upgrade pip
  step "pip install $TORCH_SPEC" .venv/bin/python -m pip install -q "$TORCH_SPEC"
  step "pip install -e .[$EXTRAS]" .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
  rm -f .venv/.dtrain-setup-*
  touch "$stamp"
fi
if [ "$DEV" = 1 ]; then
  # checkov (tests/infra) has its own virtualenv: it pins dozens of packages the dev extra also uses.
  step "checkov into .venv-tools" env PYTHON="$PYTHON" bash scripts/infra-tools.sh
fi
echo "setup: done (details in $LOG). Train with: .venv/bin/dtrain train mnist --dataset fashion-mnist"
