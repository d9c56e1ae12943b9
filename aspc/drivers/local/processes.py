"""Process workers for the local runtime (`aspc run --workers processes`): each generation
instance and the learner compute in a process of their own, so they overlap on separate cores
instead of contending for one interpreter's lock.

The worker threads of workers.py stay in the main process, with the controller: each drives its
process through a proxy with the role's interface (`ProcessEngine` for a generation engine,
`ProcessLearner` for the trainer), one request and one reply at a time over a pipe. Tensors in
requests and replies (published weights, rollouts) are pickled through the pipe like the rest
(`_send`: faster than torch's shared-memory reductions at these sizes). The main process keeps every
rollout (a learner pass sends them and copies back the fields it set), so checkpoints, metrics and
held-out evaluation read the same objects as with threads.

A child ignores SIGINT and SIGTERM (the main process handles Ctrl-C and SIGTERM, and still reads
the learner's state for its checkpoint; both may reach the whole process group) and exits when its
pipe closes, so a killed main process leaves no orphans. A child names itself (`/proc/PID/comm`,
what `ps` shows): `aspc learner`, `aspc gen[0]`.

Children are forked from a fork server (multiprocessing's `forkserver`): a process started once per
main process that imports torch and the backend's worker modules before any thread pool exists,
then forks a child per worker in milliseconds. Spawning imported torch in every child (seconds
each on two cores, three children per run) and finalised it again at exit. A child takes the
main process's working directory and `sys.path` (multiprocessing sends them) and its environment
(`_serve` sets it), as a spawned child did.
"""
from __future__ import annotations

import inspect
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import threading
import traceback

from aspc.drivers.local.workers import InstanceLost
from aspc.ir.kinds import ROLE_CALLS

# Never a plain fork of the main process: fork after torch has started its thread pools can
# deadlock the child. The fork server forks before torch has computed anything.
START = "forkserver"
# Imported lazily by the CPU backend's `set_threads` at a worker's first call (about a second a child).
LAZY_IMPORTS = ("torch._dynamo",)
_HELD = {signal.SIGINT, signal.SIGTERM}  # blocked in the fork server and in a child until it ignores them


class WorkerProcessFailed(Exception):
    """A worker process raised or died; the message names it and says why."""


def _serve(conn, name: str, threads: int, set_threads, search_path: list[str], environment: dict[str, str]) -> None:
    """A child's loop: its server object first (user modules, e.g. a python reward, import from
    `search_path` as in the main process), then (method, args) in, ("ok", value) or ("error",
    text) out, until the pipe closes. A child never prints a traceback of its own: an error goes
    back as a reply, and a closed pipe (the main process ended or was killed) ends it quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and so is SIGTERM (aspc/cli/run.py)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # blocked since its start (ChildProcess)
    _name_process(name)
    _take_environment(environment)
    set_threads(threads)
    sys.path[:0] = search_path
    try:
        _loop(conn, _receive(conn))
    except (EOFError, OSError):
        return


def _name_process(name: str) -> None:
    """`aspc learner`, `aspc gen[0]` in /proc/PID/comm (15 bytes at most): what `ps` and tests see."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(f"aspc {name}"[:15])
    except OSError:  # not Linux: the name is only cosmetic
        pass


def _take_environment(environment: dict[str, str]) -> None:
    """The main process's environment as it is now, not as it was when the fork server started."""
    for name in set(os.environ) - set(environment):
        del os.environ[name]
    os.environ.update(environment)


def start_fork_server(preload: list[str]):
    """The fork server's context, its server started if it was not: it imports `preload` (and
    LAZY_IMPORTS, and what the main module is made of) while this process goes on, e.g. with the
    warm start. The first call of a process chooses the modules; every later child finds them
    imported. SIGINT stays blocked in the server and so in every child it forks (see ChildProcess)."""
    context = multiprocessing.get_context(START)
    context.set_forkserver_preload(list(dict.fromkeys([*_main_imports(), *preload, *LAZY_IMPORTS])))
    _start_resource_tracker()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return context


def _start_resource_tracker() -> None:
    """multiprocessing's resource tracker, started before SIGINT is blocked for the fork server:
    starting it unblocks SIGINT on the calling thread (CPython 3.11's resource_tracker), and a fork
    server started after that caught a Ctrl-C while importing its preload, with a traceback."""
    import multiprocessing.resource_tracker

    multiprocessing.resource_tracker.ensure_running()


