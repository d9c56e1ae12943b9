"""Tools that attack their sandbox, for tests/test_tool_runner.py: each is what model-written code could
do. They take the raw argument string (a JSON value where they need one) and report what they managed."""
import json
import os
import signal
import socket


def fork_bomb(arguments):
    while True:
        os.fork()


def allocate(arguments):
    block = bytearray(10 * 10**9)  # 10 GB
    return len(block)


def spin(arguments):
    while True:
        pass


def write_outside(arguments):
    """{path: "written" | the error} for each path of the JSON list."""
    return json.dumps({path: _write(path) for path in json.loads(arguments)})


def _write(path):
    try:
        with open(path, "w") as file:
            file.write("hostile")
    except OSError as error:
        return type(error).__name__
    return "written"


def read_files(arguments):
    """{path: what it holds | the error} for each path of the JSON list."""
    return json.dumps({path: _read(path) for path in json.loads(arguments)})


def _read(path):
    try:
        with open(path) as file:
            return file.read(200)
    except OSError as error:
        return type(error).__name__


def environment(arguments):
    """os.environ, and the environment the process started with (what is left in its memory)."""
    try:
        with open("/proc/self/environ", "rb") as environ:
            raw = environ.read().decode("utf-8", "replace")
    except OSError as error:  # a process that changed its user is not dumpable: /proc/self is root's
        raw = type(error).__name__
    return json.dumps({"os.environ": dict(os.environ), "/proc/self/environ": raw})


def connect(arguments):
    """arguments: [a TCP port on 127.0.0.1, a unix socket path]."""
    port, unix_path = json.loads(arguments)
    return json.dumps({"tcp": _connect(socket.AF_INET, ("127.0.0.1", port)),
                       "unix": _connect(socket.AF_UNIX, unix_path)})


def _connect(family, address):
    try:
        with socket.socket(family, socket.SOCK_STREAM) as connection:
            connection.settimeout(2)
            connection.connect(address)
    except OSError as error:
        return f"failed: {type(error).__name__}"
    return "connected"


def kill_everything(arguments):
    """SIGKILL to the parent, then to every pid in /proc but its own: the pids it managed to signal."""
    killed = []
    for pid in [os.getppid()] + [int(name) for name in os.listdir("/proc") if name.isdigit()]:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return json.dumps(killed)


def print_flood(arguments):
    """Prints `arguments` megabytes to stdout and returns None (the observation is what it printed)."""
    line = "p" * (1 << 20)
    for _ in range(int(arguments)):
        print(line, end="")


def return_flood(arguments):
    return "r" * (100 << 20)
