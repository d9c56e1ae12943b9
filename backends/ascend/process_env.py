"""The environment of one launched process besides its devices: HCCL timeouts and buffers, the
allocator setting, node addresses for rendezvous, and HCCL port ranges where processes share NPUs.

Every HCCL_* name here is in CANN's environment-variable reference (listed with its page in
tests/ascend_conformance/hccl_env.txt). HCCL_HOST_SOCKET_PORT_RANGE / HCCL_NPU_SOCKET_PORT_RANGE:
"If multiple service processes share one NPU, you are advised to configure this environment
variable. Otherwise, the service may fail to run due to port conflicts" (CANN 8.5 envref_07_0143);
each process gets a range of its own on its node, so no two processes of a node can collide.
HCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: the network interface HCCL's and gloo's rendezvous sockets
bind to (CANN envref "HCCL_SOCKET_IFNAME"; torch.distributed's gloo): ASPC_SOCKET_IFNAME, else each
node's default-route interface, resolved where the process starts (the launch script, or
`resolved` in the runtimes' own processes)."""
from __future__ import annotations

import os
import re

HCCL_ENV = {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1800", "HCCL_BUFFSIZE": "200"}
ALLOC_ENV = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}  # megatron processes only
HOST_PORT_BASE, NPU_PORT_BASE, PORTS_PER_PROCESS = 61000, 62000, 16
NODE_REFERENCE = re.compile(r"^\$\{NODE\[(\d+)\]\}$")
SOCKET_VARIABLES = ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
SOCKET_REFERENCE = "${SOCKET_IFNAME}"  # the launch script sets SOCKET_IFNAME on each node


def node_address(node: int, addresses: tuple[str, ...] | None) -> str:
    """A node's address: from the list the operator gave (ASPC_NODES, node0 first), else a reference
    to it that the launch script resolves from ASPC_NODES when it runs."""
    if addresses is not None:
        if node >= len(addresses):
            raise ValueError(f"the plan needs node{node}, but ASPC_NODES lists {len(addresses)} addresses: "
                             f"give one address per node, node0 first")
        return addresses[node]
    return f"${{NODE[{node}]}}"


def referenced_node(value: str) -> int | None:
    match = NODE_REFERENCE.match(value)
    return int(match.group(1)) if match else None


def port_ranges(slot: int) -> dict[str, str]:
    """HCCL's host and NPU socket port ranges of the `slot`-th process of a node that shares NPUs."""
    host = HOST_PORT_BASE + slot * PORTS_PER_PROCESS
    npu = NPU_PORT_BASE + slot * PORTS_PER_PROCESS
    return {"HCCL_HOST_SOCKET_PORT_RANGE": f"{host}-{host + PORTS_PER_PROCESS - 1}",
            "HCCL_NPU_SOCKET_PORT_RANGE": f"{npu}-{npu + PORTS_PER_PROCESS - 1}"}


def node_addresses_from_env(environ=None) -> tuple[str, ...] | None:
    """ASPC_NODES: the nodes' addresses, node0 first, comma-separated; None when unset."""
    value = (os.environ if environ is None else environ).get("ASPC_NODES", "").strip()
    return tuple(a.strip() for a in value.split(",") if a.strip()) or None


def socket_ifname_from_env(environ=None) -> str | None:
    """ASPC_SOCKET_IFNAME: the interface every node's HCCL and gloo sockets use; None when unset."""
    return (os.environ if environ is None else environ).get("ASPC_SOCKET_IFNAME", "").strip() or None


def socket_env(ifname: str | None) -> dict[str, str]:
    """HCCL's and gloo's socket interface: `ifname`, else a reference resolved on each node."""
    return dict.fromkeys(SOCKET_VARIABLES, ifname or SOCKET_REFERENCE)


def default_route_interface(route_table: str = "/proc/net/route") -> str | None:
    """The interface of this host's IPv4 default route (destination 00000000), None without one."""
    try:
        lines = open(route_table).read().splitlines()[1:]
    except OSError:
        return None
    return next((fields[0] for fields in map(str.split, lines) if len(fields) > 1 and fields[1] == "00000000"), None)


def resolved(env: dict, environ=None) -> dict:
    """A launch-plan environment for a process started here: the socket-interface reference becomes
    ASPC_SOCKET_IFNAME or this host's default-route interface (left to HCCL and gloo without one)."""
    ifname = socket_ifname_from_env(environ) or default_route_interface()
    out = {k: v for k, v in env.items() if v != SOCKET_REFERENCE or ifname}
    return {k: ifname if v == SOCKET_REFERENCE else v for k, v in out.items()}
