"""The ToolRunner: tool calls that misbehave in every way still come back as a ToolResult, and the runner survives."""
from __future__ import annotations

import json
import os
import signal
import subprocess
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
