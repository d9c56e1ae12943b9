"""Run the tool calls of agentic RL episodes: each call in a fresh confined process, with a timeout.

A pipeline declares `tool("calc", python = "tiny_tools:calc", timeout = 5)` or
`tool("shell", command = "python3 sandbox.py", timeout = 10, env = "LANG=C")`; the arguments the
model writes are untrusted. `ToolRunner.run` never raises for anything a tool does: it returns a
ToolResult whose observation is what the model sees.
  - python tools are called as function(arguments) with the raw string, or function(**object) when
    the arguments are a JSON object (Hermes-style calls). The observation is str() of the return
    value (bytes decoded as UTF-8), or what the tool printed when it returns None.
  - command tools are split with shlex (no shell) and get the arguments on stdin; the observation is
    their stdout, and on a non-zero exit also their stderr. A relative path in the command line that
    names a file in base_dir is made absolute, since the command runs in its scratch folder.
How each call is confined, and what is not isolated, is in the docstring of `sandbox`.
At most `workers` calls run at once; a call's timeout and `seconds` start when it gets its slot.
"""
from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from aspc.rl import sandbox
from aspc.frontend.user_code import UserCodeError, load_function

TRUNCATED = "…[truncated]"


class ToolError(ValueError):
    """A tool name the runner does not know, or a tool declared wrongly: the caller's mistake."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    python: str = ""        # "module:function"; exactly one of python / command
    command: str = ""       # a shell-free command line, split with shlex; the arguments arrive on stdin
    timeout_s: float = 30.0
    env: str = ""           # "NAME=value,NAME2=value2": the only variables a command tool sees (plus PATH, HOME)
    base_dir: str | None = None  # folder where python tool modules are looked up first


@dataclass(frozen=True)
class ToolResult:
    status: str        # "ok" | "error" (the tool raised / exited non-zero) | "timeout" | "crashed" (its process died)
    observation: str   # what the model sees, at most max_chars characters
    seconds: float     # wall time of the call


class ToolRunner:
    """Runs declared tools; thread-safe. `isolation` says which protections of `sandbox` are active."""

    def __init__(self, tools: list[ToolSpec], workers: int = 8, max_chars: int = 2048):
        self.tools = {tool.name: _checked(tool) for tool in tools}
        if len(self.tools) != len(tools):
            raise ToolError("two tools have the same name")
        self.max_chars = max_chars
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._closed = False
        with self._lock:
            self.isolation: dict[str, bool] = self._start_server()

    def run(self, tool: str, arguments: str, timeout_s: float | None = None) -> ToolResult:
        """Call `tool` with the raw argument string the model wrote; blocks until it ends or times out."""
        spec = self.tools.get(tool)
        if spec is None:
            raise ToolError(f"unknown tool '{tool}'; declared: {', '.join(sorted(self.tools)) or 'none'}")
        timeout = spec.timeout_s if timeout_s is None else timeout_s
        with self._slots:
            start = time.monotonic()
            status, observation = self._call_in_scratch(spec, arguments, timeout)
            return ToolResult(status, _truncate(observation, self.max_chars), time.monotonic() - start)

    def close(self) -> None:
        """Stop the sandbox server; calls in flight are killed with it."""
        with self._lock:
            self._closed = True
            self._stop_server()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call_in_scratch(self, spec: ToolSpec, arguments: str, timeout: float) -> tuple[str, str]:
        scratch = tempfile.mkdtemp(prefix=f"aspc-tool-{spec.name}-")
        try:
            return self._call(_request(spec, arguments, timeout, scratch, self.max_chars), timeout)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _call(self, request: dict, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        channel = self._open_channel()
        if channel is None:
            return "crashed", "error: the tool sandbox is not running"
        with channel:
            reply, pgid = _exchange(channel, json.dumps(request).encode(), deadline)
        if reply is None:
            _kill_group(pgid)
            return "timeout", f"error: timed out after {timeout:g} s"
        try:
            answer = json.loads(reply)
            return answer["status"], answer["observation"]
        except (ValueError, KeyError, TypeError):
            return "crashed", "error: the tool's process died before it replied"

    def _open_channel(self) -> socket.socket | None:
        """A socket to a freshly forked sandbox child; the server is restarted once if it died."""
        ours, theirs = socket.socketpair()
        with self._lock, theirs:
            for _attempt in range(2):
                if self._closed:
                    raise ToolError("the ToolRunner is closed")
                try:
                    socket.send_fds(self._control, [b"c"], [theirs.fileno()])
                    return ours
                except OSError:
                    self._stop_server()
                    self._start_server()
        ours.close()
        return None

    def _start_server(self) -> dict[str, bool]:
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._server = subprocess.Popen(sandbox.start_command(theirs.fileno()), pass_fds=[theirs.fileno()],
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env=_server_environment())
        self._control.settimeout(30)
        isolation = json.loads(self._control.recv(4096))
        self._control.settimeout(None)
        return isolation

    def _stop_server(self) -> None:
        self._control.close()
        if self._server is not None:
            try:
                self._server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()


def _checked(tool: ToolSpec) -> ToolSpec:
    if bool(tool.python) == bool(tool.command):
        raise ToolError(f"tool '{tool.name}' needs exactly one of python = \"module:function\" or command = \"...\"")
    if tool.python and ":" not in tool.python:
        raise ToolError(f"tool '{tool.name}': python = \"{tool.python}\" is not \"module:function\"")
    return tool


def _request(spec: ToolSpec, arguments: str, timeout: float, scratch: str, max_chars: int) -> dict:
    """cwd and home: the folders the sandbox hides from the tool, besides the tool's own (sandbox docstring)."""
    base_dir = os.path.abspath(spec.base_dir) if spec.base_dir else None  # the child imports after a chdir
    return {"python": spec.python, "command": spec.command, "env": spec.env, "base_dir": base_dir,
            "arguments": arguments, "scratch": os.path.realpath(scratch), "cpu_seconds": int(timeout) + 1,
            "max_chars": max_chars, "cwd": os.getcwd(), "home": os.path.expanduser("~")}


