"""The runtime's core: a deterministic, event-driven state machine over an execution plan.

It owns the queues, the dispatch policy, the staleness gate and the policy versions; it owns no
threads, no clock, no torch and no Ray. The simulator, the local runtime and the Ray runtime all
drive it: they feed it events and carry out the actions it returns.
"""
from aspc.controller.core import Controller, ControllerConfig  # noqa: F401 - the package's interface
from aspc.controller.events import *  # noqa: F401,F403 - the event and action vocabulary
