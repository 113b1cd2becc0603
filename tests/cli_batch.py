"""Many `python -m shardlab ...` commands for the price of one interpreter start.

A test of what a command prints when it fails (one `error:` line, no traceback, the exit status)
pays ~3 CPU-s per subprocess for importing torch and shardlab before the few milliseconds that
matter. `run_commands` starts one driver interpreter, imports the heavy modules once, and runs each
command in a process forked from it: the child points its file descriptors 1 and 2 at files of
its own (so whatever any layer prints, Python or C, is caught, as a subprocess's pipes would),
runs the module as `python -m` runs it (`runpy`, `__main__`), maps SystemExit and an uncaught
exception to the exit status the interpreter would give (an uncaught one prints its traceback
through `sys.excepthook`), runs the atexit handlers and exits. Each command is still its own
process with its own state (a fork, not a call in a shared interpreter); what differs from a cold
start is only that the preloaded modules are already imported, and whatever importing them printed
is put in front of every command's stderr, so a warning at import still counts against it.

[Note: when a command must still be a cold start]
The fork tests what the command does, not how the interpreter and `shardlab`'s entry start up
(console script, `python -m`, torch imported lazily): those are each tested by one real
subprocess elsewhere (tests/test_cli_fast.py's fresh interpreter, the end-to-end launches), and a
command whose point is the launcher or the process tree (workers, stores, signals) stays a real
subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

# torch, the loop, export/eval/generate and the checkpoint reader: what the error paths import
PRELOAD = ("torch", "shardlab.cli", "shardlab.config", "shardlab.loop.train", "shardlab.export")

DRIVER = r"""
import atexit, importlib, json, os, runpy, sys, time, traceback
spec = json.load(open(sys.argv[1]))
for name in spec["preload"]:
    importlib.import_module(name)
sys.stdout.flush(); sys.stderr.flush()
codes = []
for i, case in enumerate(spec["cases"]):
    out, err = (os.path.join(spec["dir"], f"{i}.{s}") for s in ("out", "err"))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            if case["cwd"]:
                os.chdir(case["cwd"])
            os.environ.update(case["env"])
            sys.argv = [case["module"], *case["argv"]]
            try:
                runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:   # as the interpreter maps it
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:
                sys.excepthook(*sys.exc_info())
                code = 1
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)
    deadline = time.monotonic() + spec["timeout_s"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            codes.append(os.waitstatus_to_exitcode(status))
            break
        if time.monotonic() > deadline:   # a hang guard: the case fails, the others go on
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            codes.append("hang guard: killed after %s s" % spec["timeout_s"])
            break
        time.sleep(0.02)
json.dump(codes, open(os.path.join(spec["dir"], "codes.json"), "w"))
"""


@dataclass
class Command:
    """One command: `python -m MODULE ARGV...` in `cwd`, with `env` added to the driver's environment
    (read at run time: a variable read at import, SHARDLAB_PLUGINS, belongs in `run_commands`'s env)."""

    argv: Sequence[object]
    module: str = "shardlab"
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def run_commands(commands: Sequence[Command], *, env: dict[str, str] | None = None, preload: Sequence[str] = PRELOAD,
                 timeout_s: float = 300) -> list[subprocess.CompletedProcess]:
    """Each command's CompletedProcess (returncode, stdout, stderr), as subprocess.run with
    capture_output=True, text=True would give it. `timeout_s` is a hang guard per command."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="cli-batch-") as d:
        spec = {"dir": d, "preload": list(preload), "timeout_s": timeout_s,
                "cases": [{"argv": [str(a) for a in c.argv], "module": c.module, "cwd": None if c.cwd is None
                           else str(c.cwd), "env": c.env} for c in commands]}
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        driver = subprocess.run([sys.executable, "-c", DRIVER, os.path.join(d, "spec.json")], capture_output=True,
                                text=True, env=full_env, timeout=timeout_s * (len(commands) + 1))
        assert driver.returncode == 0, f"the command driver failed:\n{driver.stdout[-2000:]}{driver.stderr[-3000:]}"
        with open(os.path.join(d, "codes.json")) as f:
            codes = json.load(f)
        results = []
        for i, (c, code) in enumerate(zip(commands, codes)):
            assert isinstance(code, int), f"{c.argv}: {code}"
            with open(os.path.join(d, f"{i}.out")) as out, open(os.path.join(d, f"{i}.err")) as err:
                results.append(subprocess.CompletedProcess([sys.executable, "-m", c.module, *map(str, c.argv)],
                                                           code, driver.stdout + out.read(),
                                                           driver.stderr + err.read()))
        return results
