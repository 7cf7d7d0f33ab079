"""MODEL_CARD.md and recipe.json of the pocket semi-AR drafters (DSpark, Domino), from the
recipe's facts (`recipes.pocket.semiar.run`)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from recipes.pocket.block_card import window_text

DEEPSPEC = "deepseek-ai/DeepSpec@afdfa7c9382a3341a3e6f17756dd816da79f132c"
SPECFORGE = "sgl-project/SpecForge@a6b6b0230009d15ec2a97a57384e6f53f0f96946"


def write_card(out: Path, facts: dict) -> None:
    (out / "recipe.json").write_text(json.dumps(facts, indent=2) + "\n")
    c, d, t = facts["config"], facts["data"], facts["train"]
    dspark = facts["kind"] == "dspark"
    files = "\n".join(f"| `{name}` | {size:,} |" for name, size in facts["sizes"].items())
    text = f"""# Pocket {"DSpark" if dspark else "Domino"} drafter

A semi-autoregressive block drafter for the pocket target (`models/pocket/target`): a DFlash
backbone whose block rows are corrected from the drafted path ({
        "DeepSpec's DSpark: a Markov head on the previous token, and a confidence head"
        if dspark
        else "SpecForge's Domino: a GRU over the path's tokens and embed_proj"
    }), trained by `python -m decode.train_pocket.{facts["kind"]}` on this machine's CPU. Like the
pocket pair it is a stand-in: its figures say nothing about drafters for 8B-class targets.
Decode it with `model=pocket_{facts["kind"]}` (`conf/model/pocket_{facts["kind"]}.yaml`), i.e.
`model.drafter_kind={facts["kind"]} model.drafter=models/pocket/{facts["kind"]}`.

## Format

{_format(facts)}

- one backbone decoder layer, hidden {facts["hidden"]}, MLP {c["intermediate"]},
  {c["heads"]} heads / {c["kv_heads"]} kv heads, over the states LEAVING target layers
  {c["target_layer_ids"]} (output convention) through one shared `fc`; {facts["params"]:,}
  parameters, {facts["trainable"]:,} trained, {facts["heads"]:,} of them the kind's head
