"""`shardlab render slurm`: one sbatch file that runs one torchrun agent per node.

Layout (the usual multi-node recipe): Slurm starts one task per node, each task is a
torchrun elastic agent that starts `nproc_per_node` workers, and the agents meet through a
c10d rendezvous on the allocation's first host. The agent count is read from SLURM_NTASKS,
not SLURM_NNODES, so the same file also runs several agents on one host (the local test
cluster submits it with `--nodes=1 --ntasks-per-node=2`).

Preemption (docs/preemption.md): with preemption.enabled the file asks Slurm for
`--signal=B:USR1@<grace>` and `--requeue`. The batch shell traps USR1 (from the time limit,
or `scancel --signal=USR1 --batch`), forwards it to the job steps, and when the agents exit 75
(their workers saved a checkpoint) runs `scontrol requeue`; the requeued job resumes
(checkpoint.resume=auto). The agents are `python -m shardlab.torchrun`: torchrun that also
forwards SIGUSR1, waits the grace period (--shutdown-timeout) and exits 75 after a save.

The hang doctor (docs/debugging.md) is on (doctor.enabled=true): each rank's record lives in
<run dir>/debug on the filesystem the job shares (output.dir, relative to --chdir), the file
prints where that is, and when a worker fails each agent prints the doctor's diagnosis.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shardlab.deploy.common import (
    RESOLVED_CONFIG_NAME,
    DeployTarget,
    RenderError,
    add_min_nodes_argument,
    check_dns_label,
    check_every_size,
    check_positive,
    node_range,
    out_dir,
    resolve_config,
    sh_quote,
    with_defaults,
    write_files,
)
from shardlab.deploy.templating import fill
from shardlab.loop import preemption

SBATCH_NAME = "shardlab.sbatch"

SBATCH_TEMPLATE = r"""#!/bin/bash
# Rendered by `shardlab render slurm`; submit with: sbatch @sbatch_path
# @size_line
#SBATCH --job-name=@job_name
#SBATCH --nodes=@nodes
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=@cpus_per_task
#SBATCH --time=@time_limit
#SBATCH --chdir=@workdir
#SBATCH --output=@log_dir/%x-%j.out
#SBATCH --open-mode=append
@optional_directives
set -euo pipefail

# The resolved config written next to this file (checkpoint.resume=auto, so an agent
# restart or a requeue continues from the newest complete checkpoint).
CONFIG=@config_path

# One agent per Slurm task; in the canonical layout that is one per node.
NUM_AGENTS="${SLURM_NTASKS:?run this file with sbatch}"
# Every agent must name the same rendezvous host: the allocation's first host.
HEAD_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
RDZV_PORT=@rdzv_port
# The rendezvous id: new for each start of this script and not guessable (the job id is), since
# whoever reaches the endpoint and knows the id can write the rendezvous state torch unpickles
# (docs/security.md). The tasks of this job inherit it.
RDZV_ID="$SLURM_JOB_ID-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"

# Which interface the collectives use. NCCL accepts an exclusion list; gloo needs a name.
@socket_env
# One math thread per worker unless the user asked otherwise: cores are per task.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-@omp_threads}"

@setup
echo "shardlab: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}), $NUM_AGENTS agent(s), rendezvous $HEAD_HOST:$RDZV_PORT, config $CONFIG"
# The hang doctor (docs/debugging.md): every rank keeps its heartbeat and last collectives under
# $RUN_DIR/debug on the shared filesystem; when a worker fails the agents print the diagnosis.
RUN_DIR=@run_dir
echo "shardlab: run directory $RUN_DIR; a hang: shardlab doctor $RUN_DIR --live (from any node)"

# Preemption: the workers leave this file once their checkpoint is saved (the agents exit 75).
export SHARDLAB_PREEMPTION_MARKER="${TMPDIR:-/tmp}/shardlab-preempted-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
rm -f "$SHARDLAB_PREEMPTION_MARKER"
SRUN_PID=""
# shellcheck disable=SC2317  # called by the traps below
forward_signal() {
    # Slurm signals only this shell (--signal=B:...); the workers save at their next step boundary.
    echo "shardlab: got $1, forwarding it to the job steps"
    scancel --signal="$1" "$SLURM_JOB_ID" || { [ -n "$SRUN_PID" ] && kill -s "$1" "$SRUN_PID"; } || true
}
@traps

