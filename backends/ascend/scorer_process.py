"""A reward model's or judge's instance in a process of its own: started on this node with the
launch plan's environment of the instance's first process (its ASCEND_RT_VISIBLE_DEVICES, RANK,
MASTER_ADDR/PORT, HCCL_* and VLLM_* variables), so that it sits on its own NPUs and has megatron's
parallel state or vLLM's engine to itself, as the launch plan's processes do; the driver's scoring
threads call it through `RemoteTerm.scores`, several calls in flight at once (an LLM judge's
`concurrency`).

    python -m aspc.backends.ascend.scorer_process SPEC.json FACTORY

FACTORY ("module:function") builds the term from the spec (scorers.build_term); it must answer
`scores(items)` for items with `.prompt` and `.response` token ids and `.prompt_text`. The child
connects back to ASPC_SCORER_ADDRESS with the key in ASPC_SCORER_KEY (multiprocessing.connection),
reports whether the term was built, then answers each call (id, items) with (id, "ok", scores) or
(id, "error", (type, message)) from a thread of its own."""
from __future__ import annotations

import importlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from multiprocessing.connection import Client, Listener
from types import SimpleNamespace

from aspc.rl.rewards import RewardError

START_TIMEOUT_S = 900.0  # megatron or vLLM loading a checkpoint onto NPUs
CLOSE_TIMEOUT_S = 30.0  # an engine or megatron tearing down
LOG_TAIL = 2000


class ScorerFailed(RewardError):
    """A scorer's call or process failed; the message names the failure and the process's log (a
    RewardError: the run reports it as one message)."""


class ScorerProcess:
    """The driver's side: starts the child, waits until its term is built, sends calls and hands each
    answer to the caller waiting for it."""

    def __init__(self, spec: dict, factory: str, what: str, env: dict | None = None):
        self.what, self.calls, self.lock, self.next_id = what, {}, threading.Lock(), 0
        self.folder = tempfile.TemporaryDirectory(prefix="aspc-scorer-")
        spec_file, self.log_path = f"{self.folder.name}/spec.json", f"{self.folder.name}/log.txt"
        with open(spec_file, "w", encoding="utf-8") as handle:
            json.dump(spec, handle)
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        child_env = {**os.environ, **(env or {}), "ASPC_SCORER_ADDRESS": f"{host}:{port}",
                     "ASPC_SCORER_KEY": key.hex()}
        with open(self.log_path, "wb") as log:
            self.child = subprocess.Popen([sys.executable, "-m", __name__, spec_file, factory], env=child_env,
                                          stdout=log, stderr=subprocess.STDOUT)
        self.conn = self._accept(listener)
        status, detail = self.conn.recv()
        if status != "ready":
            self.close()
            raise ScorerFailed(f"{what} could not start: {detail}")
        threading.Thread(target=self._read, daemon=True, name=f"{what} answers").start()

    def _accept(self, listener):
        """The child's connection, or ScorerFailed with its log if it ends (or hangs) before connecting."""
        box: list = []
        waiter = threading.Thread(target=lambda: box.append(listener.accept()), daemon=True)
        waiter.start()
        waited = 0.0
        while waiter.is_alive() and self.child.poll() is None and waited < START_TIMEOUT_S:
            waiter.join(0.2)
            waited += 0.2
        if not box:
            self.child.kill()
            raise ScorerFailed(f"{self.what} ended before it connected (exit code {self.child.wait()}): "
                               f"{self.log_tail()}")
        return box[0]

    def scores(self, items: list) -> list[float]:
        """One call: each item's (prompt, response) token ids (and prompt text: a checkpoint judge's
        prompt is text) scored in the child."""
        future: Future = Future()
        with self.lock:
            call, self.next_id = self.next_id, self.next_id + 1
            self.calls[call] = future
            self.conn.send((call, [(list(i.prompt), list(i.response), getattr(i, "prompt_text", ""))
                                   for i in items]))
        return future.result()

    def _read(self) -> None:
        while True:
            try:
                call, status, payload = self.conn.recv()
            except (EOFError, OSError):
                self._fail_all()
                return
            future = self.calls.pop(call)
            if status == "ok":
                future.set_result(payload)
            else:
                future.set_exception(remote_error(*payload))

    def _fail_all(self) -> None:
        error = ScorerFailed(f"{self.what}'s process ended (exit code {self.child.wait()}): {self.log_tail()}")
        with self.lock:
            pending, self.calls = self.calls, {}
        for future in pending.values():
            future.set_exception(error)

    def log_tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:
            return "(no log)"
        return text[-LOG_TAIL:].strip() or "(empty log)"

    def close(self) -> None:
        """The child ends: asked to (it stops taking calls), killed if it has not within CLOSE_TIMEOUT_S."""
        try:
            self.conn.send(None)
        except (AttributeError, OSError):
            pass
        try:
            self.child.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
        if hasattr(self, "conn"):
            self.conn.close()


def remote_error(kind: str, message: str) -> Exception:
    """The child's error as the CPU path raises it: a judge's unparsable verdict stays JudgeCallFailed
    (the driver's failure policy reports it by name); anything else is ScorerFailed, named."""
    from aspc.rl.judge_verdict import JudgeCallFailed

    return JudgeCallFailed(message) if kind == "JudgeCallFailed" else ScorerFailed(f"{kind}: {message}")


# ---- the child ----
def serve(conn, term) -> None:
    send = threading.Lock()

    def answer(call: int, pairs: list) -> None:
        items = [SimpleNamespace(prompt=p, response=r, prompt_text=text) for p, r, text in pairs]
        try:
            reply = (call, "ok", [float(s) for s in term.scores(items)])
        except Exception as error:  # the call's failure, reported to the caller
            reply = (call, "error", (type(error).__name__, str(error)))
        with send:
            conn.send(reply)

    while True:
        try:
            message = conn.recv()
        except EOFError:  # the driver's process ended
            return
        if message is None:
            return
        threading.Thread(target=answer, args=message, daemon=True).start()


def main(argv: list[str]) -> int:
    spec_file, factory = argv
    host, port = os.environ["ASPC_SCORER_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["ASPC_SCORER_KEY"]))
    try:
        module, function = factory.split(":")
        with open(spec_file, encoding="utf-8") as handle:
            term = getattr(importlib.import_module(module), function)(json.load(handle))
    except Exception as error:  # reported to the driver, which stops the run with it
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return 1
    conn.send(("ready", None))
    serve(conn, term)
    close = getattr(term, "close", None)  # a reward model on several ranks: the followers stop
    if close is not None:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
