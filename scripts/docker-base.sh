#!/usr/bin/env bash
# Make a Python base image locally, for building Dockerfile.train where no registry can be pulled from:
# debootstrap a minimal Debian bookworm (python3 3.11, venv, CA certificates) and `docker import` it.
#
#   sudo scripts/docker-base.sh [TAG]        # default TAG: dtrain-base:bookworm
#   docker build --build-arg BASE_IMAGE=dtrain-base:bookworm -f Dockerfile.train .
#
# Needs root, debootstrap and a running Docker daemon. Skips the work when TAG already exists
# (DTRAIN_BASE_REBUILD=1 forces it). Environment: DEBIAN_MIRROR (default: the first deb.debian.org-style
# URI in /etc/apt, else http://deb.debian.org/debian), DOCKER (default: docker).
set -euo pipefail

TAG="${1:-dtrain-base:bookworm}"
DOCKER="${DOCKER:-docker}"
SUITE=bookworm
# What Dockerfile.train's stages need from the base: python3 with venv/ensurepip, CA certificates for pip.
# passwd (useradd) is already in minbase.
INCLUDE=python3,python3-venv,ca-certificates

if [ "$(id -u)" != 0 ]; then
  echo "docker-base: needs root (debootstrap)" >&2
  exit 2
fi
command -v debootstrap >/dev/null || { echo "docker-base: needs debootstrap: apt-get install debootstrap" >&2; exit 2; }
if [ "${DTRAIN_BASE_REBUILD:-0}" != 1 ] && $DOCKER image inspect "$TAG" >/dev/null 2>&1; then
  echo "docker-base: $TAG exists"
  exit 0
fi

mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
  # the host's own Debian mirror: a deb822 `URIs:` line or a one-line `deb` entry (not comments)
  mirror=$(grep -rshE '^(URIs:|deb) ' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
    grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -1 | tr -d ' ' || true)
  mirror="${mirror:-http://deb.debian.org/debian}"
fi

root=$(mktemp -d /var/tmp/dtrain-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "docker-base: debootstrap $SUITE from $mirror"
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$root/rootfs" "$mirror" >"$root/debootstrap.log" 2>&1 || {
  tail -20 "$root/debootstrap.log" >&2
  exit 1
}
# Slim it the way the official slim images are: no apt lists, caches, docs or man pages.
rm -rf "$root/rootfs/var/lib/apt/lists/"* "$root/rootfs/var/cache/apt/"*.bin "$root/rootfs/var/cache/apt/archives/"*.deb \
  "$root/rootfs/usr/share/doc/"* "$root/rootfs/usr/share/man/"* "$root/rootfs/usr/share/info/"*
# Certificate authorities this machine adds to the system's (a TLS-inspecting proxy's, a company CA) are
# trusted in the image too, or pip inside a build could not reach PyPI here. pip < 24.2 and requests use
# certifi's bundle unless told otherwise, hence the variables.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/rootfs/usr/local/share/ca-certificates/"
  chroot "$root/rootfs" update-ca-certificates >/dev/null 2>&1
fi
CA=/etc/ssl/certs/ca-certificates.crt
# The image's apt sources point at the same mirror, so `apt-get` in a build works where the host's does.
echo "deb $mirror $SUITE main" >"$root/rootfs/etc/apt/sources.list"
tar -C "$root/rootfs" -c . | $DOCKER import \
  --change 'ENV LANG=C.UTF-8' --change "ENV PIP_CERT=$CA" --change "ENV REQUESTS_CA_BUNDLE=$CA" \
  --change "ENV SSL_CERT_FILE=$CA" --change 'CMD ["python3"]' \
  --message "debootstrap --variant=minbase $SUITE + $INCLUDE" - "$TAG" >/dev/null
echo "docker-base: made $TAG ($($DOCKER image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