def _server_environment() -> dict[str, str]:
    """The sandbox server and every tool forked from it start without the runner's variables (secrets,
    tokens): a tool could read them back from /proc/self/environ even after os.environ is cleared."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.path.expanduser("~"), "LANG": "C.UTF-8"}


def _exchange(channel: socket.socket, request: bytes, deadline: float) -> tuple[bytes | None, int | None]:
    """Send the request, read the reply: (reply, child pid); reply None at the deadline, b"" if it died."""
    received, pgid = b"", None
    try:
        channel.settimeout(max(deadline - time.monotonic(), 0.001))
        first_line = _read_line(channel)
        pgid = int(first_line) if first_line else None
        channel.sendall(request)
        channel.shutdown(socket.SHUT_WR)
        while chunk := _recv_until(channel, deadline):
            received += chunk
    except TimeoutError:
        return None, pgid
    except (OSError, ValueError):
        return b"", pgid
    return received, pgid


def _read_line(channel: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = channel.recv(1)
        if not chunk:
            return b""
        line += chunk
    return line


def _recv_until(channel: socket.socket, deadline: float) -> bytes:
    channel.settimeout(max(deadline - time.monotonic(), 0.001))
    return channel.recv(1 << 16)


def _kill_group(pgid: int | None) -> None:
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass  # already gone


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max(max_chars - len(TRUNCATED), 0)] + TRUNCATED


# ---- inside the sandbox child ----------------------------------------------------------------------

def serve_tools(control_fd: int) -> None:
    """Entry point of the sandbox server process (see sandbox.start_command)."""
    sandbox.serve(control_fd, run_call)


def run_call(request: dict, drop_privileges) -> dict:
    """Run one call in the confined child: {"status": ..., "observation": ...}."""
    try:
        if request["python"]:
            status, text = _call_python(request, drop_privileges)
        else:
            status, text = _run_command(request, drop_privileges)
    except sandbox.SandboxError as error:  # not the model's fault: the call did not run
        status, text = "crashed", f"error: sandbox: {error}"
    text = _truncate(text, request["max_chars"])
    return {"status": status, "observation": text.encode("utf-8", "replace").decode("utf-8")}


def _call_python(request: dict, drop_privileges) -> tuple[str, str]:
    _silence_output_fds()
    base_dir = Path(request["base_dir"]) if request["base_dir"] else None
    try:
        function = load_function(request["python"], base_dir)
    except UserCodeError as error:
        return "error", f"error: {error.message}"
    drop_privileges()  # the module was imported with the runner's rights; the call runs without them
    os.environ.clear()  # as a command tool's: the declared variables, PATH and HOME
    os.environ.update(_environment(request["env"], request["scratch"]))
    printed = _CappedOutput(request["max_chars"] * 4)
    sys.stdout = sys.stderr = printed  # this child process ends after the call: nothing to restore
    try:
        value = _call_with(function, request["arguments"])
        return "ok", printed.getvalue() if value is None else _as_text(value)
    except BaseException as error:  # anything the tool raises, even in its __str__, is the model's observation
        return "error", f"error: {type(error).__name__}: {error}"


class _CappedOutput(io.StringIO):
    """What a python tool prints: the first `limit` characters are kept, the rest dropped as it comes, so
    a tool printing 100 MB holds no more than that in memory. `limit` exceeds max_chars, so a cut output
    is still marked by _truncate."""

    def __init__(self, limit: int):
        super().__init__()
        self._room = limit

    def write(self, text: str) -> int:
        kept = text[:max(self._room, 0)]
        self._room -= len(kept)
        super().write(kept)
        return len(text)


def _call_with(function, arguments: str):
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    return function(**parsed) if isinstance(parsed, dict) else function(arguments)


def _silence_output_fds() -> None:
    """The tool's raw writes to fd 1 and 2 would land in the trainer's log: drop them."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _as_text(value) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _run_command(request: dict, drop_privileges) -> tuple[str, str]:
    try:
        argv = _command_line(request["command"], request["base_dir"])  # base_dir looked at before the drop
        drop_privileges()
        with tempfile.TemporaryFile(dir=".") as stdin, tempfile.TemporaryFile(dir=".") as stderr:
            stdin.write(request["arguments"].encode("utf-8", "replace"))
            stdin.seek(0)
            process = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr,
                                       env=_environment(request["env"], request["scratch"]))
            stdout = _read_capped(process.stdout, request["max_chars"] * 4 + 4)  # UTF-8: up to 4 bytes a char
            code = process.wait()
            stderr.seek(0)
            errors = stderr.read(request["max_chars"] * 4)
    except (OSError, ValueError) as error:  # no such program, unbalanced quotes, too many processes
        return "error", f"error: {type(error).__name__}: {error}"
    output = stdout.decode("utf-8", "replace")
    if code == 0:
        return "ok", output
    return "error", f"error: exit code {code}\n{output}{errors.decode('utf-8', 'replace')}"


def _command_line(command: str, base_dir: str | None) -> list[str]:
    argv = shlex.split(command)
    if base_dir is None:
        return argv
    return [str(Path(base_dir) / part) if not os.path.isabs(part) and (Path(base_dir) / part).is_file() else part
            for part in argv]


def _environment(declared: str, scratch: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in declared.split(",") if "=" in item]
    return {"PATH": "/usr/bin:/bin", **{name.strip(): value for name, value in pairs}, "HOME": scratch}


def _read_capped(stream, limit: int) -> bytes:
    """The first `limit` bytes; the rest is read and dropped so the command never blocks on a full pipe."""
    kept = b""
    while chunk := stream.read1(1 << 16):
        kept += chunk[:max(limit - len(kept), 0)]
    return kept
