"""The environment of one launched process besides its devices: HCCL timeouts and buffers, the
allocator setting, node addresses for rendezvous, and HCCL port ranges where processes share NPUs.

Every HCCL_* name here is in CANN's environment-variable reference (listed with its page in
tests/ascend_conformance/hccl_env.txt). HCCL_HOST_SOCKET_PORT_RANGE / HCCL_NPU_SOCKET_PORT_RANGE:
"If multiple service processes share one NPU, you are advised to configure this environment
variable. Otherwise, the service may fail to run due to port conflicts" (CANN 8.5 envref_07_0143);
each process gets a range of its own on its node, so no two processes of a node can collide."""
from __future__ import annotations

import os
import re

HCCL_ENV = {"HCCL_CONNECT_TIMEOUT": "1200", "HCCL_EXEC_TIMEOUT": "1800", "HCCL_BUFFSIZE": "200"}
ALLOC_ENV = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}  # megatron processes only
HOST_PORT_BASE, NPU_PORT_BASE, PORTS_PER_PROCESS = 61000, 62000, 16
NODE_REFERENCE = re.compile(r"^\$\{NODE\[(\d+)\]\}$")


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