@srun_kill
srun @srun_kill_flag --label --ntasks="$NUM_AGENTS" \
    @python -m shardlab.torchrun \
    --nnodes=@nnodes \
    --nproc-per-node=@nproc \
    --rdzv-id="$RDZV_ID" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$HEAD_HOST:$RDZV_PORT" \
    --max-restarts=@max_restarts \
    --shutdown-timeout=@grace_s \
    -m shardlab train "$CONFIG" &
SRUN_PID=$!
# a trapped signal interrupts `wait`; wait again until srun itself has ended
set +e
while :; do
    wait "$SRUN_PID"
    rc=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break
done
set -e
# 75: the workers saved a preemption checkpoint. (The marker covers an agent that Slurm
# killed after the save because another agent exited first: --kill-on-bad-exit.)
if [ "$rc" = @preempted_code ] || [ -e "$SHARDLAB_PREEMPTION_MARKER" ]; then
    rm -f "$SHARDLAB_PREEMPTION_MARKER"
    @on_preempted
fi
@elastic_outcome
exit "$rc"
"""


@dataclass
class SlurmRequest:
    config: str | None
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    out: Path
    nproc_per_node: int | None = None     # default: gpus_per_node, or 1 on CPU nodes
    cpus_per_task: int | None = None      # default: 4 per GPU, 2 on CPU nodes
    job_name: str = "shardlab"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str = "01:00:00"
    mem: str | None = None
    max_restarts: int = 3
    rdzv_port: int = 29500
    socket_ifname: str | None = None
    python: str = "python3"
    setup: str = ""
    workdir: str | None = None
    requeue: bool = True                  # with preemption.enabled: requeue after a preemption save
    min_nodes: int | None = None          # elastic: torchrun --nnodes=MIN:(the agents), --no-kill (docs/elastic.md)


def _procs(req: SlurmRequest) -> int:
    return req.nproc_per_node if req.nproc_per_node is not None else max(req.gpus_per_node, 1)


def render(req: SlurmRequest) -> tuple[list[Path], str]:
    """Check everything, then write the sbatch file, the resolved config and the log dir.
    Returns (written files, submit hint)."""
    nproc, cpus = _checked_sizes(req)
    lo, _ = node_range(req.min_nodes, req.nodes)
    world = req.nodes * nproc
    run = resolve_config(req.config, with_defaults(req.overrides, {"checkpoint.resume": "auto",
                                                                   "doctor.enabled": "true"}), world)
    check_every_size(run, nproc, lo, req.nodes)

    out = req.out.resolve()
    config_path = out / RESOLVED_CONFIG_NAME
    log_dir = out / "logs"
    cfg = run.config
    grace = preemption.grace_estimate(cfg) if cfg.preemption.enabled else None
    text = fill(
        SBATCH_TEMPLATE,
        sbatch_path=sh_quote(str(out / SBATCH_NAME)),
        size_line=(f"{lo}..{req.nodes} node(s) (elastic) x {nproc} process(es) = world size {lo * nproc}..{world}."
                   if req.min_nodes else f"{req.nodes} node(s) x {nproc} process(es) = world size {world}."),
        **_srun_kill(lo if req.min_nodes else None, sh_quote(req.python)),
        nodes=req.nodes, nproc=nproc, job_name=req.job_name, cpus_per_task=cpus,
        time_limit=req.time_limit, workdir=req.workdir or os.getcwd(), log_dir=log_dir,
        optional_directives="\n".join(_optional_directives(req, grace)), config_path=sh_quote(str(config_path)),
        rdzv_port=req.rdzv_port, socket_env=_socket_env(req.socket_ifname), omp_threads=max(1, cpus // nproc),
        setup=req.setup or "# (no environment setup requested: --setup 'source venv/bin/activate')",
        python=sh_quote(req.python), max_restarts=req.max_restarts,
        grace_s=grace.grace_s if grace is not None else 30, preempted_code=preemption.PREEMPTED_EXIT_CODE,
        **_preemption_lines(grace, req.requeue), run_dir=_run_dir_expression(cfg, req.workdir or os.getcwd()),
    )
    log_dir.mkdir(parents=True, exist_ok=True)    # Slurm does not create the --output directory
    written = write_files(out, {SBATCH_NAME: text, RESOLVED_CONFIG_NAME: run.yaml_text},
                          executable=(SBATCH_NAME,))
    hint = f"sbatch {sh_quote(str(out / SBATCH_NAME))}"
    if grace is not None:
        hint += f"   # {grace.describe()}"
    return written, hint


def _checked_sizes(req: SlurmRequest) -> tuple[int, int]:
    """The request's counts, port and name checked; (processes per node, CPUs per task)."""
    check_positive(req.nodes, "--nodes")
    check_positive(req.gpus_per_node, "--gpus-per-node", minimum=0)
    nproc = check_positive(_procs(req), "--nproc-per-node")
    if req.gpus_per_node and nproc > req.gpus_per_node:
        raise RenderError(f"--nproc-per-node {nproc} exceeds --gpus-per-node {req.gpus_per_node}: "
                          "each worker needs its own GPU")
    cpus = req.cpus_per_task if req.cpus_per_task is not None else (4 * req.gpus_per_node or 2)
    check_positive(cpus, "--cpus-per-task")
    check_positive(req.max_restarts, "--max-restarts", minimum=0)
    if not 1 <= req.rdzv_port <= 65535:
        raise RenderError(f"--rdzv-port must be a TCP port (1-65535), got {req.rdzv_port}")
    check_dns_label(req.job_name, "--job-name")
    return nproc, cpus


