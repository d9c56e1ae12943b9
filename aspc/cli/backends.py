"""The executors of each platform, by name: the one place that knows which backend module
implements the executor roles (aspc/roles.py) for a platform. Imported lazily, so that
`aspc simulate` never imports torch and a CPU machine never imports the NPU stack."""
from __future__ import annotations

import importlib

from aspc.plan.execution_plan import ExecutionPlan

# platform -> (module, the factory in it): an Executors factory for `aspc run`, a Pricing for `aspc simulate`
RUN = {"cpu": ("aspc.backends.cpu.executors", "CpuExecutors")}
SIMULATE = {"roofline": ("aspc.backends.sim.pricing", "RooflinePricing")}


def load(table: dict, name: str):
    module, attribute = table[name]
    return getattr(importlib.import_module(module), attribute)


def run_executors(backend: str):
    """The Executors factory of `aspc run --backend NAME`."""
    return load(RUN, backend)


def simulator_pricing(plan: ExecutionPlan, calibration=None):
    return load(SIMULATE, "roofline")(plan, calibration)
