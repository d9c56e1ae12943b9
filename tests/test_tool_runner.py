"""The ToolRunner: tool calls that misbehave in every way still come back as a ToolResult, and the runner survives."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from aspc.backends.cpu.tool_runner import TRUNCATED, ToolError, ToolRunner, ToolSpec

TOOLS = '''
import os, time

def calc(expression):
    return eval(expression, {})

def add(a, b):
    return a + b

def fail(arguments):
    raise ZeroDivisionError("division by zero")

def nap(arguments):
    start = time.time()
    time.sleep(float(arguments))
    return f"{start} {time.time()}"

def raw_bytes(arguments):
    return b"ok \\xff\\xfe end"

def huge(arguments):
    return "x" * 1_000_000

def surrogate(arguments):
    print("printed \\udcff")

def die(arguments):
    os._exit(1)
'''


def tool(name: str, base_dir, **fields) -> ToolSpec:
    return ToolSpec(name, python=f"tiny_tools:{name}", base_dir=str(base_dir), **fields)


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "tiny_tools.py").write_text(TOOLS)
    return folder


@pytest.fixture(scope="module")
def runner(tools_dir):
    names = ["calc", "add", "fail", "nap", "raw_bytes", "huge", "surrogate", "die"]
    specs = [tool(name, tools_dir, timeout_s=5) for name in names]
    specs += [ToolSpec("missing", python="no_such_module_here:f", base_dir=str(tools_dir)),
              ToolSpec("echo", command="cat"),
              ToolSpec("env", command="env", env="LANG=C,FOO=bar"),
              ToolSpec("python", command="python3 -", timeout_s=10)]
    with ToolRunner(specs, workers=4, max_chars=200) as built:
        yield built


def test_a_python_tool_returns_its_value(runner):
    assert (runner.run("calc", "6 * 7").status, runner.run("calc", "6 * 7").observation) == ("ok", "42")


def test_a_python_tool_may_import_lazily(runner):
    assert runner.run("calc", "str(__import__('fractions').Fraction(2, 6))").observation == "1/3"


def test_a_json_object_becomes_keyword_arguments(runner):
    assert runner.run("add", json.dumps({"a": 2, "b": 3})).observation == "5"


def test_a_raising_tool_is_an_error_with_type_and_message(runner):
    result = runner.run("fail", "")
    assert result.status == "error"
    assert result.observation == "error: ZeroDivisionError: division by zero"


def test_a_module_that_cannot_be_imported_is_an_error(runner):
    result = runner.run("missing", "")
    assert result.status == "error" and "no_such_module_here" in result.observation


def test_a_hung_tool_times_out_and_the_next_call_works(runner):
    result = runner.run("nap", "30", timeout_s=0.5)
    assert result.status == "timeout" and result.observation == "error: timed out after 0.5 s"
    assert result.seconds < 5
    assert runner.run("calc", "1 + 1").observation == "2"


def test_a_dying_worker_is_crashed_and_the_next_call_works(runner):
    assert runner.run("die", "").status == "crashed"
    assert runner.run("calc", "2 + 2").observation == "4"


def test_garbage_output_is_still_a_truncated_str(runner):
    assert runner.run("raw_bytes", "").observation == "ok \ufffd\ufffd end"
    huge = runner.run("huge", "").observation
    assert len(huge) <= 200 and huge.endswith(TRUNCATED)
    printed = runner.run("surrogate", "").observation
    assert printed.startswith("printed") and printed.encode("utf-8")


def test_garbage_from_a_command_is_still_a_truncated_str(runner):
    assert runner.run("python", "import sys; sys.stdout.buffer.write(b'ok \\xff end')").observation == "ok \ufffd end"
    huge = runner.run("python", "print('y' * 1_000_000)")
    assert huge.status == "ok" and len(huge.observation) <= 200 and huge.observation.endswith(TRUNCATED)


def test_unknown_tool_raises_tool_error(runner):
    with pytest.raises(ToolError):
        runner.run("nope", "")


def test_a_tool_needs_exactly_one_of_python_and_command():
    with pytest.raises(ToolError):
        ToolRunner([ToolSpec("both", python="m:f", command="cat")])


def test_at_most_workers_calls_run_at_once(tools_dir):
    with ToolRunner([tool("nap", tools_dir)], workers=2) as runner:
        results = []
        threads = [threading.Thread(target=lambda: results.append(runner.run("nap", "0.5"))) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    spans = sorted(tuple(map(float, result.observation.split())) for result in results)
    assert all(result.status == "ok" for result in results)
    first_round_end = min(end for _, end in spans[:2])
    assert spans[2][0] >= first_round_end - 0.05  # the third call started only when a slot came free


def test_a_command_gets_the_arguments_on_stdin(runner):
    assert runner.run("echo", "hello tool").observation == "hello tool"


def test_a_command_sees_only_the_declared_environment(runner):
    lines = runner.run("env", "").observation.splitlines()
    names = {line.split("=", 1)[0] for line in lines}
    assert names == {"PATH", "HOME", "LANG", "FOO"}
    assert "FOO=bar" in lines and "PATH=/usr/bin:/bin" in lines


def test_a_command_runs_in_a_scratch_folder_that_is_removed(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.run("python", "import os; open('out.txt', 'w').write('x'); print(os.getcwd())")
    scratch = result.observation.strip()
    assert result.status == "ok" and scratch != str(tmp_path)
    assert not (tmp_path / "out.txt").exists() and not os.path.exists(scratch)


def test_allocating_4_gib_fails(runner):
    result = runner.run("python", "block = bytearray(4 << 30)")
    assert result.status == "error" and "MemoryError" in result.observation


def test_a_fork_bomb_is_stopped_and_the_machine_stays_healthy(runner):
    result = runner.run("python", "import os\nwhile True:\n    os.fork()", timeout_s=3)
    assert result.status in ("timeout", "error")
    assert runner.run("calc", "3 + 3").observation == "6"
    assert subprocess.run(["true"]).returncode == 0
    deadline = time.monotonic() + 10
    while _processes_of_nobody() > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    if runner.isolation["user"]:
        assert _processes_of_nobody() == 0


def test_isolation_reports_every_protection(runner):
    assert set(runner.isolation) >= {"network", "processes", "user", "resource_limits", "filesystem"}
    assert all(isinstance(active, bool) for active in runner.isolation.values())


def test_no_network_when_isolated(runner):
    if not runner.isolation["network"]:
        pytest.skip("this machine allows no network namespace: isolation['network'] is False")
    program = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n" \
              "    print('connected')\nexcept OSError as error:\n    print('failed', error)"
    assert runner.run("python", program).observation.startswith("failed")


def test_a_python_tool_runs_unprivileged_when_the_runner_is_root(runner, tmp_path):
    if not runner.isolation["user"]:
        pytest.skip("the runner is not root: tools keep its user id")
    result = runner.run("calc", f"open('{tmp_path}/owned', 'w')")
    assert result.status == "error" and "PermissionError" in result.observation


def _processes_of_nobody() -> int:
    count = 0
    for entry in os.scandir("/proc"):
        try:
            count += entry.name.isdigit() and entry.stat().st_uid == 65534
        except OSError:
            continue
    return count


def test_a_python_fork_bomb_is_stopped(runner):
    result = runner.run("calc", "[__import__('os').fork() for _ in range(10 ** 6)]", timeout_s=3)
    assert result.status in ("timeout", "error", "crashed")
    assert runner.run("calc", "5 + 5").observation == "10"


def test_a_dead_sandbox_server_is_restarted(tools_dir):
    with ToolRunner([tool("calc", tools_dir)]) as runner:
        os.kill(runner._server.pid, signal.SIGKILL)
        runner._server.wait()
        assert runner.run("calc", "7 * 6").observation == "42"


# ---- the fallback: a runner that is not root, on a machine that allows no namespaces ---------------

FALLBACK_RUNNER = r'''
import json, os, socket, sys, tempfile
from aspc.backends.cpu import sandbox
from aspc.backends.cpu.tool_runner import ToolRunner, ToolSpec

start_command = sandbox.start_command
def without_namespaces(control_fd):
    """The sandbox server is a fresh interpreter: make unshare fail there, as on a machine without
    user namespaces (a container, a hardened kernel)."""
    argv = start_command(control_fd)
    argv[2] = argv[2].replace("from aspc.backends.cpu.tool_runner import",
                              "from aspc.backends.cpu import sandbox; sandbox._unshare = lambda flags: False; "
                              "from aspc.backends.cpu.tool_runner import")
    return argv
sandbox.start_command = without_namespaces

folder = tempfile.mkdtemp()
with open(os.path.join(folder, "fallback_tools.py"), "w") as module:
    module.write("import os\ndef secret(arguments):\n    return os.environ.get('RUNNER_SECRET', 'unset')\n")
os.environ["RUNNER_SECRET"] = "s3cret"
listener = socket.create_server(("127.0.0.1", 0))
PROBE = """import json, os, resource
limits = {name: resource.getrlimit(getattr(resource, 'RLIMIT_' + name))
          for name in ('CPU', 'AS', 'NOFILE', 'FSIZE', 'NPROC')}