def _optional_directives(req: SlurmRequest, grace: preemption.GraceEstimate | None) -> list[str]:
    """The #SBATCH lines only some jobs carry."""
    optional = []
    if req.gpus_per_node > 0:   # never ask for GPUs on a CPU cluster: no gres.conf -> rejected job
        optional.append(f"#SBATCH --gpus-per-node={req.gpus_per_node}")
    for flag, value in (("partition", req.partition), ("account", req.account), ("qos", req.qos),
                        ("mem", req.mem)):
        if value:
            optional.append(f"#SBATCH --{flag}={value}")
    if grace is not None:
        # B: only the batch shell gets it (it forwards); Slurm may send it up to 60 s early
        optional.append(f"#SBATCH --signal=B:USR1@{grace.grace_s}")
    if req.requeue:
        optional.append("#SBATCH --requeue")
    if req.min_nodes:
        optional.append("#SBATCH --no-kill")  # a failed node leaves the allocation; the job goes on
    return optional


def _preemption_lines(grace: preemption.GraceEstimate | None, requeue: bool) -> dict[str, str]:
    """The batch script's signal traps and what it does after a preemption save."""
    if grace is not None and requeue:
        on_preempted = ('echo "shardlab: checkpoint saved after a preemption signal; requeueing job $SLURM_JOB_ID"\n'
                        '    scontrol requeue "$SLURM_JOB_ID"\n    exit 0')
    else:
        on_preempted = 'echo "shardlab: checkpoint saved after a preemption signal; resubmit to continue"'
    traps = ("trap 'forward_signal USR1' USR1\ntrap 'forward_signal TERM' TERM" if grace is not None
             else "# (preemption.enabled=false: no signal is trapped)")
    return {"traps": traps, "on_preempted": on_preempted}


def _socket_env(ifname: str | None) -> str:
    """The network interface NCCL and gloo use: the one named, else every one but loopback and docker's."""
    if ifname:
        return f"export NCCL_SOCKET_IFNAME={sh_quote(ifname)}\nexport GLOO_SOCKET_IFNAME={sh_quote(ifname)}"
    return ('export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker0}"\n'
            '# GLOO_SOCKET_IFNAME is left to the environment (gloo takes no exclusion list).')


def _srun_kill(min_nodes: int | None, python: str) -> dict[str, str]:
    """How the job step treats a lost agent: a fixed-size job stops them all; an elastic one
    (srun --no-kill, torchrun --nnodes=MIN:agents) lets the others re-form without it."""
    if min_nodes is None:
        return {"srun_kill": "# --kill-on-bad-exit: if one agent gives up (restarts used up), stop the others too\n"
                             "# instead of leaving them waiting in the rendezvous until the time limit.",
                "srun_kill_flag": "--kill-on-bad-exit=1", "nnodes": '"$NUM_AGENTS"',
                "elastic_outcome": "# (a fixed-size job: srun's status is the job's)"}
    return {"srun_kill": "# --no-kill: a lost node (or agent) does not end the step; the other agents re-form\n"
                         f"# without it, down to {min_nodes}, at the same global batch (docs/elastic.md).",
            "srun_kill_flag": "--no-kill", "nnodes": f'"{min_nodes}:$NUM_AGENTS"',
            "elastic_outcome": _ELASTIC_OUTCOME.format(python=python)}


