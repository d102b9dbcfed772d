#!/usr/bin/env bash
# Set up dtrain on this machine: system packages (when run as root), a virtualenv in .venv,
# torch, and dtrain with its training and development extras. Safe to run again.
#
#   scripts/setup.sh            # everything, for training and tests
#   DTRAIN_TORCH=torch==2.13.0 scripts/setup.sh   # choose the torch build (default below)
#
# torch is pinned to 2.13.0 because the machines this project is developed and tested on carry a
# local CPU wheel of exactly that version; a looser spec pulls gigabytes of CUDA wheels. On a GPU
# machine, set DTRAIN_TORCH to the CUDA build you want.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC="${DTRAIN_TORCH:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
APT_PACKAGES=(
  dataset-fashion-mnist  # Fashion-MNIST as IDX files, for training offline and the tests
  # the multi-host test bed (scripts/testbed.py, tests/cluster): netns, bridge, sshd per host
  openssh-server openssh-client iproute2 iptables procps
  shellcheck  # tests/infra: the GCP nodes' startup script (docker/node-startup.sh)
  # tests/docker: a Docker engine, a locally made base image, compose (bookworm has v1 only) and a
  # registry to push to and pull from
  docker.io debootstrap docker-compose docker-registry
)

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
elif ! [ -d /usr/share/datasets/fashion-mnist ]; then
  echo "setup: not root, skipping apt; for offline Fashion-MNIST run: sudo apt-get install dataset-fashion-mnist" >&2
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "setup: pip install $TORCH_SPEC"
.venv/bin/python -m pip install -q "$TORCH_SPEC"
echo "setup: pip install -e .[dev,lora,tensorboard]"
.venv/bin/python -m pip install -q -e ".[dev,lora,tensorboard]"
# checkov (tests/infra) has its own virtualenv: it pins dozens of packages the dev extra also uses.
echo "setup: checkov into .venv-tools"
PYTHON="$PYTHON" bash scripts/infra-tools.sh >/dev/null
echo "setup: done. Activate with: source .venv/bin/activate"
