"""Where the Ray runtime's actors go: the accelerators each one holds, the node trainer rank 0 must
be on, and whether the cluster has the devices at all.

Rank 0 is pinned, not found: the launch plan fixes MASTER_ADDR (rank 0's node in ASPC_NODES) for the train
job's other ranks, which the launch script starts outside Ray, and for each transfer group's
`master_address`. verl does the converse (verl/single_controller/ray/base.py, `RayWorkerGroup.
_get_master_addr_port`: a probe task on bundle 0 of the first placement group, sorted by node IP,
tells the other ranks where rank 0 landed), which needs every rank to be a Ray actor. Here the
learner's bundle asks for a share of Ray's per-node resource `node:<ip>` (every node has one,
ray/_private/resource_and_label_spec.py), which holds that bundle, and so the actor, on rank 0's
node while the other bundles go wherever they fit."""
from __future__ import annotations

import socket

from aspc.controller.config import UnsupportedPlan
from aspc.ir.facts import hardware_table

NODE_PREFIX = "node:"  # Ray's NODE_ID_PREFIX
NODE_SHARE = 0.001  # of a node resource: enough to pin a bundle, leaving it free for others


def device_bundles(plan, engines_share: bool | None = None) -> tuple[str, list[dict]]:
    """The Ray resource of the generation pool's devices (NPU on Ascend pools, from
    aspc/data/hardware.toml) and the devices of each actor: one bundle per generation instance (its
    tp·pp devices), then the learner's (rank 0's device; the other ranks of a megatron job start from
    the launch plan); no bundles on a CPU pool. Colocated engines (`engines_share`; None: those of
    a time-shared pool) hold no devices of Ray's: they share the NPUs of the trainer's ranks, which
    the launch plan starts outside Ray (colocated.py pins each engine to its node instead)."""
    gen = plan.stages_of("generate")[0]
    kind = hardware_table()[plan.pool(gen.pool).hardware].ray_resource
    if kind == "CPU":
        return kind, []
    shared = gen.placement == "time_shared" if engines_share is None else engines_share
    engine = {} if shared else {kind: gen.parallel.devices}
    return kind, [dict(engine) for _ in gen.instances] + [{kind: 1}]


def missing_devices(ray, plan) -> str | None:
    """Why the cluster cannot hold the plan's actors (too few devices of their kind), or None."""
    kind, bundles = device_bundles(plan)
    need = sum(b.get(kind, 0) for b in bundles)
    have = ray.cluster_resources().get(kind, 0)
    if have >= need:
        return None
    engines, each = len(bundles) - 1, bundles[0].get(kind, 0)
    return (f"the Ray cluster has {have:g} {kind}s (ray.cluster_resources()), but the run's actors need {need}: "
            f"{engines} generation instances x {each} and 1 for trainer rank 0 (its other ranks start "
            f"from the launch plan, --dry-run); join more {kind} nodes to the cluster (ray start --address=...), "
            f"or run with --address of a cluster that has them")


def rank0_node(ray, address: str) -> dict:
    """The resource that pins a bundle to the Ray node at `address` (an IP or a host name); nothing
    for a launch plan without node addresses (a `${NODE[0]}` reference: ASPC_NODES was not set)."""
    return node_pin(ray, address, "trainer rank 0 must run on its node {address} (MASTER_ADDR, from ASPC_NODES: "
                                  "the train job's other ranks and the weight-transfer groups meet there)")


def engine_node(ray, address: str, index: int) -> dict:
    """The resource that pins colocated instance `index`'s engine actor to the node of its NPUs."""
    return node_pin(ray, address, f"colocated generation instance {index} must run on the node of its NPUs, "
                                  "{address} (ASPC_NODES: the trainer ranks on those NPUs hand it the weights)")


def node_pin(ray, address: str, why: str) -> dict:
    """`{node:<ip>: a share}` for the Ray node at `address`; `why` (with {address}) says who must be
    there when the cluster has no such node."""
    if address.startswith("${"):
        return {}
    resources = ray.cluster_resources()
    for candidate in (address, _resolved(address)):
        if candidate and NODE_PREFIX + candidate in resources:
            return {NODE_PREFIX + candidate: NODE_SHARE}
    nodes = sorted(name.removeprefix(NODE_PREFIX) for name in resources
                   if name.startswith(NODE_PREFIX) and not name.startswith(NODE_PREFIX + "__"))
    raise UnsupportedPlan(f"{why.format(address=address)}, which is not a node of the Ray cluster (its nodes: "
                          f"{', '.join(nodes)}); start Ray on that node and join it to the cluster, or give "
                          f"ASPC_NODES the nodes' Ray addresses, node0 first")


def _resolved(address: str) -> str | None:
    try:
        return socket.gethostbyname(address)
    except OSError:
        return None