# srun exits with its worst task's status: a lost agent's, even when the agents that remained
# trained every step. The job's status is the run's: metrics.json at the last step, written since
# this script started (bash's SECONDS), is a finished run (observe/runs.py `finished_since`).
_ELASTIC_OUTCOME = """\
# srun reports its worst task: after a lost agent, whether the agents that remained finished decides
if [ "$rc" != 0 ] && {python} -c 'import sys; from shardlab.observe.runs import finished_since
sys.exit(0 if finished_since(sys.argv[1], float(sys.argv[2])) else 1)' "$RUN_DIR" "$(( $(date +%s) - SECONDS ))"; then
    echo "shardlab: the run finished on the agents that remained (srun exited $rc: an agent was lost)"
    rc=0
fi"""


def _run_dir_expression(cfg, workdir: str) -> str:  # noqa: ANN001
    """The run directory as the workers will name it, in shell: output.run_name, or (unset) the
    default run name, the hash of this resolved config that every worker computes from it."""
    from shardlab.loop.run import default_run_name  # the training loop's rule; deferred: only here

    return sh_quote(os.path.join(workdir, cfg.output.dir, cfg.output.run_name or default_run_name(cfg)))


def submit(sbatch_file: Path, extra_args: list[str], timeout_s: float = 60.0) -> str:
    """Run sbatch on a rendered file and return the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RenderError("sbatch is not on PATH: run `shardlab submit slurm` on a Slurm login node")
    cmd = [sbatch, "--parsable", *extra_args, str(sbatch_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise RenderError(f"sbatch failed with exit code {proc.returncode}")
    return proc.stdout.strip().split(";")[0]


# -- the command (shardlab render/submit slurm) -----------------------------------------------------
def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="workers per node (default: --gpus-per-node, or 1 on CPU nodes)")
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per node's task (default 4 per GPU, 2 on CPU)")
    p.add_argument("--job-name", default="shardlab")
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    p.add_argument("--account", default=None)
    p.add_argument("--qos", default=None)
    p.add_argument("--time", dest="time_limit", default="01:00:00", help="time limit (default 01:00:00)")
    p.add_argument("--mem", default=None, help="memory per node, e.g. 64G (default: the cluster's default)")
    p.add_argument("--rdzv-port", type=int, default=29500)
    p.add_argument("--socket-ifname", default=None,
                   help="network interface for NCCL and gloo (default: NCCL avoids lo/docker0, gloo picks)")
    p.add_argument("--python", default="python3", help="Python on the compute nodes that has shardlab installed")
    p.add_argument("--setup", default="", help="shell line run before training, e.g. 'source ~/venv/bin/activate'")
    p.add_argument("--workdir", default=None, help="job working directory (default: the current directory)")
    p.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=True,
                   help="#SBATCH --requeue, and `scontrol requeue` after a preemption save (default: on; "
                        "docs/preemption.md)")
    add_min_nodes_argument(p)


def _render_args(args: argparse.Namespace, common: dict) -> tuple[list[Path], str]:
    return render(SlurmRequest(
        **common, nproc_per_node=args.nproc_per_node, cpus_per_task=args.cpus_per_task,
        job_name=args.job_name, partition=args.partition, account=args.account, qos=args.qos,
        time_limit=args.time_limit, mem=args.mem, max_restarts=args.max_restarts, rdzv_port=args.rdzv_port,
        socket_ifname=args.socket_ifname, python=args.python, setup=args.setup, workdir=args.workdir,
        requeue=args.requeue, min_nodes=args.min_nodes))


def _submit_args(args: argparse.Namespace, out: Path) -> int:
    job_id = submit(out / SBATCH_NAME, list(args.sbatch_arg))
    print(f"submitted Slurm job {job_id}; log: {(out_dir(args) / 'logs').resolve()}/{args.job_name}-{job_id}.out")
    return 0


def _add_submit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra sbatch option, repeatable, e.g. --sbatch-arg=--dependency=afterok:123")


TARGET = DeployTarget("slurm", "an sbatch script: one torchrun agent per node", _add_arguments, _render_args,
                      submit=_submit_args, submit_arguments=_add_submit_arguments)
