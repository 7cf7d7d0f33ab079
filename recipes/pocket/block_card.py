"""MODEL_CARD.md and recipe.json of the pocket block drafter, from the recipe's facts."""

from __future__ import annotations

import json
from pathlib import Path


def write_card(out: Path, facts: dict) -> None:
    (out / "recipe.json").write_text(json.dumps(facts, indent=2) + "\n")
    c, d, t, v = facts["config"], facts["data"], facts["train"], facts["val"]
    rows = " / ".join(f"{v[k]:.3f}" for k in sorted(v) if k.startswith("agree_row"))
    files = "\n".join(f"| `{name}` | {size:,} |" for name, size in facts["sizes"].items())
    weights, labels = _loss_text(c)
    per_layer = c.get("context_mixing", "shared") == "per_layer"
    name, command, context, keys = _context_text(per_layer)
    text = f"""# Pocket block drafter{" (DCore recipe)" if per_layer else ""}

A block-parallel drafter in DFlash's layout for the pocket target (`models/pocket/target`),
trained by `python -m decode.train_pocket.block{command}` on this machine's CPU. Like the
pocket pair it is a stand-in: its figures say nothing about drafters for 8B-class targets.
Select it with `model=pocket_{name}` (`conf/model/pocket_{name}.yaml`).

## Format

DFlash's layout (z-lab/dflash `DFlashDraftModel`): `config.json`, a Qwen3 layer config with
`architectures: ["DFlashDraftModel"]`, `block_size: {c["block_size"]}` and `dflash_config`
(`target_layer_ids: {c["target_layer_ids"]}`, `mask_token_id: {facts["mask_token_id"]}`{
        ", `context_mixing: per_layer`" if per_layer else ""
    });
`model.safetensors` ({c["export_dtype"]}): {keys}, `norm`. No
embedding and no lm_head: the drafter uses the target's.

- one decoder layer, hidden {facts["hidden"]}, MLP {c["intermediate"]}, {c["heads"]} heads /
  {c["kv_heads"]} kv heads; {facts["params"]:,} parameters
- target states: those LEAVING target layers {c["target_layer_ids"]} (output convention,
  transformers' `hidden_states[i + 1]`), {context}
- mask: the pocket vocabulary has no mask token, so an id is reserved:
  the pad id ({facts["mask_token_id"]}), never a training target and never emitted by the
  target. The placeholders are its frozen embedding row; no embedding is learned
- the block's marginals are not conditioned on earlier draft tokens

## Recipe

- data: the pocket EAGLE-3 head's (training side of the pocket corpus' split only):
  {d["text_tokens"]:,} tokens of standard-library text and {d["rollout_tokens"]:,} tokens of
  the target's own T=1 continuations of {d["rollout_prompts"]} prompts; {d["minutes"]:.1f} min
- {c["anchors"]} blocks per window at random anchors, each over the context before its
  anchor; loss: cross-entropy at each block row against {labels}; {weights}
- AdamW, lr {c["train"]["lr"]}, {t["steps"]} steps of {c["train"]["batch"]} windows of
  {c["train"]["seq_len"]} positions, {t["minutes"]:.1f} min on {c["threads"]} thread(s)
  (torch {facts["torch"]}); a rerun on another machine reproduces the recipe, not these
  exact weights
- held-out agreement (drafter argmax equal to the target's, standard-library validation
  files, teacher-forced) at block rows 1 / 2 / ...: {rows}; mean leading run of matches
  (a greedy chain's accepted drafts, teacher-forced): {v.get("chain_run", float("nan")):.2f}

{window_text(facts, f"pocket_{name}")}

## Files

| file | bytes |
|---|---|
{files}
"""
    (out / "MODEL_CARD.md").write_text(text)


def window_text(facts: dict, model: str) -> str:
    """The card's section on the trained context window and the setting that keeps to it."""
    w, c = facts["context_window"], facts["config"]
    return f"""## Context window

Trained on windows of {c["train"]["seq_len"]} positions, a block's anchor at most
{c["train"]["seq_len"]} - {c["train"]["seq_len"] - w} (its drafted rows fit the window), so no
block attended to more than **{w} context positions**. Online the context is the prompt and
the output so far, often longer, and the rows degrade past the trained window.
`conf/model/{model}.yaml` sets `model.drafter_window: {w}`: the drafter attends to its latest
{w} context positions only (exact: its context keys carry their absolute positions), and
holds no more. `model.drafter_window: null` drafts over the whole context, as the references
do."""


def _loss_text(c: dict) -> tuple[str, str]:
    """The card's sentences on the position weights and the labels."""
    weights = (
        f"DFlash's decay, row k weighted exp(-(k - 1) / {c['decay_gamma']}) "
        "(normalised to mean 1). The paper gives no constant; 4 is the public DFlash training "
        "code's for blocks of 8, close to this one's 9: the last row weighs about a sixth of the first"
        if c["position_weights"] == "decayed"
        else "D-PACE's acceptance-oriented weights w_j = sum_{m >= j} prod_{i <= m} q_i, q_i the "
        "drafter's mean probability of the gold token at row i smoothed by a moving average "
        f"of factor {c['dpace_smoothing']} over steps. The paper gives no smoothing constant; "
        "0.9 averages about ten steps, enough to damp one batch's noise while following training"
    )
    labels = (
        "the target's own row at that position (`labels: target`): the pocket corpus' text is "
        "not target-generated, as DFlash's training data is, so the target's distribution is "
        "the label"
        if c.get("labels", "target") == "target"
        else "the window's next token (`labels: data`, DFlash's hard labels)"
    )
    return weights, labels


def _context_text(per_layer: bool) -> tuple[str, str, str, str]:
    """(model name, recipe override, how the target states become context, weight keys)."""
    name, command = ("block_dcore", " pocket_block=dcore") if per_layer else ("block", "")
    context = (
        "mixed for each draft layer i with its own weights softmax(W_fuse[i, :]) (`fuse`, "
        "DFlare's per-draft-layer mixing, the DCore recipe's context) and turned into that "
        "layer's context keys and values by its own `context_k_proj` / `context_v_proj`"
        if per_layer
        else "projected by one shared `fc`"
    )
    keys = (
        "`fuse`, `hidden_norm`, `layers.0.*` (with `context_{k,v}_proj`)"
        if per_layer
        else ("`fc`, `hidden_norm`, `layers.0.*`")
    )
    return name, command, context, keys
