"""Where a run's stores listen: on loopback for a one-host run, on the endpoint's address for a
multi-host one, never on every interface (docs/security.md).

[Note: who may reach a run's stores]
torch's distributed stores (TCPStore) have no authentication, and torch's dynamic rendezvous keeps
its state in the store pickled and unpickles what it reads back
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, `_BackendRendezvousStateHolder.sync`
via `pickle.loads`): whoever can write the key `torch.rendezvous.<id>` runs code in every agent.
PyTorch's SECURITY.md says its distributed features are for trusted networks. What a run can
control is who reaches its stores at all. torch 2.13 opens up to two TCP servers per job, and
both bind every interface whatever host name they are given (read in torch's source and seen
with `ss -ltnp`: `*:PORT`):
  1. the c10d rendezvous backend's store, hosted by the agent whose address matches the
     endpoint (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py, `_create_tcp_store`);
  2. the store the workers share: by default the rank-0 agent serves it
     (`DynamicRendezvousHandler._create_tcp_store_server`, port 0); with
     TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (shardlab's elastic agents: [Note: a joining node and the
     agents' shared store] in loop/elastic.py) the rank-0 worker serves it through env://
     (torch/distributed/rendezvous.py, `_create_c10d_store`).
TCPStore's constructor takes `master_listen_fd`: a socket the caller has already bound, on which
the server then listens (libuv and the classic backend alike, checked here). So shardlab binds
each socket itself, to one address, and hands it over: `store_server` below. For (1) and (2) a
rendezvous handler registered as `shardlab` (torch's c10d handler with those two stores bound;
the launcher and `python -m shardlab.torchrun` use it in place of `c10d`); for the workers' store,
loop/runtime.py.

Which address: `listen_address`. A loopback endpoint (127.0.0.1, localhost, ::1, or a name that
resolves to loopback here): that loopback address, which the agents also publish to their workers
(torchrun's --local-addr), so nothing else is needed. Otherwise the address of this host that the route to the endpoint leaves from (a UDP
socket "connected" to it and asked for its own name: no packet is sent); on the endpoint's own
host that is the endpoint's address itself. The agent publishes that address to its workers,
so the workers' store listens where the other hosts reach it, and only there.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import sys
from typing import Any

LOOPBACK = "127.0.0.1"
BACKEND = "shardlab"   # the rendezvous backend name registered by `register_rendezvous`
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def _resolve(host: str) -> list[str]:
    """Every address `host` names here (an address names itself)."""
    try:
        return [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_loopback(host: str) -> bool:
    """True when `host` names this host's loopback only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    addresses = _resolve(host)
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def is_loopback_name(host: str) -> bool:
    """True when `host` is written as loopback (localhost, 127.x.y.z, ::1), not merely resolved to it
    (a Debian host's own name resolves to 127.0.1.1, which other hosts do not reach)."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen_address(endpoint_host: str) -> str:
    """The one address this host's stores listen on for a job meeting at `endpoint_host` (the
    Note above): loopback for a loopback endpoint, else the source address of the route to it."""
    if endpoint_host.lower() in _LOOPBACK_NAMES:
        return LOOPBACK
    if is_loopback(endpoint_host):   # 127.0.0.5, or a host name that resolves to 127.0.1.1 here
        return _resolve(endpoint_host)[0]
    for address in _resolve(endpoint_host):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((address, 9))      # a datagram socket's connect sends nothing
                return str(probe.getsockname()[0])
        except OSError:
            continue
    raise OSError(f"no route from this host to the rendezvous endpoint {endpoint_host!r}: "
                  "check the host name (it must resolve here) or give an address")


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) only, not yet listening (TCPStore listens on it)."""
    address = _resolve(host)
    if not address:
        raise OSError(f"cannot resolve {host!r} to an address to listen on")
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address[0], port))
    except OSError:
        sock.close()
        raise
    return sock


def store_server(host: str, port: int, **kwargs: Any) -> Any:
    """A TCPStore server listening on `host` only (the Note above); kwargs as TCPStore's."""
    import torch.distributed as dist

    sock = bound_socket(host, port)
    try:
        return dist.TCPStore(host, sock.getsockname()[1], is_master=True, master_listen_fd=sock.detach(),
                             **kwargs)
    except BaseException:
        sock.close()
        raise


# -- the rendezvous handler: torch's c10d one, its two stores bound to one address -------------------

def _rendezvous_store(params: Any, listen: str) -> Any:
    """The c10d backend's store (torch's `_create_tcp_store`, bound): the agent whose host the
    endpoint names serves it on `listen`; the others, and a host that finds it already served
    (several agents on one host), are its clients."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = datetime.timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import _matches_machine_hostname

        is_host = is_loopback(host) or _matches_machine_hostname(host)
    if is_host:
        try:
            return store_server(listen, port, multi_tenant=True, timeout=timeout)
        except (OSError, RuntimeError, ValueError):
            if params.get_as_bool("is_host") is not None:
                raise
    return dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)


def _create_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host = params.endpoint.rsplit(":", 1)[0] if params.endpoint else LOOPBACK
    host = host.strip("[]")
    listen = params.local_addr or listen_address(host)
    if params.max_nodes > 1 and is_loopback(listen) and not is_loopback_name(host):
        print(f"shardlab: warning: the rendezvous endpoint {host} is {listen} (loopback) on this host: only agents "
              "on this host can join; for agents on other hosts give an address they reach (--rdzv-endpoint "
              "IP:PORT)", file=sys.stderr, flush=True)
    # the address this agent publishes to its workers (MASTER_ADDR) is the one its stores listen on
    params.local_addr = listen
    store = _rendezvous_store(params, listen)

    class BoundC10dBackend(C10dRendezvousBackend):
        """torch's c10d rendezvous backend under the name it was asked by (torch checks the two agree)."""

        @property
        def name(self) -> str:
            return BACKEND

    handler = create_handler(store, BoundC10dBackend(store, params.run_id), params)
    if not hasattr(handler, "_create_tcp_store_server"):
        raise RuntimeError("this torch's rendezvous has no _create_tcp_store_server: shardlab's listener "
                           "binding (loop/listen.py) needs updating for it")
    # the workers' shared store (torch opens it on port 0 of every interface): on `listen` only
    handler._create_tcp_store_server = lambda addr, port: store_server(listen, port, multi_tenant=True)
    return handler


def register_rendezvous() -> str:
    """Register the `shardlab` rendezvous backend with torch (idempotent); its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)   # the same creator again: a no-op
    return BACKEND


def worker_store(host: str, port: int, rank: int, world: int, timeout: datetime.timedelta) -> Any:
    """The store a group's workers share when one of them serves it (env://'s, bound): rank 0
    listens on `host` only (the address the agent published: loopback on one host)."""
    import torch.distributed as dist

    if rank == 0:
        return store_server(host, port, world_size=world, multi_tenant=True, timeout=timeout)
    return dist.TCPStore(host, port, world_size=world, is_master=False, multi_tenant=True, timeout=timeout)
