#!/bin/bash
# shardlab-node-setup: prepare one node of the Nebius cluster in infra/terraform/nebius.
#
# cloud-init writes this file to /usr/local/sbin/shardlab-node-setup and runs it once, as root,
# at first boot. It is idempotent: `sudo shardlab-node-setup` repeats it (after you changed the
# source or the torch version, say). Settings come from /etc/shardlab/cluster.env.
#
#   1. mount the shared filesystem at the same path as on every other node
#   2. install the OS packages a venv needs
#   3. node 0 fetches the source onto the shared filesystem (git); without a git URL every node
#      waits for you to copy it there
#   4. node 0 builds the venv and publishes its exact package list (pip freeze); the other
#      nodes wait for that list and install exactly it, so every node runs the same versions
#   5. check that torch sees this node's GPUs
#   6. publish this node's readiness and the hash of its package list; shardlab-launch refuses
#      to start while a node is missing or differs
set -euo pipefail

ENV_FILE="${SHARDLAB_ENV_FILE:-/etc/shardlab/cluster.env}"
LOG_FILE="${SHARDLAB_SETUP_LOG:-/var/log/shardlab-node-setup.log}"
# shellcheck source=/dev/null
. "$ENV_FILE"

exec > >(tee -a "$LOG_FILE") 2>&1

log() { echo "shardlab-node-setup [node $SHARDLAB_NODE_RANK] $(date -u +%H:%M:%S): $*"; }
die() { log "ERROR: $*"; exit 1; }

SHARED="$SHARDLAB_SHARED_DIR"
STATE="$SHARED/.shardlab-cluster/$SHARDLAB_CLUSTER"   # per cluster: a reused filesystem may serve several
SRC="$SHARED/src/shardlab"
SOURCE_ID_FILE="$SRC/.shardlab-source-id"
LOCK_FILE="$STATE/venv.lock"
LOCK_KEY_FILE="$STATE/venv.lock.key"
VENV="$SHARDLAB_VENV"
DEADLINE=$(( $(date +%s) + SHARDLAB_SETUP_WAIT_MINUTES * 60 ))

# wait_for DESCRIPTION COMMAND...: poll until COMMAND succeeds or the deadline passes
wait_for() {
    local what="$1"
    shift
    until "$@"; do
        [ "$(date +%s)" -lt "$DEADLINE" ] || die "gave up waiting for $what after $SHARDLAB_SETUP_WAIT_MINUTES min; fix it, then run 'sudo shardlab-node-setup' again"
        sleep 10
    done
}

# write_atomic PATH: stdin to PATH through a temporary name, so that a reader on another
# node never sees half a file
write_atomic() {
    cat > "$1.partial.$$"
    mv -f "$1.partial.$$" "$1"
}

pip_index_args=()
if [ -n "$SHARDLAB_TORCH_INDEX_URL" ]; then
    pip_index_args=(--extra-index-url "$SHARDLAB_TORCH_INDEX_URL")
fi

# ------------------------------------------------------------------ 1. shared filesystem
log "mounting the shared filesystem ($SHARDLAB_FS_TAG) at $SHARED"
mkdir -p "$SHARED"
if ! grep -q "^${SHARDLAB_FS_TAG}[[:space:]]" /etc/fstab; then
    # nofail: a node whose filesystem is missing still boots and can be inspected
    echo "$SHARDLAB_FS_TAG $SHARED virtiofs defaults,nofail 0 0" >> /etc/fstab
fi
mountpoint -q "$SHARED" || mount "$SHARED"
mountpoint -q "$SHARED" || die "$SHARED is not a mount point: is the filesystem attached with mount tag $SHARDLAB_FS_TAG?"

user_group="$(id -gn "$SHARDLAB_USER")"
mkdir -p "$STATE/nodes"
# the login user owns the places runs write to; never chown -R a filesystem that may be reused
for d in "$SHARED/data" "$SHARED/jobs" "$SHARED/checkpoints" "$SHARED/runs" "$SHARED/src"; do
    install -d -o "$SHARDLAB_USER" -g "$user_group" "$d"
done
rm -f "$STATE/nodes/$SHARDLAB_NODE_RANK.ready"

# ------------------------------------------------------------------ 2. OS packages
log "installing OS packages"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends python3-venv git ca-certificates

