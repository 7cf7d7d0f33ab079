"""MODEL_CARD.md and recipe.json of a block-family drafter for a real target, from the
recipe's facts (`recipes.block_head.recipe.run`)."""

from __future__ import annotations

import json
from pathlib import Path

from recipes.eagle3.card import suite_section
from recipes.pocket.semiar_card import DEEPSPEC, SPECFORGE, reflow

NAMES = {"block": "DFlash block drafter", "dspark": "DSpark drafter", "domino": "Domino drafter"}


def model_name(facts: dict) -> str:
    """The conf/model name decoding with the drafter (the one it was trained under)."""
    return facts["model"]


def _rows(x: dict) -> str:
    return " / ".join(f"{x[k]:.3f}" for k in sorted(x, key=lambda k: (len(k), k))
                      if k.startswith("agree_row"))  # fmt: skip


def _model(facts: dict) -> str:
    c, kind = facts["config"], facts["kind"]
    base = (f"one Qwen3 decoder layer at width {facts['hidden']} (MLP "
            f"{c['intermediate'] or 'the target'}'s, heads as the target's unless set) over the "
            f"states LEAVING target layers {c['target_layer_ids']} (output convention: exactly "
            "the capture's states, head.aux_layers minus one, low / mid / high as EAGLE-3's) "
            "through one shared `fc`; the target's embedding and lm_head, frozen")  # fmt: skip
    if kind == "block":
        return f"DFlash's layout (`pairs.block`): {base}."
    if kind == "dspark":
        return (f"DeepSpec's layout (`Qwen3DSparkModel`, read at {DEEPSPEC}): {base}; a "
                f"{c['markov_head_type']} Markov head of rank {c['markov_rank']} and a "
                "confidence head. Its own `embed_tokens` and `lm_head` are frozen copies of the "
                "target's, so the file leaves them out and config.json says "
                "`shared_with_target: [embed_tokens, lm_head]`: the loader fills them from the "
                "target (`pairs.semiar.layout`).")  # fmt: skip
    return (f"SpecForge's layout (`DominoDraftModel`, read at {SPECFORGE}): {base}; a prefix "
            f"GRU of width {c['gru_hidden_dim']} and embed_proj of width {c['emb_dim']}, "
            f"rows past the first {c['pure_draft_prefix_len']} corrected.")  # fmt: skip


def _loss(facts: dict) -> str:
    c, kind = facts["config"], facts["kind"]
    ce = (f"cross-entropy against the window's tokens (DFlash's hard labels: the replies are the "
          f"target's own greedy text), row k weighted exp(-(k - 1) / {c['decay_gamma']})")  # fmt: skip
    if kind == "block":
        return ce
    if kind == "dspark":
        return (f"{c['ce_alpha']} x the {ce} + {c['l1_alpha']} x sum |q - p| + "
                f"{c['confidence_alpha']} x the confidence BCE towards 1 - TV(q, p); p the "
                f"captured top-{facts['head']['target_top_k']} target row over the draft "
                "vocabulary, mapped back to target ids and renormalised over those tokens (an "
                "approximation: the target's mass outside them is dropped)")  # fmt: skip
    return (f"SpecForge's curriculum: (1 - lambda) x CE(final) + lambda x CE(base), the {ce}; "
            f"lambda from {c['lambda_base_start']} to 0 over the first "
            f"{c['lambda_base_decay_ratio']} of the run")  # fmt: skip


def _calibration(facts: dict) -> str:
    s = facts.get("sts")
    if not s:
        return ""
    mean = {k: sum(s[k]["ece"]) / len(s[k]["ece"]) for k in ("before", "after")}
    temps = ", ".join(f"{t:.2f}" for t in s["temperatures"])
    return (f"\n- confidence calibration (sequential temperature scaling, fitted on "
            f"{s['fit_blocks']} held-out blocks, reported on {s['report_blocks']} others): ECE "
            f"of the cumulative acceptance, mean over positions, {mean['before']:.4f} -> "
            f"{mean['after']:.4f}; temperatures {temps}")  # fmt: skip


def write_card(out: Path, facts: dict) -> None:
    (out / "recipe.json").write_text(json.dumps(facts, indent=2) + "\n")
    c, d, t, h = facts["config"], facts["data"], facts["train"], facts["head"]
    v, b = facts["val"], facts.get("val_base")
    init = (f"the backbone started from the trained block drafter `{c['backbone_init']}` (the "
            "heads from the reference's init), which saves CPU" if c.get("backbone_init")
            else "from scratch")  # fmt: skip
    files = "\n".join(f"| `{n}` | {s:,} |" for n, s in facts["sizes"].items())
    base = (f"; the backbone's rows alone {_rows(b)}, run {b.get('chain_run', float('nan')):.2f}"
            if b else "")  # fmt: skip
    text = f"""# {NAMES[facts["kind"]]} for `{facts["target"]}`

Trained on this project's CPU by `python -m decode.train_head model={model_name(facts)}`
(`recipes/block_head/`), settings in `recipe.json`. Decode it with `model={model_name(facts)}`.
{facts["params"]:,} parameters, {facts["trainable"]:,} trained ({facts["heads"]:,} in the
kind's head); the block drafts {facts["depth"]} positions; mask token {facts["mask_token_id"]}.

## Model

{_model(facts)}

## Data

- the EAGLE-3 head recipe's capture of the target, reused (`{h["capture"]}`, made once by
  `recipes.eagle3.data`): {d["tokens"]:,} tokens in {d["windows"]} windows of {d["window"]}
  (training-side ShareGPT conversations and the target's own greedy replies), {d["val_windows"]}
  windows held out; {d["assistant_tokens"]:,} assistant tokens trained on
- no target forward while training: the captured states, the target's embedding and lm_head

## Training

- {c["anchors"]} blocks per window at random anchors on assistant positions, all in one
  masked forward; {_loss(facts)}; {init}
- AdamW, lr {c["train"]["lr"]}, {t["steps"]} steps of {c["train"]["batch"]} windows,
  {t["minutes"]:.1f} min on {h["threads"]} CPU thread(s) ({t["ms_per_step"]:.0f} ms a step,
  evaluation included; torch {facts["torch"]}); a rerun resumes from its checkpoint

## Held-out figures

- teacher-forced agreement with the target's argmax on the capture's held-out windows, rows
  1 / 2 / ...: {_rows(v)}; mean leading run of matches {v.get("chain_run", float("nan")):.2f}{base}{_calibration(facts)}

## Decoding

{suite_section(facts.get("suite"), model_name(facts)).rstrip()}

## Context window

Trained on windows of {d["window"]} positions, an anchor at most {d["window"]} - 1 -
{facts["depth"]}, so no block attended to more than **{facts["context_window"]} context
positions**: `conf/model/{model_name(facts)}.yaml` sets `model.drafter_window:
{facts["context_window"]}`.

## Files

| file | bytes |
|---|---|
{files}
"""
    (out / "MODEL_CARD.md").write_text(reflow(text))
