#!/usr/bin/env bash
# Train on a Cloud TPU pod slice (or serve from a one-host slice): create it, install this repo on
# every worker, run a config.
#
#   launch/tpu_pod.sh create                 # the TPU VM slice
#   launch/tpu_pod.sh install                # this checkout + jax[tpu] on every worker
#   launch/tpu_pod.sh mount BUCKET           # gcsfuse: BUCKET at /mnt/adaflash on every worker
#   launch/tpu_pod.sh train CONFIG [key=value ...]   # `adaflash train` on ALL workers at once
#   launch/tpu_pod.sh opd CONFIG [key=value ...]     # `adaflash opd` likewise
#   launch/tpu_pod.sh run 'COMMAND'          # any command on all workers
#   launch/tpu_pod.sh serve [adaflash serve flags]   # one-host slice only: `adaflash serve` on worker 0,
#                                            # tunnelled to localhost:$PORT here (e.g. --mesh tensor=8)
#   launch/tpu_pod.sh delete
#
# Settings (environment): TPU_NAME, ZONE, ACCELERATOR, RUNTIME, PROJECT (default: gcloud's), SPOT=1,
# SHARED (mount point, default /mnt/adaflash), PORT (serve: default 8000).
# Every worker must run the same command: jax.distributed finds the others from the TPU
# metadata; a worker left out makes the rest stop after ADAFLASH_INIT_TIMEOUT (300 s) with
# an error saying how many were expected. Checkpoints need one directory visible to all workers (the gcsfuse
# mount, or NFS/Filestore): pass checkpoint.dir=/mnt/adaflash/runs/NAME.
set -euo pipefail

TPU_NAME=${TPU_NAME:-adaflash-pod}
ACCELERATOR=${ACCELERATOR:-v5p-16}           # v5p-16: 8 chips, 2 workers; v6e-16: 16 chips, 4 workers
case "$ACCELERATOR" in
  v5p-*) ZONE=${ZONE:-us-east5-a}; RUNTIME=${RUNTIME:-v2-alpha-tpuv5} ;;
  v6e-*) ZONE=${ZONE:-us-east5-b}; RUNTIME=${RUNTIME:-v2-alpha-tpuv6e} ;;
  v5litepod-*) ZONE=${ZONE:-us-west4-a}; RUNTIME=${RUNTIME:-v2-alpha-tpuv5-lite} ;;
  *) ZONE=${ZONE:?set ZONE for $ACCELERATOR}; RUNTIME=${RUNTIME:?set RUNTIME for $ACCELERATOR} ;;
esac
SHARED=${SHARED:-/mnt/adaflash}               # where `mount` puts the bucket on every worker
REMOTE_DIR=adaflash_jax                      # on each worker, under the login user's home
VENV='~/adaflash_venv'
PROJECT_FLAG=()
[[ -n "${PROJECT:-}" ]] && PROJECT_FLAG=(--project="$PROJECT")
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

on_all_workers() {  # run one shell command on every worker, output of all streamed here
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" ${PROJECT_FLAG[@]+"${PROJECT_FLAG[@]}"} --worker=all \
    --command="$1"
}

quote_args() {  # the arguments, shell-quoted for the remote command line
  local out="" a
  for a in "$@"; do out+=" $(printf '%q' "$a")"; done
  printf '%s' "$out"
}

cmd=${1:-help}
shift || true
case "$cmd" in
  create)
    spot=()
    [[ "${SPOT:-0}" == 1 ]] && spot=(--spot)
    gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" ${PROJECT_FLAG[@]+"${PROJECT_FLAG[@]}"} \
      --accelerator-type="$ACCELERATOR" --version="$RUNTIME" ${spot[@]+"${spot[@]}"}
    ;;
  install)
    archive=$(mktemp /tmp/adaflash_jax.XXXXXX.tar.gz)
    git -C "$REPO_ROOT" archive --format=tar.gz -o "$archive" HEAD   # committed files only
    gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME":adaflash_jax.tar.gz --zone="$ZONE" \
      ${PROJECT_FLAG[@]+"${PROJECT_FLAG[@]}"} --worker=all
    rm -f "$archive"
    # The TPU VM images ship Python 3.10; the package needs >= 3.11, so uv provides 3.12.
    on_all_workers "set -e; rm -rf ~/$REMOTE_DIR && mkdir -p ~/$REMOTE_DIR && \
      tar -xzf ~/adaflash_jax.tar.gz -C ~/$REMOTE_DIR && \
      (test -x ~/.local/bin/uv || curl -LsSf https://astral.sh/uv/install.sh | sh) && \
      ~/.local/bin/uv venv -q --allow-existing --python 3.12 $VENV && \
      ~/.local/bin/uv pip install -q --python $VENV/bin/python 'jax[tpu]' -e ~/$REMOTE_DIR && \
      $VENV/bin/python -c 'import jax, adaflash_jax; print(\"jax\", jax.__version__)'"
    ;;
  mount)
    bucket=${1:?usage: $0 mount BUCKET}
    on_all_workers "set -e; if ! command -v gcsfuse >/dev/null; then \
      echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null; \
      curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null; \
      sudo apt-get update -qq && sudo apt-get install -y -qq gcsfuse; fi; \
      sudo mkdir -p $SHARED && sudo chown \$(id -u):\$(id -g) $SHARED && \
      (mountpoint -q $SHARED || gcsfuse --implicit-dirs $bucket $SHARED)"
    ;;
  train|opd)
    config=${1:?usage: $0 $cmd CONFIG [key=value ...]}
    shift
    on_all_workers "cd ~/$REMOTE_DIR && $VENV/bin/adaflash $cmd $(quote_args "$config" "$@")"
    ;;
  serve)
    # Decoding is single-process: serving needs a slice with one worker (v5litepod-8, v6e-8, ...).
    case "$ACCELERATOR" in
      v5litepod-[148]|v6e-[148]|v5p-8|v4-8) ;;
      *) echo "serve needs a one-host slice (e.g. ACCELERATOR=v5litepod-8), not $ACCELERATOR" >&2; exit 2 ;;
    esac
    port=${PORT:-8000}
    # The server listens on the VM's loopback; the ssh tunnel makes it localhost:$port here.
    gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" ${PROJECT_FLAG[@]+"${PROJECT_FLAG[@]}"} --worker=0 \
      --command="cd ~/$REMOTE_DIR && $VENV/bin/adaflash serve --port $port$(quote_args "$@")" \
      -- -L "$port:127.0.0.1:$port"
    ;;
  run)
    on_all_workers "cd ~/$REMOTE_DIR && source $VENV/bin/activate && ${1:?usage: $0 run 'COMMAND'}"
    ;;
  delete)
    gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone="$ZONE" ${PROJECT_FLAG[@]+"${PROJECT_FLAG[@]}"} --quiet
    ;;
  *)
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"
    ;;
esac