# ------------------------------------------------------------------ 3. source
if [ "$SHARDLAB_NODE_RANK" = 0 ] && [ -n "$SHARDLAB_GIT_URL" ]; then
    log "fetching $SHARDLAB_GIT_URL at $SHARDLAB_GIT_REF into $SRC"
    if [ ! -d "$SRC/.git" ]; then
        rm -rf "$SRC.partial"
        git clone --quiet "$SHARDLAB_GIT_URL" "$SRC.partial"
        rm -rf "$SRC"
        mv "$SRC.partial" "$SRC"
    fi
    # fetch exactly the ref (branch, tag or commit) and detach there: no local branch to drift
    git -C "$SRC" fetch --quiet origin "$SHARDLAB_GIT_REF"
    git -C "$SRC" checkout --quiet --detach FETCH_HEAD
    git -C "$SRC" rev-parse HEAD | write_atomic "$SOURCE_ID_FILE"
    chown -R "$SHARDLAB_USER:$user_group" "$SRC"
elif [ -z "$SHARDLAB_GIT_URL" ]; then
    log "no git URL: waiting for the source at $SRC (copy it there and write $SOURCE_ID_FILE; README.md)"
fi
wait_for "the source ($SOURCE_ID_FILE)" test -s "$SOURCE_ID_FILE"
[ -f "$SRC/pyproject.toml" ] || die "$SRC has no pyproject.toml: not a shardlab source tree"
source_id="$(cat "$SOURCE_ID_FILE")"
lock_key="source=$source_id torch=$SHARDLAB_TORCH_VERSION index=$SHARDLAB_TORCH_INDEX_URL"
log "source $source_id"

# ------------------------------------------------------------------ 4. venv
if [ -f "$VENV/.shardlab-key" ] && [ "$(cat "$VENV/.shardlab-key")" = "$lock_key" ]; then
    log "venv $VENV is up to date"
elif [ "$SHARDLAB_NODE_RANK" = 0 ]; then
    log "building $VENV (torch==$SHARDLAB_TORCH_VERSION, shardlab from $SRC)"
    rm -f "$LOCK_KEY_FILE"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first, from its index when one is given; shardlab then finds it satisfied
    if [ -n "$SHARDLAB_TORCH_INDEX_URL" ]; then
        "$VENV/bin/python" -m pip install -q --index-url "$SHARDLAB_TORCH_INDEX_URL" "torch==$SHARDLAB_TORCH_VERSION"
    else
        "$VENV/bin/python" -m pip install -q "torch==$SHARDLAB_TORCH_VERSION"
    fi
    "$VENV/bin/python" -m pip install -q "$SRC"
    "$VENV/bin/python" -m pip freeze --exclude shardlab | write_atomic "$LOCK_FILE"
    echo "$lock_key" | write_atomic "$LOCK_KEY_FILE"
    echo "$lock_key" > "$VENV/.shardlab-key"
else
    log "waiting for node 0's package list ($LOCK_FILE)"
    wait_for "node 0's package list" test "$(cat "$LOCK_KEY_FILE" 2>/dev/null)" = "$lock_key"
    log "building $VENV from node 0's package list"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "${pip_index_args[@]}" -r "$LOCK_FILE"
    "$VENV/bin/python" -m pip install -q --no-deps "$SRC"
    echo "$lock_key" > "$VENV/.shardlab-key"
fi

# ------------------------------------------------------------------ 5. GPUs
cuda_devices="$("$VENV/bin/python" -c 'import torch; print(torch.cuda.device_count())')"
torch_build="$("$VENV/bin/python" -c 'import torch, shardlab; print(torch.__version__, "cuda", torch.version.cuda)')"
log "torch $torch_build sees $cuda_devices GPU(s)"
if [ "$cuda_devices" -lt "$SHARDLAB_GPUS_PER_NODE" ]; then
    nvidia-smi || true
    die "torch sees $cuda_devices GPU(s), the preset has $SHARDLAB_GPUS_PER_NODE: is the image's driver older than this torch build's CUDA? (image_family / torch_index_url)"
fi

# ------------------------------------------------------------------ 6. readiness
freeze_hash="$("$VENV/bin/python" -m pip freeze | sha256sum | cut -d' ' -f1)"
{
    echo "host=$(hostname)"
    echo "freeze=$freeze_hash"
    echo "torch=$torch_build"
    echo "gpus=$cuda_devices"
    echo "source=$source_id"
} | write_atomic "$STATE/nodes/$SHARDLAB_NODE_RANK.ready"
log "ready (packages $freeze_hash)"
