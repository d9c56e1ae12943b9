"""Front-end speed: parse + check + lower of the largest bundled pipeline and of a generated
5,000-line pipeline. Prints a Markdown table; figures go to bench/RESULTS.md.

    python bench/bench_frontend.py
"""
from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

from aspc.compiler import compile_source
from aspc.parser import _lark

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


def generated_pipeline(lines: int) -> str:
    head = "pipeline generated\npool cpu = cpu x 2\n"
    chains = max(1, (lines - 2) // CHAIN.count("\n"))
    return head + "".join(CHAIN.format(i=i) for i in range(chains))


def median_seconds(text: str, file: str, base_dir: Path | None, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        compile_source(text, file, base_dir=base_dir)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    start = time.perf_counter()
    _lark()
    grammar_ms = (time.perf_counter() - start) * 1e3
    largest = max((ROOT / "pipelines").glob("*.aspl"), key=lambda p: len(p.read_text().splitlines()))
    small = median_seconds(largest.read_text(), str(largest), largest.parent, repeat=50)
    big_text = generated_pipeline(5000)
    big = median_seconds(big_text, "generated.aspl", None, repeat=5)
    print(f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}")
    print("| input | lines | parse + check + lower (median) | aim |")
    print("|---|---|---|---|")
    print(f"| one-time grammar load (LALR tables) | — | {grammar_ms:.0f} ms | — |")
    print(f"| `{largest.relative_to(ROOT)}` (largest bundled) | {len(largest.read_text().splitlines())} "
          f"| {small * 1e3:.1f} ms | < 50 ms |")
    print(f"| generated pipeline | {len(big_text.splitlines())} | {big:.2f} s | < 2 s |")


if __name__ == "__main__":
    main()
