"""The online half of `bench.bench_drafters`: every drafter kind, shape, temperature pair and
budget decoded on the same prompts in one interleaved run, and the tables of seed 003.

Budgets are the paper's: B counts the verified tokens, root (the bonus token) included, so
B = 8 verifies 7 drafted nodes (`select.budget` = B - 1, which counts drafted nodes). A
shape is written as the paper's triple steps/top-k/tokens (sglang's speculative_num_steps /
eagle_topk / num_draft_tokens):
  chain : pool.top_k=1 pool.expand=1 pool.expand_steps=B - 2, every node verified: (B-1)/1/B;
  tree  : the default 710-candidate pool (depth 8, 10 children a node) and the draft rule's
          best B - 1 nodes of it: 8/10/B.
A block drafter's pool is at most as deep as its block drafts (block_size - 1; a semi-AR
drafter's rows), so its chain stops there (the paper uses budget-specific DFlash
checkpoints; the pocket block drafters have one block size each).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pandas as pd

from decode.baseline import row_entropies
from decode.elasticity import budget_elasticity
from decode.loop import decode_prompt
from decode.metrics import (
    PromptTiming,
    entropy_halves,
    prompt_table,
    round_table,
    run_groups,
    task_entropy,
    timed_baseline,
    tokens_to_eos,
)
from decode.session import arm_order
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from pairs.models import ModelPair
from pairs.prompts import Prompt, encode_prompt
from specrank.statistics.bootstrap import percentile_interval, resample_weights
from tree.config import DecodeConfig, PoolConfig, SelectConfig

# kind -> conf/model/<name>.yaml; dcore: the block drafter of the DCore recipe (DFlare's
# per-draft-layer mixing, D-PACE's weights); dspark, domino: the semi-AR drafters (a DFlash
# backbone corrected from the drafted path: DeepSpec's Markov head, SpecForge's GRU)
KINDS = {"standalone": "pocket", "eagle3": "pocket_eagle3", "block": "pocket_block",
         "dcore": "pocket_block_dcore", "dspark": "pocket_dspark",
         "domino": "pocket_domino"}  # fmt: skip
PAIRS = ("0|0", "1|0", "1|1")  # T_t|T_d, the paper's three
# The paper's latency stages (its Tab. 6) on this decoder's (decode.round.STAGES). Ours merge:
# setup, rollout and the drafter's resync are one draft step (the drafter first takes the
# tokens the last round committed, then grows the pool); the target forward and acceptance
# are one verify step (the pass, then the outcome at every row); proposal assembly is
# select (the tree, its mask and batch rows); bookkeeping is cache compaction (the paper's
# "compacted to the front of the cache", part of its Acceptance).
PAPER_STAGES = {
    "setup+rollout+resync": ("draft",),
    "proposal assembly": ("features", "select"),
    "target fwd+acceptance": ("root_pass", "verify"),
    "cache compaction": ("bookkeeping",),
}


@dataclass(frozen=True)
class Variant:
    """One decoder of the bench: drafter kind, pool shape, temperature pair, paper budget."""

    kind: str
    shape: str  # tree | chain
    pair: str  # "T_t|T_d"
    budget: int  # verified tokens, root included (the paper's B)
    # exhaustive: the default (a chain's node accepted with p(c)); coupling: a sampled chain
    # accepted with min(1, p/q), the paper's 1|1 chain acceptance (decode.verifier)
    verifier: str = "exhaustive"

    @property
    def temperatures(self) -> tuple[float, float]:
        t_t, t_d = self.pair.split("|")
        return float(t_t), float(t_d)

    @property
    def shape_label(self) -> str:
        """The shape, and the verifier where it is not the default (`chain+coupling`)."""
        return self.shape if self.verifier == "exhaustive" else f"{self.shape}+{self.verifier}"

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.shape_label}"

    def pool(self) -> PoolConfig:
        if self.shape == "chain":
            return PoolConfig(top_k=1, expand_steps=self.budget - 2, expand=1)
        return PoolConfig()

    def triple(self) -> str:
        p = self.pool()
        return f"{p.expand_steps + 1}/{p.top_k}/{self.budget}"

    def settings(self, max_new_tokens: int, seed: int = 0) -> OnlineSettings:
        t_t, t_d = self.temperatures
        dec = DecodeConfig(temperature=t_t, max_new_tokens=max_new_tokens, seed=seed,
                           draft_temperature=t_d, verifier=self.verifier)  # fmt: skip
        sel = SelectConfig(budget=self.budget - 1)
        return OnlineSettings(DecodeSettings(self.pool(), sel, dec), rule="draft", score="tree")


def variants(kinds: list[str], shapes: list[str], pairs: list[str], budgets: list[int],
             max_depth: dict[str, int], chain_verifiers: tuple[str, ...] = ("exhaustive",),
             ) -> tuple[list[Variant], list[str]]:  # fmt: skip
    """Every (kind, shape, pair, budget) a drafter can draft, and a note for each it cannot.

    max_depth: kind -> the deepest pool it drafts (a block drafter's block_size - 1, a
    semi-AR drafter's rows).
    chain_verifiers: the verifiers of a chain drafted at T_d > 0, each its own variant (over
    deterministic drafts coupling is the default's rule, so it is not run there)."""
    out, skipped = [], []
    for kind in kinds:
        for shape in shapes:
            for b in budgets:
                depth = Variant(kind, shape, "0|0", b).pool().expand_steps + 1
                if depth > max_depth.get(kind, depth):
                    skipped.append(f"{kind}/{shape} at B={b}: depth {depth} > its "
                                   f"{max_depth[kind]} (the positions a block drafts)")  # fmt: skip
                    continue
                for p in pairs:
                    sampled_chain = (
                        shape == "chain" and Variant(kind, shape, p, b).temperatures[1] > 0
                    )
                    verifiers = chain_verifiers if sampled_chain else ("exhaustive",)
                    out += [Variant(kind, shape, p, b, ver) for ver in verifiers]
    return out, skipped


def decode_law(
    pairs: dict[str, ModelPair], prompts: list[Prompt], chosen: list[Variant],
    max_new_tokens: int, warmup: int = 1, exact: bool = True,
) -> dict[Variant, list[PromptTiming]]:  # fmt: skip
    """Every variant of one target temperature on every prompt, and the target-only baseline.

    As `decode.session.decode_all`, across drafters: after `warmup` untimed prompts, prompt
    by prompt the baseline before (odd positions) or after (even) the speculative decodes,
    the variants in an order rotating with the position. The pairs share the target's
    weights (one folder); the baseline runs on the first's. At T=0 every output must equal
    the baseline's (a lossless decoder), or the bench stops; with ``exact`` False (bf16,
    whose rounding differs between a tree pass and one-token steps and may flip a near-tied
    argmax on an H200 lease) each decode's agreement is kept in `greedy_match`.
    """
    t_t = chosen[0].temperatures[0]
    if any(v.temperatures[0] != t_t for v in chosen):
        raise ValueError("decode_law: one target temperature per call")
    first = next(iter(pairs.values()))
    encoded = [encode_prompt(first.tokenizer, p.text) for p in prompts]
    settings = {v: v.settings(max_new_tokens) for v in chosen}

    def spec(i: int, v: Variant):
        pr = pairs[v.kind]
        return decode_prompt(pr.target, pr.drafter, encoded[i], settings[v], pr.eos_ids,
                             prompts[i].id, prompts[i].task)  # fmt: skip

    def base(i: int):
        return timed_baseline(first.target, encoded[i], max_new_tokens, first.eos_ids, t_t, 0,
                              prompts[i].id)  # fmt: skip

    for i in range(min(warmup, len(prompts))):
        for v in chosen:
            spec(i, v)
        base(i)
    out: dict[Variant, list[PromptTiming]] = {v: [] for v in chosen}
    for i, p in enumerate(prompts):
        if i % 2 == 1:
            b_out, b_ms = base(i)
        runs = {v: spec(i, v) for v in arm_order(chosen, i)}
        if i % 2 == 0:
            b_out, b_ms = base(i)
        n_eos = tokens_to_eos(b_out, first.eos_ids)
        entropy = row_entropies(first.target, encoded[i], b_out[:n_eos], t_t)
        for v, r in runs.items():
            agree = None if t_t != 0 else r.output[: len(b_out)] == b_out[: len(r.output)]
            if agree is False and exact:
                raise AssertionError(f"greedy output of {v} differs from target-only on {p.id}")
            out[v].append(PromptTiming(p.id, p.task, r, n_eos, b_ms, agree, entropy))
    return out


def _stage_split(group: pd.Series) -> dict[str, float]:
    """The paper's stages in ms per round, from a group's per-stage means (run_groups)."""
    return {
        f"ms/{name}": float(sum(group[f"ms_per_round/{s}"] for s in ours))
        for name, ours in PAPER_STAGES.items()
    }


def variant_tables(
    timings: dict[Variant, list[PromptTiming]], eos_ids: frozenset[int], n_resamples: int,
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """(groups, elasticity, halves) of one run.

    groups: one row per variant and group (all, entropy/low, entropy/high): tau, tokens/s,
    speedup over target-only with its paired prompt-bootstrap interval, the paper's stage
    split in ms per round. The entropy split is the run's one: tasks ordered by the target's
    mean row entropy on the baseline decodes (decode.metrics), shared by every variant.
    elasticity: per kind, shape and pair, 100 x the log changes of TPS, tau and eta from the
    smallest budget to the next (decode.elasticity: paired, one weight row for both budgets).
    """
    tables = {v: (round_table(t), prompt_table(t, eos_ids)) for v, t in timings.items()}
    every = pd.concat([p for _, p in tables.values()]).drop_duplicates("prompt_id")
    halves = entropy_halves(task_entropy(pd.DataFrame(), every)[0])
    rows = []
    for v, (rounds, prompts) in tables.items():
        groups = run_groups(rounds, prompts, n_resamples, seed, halves)
        groups = groups[groups["group"].isin(["all", "entropy/low", "entropy/high"])]
        for _, g in groups.iterrows():
            rows.append({**_keys(v), "group": g["group"], "prompts": int(g["prompts"]),
                         "rounds": int(g["rounds"]), "tau": g["tau"],
                         "tokens_per_s": g["tokens_per_s"],
                         "target_tokens_per_s": g["baseline_tokens_per_s"],
                         "speedup": g["speedup"], "speedup_lo": g["speedup_lo"],
                         "speedup_hi": g["speedup_hi"], **_stage_split(g)})  # fmt: skip
    groups = pd.DataFrame(rows)
    halves_table = pd.DataFrame(
        [{"task": t, "half": h} for t, h in sorted(halves.items(), key=lambda x: x[1])]
    )
    return groups, _elasticity(tables, n_resamples, seed), halves_table


def _keys(v: Variant) -> dict:
    return {"kind": v.kind, "shape": v.shape_label, "pair": v.pair, "budget": v.budget,
            "triple": v.triple()}  # fmt: skip


def _elasticity(tables: dict, n_resamples: int, seed: int) -> pd.DataFrame:
    by_arm: dict[tuple, dict[int, pd.DataFrame]] = {}
    for v, (_, prompts) in tables.items():
        by_arm.setdefault((v.kind, v.shape_label, v.pair), {})[v.budget] = prompts
    rows = []
    for (kind, shape, pair), per_budget in by_arm.items():
        e = budget_elasticity(per_budget, n_resamples, seed)
        for _, r in e.iterrows():
            rows.append({"kind": kind, "shape": shape, "pair": pair, **r.to_dict()})
    return pd.DataFrame(rows)


def tau_versus(timings: dict[Variant, list[PromptTiming]], base_kind: str, n_resamples: int,
               seed: int = 0) -> pd.DataFrame:  # fmt: skip
    """Each variant's tau against `base_kind`'s at the same shape, pair, budget and verifier,
    on the same prompts: the ratio and the difference with paired prompt-bootstrap intervals
    (one resample draws prompts for both; tau is tokens per round over the drawn prompts'
    rounds). Empty without `base_kind`."""
    sums = {v: {p.prompt_id: (sum(len(r.emitted) for r in p.run.rounds), len(p.run.rounds))
                for p in t} for v, t in timings.items()}  # fmt: skip
    rows = []
    for v in timings:
        base = dataclasses.replace(v, kind=base_kind)
        if v.kind == base_kind or base not in timings:
            continue
        ids = sorted(sums[v].keys() & sums[base].keys())
        w = np.vstack([np.ones(len(ids)), resample_weights(len(ids), n_resamples, seed)])
        taus = []
        for arm in (v, base):
            emitted, rounds = (np.array([sums[arm][i][k] for i in ids], float) for k in (0, 1))
            taus.append((w @ emitted) / (w @ rounds))
        ratio, diff = taus[0] / taus[1], taus[0] - taus[1]
        rows.append({**_keys(v), "versus": base_kind, "prompts": len(ids), "tau": taus[0][0],
                     "base_tau": taus[1][0],
                     **percentile_interval(ratio[0], ratio[1:]).columns("tau_ratio"),
                     **percentile_interval(diff[0], diff[1:]).columns("tau_diff")})  # fmt: skip
    return pd.DataFrame(rows)
