"""`python -m bench.compile_head`: does `torch.compile` make the EAGLE-3 head's drafting levels faster?

    python -m bench.compile_head                      # the pocket pair, B=8, 4 prompts
    python -m bench.compile_head --prompts 2 --tokens 16 --repeats 2

The drafting stage of an EAGLE-3 round runs the head's lean forward once per level
(`pairs.eagle3.lean.LeanHead.forward`, then `.outputs` for the logits). This decodes a few
prompts of data/prompts/sharegpt_heldout.jsonl greedily (rule=draft, run.score=tree) on the
pocket pair, with those two functions eager and compiled by `torch.compile(dynamic=True)`
(level widths and cache lengths vary, so shapes are symbolic rather than bucketed),
alternating eager and compiled decodes `--repeats` times, and prints the median drafting
ms a round of each, their ratio, the compile time (the first compiled decodes) and the
graphs Dynamo compiled (each beyond the first is a recompile). Compiled rounds must emit
the eager rounds' tokens. Where Inductor cannot build (no C++ compiler), it says so and
measures nothing. CPU figures: one thread; give the load beside them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.bench_ops import PROMPTS, decode_rounds, load_kind, read_prompts


def _draft_ms(rounds: list) -> float:
    return statistics.median(r.stage_ms[0] for r in rounds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import torch._dynamo.utils as dynamo_utils
    from torch._dynamo.exc import BackendCompilerFailed

    from pairs.eagle3 import lean
    from pairs.prompts import encode_prompt
    from specrank.settings.paths import PROJECT_ROOT

    pair = load_kind("eagle3")
    encoded = [encode_prompt(pair.tokenizer, p["prompt"])
               for p in read_prompts(PROJECT_ROOT / PROMPTS, a.prompts)]  # fmt: skip
    eager = (lean.LeanHead.forward, lean.LeanHead.outputs)
    compiled = tuple(torch.compile(f, dynamic=True) for f in eager)

    def use(fns: tuple) -> None:
        lean.LeanHead.forward, lean.LeanHead.outputs = fns

    try:
        reference = decode_rounds(pair, encoded, a.budget, a.tokens)  # eager, also a warm-up
        use(compiled)
        t0 = time.perf_counter()
        first = decode_rounds(pair, encoded, a.budget, a.tokens)
        compile_s = time.perf_counter() - t0
    except BackendCompilerFailed as err:  # Inductor could not build (no C++ compiler, ...)
        use(eager)
        print(f"torch.compile could not build here ({type(err).__name__}: {err}); eager only")
        return
    if [r.emitted for r in first] != [r.emitted for r in reference]:
        raise RuntimeError("compiled drafting emitted other tokens than eager drafting")
    ms: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(a.repeats):
        for name, fns in (("eager", eager), ("compiled", compiled)):
            use(fns)
            ms[name].append(_draft_ms(decode_rounds(pair, encoded, a.budget, a.tokens)))
    use(eager)
    e, c = statistics.median(ms["eager"]), statistics.median(ms["compiled"])
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    print(f"pocket EAGLE-3 head, B={a.budget}, {a.prompts} prompts x {a.tokens} tokens, one "
          f"thread, {a.repeats} alternating decodes each:")  # fmt: skip
    print(f"  drafting ms a round (median): eager {e:.2f}, compiled {c:.2f}, compiled/eager "
          f"x{c / e:.2f}")  # fmt: skip
    print(f"  compile: {compile_s:.1f} s (the first compiled decodes), {graphs} graphs "
          f"({max(graphs - 2, 0)} recompiles beyond one per function)")  # fmt: skip


if __name__ == "__main__":
    main()
