"""Which published policy versions the runtime keeps in memory: the newest (what the next sync asks
for) and every version an instance was told to load and has not loaded yet. The learner publishes a
full copy of the weights every step; kept forever they grew the driver's memory by the model's size
each step (a SmolLM2-135M run held 11 GB at step 16). The controller only ever asks an instance to
load the newest published version (aspc/controller/core.py, pending_sync), so nothing older than the
oldest outstanding request can be asked for again."""
from __future__ import annotations


class PublishedVersions:
    def __init__(self, weights: dict):
        self.weights = weights  # version -> weights: the dict the learner's worker publishes into
        self.outstanding: dict[int, int] = {}  # instance -> the version it was told to load

    def requested(self, instance: int, version: int) -> None:
        self.outstanding[instance] = version

    def loaded(self, instance: int, version: int) -> None:
        if self.outstanding.get(instance) == version:
            del self.outstanding[instance]
        self.prune()

    def prune(self) -> None:
        """Drop what no instance can ask for. The learner's worker adds versions on its own thread:
        the keys are read from a copy (one atomic step), and only older keys are removed."""
        versions = list(self.weights.copy())
        if not versions:
            return
        keep = {max(versions), *self.outstanding.values()}
        for version in versions:
            if version not in keep:
                self.weights.pop(version, None)