def threads(pid):  # of a process of this user; 0 for one that ended meanwhile
    try:
        mine = os.stat(f'/proc/{pid}').st_uid == os.getuid()
        return int(dict(l.split(':', 1) for l in open(f'/proc/{pid}/status') if ':' in l)['Threads']) if mine else 0
    except OSError:
        return 0
tasks = sum(threads(p) for p in os.listdir('/proc') if p.isdigit())
exec_env = [v.split(b'=')[0].decode() for v in open('/proc/self/environ', 'rb').read().split(bytes(1)) if v]
print(json.dumps({'uid': os.getuid(), 'cwd': os.getcwd(), 'home': os.environ['HOME'], 'env': sorted(exec_env),
                  'limits': limits, 'tasks': tasks}))"""
TRIES = {
    "memory": "block = bytearray(2 << 30)",
    "file_size": "open('big', 'wb').write(b'x' * (65 << 20))",
    "open_files": "files = [open('f%d' % i, 'w') for i in range(100)]",
    "network": "import socket; socket.create_connection(('127.0.0.1', %d), timeout=2); print('connected')"
               % listener.getsockname()[1],
}
specs = [ToolSpec("python", command="python3 -", timeout_s=9, env="LANG=C"),
         ToolSpec("secret", python="fallback_tools:secret", base_dir=folder)]
with ToolRunner(specs, workers=2) as runner:
    probe = runner.run("python", PROBE)
    out = {"runner_uid": os.getuid(), "isolation": runner.isolation, "probe": json.loads(probe.observation),
           "tries": {name: vars(runner.run("python", program)) for name, program in TRIES.items()},
           "hung": vars(runner.run("python", "import time; time.sleep(30)", timeout_s=1)),
           "secret": runner.run("secret", "").observation}
out["scratch_left"] = os.path.exists(out["probe"]["cwd"])
print(json.dumps(out))
'''


def _as_a_plain_user() -> list[str] | None:
    """The command prefix that runs a Python as `nobody` (this test's runner must not be root), keeping
    only the right to read files, so that a Python installed under /root still starts; None: no way."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search"]


