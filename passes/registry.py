"""Every pass by name: an explicit table (no registration as an import side effect)."""
from __future__ import annotations

from aspc.passes.async_decouple import AsyncDecouple
from aspc.passes.auto_place import AutoPlace
from aspc.passes.continuous_batching import ContinuousBatching
from aspc.passes.pack import Pack
from aspc.passes.partial_rollout import PartialRollout
from aspc.passes.place import Place
from aspc.passes.queue_aware_dispatch import QueueAwareDispatch
from aspc.passes.stream import Stream

PASSES = {p.name: p for p in (ContinuousBatching, AsyncDecouple, QueueAwareDispatch, Pack, Stream,
                              PartialRollout, Place, AutoPlace)}
