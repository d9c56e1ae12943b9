"""Mutation check of the Ascend executors' external API names (issue 33, item 4).

Every name that backends/ascend hands to vLLM, vllm-ascend, megatron-core or torchair -- each
imported name, each attribute used on an imported module, class or object built from one, each
keyword of a call to them, each key of a dict literal passed to them, and each method or attribute
of megatron's DDP, optimizers and buffers that the executors use -- is renamed, one site at a time,
and the tests must fail for every one. A mutation no test notices is an API name nothing checks.

    python tests/mutate_api_names.py           # every site; exit 1 if one survives
    python tests/mutate_api_names.py --list    # the sites only

A mutant is first given to the AST conformance check itself (tests/test_ascend_conformance.py's
`unknown_names` over the mutated file, against the same wheels): when it reports the name,
test_executors_call_only_names_that_exist fails on that mutant. The others run the tests in TESTS
order with -x, in a subprocess, the file mutated on disk and restored after each run (also when
interrupted)."""
from __future__ import annotations

import argparse
import ast
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_ascend_conformance import _dotted as _owner  # noqa: E402 (`x` or `self.x`, as the AST check reads owners)
EXECUTORS = ROOT / "backends" / "ascend"
PACKAGES = ("vllm", "vllm_ascend", "megatron", "torchair", "torch_npu")
TESTS = ["tests/test_megatron_real.py", "tests/test_trainer_differential_megatron.py",
         "tests/test_megatron_parallel.py", "tests/test_ascend_conformance.py", "tests/test_torchair_conformance.py",
         "tests/test_ascend_load.py", "tests/test_ascend.py", "tests/test_ascend_executors.py",
         "tests/test_ascend_critic.py", "tests/test_ascend_colocated.py", "tests/test_ascend_policy_dp.py",
         "tests/test_ascend_engine_group.py", "tests/test_ascend_scorers.py", "tests/test_ascend_reward_ranks.py",
         "tests/test_reshard.py", "tests/test_megatron_routing_replay.py"]
SUFFIX = "_mutant"


@dataclass(frozen=True)
class Site:
    path: Path
    line: int  # 1-based
    col: int  # where `name` starts on the line
    name: str
    kind: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}:{self.col + 1} {self.kind} {self.name}"


# what megatron's DDP buffers and optimizers hold, as the executors read them (attributes, not methods)
MEGATRON_STATE = {"buffers", "expert_parallel_buffers", "param_data", "grad_data", "params", "main_grad",
                  "chained_optimizers", "optimizer", "zero_grad"}


def megatron_members() -> set[str]:
    """Public methods and attributes of megatron-core's DDP and optimizers that torch's Module and
    plain objects do not have, and MEGATRON_STATE: what the executors use on the objects megatron
    returns (the AST check cannot follow them; the tests on the real megatron do)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer, MegatronOptimizer

    found = set()
    for cls in (DistributedDataParallel, MegatronOptimizer, ChainedOptimizer, DistributedOptimizer):
        found |= {name for name in dir(cls) if not name.startswith("_")}
    return found - set(dir(torch.nn.Module)) - set(dir(object)) | MEGATRON_STATE


def imported_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> module, for names imported from the platform packages (and `import torchair`)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            names |= {alias.asname or alias.name: node.module for alias in node.names}
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name: alias.name for alias in node.names
                      if alias.name.split(".")[0] in PACKAGES}
    return names


def built_objects(tree: ast.Module, imported: dict[str, str]) -> set[str]:
    """Names assigned an object of an imported class or the result of an imported function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called in imported:
                found |= {_owner(t) for t in node.targets if _owner(t)}
    return found


