"""`python -m bench.bench_eagle3`: the pocket EAGLE-3 head against the standalone pocket drafter.

Same target weights, same prompts (the default suite, `data=default`), same run: every
prompt is decoded with each drafter and target-only, in an order alternating with the
prompt's position, after one untimed warm-up prompt. Online decoding with the draft rule
(`run.score=tree`: the verified tree alone, as `decode.run` does), default 710-candidate
pool, B = 59. Prints per law and drafter: tau (accepted + 1 per round), tokens/s, the
speed-up over target-only and the ratio eagle3 / standalone, the per-round stage means
(draft, verify, the rest), and the machine load (`uptime`) before and after.

    python -m bench.bench_eagle3                          # T=0 and T=1, 64 new tokens
    python -m bench.bench_eagle3 --laws 0 --max-new-tokens 32 --prompts 6
    python -m bench.bench_eagle3 --card                   # also record the figures in the card
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
import torch
import transformers
from omegaconf import OmegaConf

from decode.inputs import resolve_inputs
from decode.loop import PromptRun, decode_prompt
from decode.metrics import timed_baseline
from decode.round import STAGES
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from pairs.config import DataConfig, ModelConfig
from pairs.models import load_model_pair
from pairs.prompts import encode_prompt
from recipes.pocket.eagle3_card import write_card
from specrank.paths import PROJECT_ROOT
from tree.config import DecodeConfig, PoolConfig, SelectConfig

CONF = PROJECT_ROOT / "conf"


def _conf(cls, path):
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.load(path)))


def _load() -> str:
    return "load average {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


@dataclasses.dataclass
class Tally:
    tokens: int = 0
    rounds: int = 0
    ms: float = 0.0
    stage_ms: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(len(STAGES)))

    def add(self, r: PromptRun) -> None:
        self.tokens += len(r.output)
        self.rounds += len(r.rounds)
        self.ms += r.total_ms
        self.stage_ms += np.sum([x.stage_ms for x in r.rounds], axis=0)

    @property
    def tau(self) -> float:
        return self.tokens / max(self.rounds, 1)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.ms


def bench_law(pairs: dict, prompts, temperature: float, args) -> dict[str, Tally]:
    s = OnlineSettings(
        DecodeSettings(
            PoolConfig(),
            SelectConfig(budget=args.budget),
            DecodeConfig(temperature=temperature, max_new_tokens=args.max_new_tokens),
        ),
        rule="draft",
        score="tree",
    )
    names = list(pairs)
    tok = pairs[names[0]].tokenizer
    encoded = [encode_prompt(tok, p.text) for p in prompts]
    tallies = {n: Tally() for n in [*names, "target-only"]}

    def spec(name: str, i: int) -> PromptRun:
        pr = pairs[name]
        return decode_prompt(pr.target, pr.drafter, encoded[i], s, pr.eos_ids, prompts[i].id)

    for name in names:  # warm-up (lazy inits, allocator), untimed
        spec(name, 0)
    for i in range(len(prompts)):
        order = names if i % 2 == 0 else names[::-1]
        runs = {n: spec(n, i) for n in order}
        pr = pairs[names[0]]
        out, ms = timed_baseline(
            pr.target, encoded[i], args.max_new_tokens, pr.eos_ids, temperature, 0, prompts[i].id
        )
        tallies["target-only"].tokens += len(out)
        tallies["target-only"].ms += ms
        for n, r in runs.items():
            tallies[n].add(r)
        if temperature == 0:  # both decoders are lossless: the same greedy output
            outs = [runs[n].output[: args.max_new_tokens] for n in names] + [out]
            assert all(o == outs[-1] for o in outs), f"greedy outputs differ on {prompts[i].id}"
    return tallies


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--laws", type=float, nargs="+", default=[0.0, 1.0], help="temperatures")
    ap.add_argument("--prompts", type=int, default=12, help="the first N / 2 of each suite source")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=59)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--card", action="store_true", help="write the figures into the head's card")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    load_before = _load()
    data = _conf(DataConfig, CONF / "data" / "default.yaml")
    each = args.prompts // len(data.sources)  # the head of every source (HumanEval, ShareGPT)
    data.sources = [dataclasses.replace(src, limit=each) for src in data.sources]
    pairs = {}
    for name in ("pocket", "pocket_eagle3"):
        model, prompts = resolve_inputs(_conf(ModelConfig, CONF / "model" / f"{name}.yaml"), data)
        pairs[{"pocket": "standalone", "pocket_eagle3": "eagle3"}[name]] = load_model_pair(model)
    print(
        f"{len(prompts)} prompts (data=default), <= {args.max_new_tokens} new tokens, pool 710, "
        f"B={args.budget}, rule=draft, score=tree, float32, {args.threads} thread(s); {load_before}"
    )
    rows = []
    for temp in args.laws:
        t0 = time.perf_counter()
        tallies = bench_law(pairs, prompts, temp, args)
        base = tallies["target-only"].tokens_per_s
        print(f"\nT={temp:g} ({time.perf_counter() - t0:.0f} s)")
        print(
            f"  {'drafter':<12} {'tau':>6} {'tok/s':>8} {'vs target':>9}   per-round ms: "
            + " ".join(f"{s:>9}" for s in STAGES)
        )
        for name, t in tallies.items():
            if name == "target-only":
                print(f"  {name:<12} {'1.000':>6} {t.tokens_per_s:8.1f} {1:9.2f}x")
                rows.append(
                    {
                        "law": f"T={temp:g}",
                        "drafter": name,
                        "tau": 1.0,
                        "tokens_per_s": t.tokens_per_s,
                    }
                )
                continue
            per = t.stage_ms / max(t.rounds, 1)
            print(
                f"  {name:<12} {t.tau:6.3f} {t.tokens_per_s:8.1f} {t.tokens_per_s / base:9.2f}x   "
                + "              "
                + " ".join(f"{v:9.2f}" for v in per)
            )
            d = dict(zip(STAGES, per, strict=True))
            rows.append(
                {
                    "law": f"T={temp:g}",
                    "drafter": name,
                    "tau": t.tau,
                    "tokens_per_s": t.tokens_per_s,
                    "draft_ms": d["draft"],
                    "verify_ms": d["verify"] + d["root_pass"],
                    "other_ms": d["features"] + d["select"] + d["bookkeeping"],
                }
            )
        e, sa = tallies["eagle3"], tallies["standalone"]
        print(
            f"  eagle3 / standalone: tau x{e.tau / sa.tau:.3f}, tokens/s x{e.tokens_per_s / sa.tokens_per_s:.3f}"
        )
    load_after = _load()
    print(f"\n{load_after}")
    if args.card:
        import json

        folder = PROJECT_ROOT / "models" / "pocket" / "eagle3"
        facts = json.loads((folder / "recipe.json").read_text())
        facts["suite"] = {
            "command": "python -m bench.bench_eagle3 --card",
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "pool": "710 (SPEC §2 defaults)",
            "budget": args.budget,
            "threads": args.threads,
            "load": f"{load_before} before, {load_after} after",
            "rows": rows,
        }
        write_card(folder, facts)
        print(f"figures written to {folder / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