def _main_imports() -> list[str]:
    """The modules the main module is made of: its own name under `python -m`, and where its
    modules and functions come from (`aspc.cli.main` for the `aspc` script). Every child imports
    the main module again, as a spawned one does; these make that cheap."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    names = [spec.name] if spec is not None and not spec.name.endswith("__main__") else []
    for value in vars(main).values() if main is not None else ():
        if inspect.ismodule(value):
            names.append(value.__name__)
        elif (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ not in ("__main__", None):
            names.append(value.__module__)
    return names


def _loop(conn, server) -> None:
    while True:
        method, args = _receive(conn)
        if method == "stop":  # no reply: the main process may already have closed its end
            return
        if method == "ready":
            _send(conn, ("ok", None))
            continue
        try:
            reply = ("ok", getattr(server, method)(*args))
        except Exception as error:  # reported to the proxy, which raises it in the main process
            frame = traceback.extract_tb(error.__traceback__)[-1]
            reply = ("error", f"{type(error).__name__}: {error} (at {frame.filename}:{frame.lineno})")
        _send(conn, reply)


def _send(conn, obj) -> None:
    """Plain pickles: a tensor's bytes go through the pipe. torch's shared-memory reductions (the
    default of multiprocessing connections) open a segment per tensor and took 13 ms to hand a
    tiny model's weights over, against well under 1 ms this way."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn):
    return pickle.loads(conn.recv_bytes())


class ChildProcess:
    def __init__(self, name: str, server, threads: int, set_threads, search_path: list[str], title: str = ""):
        """`title`: the process in a message ("the learner process"; default "the NAME process")."""
        context = start_fork_server([set_threads.__module__, *server.modules()])
        self.name, self.title = name, title or f"the {name} process"
        # Pickled before the process starts: a server that cannot be pickled starts nothing. Sent
        # with the first call, not here: the write blocks until the child, still importing torch,
        # reads it, and the next child must not wait for that to start its own import.
        self.server: bytes | None = pickle.dumps(server, protocol=pickle.HIGHEST_PROTOCOL)
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, name, threads, set_threads, search_path,
                                                            dict(os.environ)), name=name, daemon=True)
        # The child starts with SIGINT blocked, as the fork server does (it inherited the mask of
        # start_fork_server; a mask survives exec): a Ctrl-C that lands before the child ignores
        # SIGINT must not kill it with a traceback.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self.lock = threading.Lock()  # one request at a time, whichever thread asks

    def _hand_over(self) -> None:
        """The server object, once, before the first request (under the lock)."""
        if self.server is not None:
            self.conn.send_bytes(self.server)
            self.server = None

    def call(self, method: str, *args):
        try:
            with self.lock:
                self._hand_over()
                _send(self.conn, (method, args))
                kind, value = _receive(self.conn)
        except (EOFError, OSError):
            raise InstanceLost(f"{self.title} died ({self._how_it_ended()})") from None
        if kind == "error":
            raise WorkerProcessFailed(f"{self.name}: {value}")
        return value

    def _how_it_ended(self) -> str:
        """`signal 9`, `exit code 1`: why the process is gone (waited for a little: its pipe closes
        just before it can be reaped)."""
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is None:
            return "its pipe closed"
        return f"signal {-code}" if code < 0 else f"exit code {code}"

    def ready(self) -> None:
        """Wait until the process has started and holds its engine (build time, not the run's)."""
        self.call("ready")

    def stop(self) -> None:
        """Ask the process to end (it ends at once when its pipe closes too); `join` waits for it."""
        try:
            with self.lock:
                if self.server is not None:  # never given its server: closing the pipe ends it
                    raise OSError("the child has no server")
                _send(self.conn, ("stop", ()))
        except OSError:
            pass
        self.conn.close()

    def join(self) -> None:
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


# ---- generation ----
class _EngineServer:
    """In the child: the backend's generation engine, plus what its proxy needs to know after each call."""

    def __init__(self, engine):
        self.engine = engine

    def modules(self) -> list[str]:
        """What the fork server imports ahead: the engine's module."""
        return [type(self.engine).__module__]

    def call(self, adds: list, method: str, args: tuple):
        for key, ids, seed in adds:
            self.engine.add(key, ids, seed)
        if method == "step" and not self.engine.busy:
            result = []
        else:
            result = getattr(self.engine, method)(*args)
        calls = self.engine.pop_calls() if hasattr(self.engine, "pop_calls") else []
        return result, calls, self.engine.busy, len(getattr(self.engine, "held", ()))


