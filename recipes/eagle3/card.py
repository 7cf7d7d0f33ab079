"""MODEL_CARD.md and recipe.json of a head trained by `python -m decode.train_head`.

Decoding figures (tau and speed on held-out prompts) are measured separately and added under
"suite" in recipe.json (`bench.bench_head --card`); the card shows them when present.
"""

from __future__ import annotations

import json
from pathlib import Path

from specrank.settings.renames import migrated_config


def suite_section(s: dict | None, model: str = "smollm2") -> str:
    """The decoding figures `bench.bench_head --card` measured, or the command that does."""
    if not s:
        flag = "" if model == "smollm2" else f" --model {model}"
        return ("Not measured for these weights yet: run "
                f"`python -m bench.bench_head --card{flag}`.\n")  # fmt: skip
    rows = "\n".join(
        f"| {r['law']} | {r['budget']} | {r['tau']:.3f} | {r['tokens_per_s']:.1f} | "
        f"{r['speedup']:.3f} [{r['speedup_lo']:.3f}, {r['speedup_hi']:.3f}] | "
        f"{r['break_even_tau']:.2f} |"
        for r in s["rows"]
    )
    return (
        f"`{s['command']}` ({s['date']}, load {s['load']}): the first {s['prompts']} prompts "
        f"of `data=heldout` (Spec-Bench first turns), up to {s['max_new_tokens']} new tokens, "
        f"rule=draft, {s['dtype']} on {s['threads']} CPU thread, one interleaved `decode.run` "
        "per law with target-only. tau = accepted draft tokens + 1 per round; speed-up over "
        "target-only with its paired prompt-bootstrap interval; break-even tau = the tau at "
        "which a round costs what target-only takes for its tokens.\n\n"
        "| law | B | tau | tokens/s | speed-up [95%] | break-even tau |\n"
        "|---|---|---|---|---|---|\n" + rows + "\n"
    )


def _offline(o: dict | None) -> str:
    """tau offline on a recorded store (the main job's), when recipe.json carries it."""
    if not o:
        return ""
    rows = "\n".join(
        f"| {r['law']} | {r['budget']} | {r['draft_tau']:.3f} | {r['rows_tau']:.3f} |"
        for r in o["rows"]
    )
    return (
        f"Offline, on `{o['command']}`'s traces ({o['date']}: {o['prompts']} prompts the head "
        f"never trained on, {o['max_new_tokens']} new tokens, pool {o['pool']}): tau = 1 + "
        "accepted draft tokens per round of the draft rule and of the learned `rows` "
        "reranker.\n\n| law | B | tau, draft | tau, rows |\n|---|---|---|---|\n" + rows + "\n\n"
    )


def write_card(out: Path, facts: dict) -> None:
    # `bench.bench_head --card` rewrites a recipe.json that may predate a settings rename
    facts = {**facts, "config": migrated_config({"head": facts["config"]})["head"]}
    (out / "recipe.json").write_text(json.dumps(facts, indent=2) + "\n")
    c, d, t, layer = facts["config"], facts["data"], facts["train"], facts["layer"]
    agree = " / ".join(f"{v:.3f}" for _, v in sorted(t["val_agreement"].items()))
    files = "\n".join(f"| `{name}` | {size:,} |" for name, size in facts["sizes"].items())
    text = f"""# EAGLE-3 head for `{facts["target"]}`

Trained on this project's CPU by `python -m decode.train_head` (`recipes/eagle3/`), with
the settings recorded in `recipe.json`. {facts["params"]:,} parameters: one decoder layer at
width {layer["hidden"]} (intermediate {layer["intermediate"]}, {layer["heads"]} heads,
{layer["kv_heads"]} key/value heads) over the target's states ENTERING layers
{facts["aux_layers"]}, a {c["draft_vocab"]}-token draft vocabulary (the most frequent
trained-on tokens), the target's own embeddings; weights in {c["export_dtype"]}.

## Data

- Training-side ShareGPT conversations (the pocket corpus' split rule: held-out buckets,
  the held-out prompt file and every prompt of `data/prompts/` never enter), rendered under
  the target's chat template, and the target's own greedy replies to the first user turns
  of other training-side conversations ({c["corpus"]["reply_prompts"]} prompts, at most
  {c["corpus"]["reply_tokens"]} tokens each).
- {d["tokens"]:,} tokens in {d["windows"]} windows of {c["corpus"]["chunk"]}; {d["val_windows"]}
  windows held back for agreement; {d["loss_positions"]:,} assistant tokens trained on.
- Captured once through the target in {c["capture_dtype"]}: {d["minutes"]:.1f} min
  (replies and capture together{"; " + d["note"] if d.get("note") else ""}).

## Training

EAGLE-3's training-time test over {c["ttt_steps"]} steps after the first (loss weight
{c["ttt_decay"]} ** k), soft labels from the target's top-{c["corpus"]["target_top_k"]} row over the
draft vocabulary. {t["steps"]} steps of {c["train"]["batch"]} windows, {t["tokens"]:,}
window tokens, {t["minutes"]:.1f} min on {c["threads"]} CPU thread(s), torch
{facts["torch"]}.

Held-out agreement with the target's argmax, steps 0 / 1 / 2 (each step's own positions):
{agree}.

## Decoding

{_offline(facts.get("offline"))}{suite_section(facts.get("suite"))}
## Files

| file | bytes |
|---|---|
{files}
"""
    (out / "MODEL_CARD.md").write_text(text)
