"""MODEL_CARD.md and recipe.json of the pocket EAGLE-3 head, from the recipe's facts.

The default-suite figures (accepted length and speed against the standalone pocket
drafter) are measured by `python -m bench.bench_eagle3 --card`, which adds them to the
facts under "suite" and rewrites both files.
"""

from __future__ import annotations

import json
from pathlib import Path


def _suite(s: dict) -> str:
    if not s:
        return "Not measured for these weights yet: run `python -m bench.bench_eagle3 --card`.\n"
    rows = "\n".join(
        f"| {r['law']} | {r['drafter']} | {r['tau']:.3f} | {r['tokens_per_s']:.1f} | "
        + (
            " | | |"
            if r["drafter"] == "target-only"
            else f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['other_ms']:.2f} |"
        )
        for r in s["rows"]
    )
    return (
        f"`{s['command']}`: {s['prompts']} prompts, the first {s['prompts'] // 2} of each source "
        "of the default suite (`data=default`: HumanEval, held-out ShareGPT turns), up to "
        f"{s['max_new_tokens']} new tokens, pool {s['pool']}, budget {s['budget']}, float32 on "
        f"{s['threads']} CPU thread(s); machine load (`uptime`) {s['load']}. tau = accepted "
        "draft tokens + 1 per round; tokens/s over the whole decode (prefill included); "
        "per-round stage means in ms. Both drafters verify against the same target; greedy "
        "outputs are checked equal to target-only decoding.\n\n"
        "| law | drafter | tau | tokens/s | draft ms | verify ms | rest ms |\n"
        "|---|---|---|---|---|---|---|\n" + rows + "\n"
    )


def write_card(out: Path, facts: dict) -> None:
    (out / "recipe.json").write_text(json.dumps(facts, indent=2) + "\n")
    c, d, t = facts["config"], facts["data"], facts["train"]
    agree = facts.get("val_agreement", {})
    steps = " / ".join(f"{agree[k]:.3f}" for k in sorted(agree) if k.startswith("agree_step"))
    files = "\n".join(f"| `{name}` | {size:,} |" for name, size in facts["sizes"].items())
    text = f"""# Pocket EAGLE-3 head

An EAGLE-3 draft head for the pocket target (`models/pocket/target`), trained by
`python -m decode.train_pocket.eagle3` on this machine's CPU. Like the pocket pair it is a
stand-in: its figures say nothing about heads for 8B-class targets. Select it with
`model=pocket_eagle3` (`conf/model/pocket_eagle3.yaml`).

## Format

Plain EAGLE-3 layout (SafeAILab/EAGLE, SGLang, vLLM): `config.json` with the layer's
Llama fields, `draft_vocab_size`, `target_hidden_size` and
`eagle_aux_hidden_state_layer_ids`; `model.safetensors` ({c["export_dtype"]}) with
`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. No embedding:
the head reads the target's (as EAGLE-3 heads do).

- one decoder layer, hidden {facts["hidden"]}, MLP {c["intermediate"]}, {c["heads"]} heads /
  {c["kv_heads"]} kv heads; {facts["params"]:,} parameters
- aux hidden states: those ENTERING target layers {facts["aux_layers"]} (input convention,
  transformers' `hidden_states[i]`); the default (2, N // 2, N - 3) would repeat layers
  of a 4-layer target
- draft vocabulary: the {c["draft_vocab"]} most frequent trained-on tokens of 1024
  (`d2t[i]`: target id of draft id i minus i; `t2d`: the target ids it holds)

## Recipe

- data (training side of the pocket corpus' split rule only): {d["stdlib_train_files"]}
  CPython standard-library files, {d["text_tokens"]:,} tokens of whole files and
  chat-wrapped blocks; the target's own T=1 continuations ({c["rollout_tokens"]} tokens
  at most) of {d["rollout_prompts"]} prompts drawn from those files (code heads, docstring
  first lines) under the chat template: {d["rollout_tokens"]:,} tokens; {d["minutes"]:.1f} min
- training-time test over {c["ttt_steps"]} steps after the first (loss weight
  {c["ttt_decay"]} ** k), forward KL from the target's row restricted to the draft
  vocabulary; AdamW, lr {c["train"]["lr"]}, {t["steps"]} steps of
  {c["train"]["batch"]} x {c["train"]["seq_len"]} positions, {t["minutes"]:.1f} min on
  {c["threads"]} thread(s) (torch {facts["torch"]}); a rerun on another machine reproduces
  the recipe, not these exact weights
- held-out agreement (argmax equal to the target's, standard-library validation files,
  teacher-forced), step 0 / 1 / ...: {steps}

## Measured on the default suite, against the standalone pocket drafter

{_suite(facts.get("suite", {}))}
## Files

| file | bytes |
|---|---|
{files}
"""
    (out / "MODEL_CARD.md").write_text(text)
