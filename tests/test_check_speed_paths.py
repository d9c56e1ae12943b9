"""The paths issue 37 made fast keep their behaviour: user modules looked up once per folder are still
found when written later, same-named modules of two folders stay apart, and the idle-device warning
groups stages by pool in one pass with the same messages (behaviour only; bench/ measures speed)."""
import os
import pickle
import sys

import pytest

from aspc.frontend.compiler import compile_source
from aspc.frontend.user_code import UserCodeError, load_function, load_module


@pytest.fixture
def fresh_name(tmp_path, request):
    """A module name no other test uses; modules named from it are dropped from sys.modules afterwards."""
    name = f"speed_{request.node.name.replace('[', '_').replace(']', '')}"
    yield name
    for loaded in [n for n in sys.modules if n.startswith(name)]:
        del sys.modules[loaded]


def _write_keeping_folder_mtime(folder, name, text):
    """Write a file, then give the folder its old mtime back: Python's directory cache cannot see
    the change, as when the file lands in the same clock tick as the folder was listed."""
    before = os.stat(folder)
    (folder / name).write_text(text)
    os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_module_written_after_a_first_lookup_in_the_folder_is_found(tmp_path, fresh_name):
    (tmp_path / f"{fresh_name}_a.py").write_text("def f():\n    return 'a'\n")
    assert load_function(f"{fresh_name}_a:f", tmp_path)() == "a"
    _write_keeping_folder_mtime(tmp_path, f"{fresh_name}_b.py", "def f():\n    return 'b'\n")
    assert load_function(f"{fresh_name}_b:f", tmp_path)() == "b"


def test_a_module_missing_at_first_is_found_once_written(tmp_path, fresh_name):
    with pytest.raises(UserCodeError, match=f"cannot find Python module '{fresh_name}'"):
        load_function(f"{fresh_name}:f", tmp_path)
    _write_keeping_folder_mtime(tmp_path, f"{fresh_name}.py", "def f():\n    return 1\n")
    assert load_function(f"{fresh_name}:f", tmp_path)() == 1


def test_a_submodule_written_after_its_package_was_imported_is_found(tmp_path, fresh_name):
    package = tmp_path / fresh_name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("def f():\n    return 1\n")
    assert load_function(f"{fresh_name}.first:f", tmp_path)() == 1
    _write_keeping_folder_mtime(package, "second.py", "def f():\n    return 2\n")
    assert load_function(f"{fresh_name}.second:f", tmp_path)() == 2


def test_two_folders_with_same_named_modules_each_get_their_own(tmp_path, fresh_name):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{fresh_name}.py").write_text(f"def which():\n    return '{folder}'\n")
    for folder in ("a", "b", "a", "a", "b"):  # back and forth, and the same folder twice running
        which = load_function(f"{fresh_name}:which", tmp_path / folder)
        assert which() == folder
        assert sys.modules[fresh_name].which is which  # pickled by reference, as a Ray worker loads it
        assert pickle.loads(pickle.dumps(which)) is which


def test_a_second_lookup_returns_the_same_module_and_leaves_the_search_path_alone(tmp_path, fresh_name):
    (tmp_path / f"{fresh_name}.py").write_text("def f():\n    return 1\n")
    path = list(sys.path)
    first = load_module(fresh_name, tmp_path)
    assert load_module(fresh_name, tmp_path) is first
    assert sys.path == path


def test_a_module_dropped_from_sys_modules_is_imported_again(tmp_path, fresh_name):
    (tmp_path / f"{fresh_name}.py").write_text("def f():\n    return 1\n")
    first = load_module(fresh_name, tmp_path)
    del sys.modules[fresh_name]
    second = load_module(fresh_name, tmp_path)
    assert second is not first and sys.modules[fresh_name] is second


POOLS = """pipeline p
pool empty = cpu x 2
{pools}
{chains}
"""
CHAIN = """model actor{i} = custom {{ layers = 1, hidden = 32, heads = 2 }}
data prompts{i} = synthetic("arith") {{ group = 2 }}
stage gen{i} = generate(actor{i}, prompts{i}) on p{pool} {{ instances = 1 }}
stage score{i} = reward(gen{i}, rule = "exact_match")
stage adv{i} = advantage(score{i})
stage update{i} = train(actor{i}, gen{i}, adv{i}) on p{pool}
"""


def test_idle_device_warnings_name_each_pools_own_stages_in_stage_order():
    # chains 0..5 alternate between pools p0..p2 (declared in reverse), two chains per pool
    pools = "\n".join(f"pool p{k} = cpu x 8" for k in (2, 1, 0))
    chains = "".join(CHAIN.format(i=i, pool=i % 3) for i in range(6))
    warnings = compile_source(POOLS.format(pools=pools, chains=chains)).warnings
    idle = sorted(w.message for w in warnings if "stay idle" in w.message)
    assert idle == ["no stage runs on pool 'empty': its 2 devices stay idle"] + [
        f"stages 'gen{k}', 'gen{k + 3}', 'update{k}', 'update{k + 3}' side by side use 1 + 1 + 1 + 1 = 4 "
        f"of the 8 devices of pool 'p{k}'; the other 4 stay idle" for k in range(3)]


def test_a_pool_shared_by_many_stages_names_the_first_few_and_counts_the_rest():
    """The 2 MB program's one warning named all 9,062 stages of its pool (117 kB of output)."""
    chains = "".join(CHAIN.format(i=i, pool=0) for i in range(12))
    warnings = compile_source(POOLS.format(pools="pool p0 = cpu x 64", chains=chains)).warnings
    [shared] = [w.message for w in warnings if "pool 'p0'" in w.message]
    assert shared.startswith("stages 'gen0', 'gen1', ")
    assert "and 16 more side by side use 24 of the 64 devices" in shared
    assert "'update11'" not in shared
