#!/usr/bin/env bash
# dtrain node startup script. infra/compute.tf puts it in every node's `startup-script` metadata;
# the Google guest agent runs it as root on every boot. It is idempotent: it installs only what the
# image lacks (the Deep Learning VM GPU images already carry Docker, the NVIDIA driver and the
# NVIDIA container toolkit; the Ubuntu CPU image gets docker.io from Ubuntu's archive).
#
# When it is done it reports, for `dtrain up` to poll over SSH or through the Compute API:
#   /var/lib/dtrain/ready               {"ok": true, "gpus": N, "docker": "<version>", "boot_id": "..."}
#                                       or {"ok": false, "error": "...", "boot_id": "..."}
#   guest attribute dtrain/ready        the same JSON (needs enable-guest-attributes = TRUE)
# The file is removed when the script starts, so a reader never takes the previous boot's result
# for this one; boot_id (from /proc) lets a reader of the guest attribute tell the same.
#
# Inputs (instance metadata attributes, set by infra/compute.tf):
#   dtrain-ssh-user        login user to create and add to the docker group (default dtrain)
#   dtrain-gpus            GPUs the node must show in nvidia-smi (default 0 = CPU node)
#   dtrain-registry-host   Artifact Registry host to configure docker's credential helper for
#   dtrain-slurm           1: install Slurm and munge (dtrain configures and starts them over SSH; docs/slurm.md)
#
# The DTRAIN_* environment variables below exist so tests can run the script against stubs.
set -uo pipefail

METADATA_URL="${DTRAIN_METADATA_URL:-http://metadata.google.internal/computeMetadata/v1}"
STATE_DIR="${DTRAIN_STATE_DIR:-/var/lib/dtrain}"
READY_FILE="$STATE_DIR/ready"
BOOT_ID_FILE="${DTRAIN_BOOT_ID_FILE:-/proc/sys/kernel/random/boot_id}"
GPU_WAIT_S="${DTRAIN_GPU_WAIT_S:-300}"        # the driver may still be loading (or installing) at boot
DOCKER_WAIT_S="${DTRAIN_DOCKER_WAIT_S:-120}"  # dockerd start after install or restart
APT_LOCK_WAIT_S=600                           # unattended-upgrades holds the dpkg lock on first boot
# DPkg::Lock::Timeout covers dpkg's locks only, not the lists lock (/var/lib/apt/lists/lock) that
# `apt-get update` takes and apt-daily.service holds while it refreshes the lists at first boot: an
# update then fails at once ("Could not get lock /var/lib/apt/lists/lock"). So the update is retried,
# every APT_UPDATE_RETRY_S, for at most APT_UPDATE_WAIT_S (a failed download is retried the same way).
APT_UPDATE_WAIT_S="${DTRAIN_APT_UPDATE_WAIT_S:-600}"
APT_UPDATE_RETRY_S="${DTRAIN_APT_UPDATE_RETRY_S:-10}"
POLL_S="${DTRAIN_POLL_S:-5}"

log() { echo "dtrain-startup: $*" >&2; }

