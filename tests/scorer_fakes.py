"""A scorer that backends/ascend/scorer_process.py builds in a child process for the CPU tests
(tests/test_ascend_scorers.py): light to import, so that the child starts in a moment."""
import os
import time


class JudgeCallFailed(Exception):
    """Named as the CPU judge's: the driver's side must raise the CPU judge's class for it."""


class Lengths:
    """Scores an item by its token count; a response holding 99 is an unparsable verdict, 98 kills
    the process, 97 waits until a second call has been answered (calls run at once)."""

    def __init__(self, spec):
        self.offset, self.answered, self.closed = spec["offset"], 0, spec.get("closed")

    def close(self):
        """Called once the driver has closed the process (a reward model's followers stop here)."""
        if self.closed:
            with open(self.closed, "w") as marker:
                marker.write(str(self.answered))

    def scores(self, items):
        tokens = [t for item in items for t in item.response]
        if 99 in tokens:
            raise JudgeCallFailed('the judge answered token 5, not a verdict ("1" or "0")')
        if 98 in tokens:
            os._exit(3)
        deadline = time.monotonic() + 10
        while 97 in tokens and self.answered < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.answered += 1
        return [self.offset + len(item.prompt) + len(item.response) for item in items]


def build(spec):
    if spec.get("fail"):
        raise FileNotFoundError("no checkpoint directory /nowhere")
    return Lengths(spec)
