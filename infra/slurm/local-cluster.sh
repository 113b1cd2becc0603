#!/bin/bash
# A one-host Slurm cluster for tests: slurmctld + slurmd on localhost, munge auth.
#
#   infra/slurm/local-cluster.sh up   STATE_DIR   # install if missing (root), configure, start
#   infra/slurm/local-cluster.sh down STATE_DIR   # stop the daemons this script started
#
# Everything lives in STATE_DIR (config, spool, logs, pid files); client commands need
# SLURM_CONF=STATE_DIR/slurm.conf, which `up` prints. Nothing in /etc/slurm is touched.
# Exit code 3 means "cannot provide Slurm here" (not root and not installed, or apt failed):
# callers treat it as a reason to skip, any other failure as an error.
set -euo pipefail

ACTION="${1:?usage: $0 up|down STATE_DIR}"
STATE="${2:?usage: $0 up|down STATE_DIR}"
APT_TIMEOUT="${APT_TIMEOUT:-240}"

need_install() {
    ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null
}

install_packages() {
    if [ "$(id -u)" != 0 ]; then
        echo "slurm-wlm/munge are not installed and this is not root: cannot install them" >&2
        exit 3
    fi
    export DEBIAN_FRONTEND=noninteractive
    # the package scripts try to start services; there is no init system here, so forbid it
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    if ! timeout "$APT_TIMEOUT" apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1; then
        timeout "$APT_TIMEOUT" apt-get update -q >/dev/null 2>&1 || { echo "apt-get update failed" >&2; exit 3; }
        timeout "$APT_TIMEOUT" apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
            || { echo "apt-get install slurm-wlm munge failed" >&2; exit 3; }
    fi
}

start_munge() {
    # munged refuses to run as root with a key it does not own: run it as the munge user
    if [ ! -s /etc/munge/munge.key ]; then
        if command -v mungekey >/dev/null; then mungekey --create --force >/dev/null
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0    # a munged is already answering (ours from an earlier run, or the system's)
    fi
    # munged runs as munge and writes its pid file in /run/munge; `down` stops it only if
    # this script started it (the copy in STATE marks that)
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    for _ in $(seq 50); do
        if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
            cp /run/munge/munged.pid "$STATE/munged.pid"
            return 0
        fi
        sleep 0.1
    done
    echo "munged did not start" >&2
    exit 1
}

write_config() {
    mkdir -p "$STATE/ctld" "$STATE/spool" "$STATE/log"
    # not `nproc`: it follows OMP_NUM_THREADS, which `make test` sets to 1
    local CPUS
    CPUS="$(getconf _NPROCESSORS_ONLN)"
    if [ "$CPUS" -lt 2 ]; then CPUS=2; fi
    cat > "$STATE/slurm.conf" <<CONF
# one-host test cluster written by infra/slurm/local-cluster.sh
ClusterName=shardlab-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# no cgroups in a container: track processes by parent pid, bind nothing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
# trust the CPU count below rather than what slurmd detects (a 1-core CI box still fits
# the two one-CPU tasks of the test job; tasks share cores: OverSubscribe=YES)
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    # slurmd checks that cgroup.conf exists only with cgroup plugins; write none
}

start_slurm() {
    export SLURM_CONF="$STATE/slurm.conf"
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF" -N localhost
    for _ in $(seq 100); do
        if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.2
    done
    echo "slurm did not come up; last log lines:" >&2
    tail -n 20 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
    exit 1
}

stop_pidfile() {
    local file="$1"
    [ -s "$file" ] || return 0
    local pid
    pid="$(cat "$file")"
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

case "$ACTION" in
    up)
        mkdir -p "$STATE"
        if need_install; then install_packages; fi
        start_munge
        write_config
        start_slurm
        ;;
    down)
        stop_pidfile "$STATE/slurmd.pid"
        stop_pidfile "$STATE/slurmctld.pid"
        stop_pidfile "$STATE/munged.pid"
        ;;
    *)
        echo "usage: $0 up|down STATE_DIR" >&2
        exit 2
        ;;
esac