json_string() {
  # A JSON string literal of $1 (quotes, backslashes and control characters escaped or dropped).
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/ }
  s=${s//$'\r'/ }
  s=${s//$'\t'/ }
  printf '"%s"' "$s"
}

metadata_get() {
  curl -fsS --retry 3 --retry-connrefused --max-time 10 -H 'Metadata-Flavor: Google' \
    "$METADATA_URL/instance/attributes/$1" 2>/dev/null
}

guest_attribute_put() {
  curl -fsS --max-time 10 -X PUT -H 'Metadata-Flavor: Google' --data "$2" \
    "$METADATA_URL/instance/guest-attributes/dtrain/$1" >/dev/null 2>&1 ||
    log "could not set guest attribute dtrain/$1 (is enable-guest-attributes TRUE?)"
}

BOOT_ID="$(cat "$BOOT_ID_FILE" 2>/dev/null || echo unknown)"

report() {
  # Write the JSON atomically (a poller never reads half of it), then mirror it as a guest attribute.
  local json=$1 tmp
  mkdir -p "$STATE_DIR"
  tmp="$(mktemp "$STATE_DIR/.ready.XXXXXX")" || { log "cannot write in $STATE_DIR"; return 1; }
  printf '%s\n' "$json" >"$tmp"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$READY_FILE"
  guest_attribute_put ready "$json"
}

fail() {
  log "error: $1"
  report "{\"ok\": false, \"error\": $(json_string "$1"), \"boot_id\": $(json_string "$BOOT_ID")}"
  exit 1
}

apt_update() {
  # Bounded retries of `apt-get update` (see APT_UPDATE_WAIT_S above); 1 when it never succeeded.
  local waited=0
  until apt-get -o DPkg::Lock::Timeout="$APT_LOCK_WAIT_S" update -qq >&2; do
    if [ "$waited" -ge "$APT_UPDATE_WAIT_S" ]; then
      log "apt-get update still failed after ${waited}s"
      return 1
    fi
    log "apt-get update failed (is apt-daily holding the lists lock?); retrying in ${APT_UPDATE_RETRY_S}s"
    sleep "$APT_UPDATE_RETRY_S"
    waited=$((waited + APT_UPDATE_RETRY_S))
  done
}

apt_install() {
  log "apt-get install $*"
  export DEBIAN_FRONTEND=noninteractive
  apt_update &&
    apt-get -o DPkg::Lock::Timeout="$APT_LOCK_WAIT_S" install -y -qq --no-install-recommends "$@" >&2
}

wait_for() {
  # wait_for SECONDS COMMAND...: run COMMAND every POLL_S until it succeeds or SECONDS pass.
  local limit=$1 waited=0
  shift
  until "$@" >/dev/null 2>&1; do
    if [ "$waited" -ge "$limit" ]; then
      return 1
    fi
    sleep "$POLL_S"
    waited=$((waited + POLL_S))
  done
}

ensure_docker() {
  if ! command -v docker >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || fail "docker is missing and this image has no apt-get to install it"
    apt_install docker.io || fail "apt-get install docker.io failed"
  fi
  systemctl enable --now docker.service >&2 || log "systemctl enable --now docker failed; waiting for dockerd anyway"
  wait_for "$DOCKER_WAIT_S" docker info || fail "dockerd did not answer within ${DOCKER_WAIT_S}s"
}

gpu_count() {
  nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c '[0-9]'
}

gpus_visible() {
  [ "$(gpu_count)" -ge "$1" ]
}

install_container_toolkit() {
  # NVIDIA's documented apt repository for the container toolkit, keyring-pinned.
  local keyring=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
  local base=https://nvidia.github.io/libnvidia-container
  command -v apt-get >/dev/null 2>&1 || return 1
  apt_install ca-certificates curl gnupg || return 1
  curl -fsSL "$base/gpgkey" | gpg --batch --yes --dearmor -o "$keyring" || return 1
  curl -fsSL "$base/stable/deb/nvidia-container-toolkit.list" |
    sed "s#deb https://#deb [signed-by=$keyring] https://#g" >/etc/apt/sources.list.d/nvidia-container-toolkit.list ||
    return 1
  apt_install nvidia-container-toolkit
}

ensure_gpus() {
  local want=$1 have
  command -v nvidia-smi >/dev/null 2>&1 ||
    wait_for "$GPU_WAIT_S" command -v nvidia-smi ||
    fail "nvidia-smi not found after ${GPU_WAIT_S}s: the image has no NVIDIA driver (use a Deep Learning VM image with -nvidia- in its family)"
  wait_for "$GPU_WAIT_S" gpus_visible "$want"
  have="$(gpu_count)"
  [ "${have:-0}" -eq "$want" ] || fail "expected $want GPU(s), nvidia-smi shows ${have:-0} (waited up to ${GPU_WAIT_S}s)"
  if ! command -v nvidia-ctk >/dev/null 2>&1; then
    install_container_toolkit || fail "installing the NVIDIA container toolkit failed"
  fi
  # Register the nvidia runtime with Docker once; `docker run --gpus all` needs it.
  if ! docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"nvidia"'; then
    nvidia-ctk runtime configure --runtime=docker >&2 || fail "nvidia-ctk runtime configure --runtime=docker failed"
    systemctl restart docker.service >&2 || fail "restarting docker after adding the nvidia runtime failed"
    wait_for "$DOCKER_WAIT_S" docker info || fail "dockerd did not come back within ${DOCKER_WAIT_S}s"
  fi
  nvidia-container-cli info >/dev/null 2>&1 || fail "nvidia-container-cli cannot reach the driver"
}

ensure_user() {
  local user=$1
  # The guest agent creates the user from ssh-keys too; whoever comes first, the other reuses it.
  if ! getent passwd "$user" >/dev/null; then
    useradd --create-home --shell /bin/bash "$user" || getent passwd "$user" >/dev/null ||
      fail "could not create user $user"
  fi
  getent group docker >/dev/null || groupadd --system docker || fail "could not create the docker group"
  id -nG "$user" | tr ' ' '\n' | grep -qx docker || usermod -aG docker "$user" ||
    fail "could not add $user to the docker group"
}

configure_registry() {
  # docker pulls from Artifact Registry with the node's service account through gcloud's helper.
  local user=$1 host=$2 home
  [ -n "$host" ] || return 0
  if ! command -v gcloud >/dev/null 2>&1; then
    log "gcloud not found; docker cannot authenticate to $host (pulls from it will fail)"
    return 0
  fi
  home="$(getent passwd "$user" | cut -d: -f6)"
  if [ -n "$home" ] && ! grep -qs "\"$host\"" "$home/.docker/config.json"; then
    runuser -u "$user" -- gcloud auth configure-docker "$host" --quiet >&2 ||
      log "gcloud auth configure-docker $host failed for $user"
  fi
  if ! grep -qs "\"$host\"" /root/.docker/config.json; then
    gcloud auth configure-docker "$host" --quiet >&2 || log "gcloud auth configure-docker $host failed for root"
  fi
}

ensure_slurm() {
  # Slurm and munge from the distribution's packages. Only installed here: `dtrain up` writes slurm.conf
  # and the cluster's munge key over SSH and starts the daemons (the packages' slurmd and slurmctld units
  # wait for /etc/slurm/slurm.conf). The key never passes through metadata: munge's own random key stays
  # until dtrain replaces it. About 4 MB of packages (plus libraries an image may lack).
  local missing=()
  command -v slurmd >/dev/null 2>&1 || missing+=(slurm-wlm)
  command -v munged >/dev/null 2>&1 || missing+=(munge)
  [ "${#missing[@]}" -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || fail "Slurm is missing and this image has no apt-get to install it"
  apt_install "${missing[@]}" || fail "apt-get install ${missing[*]} failed"
}

main() {
  local ssh_user gpus registry_host slurm docker_version
  rm -f "$READY_FILE"
  mkdir -p "$STATE_DIR" || { log "cannot create $STATE_DIR"; exit 1; }
  # One run at a time (the guest agent, or someone re-running `google_metadata_script_runner startup`).
  exec 9>"$STATE_DIR/.lock"
  flock -n 9 || { log "another run holds $STATE_DIR/.lock; leaving it to finish"; exit 0; }

  ssh_user="$(metadata_get dtrain-ssh-user || true)"
  ssh_user="${ssh_user:-dtrain}"
  gpus="$(metadata_get dtrain-gpus || true)"
  gpus="${gpus:-0}"
  registry_host="$(metadata_get dtrain-registry-host || true)"
  slurm="$(metadata_get dtrain-slurm || true)"
  [[ "$ssh_user" =~ ^[a-z_][a-z0-9_-]{0,31}$ ]] || fail "metadata dtrain-ssh-user '$ssh_user' is not a valid user name"
  [[ "$gpus" =~ ^[0-9]+$ ]] || fail "metadata dtrain-gpus '$gpus' is not a number"
  log "user=$ssh_user gpus=$gpus registry=${registry_host:-none}"

  ensure_docker
  if [ "$gpus" -gt 0 ]; then
    ensure_gpus "$gpus"
  fi
  ensure_user "$ssh_user"
  configure_registry "$ssh_user" "$registry_host"
  if [ "${slurm:-0}" = 1 ]; then
    ensure_slurm
  fi

  docker_version="$(docker version --format '{{.Server.Version}}' 2>/dev/null)" ||
    fail "docker version failed after setup"
  report "{\"ok\": true, \"gpus\": $gpus, \"docker\": $(json_string "$docker_version"), \"boot_id\": $(json_string "$BOOT_ID")}"
  log "ready: gpus=$gpus docker=$docker_version"
}

# Run when executed (as the guest agent does); a test may source the file to call one function.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
