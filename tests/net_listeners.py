"""What TCP sockets a process tree listens on, read from Linux's /proc and sock_diag (what `ss -ltnp` shows),
sampled while a run goes on: the listener checks of test_security.py and test_infra_multihost.py."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import subprocess
import tempfile
import time


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _below(root: int, parents: dict[int, int]) -> set[int]:
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= below
        grew = bool(below)
    return tree


def process_tree(root: int) -> set[int]:
    """`root` and every process below it."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := _parent(int(entry))) is not None:
            parents[int(entry)] = ppid
    return _below(root, parents)


class ProcessTree:
    """`process_tree(root)` sampled again and again: a process's parent is read once, when its pid
    first appears, and forgotten when the pid goes. Reading every process's stat each time cost
    ~4 ms a sample on this machine (160 processes), 7 % of a core at 20 samples a second for the
    whole of a run."""

    def __init__(self, root: int):
        self.root, self.parents = root, {}

    def pids(self) -> set[int]:
        now = {int(e) for e in os.listdir("/proc") if e.isdigit()}
        for gone in self.parents.keys() - now:
            del self.parents[gone]
        for pid in now - self.parents.keys():
            if (ppid := _parent(pid)) is not None:
                self.parents[pid] = ppid
        return _below(self.root, self.parents)


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def _listening_by_netlink() -> dict[str, tuple[str, int]] | None:
    """inode -> (address, port) of every TCP socket listening in this process's network namespace,
    asked of the kernel's sock_diag (what `ss -lt` asks), which answers with the listeners alone.
    Reading /proc/net/tcp and tcp6 cost 7 ms of kernel time per sample on this machine: a sample
    every 50 ms kept a seventh of a core busy for the whole run. None where netlink is refused."""
    found: dict[str, tuple[str, int]] = {}
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) as s:   # 4: NETLINK_SOCK_DIAG
            for family in (socket.AF_INET, socket.AF_INET6):
                # inet_diag_req_v2 (family, protocol, ext, pad, states = 1 << TCP_LISTEN, a zeroed
                # socket id) after its netlink header (SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP)
                req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, 1 << 10) + bytes(48)
                s.send(struct.pack("=IHHII", 16 + len(req), 20, 0x301, 1, 0) + req)
                if not _read_dump(s, found):
                    return None
    except OSError:
        return None
    return found


def _read_dump(s: socket.socket, found: dict[str, tuple[str, int]]) -> bool:
    """Read one sock_diag dump into `found`; False on a netlink error."""
    while True:
        data, off = s.recv(1 << 16), 0
        while off + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, off)
            if kind == 3:      # NLMSG_DONE
                return True
            if kind == 2:      # NLMSG_ERROR
                return False
            body = off + 16    # inet_diag_msg: family, state, timer, retrans; the socket id; ...; inode
            family, sport = data[body], struct.unpack_from("!H", data, body + 4)[0]
            src = data[body + 8:body + (12 if family == socket.AF_INET else 24)]
            inode = struct.unpack_from("=I", data, body + 68)[0]
            found[str(inode)] = (str(ipaddress.ip_address(src)), sport)
            off += (length + 3) & ~3


def _same_network_namespace(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def listeners_of(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that `pids` hold."""
    inodes = _socket_inodes(pids)
    if pids and _same_network_namespace(min(pids)) and (table := _listening_by_netlink()) is not None:
        return {table[i] for i in inodes if i in table}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        # the tables are per network namespace: /proc/<pid>/net of one of the pids reads theirs
        path = f"/proc/{min(pids)}/net/{os.path.basename(table)}" if pids else table
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:   # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def run_watching_listeners(cmd: list[str], timeout_s: float, **popen) -> tuple[subprocess.CompletedProcess,
                                                                                 set[tuple[str, int]]]:
    """Run `cmd` to the end, sampling its process tree's listeners every 50 ms; `timeout_s` is a
    hang guard."""
    with tempfile.TemporaryFile("w+") as log:   # a file, not a pipe: nothing blocks while we sample
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, **popen)
        seen: set[tuple[str, int]] = set()
        tree = ProcessTree(proc.pid)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.seek(0)
                raise AssertionError(f"hang guard: {cmd} still running after {timeout_s} s:\n{log.read()[-3000:]}")
            seen |= listeners_of(tree.pids())
            time.sleep(0.05)
        log.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, log.read(), ""), seen