def test_without_namespaces_a_non_root_runner_still_limits_and_scratches():
    """docs/runtime.md (isolation): without namespaces and root, a tool keeps the runner's user id, its
    network and the runner's process tree; the resource limits, the scratch folder and a command's clean
    environment still hold, and a hung call still times out."""
    prefix = _as_a_plain_user()
    if prefix is None:
        pytest.skip("the tests run as root and setpriv is missing: cannot start a non-root runner")
    done = subprocess.run([*prefix, sys.executable, "-c", FALLBACK_RUNNER], capture_output=True, text=True,
                          timeout=120, cwd="/", env={**os.environ, "TMPDIR": "/tmp"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["runner_uid"] != 0
    assert out["isolation"] == {"network": False, "processes": False, "user": False, "resource_limits": True,
                                "filesystem": False}
    probe = out["probe"]
    assert probe["uid"] == out["runner_uid"]  # no drop to nobody: the runner's own user
    limits = probe["limits"]
    assert limits["CPU"] == [10, 11] and limits["AS"] == [1 << 30] * 2 and limits["NOFILE"] == [64, 64]
    assert limits["FSIZE"] == [64 << 20] * 2
    # no user namespace: RLIMIT_NPROC counts all the user's tasks, so it is theirs now plus 256
    assert limits["NPROC"][0] == limits["NPROC"][1] and 256 < limits["NPROC"][0] <= 256 + probe["tasks"] + 16
    tries = out["tries"]
    assert tries["memory"]["status"] == "error" and "MemoryError" in tries["memory"]["observation"]
    assert tries["file_size"]["status"] == "error" and "File too large" in tries["file_size"]["observation"]
    assert tries["open_files"]["status"] == "error" and "Too many open files" in tries["open_files"]["observation"]
    assert tries["network"]["observation"].strip() == "connected"  # no network namespace: the host's network
    assert out["hung"]["status"] == "timeout"
    assert probe["cwd"] == probe["home"] and os.path.basename(probe["cwd"]).startswith("aspc-tool-python-")
    assert not out["scratch_left"]
    # a command tool gets the declared env, PATH and HOME (read from /proc/self/environ: python3 itself adds
    # LC_CTYPE to a LANG=C environment, PEP 538)
    assert probe["env"] == ["HOME", "LANG", "PATH"]
    assert out["secret"] == "s3cret"  # a python tool sees the runner's environment
