"""A judge's concurrent calls served in batches, as an inference server batches its requests: the
local runtime makes one call per sample, on threads of its own (aspc/drivers/local/scoring.py),
and a call that arrives while a forward pass is in flight joins the next pass instead of running
one of its own (on a CPU, one pass over 16 samples costs about what one pass over one does).

Each call still succeeds or fails on its own: when a batch raises, its calls run again one by
one, so an error is only ever the error of the call it belongs to."""
from __future__ import annotations

import threading
from collections.abc import Callable


class _Call:
    def __init__(self, rollouts: list):
        self.rollouts, self.finished = rollouts, False
        self.error: BaseException | None = None


class BatchedCalls:
    """`score(rollouts)` (sets each rollout's reward in place) called for concurrent callers
    together: the caller that finds no pass in flight runs one over every call waiting."""

    def __init__(self, score: Callable[[list], None]):
        self.score = score
        self.changed = threading.Condition()
        self.waiting: list[_Call] = []
        self.in_flight = False

    def __call__(self, rollouts: list) -> None:
        call = _Call(rollouts)
        with self.changed:
            self.waiting.append(call)
            while not call.finished and self.in_flight:
                self.changed.wait()
            batch = [] if call.finished else self.waiting  # no pass in flight: this caller runs the next
            if batch:
                self.in_flight, self.waiting = True, []
        if batch:
            self._serve(batch)
        if call.error is not None:
            raise call.error

    def _serve(self, batch: list[_Call]) -> None:
        try:
            self._run(batch)
        except BaseException as error:  # not one call's failure (an interrupt): every call of the pass has it
            for call in batch:
                call.error = error
            raise
        finally:
            with self.changed:
                for call in batch:
                    call.finished = True
                self.in_flight = False
                self.changed.notify_all()

    def _run(self, batch: list[_Call]) -> None:
        try:
            self.score([r for call in batch for r in call.rollouts])
            return
        except Exception as error:
            if len(batch) == 1:
                batch[0].error = error
                return
        for call in batch:  # some call's samples failed the pass: each call alone, with its own outcome
            try:
                self.score(call.rollouts)
            except Exception as error:
                call.error = error

    def __getstate__(self) -> dict:
        return {"score": self.score}

    def __setstate__(self, state: dict) -> None:
        BatchedCalls.__init__(self, state["score"])  # fresh lock and queue: neither pickles
