"""`python -m shardlab.torchrun [torchrun options] -m shardlab train CONFIG`: torchrun with
shardlab's preemption exit code (docs/preemption.md). The rendered Slurm and Kubernetes jobs
start their agents with it.

It is `python -m torch.distributed.run` with these differences:
  - SIGUSR1 is among the signals the agent forwards to its workers (unless
    --signals-to-handle is given), so `#SBATCH --signal=B:USR1@...` reaches them;
  - the workers learn where to leave the "checkpoint saved" marker (SHARDLAB_PREEMPTION_MARKER;
    a value already in the environment is kept, so a batch script can check it too);
  - it exits 75 (PREEMPTED_EXIT_CODE) when its workers saved a preemption checkpoint, where
    torchrun would exit 1 with a SignalException traceback;
  - with --nnodes MIN:MAX its workers note membership changes and print one line for each, the
    agents share no store, and the rendezvous drops a lost agent and closes its next round as
    `shardlab train --nnodes` does ([Note: the last call] in loop/elastic.py; an explicit
    --rdzv-conf is kept) (docs/elastic.md);
  - when its workers fail, it prints the hang doctor's verdict on the run directory (its local
    rank 0 notes where that is: doctor/agent.py), which names the stuck or crashed rank, then
    the one exception that matters and where the whole report is, in place of torchrun's own
    message, which names the first rank to give up (printed when the doctor has no record).
The workers' output is torchrun's to place: on the terminal (the job's log) unless torchrun's
own --redirects/--tee/--log-dir say otherwise; a cluster job's log is where its tracebacks
survive the node.
The grace period is torchrun's own `--shutdown-timeout` (rendered from preemption.grace_s).
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from typing import Any

from shardlab.atomic import read_json
from shardlab.doctor import agent as doctor
from shardlab.loop import elastic, listen, preemption


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import parse_args, run

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=", 1)[0] in ("--signals-to-handle", "--signals_to_handle") for a in argv):
        argv.insert(0, f"--signals-to-handle={preemption.AGENT_SIGNALS}")
    own_marker = not os.environ.get(preemption.MARKER_ENV)
    marker = os.environ.get(preemption.MARKER_ENV) or preemption.new_marker()
    os.environ[preemption.MARKER_ENV] = marker
    own_note = not os.environ.get(doctor.RUN_DIR_NOTE_ENV)
    run_dir_note = os.environ.setdefault(doctor.RUN_DIR_NOTE_ENV, f"{marker}.run-dir")
    args = parse_args(argv)
    if elastic.is_range(str(args.nnodes)):  # --nnodes MIN:MAX: an elastic job (docs/elastic.md)
        os.environ.update(elastic.AGENT_ENV)
        if not any(a.split("=", 1)[0] in ("--rdzv-conf", "--rdzv_conf") for a in argv):
            # [Note: the last call] (loop/elastic.py): as `shardlab train --nnodes`, not torchrun's 30 s
            timeouts = ",".join(f"{k}={v}" for k, v in elastic.rendezvous_timeouts().items())
            args = parse_args([f"--rdzv-conf={timeouts}", *argv])
    _bind_rendezvous(args)
    try:
        run(args)
    except BaseException as e:  # noqa: BLE001 - mapped to an exit code below
        code = preemption.agent_exit_code(e, marker)
        record = read_json(marker)
        if code == preemption.PREEMPTED_EXIT_CODE and record is not None:
            print(f"shardlab.torchrun: workers saved a preemption checkpoint of step {record['step']} "
                  f"({record['signal']}, {record['save_seconds']:.2f} s): exit code {code}", file=sys.stderr,
                  flush=True)
            _exit_now(code, marker if own_marker else None)
            return code
        if code == 1 and not isinstance(e, Exception):
            raise
        if not _doctor_report(run_dir_note, e, str(getattr(args, "rdzv_id", "") or "")):
            message = e.format_msg() if hasattr(e, "format_msg") else f"{type(e).__name__}: {e}"
            print(f"shardlab.torchrun: {message}", file=sys.stderr, flush=True)
        print(f"shardlab.torchrun: exit code {code}", file=sys.stderr, flush=True)
        return code
    finally:
        # two agents on one host (a Slurm job's tasks) may share these paths: the other may have
        # removed them first
        for path, own in ((marker, own_marker), (run_dir_note, own_note)):
            if own:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
    return 0


def _bind_rendezvous(args: Any) -> None:
    """torchrun's c10d rendezvous, and the one it picks for a one-node job without an endpoint
    (`--standalone`, or no rendezvous options: c10d on localhost:0), become shardlab's, whose stores
    listen on one address ([Note: who may reach a run's stores] in loop/listen.py). The static
    backend (--master-addr) is left as torch has it (docs/security.md)."""
    from torch.distributed.run import parse_min_max_nnodes

    one_node = parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and one_node):
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint = "c10d", f"{listen.LOOPBACK}:0"
        args.rdzv_id = uuid.uuid4().hex
    if args.rdzv_backend == "c10d":
        if not one_node and args.rdzv_id == "none":   # torchrun's default id: the same for every job
            raise SystemExit("shardlab.torchrun: error: a multi-node job needs --rdzv-id ID, the same for every "
                             "agent of the job and new for each job (the rendered jobs use the job's id or a "
                             "random one): whoever reaches the endpoint and knows the id takes part in the "
                             "rendezvous (docs/security.md)")
        args.rdzv_backend = listen.register_rendezvous()


def _doctor_report(note: str, e: BaseException, launch: str) -> bool:
    """After a worker failure: the doctor's verdict first, the exception that matters, where the
    whole report is (this agent's view of the exits is recorded first). False when the doctor
    has nothing to say (no run directory noted, no record): torchrun's message is printed then."""
    run_dir = doctor.noted_run_dir(note)
    failures = getattr(e, "failures", None)
    if run_dir is None or not failures:
        return False
    try:
        doctor.record_exits(run_dir, launch or None, failures)
        d = doctor.analysis.diagnose(run_dir)
        if d.kind == "no record":
            return False
        lines = doctor.failure_lines(run_dir, d, failures, None)
        sys.stderr.write("".join(f"shardlab.torchrun: {_unprefixed(line)}\n" for line in lines))
        sys.stderr.flush()
        return True
    except Exception as err:  # noqa: BLE001 - the agent's own exit code must come through regardless
        print(f"shardlab.torchrun: the doctor could not read {run_dir}: {err}", file=sys.stderr, flush=True)
        return False


def _unprefixed(line: str) -> str:
    """A launcher line without its own `error: ` / `shardlab: ` (this agent prefixes its name)."""
    for prefix in ("error: ", "shardlab: "):
        if line.startswith(prefix):
            return line[len(prefix):]
    return line


def _exit_now(code: int, marker: str | None) -> None:
    """Leave at once, without interpreter finalization.

    [Note: why a preempted agent skips finalization]
    On a signal torchrun deliberately keeps its rendezvous open (so that, normally, the other
    agents see a failure and restart), and the rendezvous heartbeat thread keeps talking to
    the store, which the first agent hosts. After a preemption every agent exits; when the
    store's host goes first, another agent's heartbeat thread is left blocked in a store call,
    and finalizing the interpreter under it aborts the process ("terminate called without an
    active exception", SIGABRT): srun then marks the step failed although the checkpoint was
    saved. Nothing is left to do here (the workers saved; the marker was read), so the agent
    flushes its output and exits directly."""
    if marker and os.path.exists(marker):
        os.remove(marker)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
