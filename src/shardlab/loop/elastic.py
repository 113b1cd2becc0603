"""Elastic training (docs/elastic.md): the node range of `--nnodes MIN:MAX`, checked at every
world size before any worker starts, and the membership line of a group that lost or gained a
node. The batch layout at the new world size is data/loader.py's rule.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardlab.atomic import read_json
from shardlab.data.loader import Layout
from shardlab.errors import ConfigError

# [Note: the last call]
# A restart after a lost node waits twice before the group re-forms. First for the dead node to
# leave the rendezvous: c10d drops a node whose heartbeat (every KEEP_ALIVE_S) was missed 3 times,
# and until then the survivors cannot start the next round (torch's default: 5 s x 3). Then, once
# MIN agents have joined the new round, c10d waits LAST_CALL_S for more before it closes it
# (torch's default is 30 s), in full whenever fewer than MAX agents are left. Both are part of the
# time from the loss to the first step at the new size; agents starting together join well within
# the last call, and one that comes later joins at the next round (a membership change:
# docs/elastic.md). SHARDLAB_LAST_CALL_S and SHARDLAB_KEEP_ALIVE_S (whole seconds) change them:
# tests/test_elastic_agents.py shortens both. `shardlab train --nnodes` (loop/launcher.py) and the
# rendered jobs' agents (`python -m shardlab.torchrun --nnodes MIN:MAX`, loop/torchrun.py) use them alike.
LAST_CALL_S = 5
KEEP_ALIVE_S = 5


def _seconds(env: str, default: int) -> int:
    value = os.environ.get(env) or str(default)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{env}={value!r}: give whole seconds >= 1, e.g. {env}={default}")
    return int(value)


def rendezvous_timeouts() -> dict[str, int]:
    """The c10d rendezvous settings an elastic agent runs with ([Note: the last call])."""
    return {"last_call_timeout": _seconds("SHARDLAB_LAST_CALL_S", LAST_CALL_S),
            "keep_alive_interval": _seconds("SHARDLAB_KEEP_ALIVE_S", KEEP_ALIVE_S)}


def parse_nnodes(text: str) -> tuple[int, int]:
    """`--nnodes N` or `--nnodes MIN:MAX` -> (MIN, MAX); ConfigError on a bad range."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        raise ConfigError(f"--nnodes {text}: give N or MIN:MAX with whole numbers, e.g. --nnodes 1:2") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes {text}: needs 1 <= MIN <= MAX (MIN:MAX nodes, e.g. --nnodes 1:2)")
    return lo, hi


def check_node_range(check: Callable[[int], None], nproc: int, lo: int, hi: int) -> None:
    """Run `check(world size)` (config.validate_for_world: the layout rule, data/loader.py, among its checks) at
    every world size an elastic launch of `nproc` workers per node may reach, before any worker
    starts; a ConfigError names the first node count that fails."""
    for nodes in range(lo, hi + 1):
        try:
            check(nodes * nproc)
        except ConfigError as e:
            raise ConfigError(f"--nnodes {lo}:{hi} x --nproc {nproc}: at {nodes} node(s), {e}") from None


# -- membership: who trained before this (re)start, and the one line a change gets -----------------
# [Note: the membership line]
# A node lost shows to the survivors as a failed collective; the agent then stops them and re-forms
# the group at whatever agents are left (or joined), and the new workers resume from the latest
# checkpoint. Nothing in that new group remembers the old one, so the run directory does: each
# worker that ends by a peer's failure or by the agent's stop (a membership change) leaves a note
# (its step and the time), and at every start rank 0 writes who the members are (node = host and
# agent pid). The first rank 0 of a new group compares, and after its first step prints one line:
# the nodes lost or joined, the new world size and accumulation, the step resumed from, the steps
# lost (the furthest step a note reports, less the step resumed), and the seconds from the first
# note (when the old group noticed) to the end of that first step.
_DIR = "elastic"
ENV = "SHARDLAB_ELASTIC"  # set by an elastic agent for its workers (AGENT_ENV): membership is watched only then


# [Note: a joining node and the agents' shared store]
# By default (torch 2.13) the rank-0 agent of a rendezvous round serves the workers' TCPStore from
# its own process and writes its address under that round's keys, but only in the round where it
# first becomes rank 0: in a later round where it is rank 0 again, it skips the write. A node that
# joins such a round (a grow: the survivor of a shrink stays rank 0) then waits for that address
# until its store timeout, and the survivor waits for the newcomer's role: the grow hangs and both
# fail after 60 s (seen here with two agents, then a third one started after the shrink). With
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every round's rank 0 writes a fresh address and the group's
# rank-0 worker serves the store (env://), so each group also starts from an empty store.

