"""The ToolRunner: tool calls that misbehave in every way still come back as a ToolResult, and the runner survives."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from aspc.rl.tool_runner import TRUNCATED, ToolError, ToolRunner, ToolSpec

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


def test_a_python_tool_runs_unprivileged_when_the_runner_is_root(runner):
    if not runner.isolation["user"]:
        pytest.skip("the runner is not root: tools keep its user id")
    assert runner.run("calc", "__import__('os').getuid()").observation == "65534"
    result = runner.run("calc", "open('/etc/aspc-owned', 'w')")  # root's folder: not nobody's to write
    assert result.status == "error" and ("PermissionError" in result.observation
                                         or "Read-only file system" in result.observation)


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


# ---- hostile tools: each attack is stopped or refused, and the runner serves the next call ---------

HOSTILE_DIR = Path(__file__).resolve().parent / "hostile_tools"
CHECKOUT = Path(__file__).resolve().parent.parent
HOSTILE = ["fork_bomb", "allocate", "spin", "write_outside", "read_files", "environment", "connect",
           "kill_everything", "print_flood", "return_flood"]
HOSTILE_CHARS = 4000  # room for the JSON reports; the floods are cut to it


@pytest.fixture(scope="module")
def hostile(tools_dir):
    specs = [ToolSpec(name, python=f"misbehaving:{name}", base_dir=str(HOSTILE_DIR), timeout_s=3) for name in HOSTILE]
    specs += [tool("calc", tools_dir, timeout_s=3), ToolSpec("sh", command="python3 -", timeout_s=3)]
    with ToolRunner(specs, workers=2, max_chars=HOSTILE_CHARS) as built:
        yield built


def still_serves(runner: ToolRunner) -> bool:
    return runner.run("calc", "20 + 22").observation == "42" and runner._server.poll() is None


def hostile_name() -> str:
    return f"aspc-hostile-{uuid.uuid4().hex}"


def test_hostile_fork_bomb_is_stopped(hostile):
    result = hostile.run("fork_bomb", "")
    assert result.status in ("timeout", "error", "crashed") and result.observation.startswith("error")
    assert still_serves(hostile)


def test_hostile_10_gb_allocation_is_refused(hostile):
    result = hostile.run("allocate", "")
    assert (result.status, result.observation) == ("error", "error: MemoryError: ")
    command = hostile.run("sh", "block = bytearray(10 * 10**9)")
    assert command.status == "error" and "MemoryError" in command.observation
    assert still_serves(hostile)


def test_hostile_endless_loop_times_out(hostile):
    result = hostile.run("spin", "", timeout_s=1)
    assert (result.status, result.observation) == ("timeout", "error: timed out after 1 s")
    assert hostile.run("sh", "while True: pass", timeout_s=1).status == "timeout"
    assert still_serves(hostile)


def test_hostile_writes_outside_the_scratch_folder_leave_nothing(hostile):
    """With filesystem isolation the tool may write only its scratch folder and a fresh /tmp and /dev/shm
    of its own; everything else is read-only. Without it (docs/runtime.md) nobody still cannot write
    root's folders, but /tmp, /var/tmp and /dev/shm are the host's."""
    if not (hostile.isolation["filesystem"] or hostile.isolation["user"]):
        pytest.skip("no filesystem isolation and the tools keep the runner's user: they write where it may")
    shared = [f"/tmp/{hostile_name()}", f"/dev/shm/{hostile_name()}"]
    protected = [f"/var/tmp/{hostile_name()}", f"/etc/{hostile_name()}", str(HOSTILE_DIR / hostile_name()),
                 str(CHECKOUT / hostile_name())]
    if hostile.isolation["filesystem"]:  # a checkout under /tmp lies under the call's own /tmp: writes vanish there
        shared += [path for path in protected if path.startswith(("/tmp/", "/dev/shm/"))]
    else:  # a user of its own still writes where every user may, as /var/tmp
        shared.append(protected[0])
    protected = [path for path in protected if path not in shared]
    try:
        written = json.loads(hostile.run("write_outside", json.dumps(shared + protected)).observation)
        command = hostile.run("sh", f"open('{shared[0]}.cmd', 'w').write('hostile')")
        assert all(written[path] != "written" for path in protected)
        assert all(not os.path.exists(path) for path in protected)
        if hostile.isolation["filesystem"]:
            assert all(written[path] == "written" for path in shared)  # in the call's own tmpfs
            assert command.status == "ok"
            assert not any(os.path.exists(path) for path in shared + [f"{shared[0]}.cmd"])
    finally:
        for path in shared + [f"{shared[0]}.cmd"]:
            if os.path.exists(path):
                os.remove(path)
    assert still_serves(hostile)


def test_hostile_reads_of_the_checkout_home_and_secrets_fail(hostile):
    if not hostile.isolation["filesystem"]:
        pytest.skip("no filesystem isolation (docs/runtime.md): a tool reads what its user may")
    in_home = Path(os.path.expanduser("~")) / hostile_name()
    in_home.write_text("home secret")
    paths = [str(in_home), __file__, str(CHECKOUT / "pyproject.toml"), str(HOSTILE_DIR / "misbehaving.py"),
             "/etc/shadow", os.path.join(os.getcwd(), "pyproject.toml")]
    try:
        read = json.loads(hostile.run("read_files", json.dumps(paths)).observation)
        listed = hostile.run("calc", f"__import__('os').listdir('{CHECKOUT}')").observation
    finally:
        in_home.unlink()
    assert read == {path: "PermissionError" if path == "/etc/shadow" else "FileNotFoundError" for path in paths}
    assert "tests" not in listed and "pyproject.toml" not in listed
    assert hostile.run("calc", "str(__import__('fractions').Fraction(2, 4))").observation == "1/2"  # stdlib kept
    assert still_serves(hostile)


def test_hostile_tool_sees_none_of_the_runners_variables(tools_dir, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    spec = ToolSpec("environment", python="misbehaving:environment", base_dir=str(HOSTILE_DIR), timeout_s=3)
    with ToolRunner([spec, tool("calc", tools_dir, timeout_s=3)], max_chars=4000) as runner:
        seen = json.loads(runner.run("environment", "").observation)
        assert still_serves(runner)
    assert set(seen["os.environ"]) == {"PATH", "HOME"}
    assert "SECRET_TOKEN" not in seen["/proc/self/environ"] and "hunter2" not in seen["/proc/self/environ"]


def test_hostile_sockets_fail_even_to_a_loopback_server(hostile, tmp_path):
    if not hostile.isolation["network"]:
        pytest.skip("no network namespace: a tool reaches the host's network (the fallback test checks it)")
    unix_path = f"/tmp/{hostile_name()}.sock"
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.socket(socket.AF_UNIX) as unix_listener:
        unix_listener.bind(unix_path)
        unix_listener.listen()
        try:
            targets = [listener.getsockname()[1], unix_path]
            reached = json.loads(hostile.run("connect", json.dumps(targets)).observation)
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
        finally:
            os.remove(unix_path)
    assert reached["tcp"].startswith("failed")
    if hostile.isolation["filesystem"]:
        assert reached["unix"] == "failed: FileNotFoundError"  # the call has a /tmp of its own
    assert still_serves(hostile)


def test_hostile_tool_cannot_kill_its_parent_or_other_processes(hostile):
    if not (hostile.isolation["processes"] or hostile.isolation["user"]):
        pytest.skip("no PID namespace and the runner's own user: a tool may signal the runner's processes")
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        result = hostile.run("kill_everything", "")
        assert result.status in ("ok", "crashed")
        assert bystander.poll() is None
        if hostile.isolation["processes"]:
            # its /proc shows only itself, and its parent is outside its namespace (getppid() is 0):
            # kill(0) reaches its own process group, where it is PID 1, which SIGKILL does not stop
            assert result.status == "ok" and json.loads(result.observation) in ([], [0])
    finally:
        bystander.kill()
        bystander.wait()
    assert still_serves(hostile)


@pytest.mark.parametrize("megabytes", [100, 2000])
def test_hostile_flood_of_printed_output_is_truncated(hostile, megabytes):
    """2000 MB kept whole would pass the 1 GiB address space: only the first max_chars*4 characters stay."""
    result = hostile.run("print_flood", str(megabytes), timeout_s=5)
    assert result.status == "ok" and result.observation == "p" * (HOSTILE_CHARS - len(TRUNCATED)) + TRUNCATED
    assert still_serves(hostile)


def test_hostile_huge_return_value_and_command_output_are_truncated(hostile):
    returned = hostile.run("return_flood", "", timeout_s=5)
    assert returned.status == "ok" and returned.observation == "r" * (HOSTILE_CHARS - len(TRUNCATED)) + TRUNCATED
    printed = hostile.run("sh", "import sys\nfor _ in range(100):\n    sys.stdout.write('z' * (1 << 20))", timeout_s=5)
    assert printed.status == "ok" and printed.observation == "z" * (HOSTILE_CHARS - len(TRUNCATED)) + TRUNCATED
    assert still_serves(hostile)


def test_the_tiny_agentic_pipelines_calc_tool_still_works():
    pipelines = CHECKOUT / "pipelines"
    with ToolRunner([ToolSpec("calc", python="tiny_tools:calc", base_dir=str(pipelines), timeout_s=5)]) as runner:
        assert (runner.run("calc", "417*63").status, runner.run("calc", "417*63").observation) == ("ok", "26271")
        bad = runner.run("calc", "4x")
    assert bad.status == "error" and bad.observation.startswith("error: ValueError")


# ---- the fallback: a runner that is not root, on a machine that allows no namespaces ---------------

FALLBACK_RUNNER = r'''
import json, os, socket, sys, tempfile
from aspc.rl import sandbox
from aspc.rl.tool_runner import ToolRunner, ToolSpec

start_command = sandbox.start_command
def without_namespaces(control_fd):
    """The sandbox server is a fresh interpreter: make unshare fail there, as on a machine without
    user namespaces (a container, a hardened kernel)."""
    argv = start_command(control_fd)
    argv[2] = argv[2].replace("from aspc.rl.tool_runner import",
                              "from aspc.rl import sandbox; sandbox._unshare = lambda flags: False; "
                              "from aspc.rl.tool_runner import")
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
    assert out["secret"] == "unset"  # a python tool's environment is scrubbed too, namespaces or not
