"""Front-end speed: parse + check + lower of the largest bundled pipeline and of a generated
5,000-line pipeline, and `aspc check` end to end (a fresh process, warnings rendered) on generated
programs of about 0.5 MB and 2 MB, to show that its time grows linearly with the file, and on 2 MB
programs with a pool and a Python reward per chain (issue 37: module look-ups and pools scale too).
Prints Markdown tables; figures go to bench/RESULTS.md.

    python bench/bench_frontend.py
"""
from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aspc.frontend.compiler import compile_source
from aspc.frontend.parser import _fast_lark, _lark

ROOT = Path(__file__).resolve().parent.parent

CHAIN = """\
model actor{i} = custom {{ layers = 2, hidden = 64, heads = 4, ffn = 256, vocab = 32 }}
model ref{i} = frozen(actor{i})
data prompts{i} = synthetic("arith") {{ prompts_per_step = 16, group = 4,
  max_prompt = 16, max_response = 24 }}
stage gen{i} = generate(actor{i}, prompts{i}) {{ instances = 1, temperature = 1.0 }}
stage score{i} = reward(gen{i}, rule = "exact_match")
stage ref_lp{i} = reference(ref{i}, gen{i})
stage adv{i} = advantage(score{i}) {{ estimator = grpo }}
stage update{i} = train(actor{i}, gen{i}, ref_lp{i}, adv{i}) {{
  loss = grpo, lr = 3e-4, kl = 0.01, micro_tokens = 1k }}
"""


# A stage nothing consumes: one warning per chain, as in the 2 MB program of issue 10.
UNUSED = 'stage probe{i} = reward(gen{i}, rule = "exact_match")\n'
CHECK_SIZES_MB = (0.5, 2.0)

# Issue 37's shape: a pool per chain and a reward in Python beside the .aspl, either one module
# with a function per chain or a module per chain.
POOLED_CHAIN = """\
pool p{i} = cpu x 2
model actor{i} = custom {{ layers = 2, hidden = 64, heads = 4, ffn = 256, vocab = 32 }}
model ref{i} = frozen(actor{i})
data prompts{i} = synthetic("arith") {{ prompts_per_step = 16, group = 4,
  max_prompt = 16, max_response = 24 }}
stage gen{i} = generate(actor{i}, prompts{i}) on p{i} {{ instances = 1, temperature = 1.0 }}
stage score{i} = reward(gen{i}, python = "{module}:score{i}")
stage ref_lp{i} = reference(ref{i}, gen{i}) on p{i}
stage adv{i} = advantage(score{i}) {{ estimator = grpo }}
stage update{i} = train(actor{i}, gen{i}, ref_lp{i}, adv{i}) on p{i} {{
  loss = grpo, lr = 3e-4, kl = 0.01, micro_tokens = 1k }}
"""
SCORE = "def score{i}(prompt, response, answer, metadata):\n    return 0.0\n"


def generated_pipeline(lines: int) -> str:
    head = "pipeline generated\npool cpu = cpu x 2\n"
    chains = max(1, (lines - 2) // CHAIN.count("\n"))
    return head + "".join(CHAIN.format(i=i) for i in range(chains))


def generated_with_warnings(megabytes: float) -> str:
    """A valid program of about this size whose every chain has an unused stage (a warning)."""
    chain = CHAIN + UNUSED
    chains = max(1, round(megabytes * 1e6 / len(chain.format(i=1000))))
    return "pipeline generated\npool cpu = cpu x 2\n" + "".join(chain.format(i=i) for i in range(chains))


def write_with_python_rewards(megabytes: float, folder: Path, module_per_chain: bool) -> Path:
    """A valid program of about this size, a pool and a Python reward per chain, and its modules."""
    chains = max(1, round(megabytes * 1e6 / len(POOLED_CHAIN.format(i=1000, module="chain_rewards"))))
    module = [f"chain_rewards{i}" if module_per_chain else "chain_rewards" for i in range(chains)]
    if module_per_chain:
        for i in range(chains):
            (folder / f"{module[i]}.py").write_text(SCORE.format(i=i))
    else:
        (folder / "chain_rewards.py").write_text("".join(SCORE.format(i=i) for i in range(chains)))
    path = folder / "python_rewards.aspl"
    path.write_text("pipeline generated\n" + "".join(POOLED_CHAIN.format(i=i, module=module[i]) for i in range(chains)))
    return path


def check_seconds(path: Path, repeat: int) -> tuple[float, int]:
    """Median wall time of `aspc check PATH` in a fresh process, and the bytes it printed."""
    samples, printed = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "aspc.cli.main", "check", str(path)], capture_output=True)
        samples.append(time.perf_counter() - start)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        printed = len(done.stdout) + len(done.stderr)
    return statistics.median(samples), printed


def check_table(repeat: int = 3) -> list[str]:
    rows = ["| program | size | lines | warnings | `aspc check` wall (median of 3) | per MB | printed |",
            "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        for megabytes in CHECK_SIZES_MB:
            path = Path(folder) / f"generated_{megabytes}mb.aspl"
            path.write_text(generated_with_warnings(megabytes))
            rows.append(check_row("generated, one unused stage per chain", path, "stage probe", repeat))
    for module_per_chain in (False, True):
        with tempfile.TemporaryDirectory() as folder:
            path = write_with_python_rewards(2.0, Path(folder), module_per_chain)
            modules = "a module per chain" if module_per_chain else "one module"
            # each pool's one stage uses 1 of its 2 devices: one idle-device warning per pool
            rows.append(check_row(f"a pool and a Python reward per chain ({modules})", path, "pool p", repeat))
    return rows


def check_row(program: str, path: Path, warned: str, repeat: int) -> str:
    """A row of the check table; `warned` is the text written once per expected warning."""
    seconds, printed = check_seconds(path, repeat)
    text = path.read_text()
    size = len(text.encode()) / 1e6
    return (f"| {program} | {size:.2f} MB | {text.count(chr(10))} | {text.count(warned)} | {seconds:.2f} s "
            f"| {seconds / size:.2f} s | {printed / 1e3:.1f} kB |")


def median_seconds(text: str, file: str, base_dir: Path | None, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        compile_source(text, file, base_dir=base_dir)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    start = time.perf_counter()
    _lark(), _fast_lark()
    grammar_ms = (time.perf_counter() - start) * 1e3
    largest = max((ROOT / "pipelines").glob("*.aspl"), key=lambda p: len(p.read_text().splitlines()))
    small = median_seconds(largest.read_text(), str(largest), largest.parent, repeat=50)
    big_text = generated_pipeline(5000)
    big = median_seconds(big_text, "generated.aspl", None, repeat=5)
    print(f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}")
    print("| input | lines | parse + check + lower (median) | aim |")
    print("|---|---|---|---|")
    print(f"| one-time grammar load (LALR tables, both lexers) | — | {grammar_ms:.0f} ms | — |")
    print(f"| `{largest.relative_to(ROOT)}` (largest bundled) | {len(largest.read_text().splitlines())} "
          f"| {small * 1e3:.1f} ms | < 50 ms |")
    print(f"| generated pipeline | {len(big_text.splitlines())} | {big:.2f} s | < 2 s |")
    print()
    print("\n".join(check_table()))


if __name__ == "__main__":
    main()
