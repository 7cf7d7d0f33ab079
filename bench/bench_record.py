"""`python -m bench.bench_record`: speed of the speculative tree decoder and of trace recording.

Same two models, same prompts, three runs after a warm-up:

    plain      the target alone, one token per forward (greedy)
    spec       speculative decoding, draft rule, B = 59, default 710-candidate pool, no recording
    record     the same plus trace rows, retained rows and shard writing

Prints tokens/s of each, the speed-up spec / plain, the recording overhead
record / spec (goal: < 1.20 in time) and the per-stage split (draft, select,
verify, bookkeeping, writing).

    python -m bench.bench_record                                  # models/pocket if present, else tiny random
    python -m bench.bench_record --target T --drafter D --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from decode.baseline import autoregressive_decode
from decode.recording import RecordReport, record_traces
from decode.stream import DecodeSettings
from pairs.config import DataConfig, ModelConfig, PromptSource
from pairs.models import load_model_pair
from pairs.prompts import encode_prompt, load_prompts
from specrank.settings.paths import PROJECT_ROOT
from tests.tiny_models import TINY_CHAT_TEMPLATE, build_tiny_pair
from tree.config import DecodeConfig, PoolConfig, SelectConfig

SPEC_BENCH = PROJECT_ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
POCKET = PROJECT_ROOT / "models" / "pocket"


def _models(args: argparse.Namespace, tmp: Path) -> ModelConfig:
    if args.target:
        target, drafter, name = args.target, args.drafter, "given"
    elif (POCKET / "target" / "config.json").exists():
        target, drafter, name = str(POCKET / "target"), str(POCKET / "drafter"), "pocket"
    else:
        # Random weights: acceptance comes only from the drafter being a noisy copy.
        build_tiny_pair(
            tmp / "tiny",
            "qwen3",
            hidden=args.tiny_hidden,
            layers=2,
            chat_template=TINY_CHAT_TEMPLATE,
        )
        target, drafter, name = (
            str(tmp / "tiny" / "target"),
            str(tmp / "tiny" / "drafter"),
            "tiny-random",
        )
    return ModelConfig(
        name=name, target=target, drafter=drafter, dtype=args.dtype, device=args.device
    )


def _prompts(n: int):
    # Short Spec-Bench prompts spread over categories, plus HumanEval.
    every = DataConfig(
        name="bench",
        sources=[
            PromptSource(kind="spec_bench", path=str(SPEC_BENCH)),
            PromptSource(kind="humaneval", task="coding", limit=n),
        ],
    )
    prompts = load_prompts(every)
    short = [p for p in prompts if len(p.text) < 400]
    step = max(1, len(short) // n)
    return short[::step][:n]


def _print_split(label: str, r: RecordReport) -> None:
    total = sum(r.stage_ms.values())
    parts = ", ".join(f"{k} {v / total:5.1%}" for k, v in r.stage_ms.items())
    print(f"  {label:<7} {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 on shared machines)"
    )
    ap.add_argument("--tiny-hidden", type=int, default=64)
    ap.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats; the fastest counts"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        pair = load_model_pair(_models(args, tmp))
        prompts = _prompts(args.prompts)
        settings = DecodeSettings(
            PoolConfig(),
            SelectConfig(rule="draft", budget=59),
            DecodeConfig(max_new_tokens=args.max_new_tokens),
        )
        print(
            f"models: {pair.ids['target']} / {pair.ids['drafter']} ({args.device}, {args.dtype}, "
            f"{args.threads} thread(s)); {len(prompts)} prompts, limit {args.max_new_tokens} tokens, greedy, B=59"
        )
        run = lambda out, write: record_traces(  # noqa: E731
            out,
            pair,
            prompts,
            settings,
            prompts_per_shard=2,
            manifest_config={"bench": 1},
            progress=False,
            write=write,
        )
        run(tmp / "warm", False)  # warm-up (allocator, lazy inits)
        # Interleaved repeats, fastest of each kept: a shared machine's noise only adds time.
        spec = rec = None
        plain_s = float("inf")
        for r in range(args.repeats):
            s_r, r_r = run(tmp / f"spec{r}", False), run(tmp / f"rec{r}", True)
            spec = s_r if spec is None or s_r.seconds < spec.seconds else spec
            rec = r_r if rec is None or r_r.seconds < rec.seconds else rec
            # Plain decoding of the same prompts under the same limit (it stops exactly
            # at the limit; the speculative run may overshoot by up to the tree depth).
            t0 = time.perf_counter()
            n_plain = 0
            for p in prompts:
                ids = encode_prompt(pair.tokenizer, p.text)
                n_plain += len(
                    autoregressive_decode(pair.target, ids, args.max_new_tokens, pair.eos_ids)
                )
            plain_s = min(plain_s, time.perf_counter() - t0)

    plain_tps = n_plain / plain_s
    print(f"plain    {plain_tps:8.1f} tokens/s  ({n_plain} tokens)")
    print(
        f"spec     {spec.tokens_per_s:8.1f} tokens/s  ({spec.tokens} tokens, {spec.rounds} rounds, "
        f"{spec.accepted / spec.rounds:.2f} accepted + 1 per round)"
    )
    print(f"record   {rec.tokens_per_s:8.1f} tokens/s  ({rec.tokens} tokens)")
    print(f"speed-up spec / plain           {spec.tokens_per_s / plain_tps:6.2f}x")
    print(f"recording overhead record/spec  {rec.seconds / spec.seconds:6.2f}x time (goal < 1.20)")
    print("per-stage split of decoding time (prefill included):")
    _print_split("spec", spec)
    _print_split("record", rec)


if __name__ == "__main__":
    main()