- mask: the pad id ({facts["mask_token_id"]}), as the pocket block drafter's (the pocket
  vocabulary has no mask token); the block drafts {facts["depth"]} positions (depth
  {facts["depth"]}, the default pool's)

## Recipe

- data: the pocket EAGLE-3 head's and block drafter's (training side of the pocket corpus'
  split only): {d["text_tokens"]:,} tokens of standard-library text and {d["rollout_tokens"]:,}
  tokens of the target's own T=1 continuations of {d["rollout_prompts"]} prompts;
  {d["minutes"]:.1f} min
- the block recipe's training (`recipes.pocket.block`): {c["anchors"]} blocks per window at
  random anchors, each over the context before its anchor, all in one masked forward; the
  node of row j is the window's token at a + j (teacher-forced paths, as both references train)
{_loss(facts)}
- AdamW, lr {c["train"]["lr"]}, {t["steps"]} steps of {c["train"]["batch"]} windows of
  {c["train"]["seq_len"]} positions, {t["minutes"]:.1f} min on {c["threads"]} thread(s)
  (torch {facts["torch"]}); a rerun on another machine reproduces the recipe, not these
  exact weights

## Held-out figures

{_heldout(facts)}

{window_text(facts, f"pocket_{facts['kind']}")}

## Files

| file | bytes |
|---|---|
{files}
"""
    (out / "MODEL_CARD.md").write_text(reflow(text))


def reflow(text: str, width: int = 95) -> str:
    """Paragraphs and bullets re-wrapped at `width` (headings and tables kept as they are)."""
    blocks = []
    for block in text.strip("\n").split("\n\n"):
        if block.startswith(("#", "|")):
            blocks.append(block)
            continue
        items: list[str] = []
        for line in block.splitlines():
            if line.startswith("- ") or not items:
                items.append(line.strip())
            else:
                items[-1] += " " + line.strip()
        blocks.append("\n".join(textwrap.fill(i, width, subsequent_indent="  " if i.startswith("- ") else "",
                                               break_on_hyphens=False, break_long_words=False)
                                 for i in items))  # fmt: skip
    return "\n\n".join(blocks) + "\n"


def _format(facts: dict) -> str:
    c = facts["config"]
    if facts["kind"] == "dspark":
        return f"""DeepSpec's layout (`Qwen3DSparkModel`, `deepspec/modeling/dspark/`, read at
{DEEPSPEC}): `config.json`, a Qwen3 config with every DSpark setting at the top level
(`block_size: {c["block_size"]}`, `target_layer_ids`, `mask_token_id`, `markov_rank:
{c["markov_rank"]}`, `markov_head_type: {c["markov_head_type"]}`, `enable_confidence_head:
true`, `confidence_head_with_markov: {str(c["confidence_with_markov"]).lower()}`,
`num_anchors`); `model.safetensors` ({c["export_dtype"]}): the backbone's keys, its own
`embed_tokens` and `lm_head` (copies of the target's, frozen, as DeepSpec initialises them),
`markov_head.*`, `confidence_head.proj.*`. Block row k drafts the token at r + k + 1."""
    return f"""SpecForge's layout (`DominoDraftModel`, `specforge/modeling/draft/domino.py`, read
at {SPECFORGE}): `config.json`, a Qwen3 config with DFlash's places (`block_size:
{c["block_size"]}` at the top level) and under `dflash_config`: `projector_type: domino`,
`emb_dim: {c["emb_dim"]}`, `gru_hidden_dim: {c["gru_hidden_dim"]}`, `shift_label: false`,
`pure_draft_prefix_len: {c["pure_draft_prefix_len"]}`, `target_layer_ids`, `mask_token_id`;
`model.safetensors` ({c["export_dtype"]}): the backbone's keys, `prefix_gru.weight_{{ih,hh}}_l0`,
`embed_proj.{{0,2}}.weight`. No embedding and no lm_head: the target's are used."""


def _loss(facts: dict) -> str:
    c = facts["config"]
    labels = ("the target's own row at that position (`labels: target`, as the pocket block "
              "drafter: the pocket corpus is not target-generated)" if c["labels"] == "target"
              else "the window's next token (`labels: data`, the references' hard labels)")  # fmt: skip
    decay = (f"every term weighted by the decay exp(-j / {c['decay_gamma']}) over rows "
             "j = 0 .. D - 1 (normalised to mean 1)")  # fmt: skip
    if facts["kind"] == "dspark":
        return f"""- loss (DeepSpec's `compute_dspark_loss`): {c["ce_alpha"]} x cross-entropy of the
  corrected row against {labels} + {c["l1_alpha"]} x sum |q - p| (= 2 TV to the target's row:
  distribution matching) + {c["confidence_alpha"]} x BCE of the confidence logit towards
  1 - TV(q, p) (detached); {decay}
- constants and why: the weights 0.1 / 0.9 / 1.0 and gamma 4 are DeepSpec's released
  `config/dspark/dspark_qwen3_8b.py` (blocks of 7; this one's 8 is the default pool's depth);
  markov_rank {c["markov_rank"]}: the released 256 serves a 151,936-token vocabulary at width
  4096, none is published for a 1,024-token one; rank {c["markov_rank"]} keeps the head a
  low-rank bigram, {facts["heads"]:,} parameters with the confidence head beside the
  backbone's {facts["backbone"]:,}; the {c["markov_head_type"]} head is the released
  configs'; the heads start at Hugging Face's init (std 0.02), as the reference's do
- calibration: the paper's Sequential Temperature Scaling (its Sec. 3.2.1; not in the code):
  per block position, left to right, the temperature (grid of 241 log-spaced values in
  [0.05, 20]; the paper gives none) minimising the {c["calibration_bins"]}-bin ECE (DeepSpec's
  evaluator's bins) of the cumulative product against the prefix acceptance
  prod (1 - TV), on alternate held-out windows of the first {c["calibration_tokens"]:,}
  validation tokens (the others report it); the targets are teacher-forced expected
  acceptances, not verification outcomes as the paper's"""
    return f"""- loss (SpecForge's `OnlineDominoModel`): (1 - lambda) x CE(final rows) + lambda x
  CE(base rows) against {labels}; {decay}; lambda falls linearly from
  {c["lambda_base_start"]} to 0 over the first {c["lambda_base_decay_ratio"]} of the run
  (SpecForge's `linear_lambda_base`, the share done in steps or wall time, whichever binds)
- constants and why: gamma 4 is the pocket block drafter's (SpecForge's 7 is for blocks of 16;
  4 for 9 keeps about the same decay per block); decay ratio 0.5 is SpecForge's default
  (its 8B example uses 1.0): on a 10-minute run the corrected rows' objective then has the
  second half of the steps to itself; pure_draft_prefix_len 1 is the released config's (the first drafted row's path is
  the root alone, which the backbone already reads); shift_label false keeps DFlash's rows
  (the pocket block drafter's), where the released config shifts; gru_hidden_dim
  {c["gru_hidden_dim"]} and emb_dim {c["emb_dim"]}: the released 1024 / 256 serve width 4096
  and a 151,936-token vocabulary, none is published for this size; these keep the head at
  {facts["heads"]:,} parameters beside the backbone's {facts["backbone"]:,}; the head starts at Hugging Face's init (std 0.02; the GRU
  at torch's), as the reference's"""


def _heldout(facts: dict) -> str:
    v, b = facts["val"], facts.get("val_base", {})

    def rows(x: dict) -> str:
        return " / ".join(f"{x[k]:.3f}" for k in sorted(x) if k.startswith("agree_row"))

    lines = [f"""- teacher-forced agreement (drafter argmax equal to the target's on the
  standard-library validation files, paths from the text) at rows 1 / 2 / ...: corrected
  {rows(v)}; the backbone's rows alone {rows(b)}; mean leading run of matches
  {v.get("chain_run", float("nan")):.2f} (backbone alone {b.get("chain_run", float("nan")):.2f})"""]  # fmt: skip
    h = facts.get("heldout")
    if h:
        w = h.get("drafter_window")
        over = "the whole context" if w is None else f"the latest {w} context positions"
        lines.append(f"""- online tau at B=8 (7 drafted nodes of the default 710-candidate pool, draft rule),
  T=0, {h["prompts"]} default-suite prompts (never trained on), {h["max_new_tokens"]} tokens,
  both drafters over {over}:
  **tau {h["tau"]:.3f}** over {h["rounds"]} rounds (tokens per round, the bonus token
  included); the pocket block drafter (DFlash recipe) on the same prompts: {h["block_tau"]:.3f}
  over {h["block_rounds"]} rounds; greedy output equal to target-only's: {h["lossless"]}""")  # fmt: skip
    s = facts.get("sts")
    if s:
        temps = ", ".join(f"{x:.2f}" for x in s["temperatures"])
        mean = {k: {q: sum(s[k][q]) / len(s[k][q]) for q in ("ece", "nll")} for k in ("before", "after")}  # fmt: skip
        lines.append(f"""- confidence calibration: temperatures per position {temps}; on {s["report_blocks"]}
  held-out blocks not fitted on, the cumulative product's ECE (mean over positions)
  {mean["before"]["ece"]:.4f} -> {mean["after"]["ece"]:.4f} and NLL
  {mean["before"]["nll"]:.4f} -> {mean["after"]["nll"]:.4f} (fitted on {s["fit_blocks"]})""")  # fmt: skip
    return "\n".join(lines)