# What an elastic agent sets for itself and its workers (launch_elastic; python -m shardlab.torchrun
# with --nnodes MIN:MAX, as the rendered elastic jobs run it).
AGENT_ENV = {ENV: "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def require_rdzv_id(rdzv_id: str | None, nodes: tuple[int, int]) -> str:
    """The rendezvous id an agent of a multi-agent job was given. There is no default: the agents
    must agree on it, and a derived one (the run name is a hash of the config) can be guessed by
    whoever reaches the endpoint, who could then write the rendezvous state that torch unpickles
    ([Note: who may reach a run's stores] in loop/listen.py)."""
    if not rdzv_id:
        raise ConfigError(f"--nnodes {nodes[0]}:{nodes[1]} needs --rdzv-id ID, the same for every agent of this job "
                          "and new for each job, e.g. --rdzv-id $(python3 -c 'import secrets; "
                          "print(secrets.token_hex(8))'): whoever reaches the endpoint and knows the id takes part "
                          "in the rendezvous (docs/security.md)")
    return rdzv_id


def is_range(nnodes: str) -> bool:
    """torchrun's --nnodes value names a range of sizes (MIN:MAX with MIN < MAX)."""
    lo, _, hi = nnodes.partition(":")
    return bool(hi) and lo.strip() != hi.strip()


def launched() -> bool:
    return os.environ.get(ENV) == "1"


def node_id() -> str:
    """This worker's node: its host and its agent (the parent process under torch's agent)."""
    import socket

    return f"{socket.gethostname()}:{os.getppid()}"


def note_end(run_dir: str, rank: int, step: int, why: str, at: float | None = None) -> None:
    """A worker that ends by a peer's failure ("lost") or the agent's stop ("stopped"; `at`: when
    the agent's signal came)."""
    if not launched():
        return
    with contextlib.suppress(OSError):
        os.makedirs(os.path.join(run_dir, _DIR), exist_ok=True)
        with open(os.path.join(run_dir, _DIR, f"end-{rank}.json"), "w") as f:
            json.dump({"step": step, "time": at or time.time(), "why": why, "node": node_id()}, f)


def stop_line(record: dict[str, Any]) -> str:
    """Rank 0's line when the agent stopped an elastic group and it saved (a node joined: torch's
    agent restarts the group on a membership change; or the whole job is being stopped)."""
    return (f"shardlab: the agent stopped the group at step {record['step']} ({record['signal']}: a node joined, "
            f"or the job is stopping); checkpoint {record['checkpoint']} saved in {record['save_seconds']:.2f} s, "
            "the next group resumes from it")


@dataclass
class Change:
    before: dict[str, list[int]]     # node -> its ranks, in the group before
    after: dict[str, list[int]]
    ends: list[dict[str, Any]]       # the old group's notes
    layout: Layout                   # the new group's
    resumed: int                     # the step it resumed from

    def line(self, now: float) -> str:
        layout, resumed = self.layout, self.resumed
        lost = [n for n in self.before if n not in self.after]
        joined = [n for n in self.after if n not in self.before]
        what = "; ".join([*(f"node {n} lost (ranks {_ranks(self.before[n])})" for n in lost),
                          *(f"node {n} joined" for n in joined)]) or "the group re-formed"
        reached = max([e["step"] for e in self.ends], default=resumed)
        since = min([e["time"] for e in self.ends], default=None)
        event = "loss" if lost else "stop"  # a grow: from the agent's stop of the old group
        took = f"{now - since:.1f} s from the {event} to the first step at this size" if since else "time unknown"
        return (f"shardlab: {what}: world size {_size(self.before)} -> {layout.world_size}, accumulation "
                f"{layout.accumulation} x micro batch {layout.micro} (global batch kept), resumed from step "
                f"{resumed}, {max(0, reached - resumed)} step(s) lost, {took}")


def _size(members: dict[str, list[int]]) -> int:
    return sum(len(r) for r in members.values())


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def membership(run_dir: str, nodes: list[str], is_main: bool, layout: Layout, resumed: int) -> Change | None:
    """Rank 0, at a start: the change since the group that trained before (None: the same, or the
    first start). `nodes`: every rank's node_id, gathered. Records this group for the next."""
    if not is_main:
        return None
    folder = os.path.join(run_dir, _DIR)
    os.makedirs(folder, exist_ok=True)
    after: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        after.setdefault(node, []).append(rank)
    path = os.path.join(folder, "members.json")
    before = read_json(path)
    ends = [e for name in sorted(os.listdir(folder)) if name.startswith("end-")
            for e in [read_json(os.path.join(folder, name))] if e]
    for name in os.listdir(folder):
        if name.startswith("end-"):
            os.remove(os.path.join(folder, name))
    with open(path + ".tmp", "w") as f:
        json.dump(after, f)
    os.replace(path + ".tmp", path)
    if before is None or before == after:
        return None
    return Change(before, after, ends, layout, resumed)