def sites_in(path: Path, members: set[str]) -> list[Site]:
    tree = ast.parse(path.read_text())
    imported = imported_names(tree)
    if not imported and not any(m in path.read_text() for m in ("zero_grad_buffer", "param_data")):
        return []
    objects = built_objects(tree, imported)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            found += [Site(path, a.lineno, a.col_offset, a.name.split(".")[-1], "import") for a in node.names]
        if isinstance(node, ast.Attribute) and node.end_lineno == node.lineno:
            owner = _owner(node.value)
            foreign = owner in imported or owner in objects
            ours = isinstance(node.value, ast.Name) and node.value.id == "self"  # self.optimizer: our attribute
            if foreign or (node.attr in members and not ours):
                found.append(Site(path, node.end_lineno, node.end_col_offset - len(node.attr), node.attr,
                                  "attribute" if foreign else "member"))
        if isinstance(node, ast.Call) and _calls_foreign(node, imported, objects):
            found += [Site(path, k.lineno, k.col_offset, k.arg, "keyword") for k in node.keywords if k.arg]
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Dict):
                    found += [Site(path, k.lineno, k.col_offset + 1, k.value, "dict key") for k in arg.keys
                              if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return sorted(set(found), key=lambda s: (s.line, s.col))


def _calls_foreign(call: ast.Call, imported: dict[str, str], objects: set[str]) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in imported
    return isinstance(func, ast.Attribute) and (_owner(func.value) in imported or _owner(func.value) in objects)


def all_sites() -> list[Site]:
    members = megatron_members()
    return [site for path in sorted(EXECUTORS.glob("*.py")) for site in sites_in(path, members)]


def mutated(text: str, site: Site) -> str:
    lines = text.splitlines(keepends=True)
    line = lines[site.line - 1]
    assert line[site.col:site.col + len(site.name)] == site.name, (str(site), line)
    lines[site.line - 1] = line[:site.col] + site.name + SUFFIX + line[site.col + len(site.name):]
    return "".join(lines)


def conformance_check():
    """`check(path, text)`: the names the AST conformance test finds unknown in one executor file's
    text (a file that runs on a newer megatron-core only, against the installed one, as the test does)."""
    import test_ascend_conformance as conformance
    from wheel_sources import Sources

    packages = ("vllm", "vllm_ascend", "megatron", "torchair")
    sources = conformance.npu_sources(*map(conformance.stack_sources, packages))
    newer = sources | {"megatron": Sources.installed("megatron")}
    return lambda path, text: conformance.unknown_names(
        ast.parse(text), newer if path.name in conformance.ON_NEWER_MEGATRON else sources)


def ordered(site: Site) -> list[str]:
    """TESTS, those that name the mutated module first (with -x, a mutant fails fast)."""
    first = [t for t in TESTS if site.path.stem in (ROOT / t).read_text()]
    return first + [t for t in TESTS if t not in first]


def caught(site: Site, timeout: int) -> tuple[bool, float]:
    """Whether the tests fail with `site` renamed: first the tests whose names mention its module
    (`-k`), then, if those pass, every test of TESTS (a run past `timeout` counts as caught: a hang)."""
    original = site.path.read_text()
    site.path.write_text(mutated(original, site))
    start = time.monotonic()
    try:
        for selection in (["-k", site.path.stem], []):
            run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *selection,
                                  *ordered(site)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            if run.returncode not in (0, 5):  # 5: -k selected no test
                return True, time.monotonic() - start
        return False, time.monotonic() - start
    except subprocess.TimeoutExpired:
        return True, time.monotonic() - start
    finally:
        site.path.write_text(original)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the mutation sites and stop")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one mutant's test run may take")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a mutated file is restored (caught's finally)
    sites = all_sites()
    if args.list:
        print("\n".join(map(str, sites)))
        print(f"{len(sites)} sites")
        return 0
    check, survivors = conformance_check(), []
    for number, site in enumerate(sites, 1):
        if check(site.path, mutated(site.path.read_text(), site)):
            print(f"[{number}/{len(sites)}] caught   {site} (the AST conformance check)", flush=True)
            continue
        failed, seconds = caught(site, args.timeout)
        print(f"[{number}/{len(sites)}] {'caught ' if failed else 'SURVIVED'} {site} ({seconds:.0f} s)", flush=True)
        if not failed:
            survivors.append(site)
    print(f"{len(sites) - len(survivors)} of {len(sites)} mutations fail a test")
    for site in survivors:
        print(f"survived: {site}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
