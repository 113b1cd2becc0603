#!/bin/bash
# shardlab-launch: start this node's torchrun agent for one rendered run.
#
#   shardlab-launch [--detach] [--no-check] RUN_DIR
#
# RUN_DIR is a directory on the shared filesystem written by `shardlab render slurm ... --out
# RUN_DIR` (terraform output render_command): its shardlab-config.yaml is the resolved config,
# already checked for this cluster's world size, with checkpoint.resume=auto. Run the same
# command on every node (terraform output launch_command does that over SSH). Node 0 hosts the
# c10d rendezvous at SHARDLAB_HEAD_ADDR:SHARDLAB_RDZV_PORT; the agents wait there for each other,
# so the order of the starts does not matter. A restarted agent (torchrun --max-restarts) or a
# repeated launch resumes from the newest complete checkpoint.
#
# --detach   run in the background (survives the SSH session); output in RUN_DIR/logs/node-<rank>.log
# --no-check skip the readiness checks (all nodes set up with identical packages, GPUs visible)
#
# Settings: /etc/shardlab/cluster.env, written by cloud-init (SHARDLAB_ENV_FILE overrides the path).
set -euo pipefail

ENV_FILE="${SHARDLAB_ENV_FILE:-/etc/shardlab/cluster.env}"

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'; }
die() { echo "shardlab-launch: $*" >&2; exit 2; }

detach=0
check=1
while [ $# -gt 0 ]; do
    case "$1" in
        --detach) detach=1 ;;
        --no-check) check=0 ;;
        -h|--help) usage; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
    shift
done
[ $# -eq 1 ] || die "give exactly one RUN_DIR (see --help)"

[ -r "$ENV_FILE" ] || die "no $ENV_FILE: this is not a node set up by infra/terraform/nebius"
# shellcheck source=/dev/null
. "$ENV_FILE"

RUN_DIR="$(realpath -m "$1")"
SHARED="$(realpath -m "$SHARDLAB_SHARED_DIR")"
case "$RUN_DIR/" in
    "$SHARED"/*) ;;
    *) die "RUN_DIR $RUN_DIR is not under the shared filesystem $SHARED: every node must read the same config" ;;
esac
CONFIG="$RUN_DIR/shardlab-config.yaml"
[ -f "$CONFIG" ] || die "no $CONFIG: render the run first (terraform output render_command)"
LOG_DIR="$RUN_DIR/logs"
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/node-$SHARDLAB_NODE_RANK.log"

if [ "$detach" = 1 ]; then
    args=()
    [ "$check" = 1 ] || args+=(--no-check)
    nohup setsid "$0" "${args[@]}" "$RUN_DIR" >> "$LOG" 2>&1 < /dev/null &
    echo "shardlab-launch: node $SHARDLAB_NODE_RANK started (pid $!), log $LOG"
    exit 0
fi

# ------------------------------------------------------------------ checks before anything starts
if [ "$check" = 1 ]; then
    STATE="$SHARED/.shardlab-cluster/$SHARDLAB_CLUSTER"
    mine="$STATE/nodes/$SHARDLAB_NODE_RANK.ready"
    [ -f "$mine" ] || die "this node has not finished its setup: see /var/log/shardlab-node-setup.log"
    my_freeze="$(sed -n 's/^freeze=//p' "$mine")"
    for ((r = 0; r < SHARDLAB_NNODES; r++)); do
        peer="$STATE/nodes/$r.ready"
        [ -f "$peer" ] || die "node $r has not finished its setup (no $peer)"
        [ "$(sed -n 's/^freeze=//p' "$peer")" = "$my_freeze" ] \
            || die "node $r has other packages than this node: run 'sudo shardlab-node-setup' on every node"
    done
    if [ "$SHARDLAB_GPUS_PER_NODE" -gt 0 ]; then
        gpus="$(nvidia-smi -L | grep -c '^GPU ' || true)"
        [ "$gpus" -ge "$SHARDLAB_NPROC_PER_NODE" ] \
            || die "nvidia-smi lists $gpus GPU(s), $SHARDLAB_NPROC_PER_NODE worker(s) need one each"
    fi
fi

# ------------------------------------------------------------------ the agent
read -r -a addrs <<< "$SHARDLAB_NODE_ADDRS"
my_addr="${addrs[$SHARDLAB_NODE_RANK]}"
is_host=0
[ "$SHARDLAB_NODE_RANK" = 0 ] && is_host=1
# one id per cluster and run directory: every node derives the same one, a new run a new one
rdzv_id="$(printf '%s-%s' "$SHARDLAB_CLUSTER" "$(basename "$RUN_DIR")" | tr -c 'A-Za-z0-9_-' '_')"

# collectives bootstrap over the VPC interface; with a GPU cluster NCCL finds InfiniBand itself
export NCCL_SOCKET_IFNAME="$SHARDLAB_SOCKET_IFNAME"
export GLOO_SOCKET_IFNAME="$SHARDLAB_SOCKET_IFNAME"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$SHARDLAB_OMP_THREADS}"

# relative paths in the config (a bare output.dir) land in the run directory, on the shared filesystem
cd "$RUN_DIR"
echo "shardlab-launch: node $SHARDLAB_NODE_RANK of $SHARDLAB_NNODES ($my_addr), $SHARDLAB_NPROC_PER_NODE worker(s)," \
    "rendezvous $SHARDLAB_HEAD_ADDR:$SHARDLAB_RDZV_PORT id $rdzv_id, InfiniBand $SHARDLAB_INFINIBAND, config $CONFIG"
# --local-addr: peers reach this agent by its VPC address, not by a hostname they may not resolve
# shardlab.torchrun: torchrun whose stores listen on --local-addr only, not on every interface
# (docs/security.md); the security group admits the rendezvous port only from the cluster's nodes
exec "$SHARDLAB_VENV/bin/python" -m shardlab.torchrun \
    --nnodes="$SHARDLAB_NNODES" \
    --nproc-per-node="$SHARDLAB_NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$SHARDLAB_HEAD_ADDR:$SHARDLAB_RDZV_PORT" \
    --rdzv-id="$rdzv_id" \
    --rdzv-conf="is_host=$is_host" \
    --local-addr="$my_addr" \
    --max-restarts="$SHARDLAB_MAX_RESTARTS" \
    -m shardlab train "$CONFIG"