class ProcessEngine:
    """A generation engine (and an episode engine, aspc/roles.py) in its own process. Requests
    added between two steps go with the next call."""

    def __init__(self, name: str, engine, threads: int, set_threads, search_path: list[str]):
        self.slots = engine.slots
        self.child = ChildProcess(name, _EngineServer(engine), threads, set_threads, search_path,
                                  f"the process of {name}")
        self.buffer: list = []
        self._busy, self.held = False, 0
        self._calls: list = []

    @property
    def busy(self) -> bool:
        return bool(self.buffer) or self._busy

    def add(self, key, ids, seed) -> None:
        self.buffer.append((key, ids, seed))

    def _call(self, method: str, *args):
        adds, self.buffer = self.buffer, []
        result, calls, self._busy, self.held = self.child.call("call", adds, method, args)
        self._calls += calls
        return result

    def step(self) -> list:
        return self._call("step")

    def load_weights(self, state) -> None:
        self._call("load_weights", state)

    def pop_calls(self) -> list:
        calls, self._calls = self._calls, []
        return calls

    def resume(self, key, result) -> list:
        return self._call("resume", key, result)

    def detach(self, key):
        return self._call("detach", key)

    def adopt(self, state, result) -> list:
        return self._call("adopt", state, result)



# ---- the learner ----
class _LearnerServer:
    def __init__(self, learner):
        self.learner = learner

    def modules(self) -> list[str]:
        """What the fork server imports ahead: the learner's module."""
        return [type(self.learner).__module__]

    def run(self, method: str, rollouts: list) -> list[dict]:
        """Per rollout, the fields the pass set (others may change in the main process meanwhile:
        a reward computed there while a reference pass runs here must not be overwritten)."""
        before = [dict(r.__dict__) for r in rollouts]
        getattr(self.learner, method)(rollouts)
        return [{k: v for k, v in r.__dict__.items() if k not in old or v is not old[k]}
                for r, old in zip(rollouts, before)]

    def optimizer_step(self) -> dict:
        return self.learner.optimizer_step()

    def snapshot(self) -> dict:
        return self.learner.snapshot()

    def parts(self) -> tuple[dict, dict]:
        l = self.learner
        return ({"actor": l.actor, "reference": l.ref, "critic": l.critic},
                {"actor": l.optimizer, "critic": l.critic_optimizer})

    def trained_parts(self) -> tuple[list[str], list[str]]:
        """The models an optimizer changes (not the frozen reference) and the optimizers, by name."""
        models, optimizers = self.parts()
        stepped = [name for name, optimizer in optimizers.items() if optimizer is not None]
        params = {id(p) for name in stepped for group in optimizers[name].param_groups for p in group["params"]}
        return [name for name, model in models.items()
                if model is not None and any(id(p) in params for p in model.parameters())], stepped

    def part(self, kind: str, name: str) -> dict:
        """One model's or optimizer's state dict."""
        models, optimizers = self.parts()
        return (models if kind == "model" else optimizers)[name].state_dict()

    def save(self, writer, error_type: type[Exception], directory, version: int) -> str | None:
        """`writer(directory, version, models, optimizers)` run here on the learner's own state; a
        failure of the kind `error_type` (the factory's CheckpointError) comes back as its message."""
        try:
            writer(directory, version, *self.parts())
        except error_type as error:
            return str(error)
        return None


class ProcessLearner:
    """The trainer in its own process. A pass (reward, reference, values, train) sends the
    unit's rollouts and copies what it computed back into the main process's objects."""

    PASSES = ROLE_CALLS

    def __init__(self, learner, threads: int, set_threads, search_path: list[str]):
        self.child = ChildProcess("learner", _LearnerServer(learner), threads, set_threads, search_path,
                                  "the learner process")

    def __getattr__(self, method):
        if method in self.PASSES:
            return lambda rollouts: self._pass(method, rollouts)
        raise AttributeError(method)

    def _pass(self, method: str, rollouts: list) -> None:
        for mine, computed in zip(rollouts, self.child.call("run", method, rollouts)):
            mine.__dict__.update(computed)

    def optimizer_step(self) -> dict:
        return self.child.call("optimizer_step")

    def snapshot(self) -> dict:
        return self.child.call("snapshot")

    def parts(self) -> tuple[dict, dict]:
        return self.child.call("parts")

    def adopt_into(self, models: dict, optimizers: dict) -> None:
        """The learner's trained state into this process's `models` and `optimizers` (the run is
        over: held-out evaluation, a last checkpoint), one part a call, so that this process holds at
        most one part in transit (pulling every part at once took SmolLM2's driver from 3 to 7.3 GB);
        a model no optimizer changes (the frozen reference) is already equal here and stays."""
        trained, stepped = self.child.call("trained_parts")
        for name in trained:
            if models.get(name) is not None:
                models[name].load_state_dict(self.child.call("part", "model", name))
        for name in stepped:
            if optimizers.get(name) is not None:
                optimizers[name].load_state_dict(self.child.call("part", "optimizer", name))

    def save(self, writer, error_type: type[Exception], directory, version: int) -> str | None:
        """The checkpoint written by the learner's process (a failed write: its message)."""
        return self.child.call("save", writer, error_type, directory, version)
