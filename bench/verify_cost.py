"""`python -m bench.verify_cost`: what a target pass over n tokens costs against one token.

    python -m bench.verify_cost --model smollm2                 # the real target, float32
    python -m bench.verify_cost --model pocket --tokens 1 9 60

Speculation pays only when a round's tokens outweigh its cost in target steps, and the
largest part of that cost is the verify pass: the target's forward over the tree's nodes
(plus the root) on top of a cache of `--context` tokens. This times that forward for each
of `--tokens` (n = 1 is a target-only step), interleaved round by round so the machine's
load meets every n alike, and prints the median ms, the ratio to n = 1 and the share spent
in the output projection (timed alone over n rows). `--cache dynamic static` also times the lean
forward over a preallocated cache (`tree.lean_model`, what a plain-Llama drafter runs on),
interleaved with transformers' own. The ratio at n = B + 1 is the break-even tau of a round that
drafted for free: the tokens a pass must yield before it beats one-token steps. On a CPU
the curve shows whether the forward is bound by reading the weights (flat in n) or by the
arithmetic (rising with n); `decode.run` prints the whole round's break-even beside it.
Give the load beside any figure; one thread by default (--threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from omegaconf import OmegaConf

from pairs.config import ModelConfig
from pairs.models import load_model_pair
from specrank.settings.paths import CONF_DIR, project_path


def load_target(name: str, dtype: str | None) -> torch.nn.Module:
    """The target of `conf/model/<name>.yaml` (its dtype unless `dtype`), on the CPU."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                              OmegaConf.load(CONF_DIR / f"model/{name}.yaml")))  # fmt: skip
    cfg = dataclasses.replace(cfg, device="cpu", dtype=dtype or cfg.dtype,
                              target=str(project_path(cfg.target)),
                              drafter=str(project_path(cfg.drafter)))  # fmt: skip
    return load_model_pair(cfg).target.eval()


def time_passes(model: torch.nn.Module, tokens: list[int], context: int, reps: int, seed: int,
                caches: tuple[str, ...] = ("dynamic",)) -> dict[tuple[str, int], dict[str, float]]:  # fmt: skip
    """Median ms of the decoder's own forward (`tree.attention.forward_chain`) over n new
    tokens after `context` cached ones, per cache kind and n, and of the output projection
    over n rows alone; kinds and n's interleaved in every repetition, each cache cut back to
    the prefix after a pass. Kinds: dynamic (transformers' cache and forward) | static
    (`tree.lean_model`'s forward over a preallocated cache)."""
    from tree.attention import compact_cache, draft_cache, forward_chain, new_cache

    g = torch.Generator().manual_seed(seed)
    vocab, width = model.config.vocab_size, model.config.hidden_size
    prefix = torch.randint(0, vocab, (context,), generator=g)
    made = {k: draft_cache(model) if k == "static" else new_cache(model) for k in caches}
    keys = [(k, n) for k in caches for n in tokens]
    ms: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    head: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    with torch.inference_mode():
        for cache in made.values():
            forward_chain(model, prefix, cache, 1)
        for rep in range(reps + 1):  # the first repetition warms up, untimed
            for kind, n in keys if rep % 2 else keys[::-1]:
                x = torch.randint(0, vocab, (n,), generator=g)
                hidden = torch.randn(n, width, generator=g, dtype=model.dtype)
                t0 = time.perf_counter()
                forward_chain(model, x, made[kind])
                t1 = time.perf_counter()
                model.lm_head(hidden)
                t2 = time.perf_counter()
                compact_cache(made[kind], context, [])  # back to the prefix for the next pass
                if rep:
                    ms[kind, n].append(1e3 * (t1 - t0))
                    head[kind, n].append(1e3 * (t2 - t1))
    return {key: {"ms": statistics.median(ms[key]), "head_ms": statistics.median(head[key])}
            for key in keys}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a conf/model/<name>.yaml")
    ap.add_argument("--dtype", default=None, help="override the model config's dtype")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    ap.add_argument("--context", type=int, default=300, help="cached tokens before the pass")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", nargs="+", choices=("dynamic", "static"), default=["dynamic"],
                    help="static: the lean forward over a preallocated cache (tree.lean_model); "
                    "both: interleaved, the first the reference")  # fmt: skip
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tokens = sorted(set(a.tokens) | {1})
    caches = tuple(dict.fromkeys(a.cache))
    model = load_target(a.model, a.dtype)
    out = time_passes(model, tokens, a.context, a.reps, a.seed, caches)
    ref = out[caches[0], 1]["ms"]
    dtype = next(model.parameters()).dtype
    print(f"{a.model} target, {dtype}, {a.threads} thread(s), {a.context} cached tokens, "
          f"median of {a.reps}; ratios to a one-token step of the {caches[0]} cache:")  # fmt: skip
    print("  cache     n tokens      ms   x one-token step   output projection")
    for kind, n in out:
        r = out[kind, n]
        print(f"  {kind:8s} {n:8d} {r['ms']:8.1f}   x{r['ms'] / ref:5.2f}            "
              f"{100 * r['head_ms'] / r['ms']:3.0f}%")  # fmt: skip


if __name__ == "__main__":
    main()
