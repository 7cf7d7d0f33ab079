"""The pocket EAGLE-3 head: data, training-time-test training, export (`models/pocket/eagle3/`).

    python -m decode.train_pocket.eagle3   # train and ship the head (a few CPU minutes)
    python -m bench.bench_eagle3 --card    # tau and speed vs the standalone drafter -> card

Data, all offline and from the training side of the pocket corpus' split rule
(`recipes.pocket.corpus`; held-out files and the default suite's prompts never enter):
CPython standard-library files (whole files and chat-wrapped blocks, as the pocket pair
trained on), and the shipped target's own T=1 continuations of prompts drawn from those
files (code heads and docstring first lines under the chat template), as EAGLE-3 trains on
target-generated replies.

Training (EAGLE-3's training-time test): the target's aux hidden states (hidden_states[i]
for `aux_layers`, the input convention) and rows come from a frozen forward; step 0 feeds
the pairs (feature j, token j + 1) causally, step k feeds each position's step-(k - 1)
output with token j + k + 1 at position j + k, attending to step 0's keys up to j and its
own earlier steps at j -- exactly what a depth-k node sees in tree drafting
(`pairs.eagle3.pool`). Loss: forward KL from the target's row restricted to the draft
vocabulary (renormalised) to the head's, at positions whose target argmax the draft
vocabulary holds, step k weighted `ttt_decay ** k`.
"""

from __future__ import annotations

import logging
import platform
import random
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig

import specrank.settings.config  # noqa: F401  (registers the root schema)
from pairs.eagle3.capture import join_aux, resolve_aux_layers
from pairs.eagle3.head import Eagle3Head
from pairs.eagle3.layout import HeadSpec
from pairs.eagle3.save import save_head
from pairs.prompts import encode_prompt
from recipes.eagle3.data import frequent_tokens
from recipes.pocket import corpus, tokenizer, train
from recipes.pocket.config import CorpusConfig, PocketBlockConfig, PocketEagle3Config
from recipes.pocket.eagle3_card import write_card
from recipes.pocket.train import Log
from specrank.settings.cli import exits_on_refusal
from specrank.settings.paths import CONF_DIR
from tree.attention import to_attention_mask

log = logging.getLogger("recipes.pocket.eagle3")


# -- data -----------------------------------------------------------------------------------------


def training_files(cc: CorpusConfig, seed: int) -> tuple[list[tuple[str, str]], corpus.CodeSplit]:
    """The standard library's training-side files, and the corpus' code split (docs per side)."""
    files = corpus.stdlib_files(cc)
    train_files = [
        f for f in files if corpus.bucket_of(f[0], cc.heldout_buckets) != cc.heldout_bucket
    ]
    return train_files, corpus.split_code(files, cc, seed)


def text_stream(tok, docs: list, max_chars: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded sample of documents up to `max_chars` characters, tokenized into one stream."""
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    kept, chars = [], 0
    for d in docs:
        if chars >= max_chars:
            break
        kept.append(d)
        chars += len(d[0])
    return tokenizer.encode_docs(tok, kept)


def training_prompts(files: list[tuple[str, str]], n: int, seed: int) -> list[str]:
    """Half code heads (a block's first lines), half docstring first lines, from training files."""
    rng = random.Random(seed)
    heads, docs = [], []
    for _, src in files:
        for block in re.split(r"\n(?=(?:def|class) )", src):
            lines = block.strip("\n").splitlines()
            if 6 <= len(lines) <= 80 and lines[0].startswith(("def ", "class ")):
                heads.append("\n".join(lines[: rng.randint(1, 4)]))
        docs += re.findall(r'"""([A-Z][^\n"]{24,200}[.?])', src)
    rng.shuffle(heads)
    rng.shuffle(docs)
    return heads[: n - n // 2] + docs[: n // 2]


@torch.no_grad()
def continuations(
    target,
    prompts: list[list[int]],
    n_tokens: int,
    pad: int,
    stop: set[int],
    seed: int,
    batch: int = 32,
) -> tuple[np.ndarray, np.ndarray]:
    """The target's T=1 continuations (full rows, no top-k), batched with left padding.

    One stream of prompt + continuation per prompt; the loss mask covers continuations only.
    """
    gen = torch.Generator().manual_seed(seed)
    stops = torch.tensor(sorted(stop))
    ids_out, mask_out = [], []
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo : lo + batch]
        width = max(map(len, chunk))
        step = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        cache, done, new = (
            DynamicCache(config=target.config),
            torch.zeros(len(chunk), dtype=torch.bool),
            [],
        )
        for _ in range(n_tokens):
            pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step.shape[1] :]
            logits = target(
                input_ids=step, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True
            ).logits[:, -1]
            t = torch.multinomial(F.softmax(logits.float(), -1), 1, generator=gen)[:, 0]
            t = torch.where(done, pad, t)  # finished rows only pad (masked out below)
            new.append(t)
            attn = torch.cat([attn, (~done).long()[:, None]], 1)
            done = done | torch.isin(t, stops)
            step = t[:, None]
            if bool(done.all()):
                break
        for p, g in zip(chunk, torch.stack(new, 1).tolist(), strict=True):
            n = next((i + 1 for i, t in enumerate(g) if t in stop), len(g))
            ids_out.append(np.asarray(p + g[:n], dtype=np.uint16))
            mask_out.append(np.asarray([False] * len(p) + [True] * n))
    return np.concatenate(ids_out), np.concatenate(mask_out)


def draft_vocabulary(streams: train.Streams, n: int) -> torch.Tensor:
    """The `n` most frequent trained-on tokens of both streams, ascending ids (EAGLE-3's rule)."""
    ids = np.concatenate([streams.code_ids, streams.chat_ids])
    mask = np.concatenate([streams.code_mask, streams.chat_mask])
    return torch.from_numpy(frequent_tokens(ids, mask, n)).long()


# -- the head and its loss ------------------------------------------------------------------------


def make_spec(
    target, aux: tuple[int, ...], draft_vocab: int, intermediate: int, heads: int, kv_heads: int
) -> HeadSpec:
    """One decoder layer at the target's width, with its norm and rotary settings."""
    t = target.config
    layer = LlamaConfig(
        hidden_size=t.hidden_size,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=t.hidden_size // heads,
        num_hidden_layers=1,
        vocab_size=t.vocab_size,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps,
        rope_parameters=dict(t.rope_parameters),
    )
    return HeadSpec(layer, draft_vocab, t.hidden_size, tuple(aux), False, "eagle3")


def make_head(spec: HeadSpec, target, draft_ids: torch.Tensor, seed: int) -> Eagle3Head:
    torch.manual_seed(seed)
    spec.layer._attn_implementation = "sdpa"
    head = Eagle3Head(
        spec.layer,
        len(spec.aux_layer_ids),
        spec.target_hidden_size,
        spec.draft_vocab_size,
        token_ids=draft_ids,
        own_embed=False,
    )
    with torch.no_grad():  # start the draft lm_head at the target's (tied) output rows
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
    head.share(target.get_input_embeddings(), None)
    return head


@torch.no_grad()
def target_view(target, x: torch.Tensor, aux: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux features [b, L, k*H], float32 log-rows [b, L, V]) of token windows x [b, L]."""
    out = target(input_ids=x, output_hidden_states=True)
    return join_aux([out.hidden_states[i] for i in aux]), out.logits.float().log_softmax(-1)


def ttt_steps(head: Eagle3Head, feats, x, steps: int):
    """Yield (step k, pre-norm outputs [b, T, hidden]) of each training-time-test step
    (`head.logits` of them: the step's draft logits).

    x: [b, L] windows; T = L - steps - 2 positions, so that step k's row at j (predicting
    token j + k + 2) has a target row and a loss-mask entry inside the window.
    """
    b, length = x.shape
    n = length - steps - 2
    hidden = head.fuse(feats[:, :n])
    cache = DynamicCache(config=head.config)
    pos = torch.arange(n)[None].expand(b, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    for k in range(steps + 1):
        vis = torch.cat([causal] + [eye] * k, dim=1)  # step 0 causal, own earlier steps at j
        mask = to_attention_mask(vis, hidden.dtype, head.config._attn_implementation)
        hidden = head(hidden, x[:, k + 1 : k + 1 + n], pos + k, mask, cache)
        yield k, hidden


def draft_ids(head: Eagle3Head) -> torch.Tensor:
    """Target id of each draft id (the identity when the vocabularies are the same)."""
    return head.token_ids if head.token_ids is not None else torch.arange(head.draft_vocab)


def ttt_loss(head, target, x, m, aux, steps: int, decay: float) -> torch.Tensor:
    feats, logp = target_view(target, x, aux)
    ids = draft_ids(head)
    n = x.shape[1] - steps - 2
    loss = torch.zeros(())
    for k, hidden in ttt_steps(head, feats, x, steps):
        logq = head.logits(hidden).float().log_softmax(-1)
        rows = logp[:, k + 1 : k + 1 + n]  # the target's row predicting token j + k + 2
        held = torch.isin(rows.argmax(-1), ids) & m[:, k + 1 : k + 1 + n]
        p = rows[..., ids].log_softmax(-1)  # restricted to the draft vocabulary, renormalised
        kl = (p.exp() * (p - logq)).sum(-1)
        loss = loss + decay**k * (kl * held).sum() / held.sum().clamp(min=1)
    return loss


@torch.no_grad()
def ttt_agreement(
    head, target, ids_np, mask_np, aux, steps: int, seq_len: int, max_tokens: int
) -> list[float]:
    """Per step: share of held-out positions where the head's argmax is the target's argmax."""
    head.eval()
    hit, tot = np.zeros(steps + 1), np.zeros(steps + 1)
    for x, m in train.val_windows(ids_np, mask_np, seq_len + steps + 1, max_tokens):
        feats, logp = target_view(target, x, aux)
        n = x.shape[1] - steps - 2
        for k, hidden in ttt_steps(head, feats, x, steps):
            logq = head.logits(hidden)
            want = logp[:, k + 1 : k + 1 + n].argmax(-1)
            got = draft_ids(head)[logq.argmax(-1)]
            sel = m[:, k + 1 : k + 1 + n]
            hit[k] += float(((want == got) & sel).sum())
            tot[k] += float(sel.sum())
    head.train()
    return (hit / np.maximum(tot, 1)).tolist()


# -- the recipe -----------------------------------------------------------------------------------


def export_head(head: Eagle3Head, spec: HeadSpec, out: Path, dtype: str) -> dict[str, int]:
    """config.json + model.safetensors (plain EAGLE-3 layout, `dtype` weights); their sizes."""
    cast = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    state = {k: (v.to(cast) if v.is_floating_point() else v) for k, v in head.own_state().items()}
    weights = save_head(out, state, spec, layout="eagle3")
    weights.chmod(0o644)  # safetensors writes 0600; the shipped folder is read by everyone
    return {p.name: p.stat().st_size for p in (out / "config.json", weights)}


@dataclass
class TrainingData:
    """The recipe's training data: text and rollout streams, validation text, their sources."""

    files: list[tuple[str, str]]
    prompts: list[list[int]]
    streams: train.Streams  # "code": text, "chat": rollouts
    val_ids: np.ndarray
    val_mask: np.ndarray


def load_target(target_dir: Path):
    """The frozen float32 target and its tokenizer."""
    target = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    target.requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(target_dir, local_files_only=True)


def training_data(pc: PocketEagle3Config | PocketBlockConfig, target, tok) -> TrainingData:
    """Stdlib text, the target's rollouts on training prompts, and validation text."""
    files, split = training_files(CorpusConfig(), pc.seed)
    text_ids, text_mask = text_stream(tok, split.train, pc.code_chars, pc.seed)
    val_ids, val_mask = tokenizer.encode_docs(tok, split.val)
    prompts = [encode_prompt(tok, p) for p in training_prompts(files, pc.rollout_prompts, pc.seed)]
    stop = {tok.eos_token_id, tok.pad_token_id}
    roll_ids, roll_mask = continuations(
        target, prompts, pc.rollout_tokens, tok.pad_token_id, stop, pc.seed
    )
    streams = train.Streams(text_ids, text_mask, roll_ids, roll_mask)
    return TrainingData(files, prompts, streams, val_ids, val_mask)


def _train(
    pc: PocketEagle3Config, target, aux: tuple[int, ...], data: TrainingData, log: Log
) -> tuple[Eagle3Head, HeadSpec, dict]:
    """A fresh head trained by training-time test; (head in eval mode, its spec, the run)."""
    spec = make_spec(target, aux, pc.draft_vocab, pc.intermediate, pc.heads, pc.kv_heads)
    head = make_head(spec, target, draft_vocabulary(data.streams, pc.draft_vocab), pc.seed)
    tcfg = replace(pc.train, seq_len=pc.train.seq_len + pc.ttt_steps + 1)  # see ttt_steps

    def loss_fn(x, m):
        return ttt_loss(head, target, x, m, aux, pc.ttt_steps, pc.ttt_decay)

    def evaluate():
        agree = ttt_agreement(
            head, target, data.val_ids, data.val_mask, aux, pc.ttt_steps, pc.train.seq_len, 8192
        )
        return {f"agree_step{k}": a for k, a in enumerate(agree)}

    res = train.train_loop(head, loss_fn, data.streams, evaluate, tcfg, pc.seed, log)
    head.eval()
    return head, spec, res


def _facts(
    pc: PocketEagle3Config,
    aux: tuple[int, ...],
    head: Eagle3Head,
    spec: HeadSpec,
    data: TrainingData,
    data_minutes: float,
    res: dict,
    sizes: dict[str, int],
) -> dict:
    """The recipe's facts, as `recipe.json` and the card record them."""
    return {
        "config": {k: getattr(pc, k) for k in pc.__dataclass_fields__ if k != "train"}
        | {"train": vars(pc.train)},
        "aux_layers": list(aux),
        "params": sum(p.numel() for p in head.parameters()),
        "hidden": spec.layer.hidden_size,
        "data": {
            "text_tokens": len(data.streams.code_ids),
            "rollout_tokens": len(data.streams.chat_ids),
            "rollout_prompts": len(data.prompts),
            "val_tokens": len(data.val_ids),
            "stdlib_train_files": len(data.files),
            "minutes": data_minutes,
        },
        "train": res,
        "val_agreement": res["history"][-1] if res["history"] else {},
        "sizes": sizes,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def run(pc: PocketEagle3Config, log: Log = print) -> dict:
    """Data, training and export; writes `recipe.json` and `MODEL_CARD.md` beside the head."""
    if pc.export_dtype not in ("float16", "bfloat16"):
        raise ValueError(
            f"pocket_eagle3.export_dtype: expected float16 or bfloat16, found {pc.export_dtype!r}"
        )
    torch.set_num_threads(pc.threads)
    t0 = time.time()
    target_dir, out = corpus.resolve(pc.target), corpus.resolve(pc.out_dir)
    target, tok = load_target(target_dir)
    aux = resolve_aux_layers(
        pc.aux_layers, None, "input", target.config.num_hidden_layers, "pocket_eagle3.aux_layers"
    )
    data = training_data(pc, target, tok)
    data_minutes = (time.time() - t0) / 60
    log(
        f"data: {len(data.streams.code_ids)} text tokens, {len(data.streams.chat_ids)} "
        f"rollout tokens, {data_minutes:.1f} min"
    )
    head, spec, res = _train(pc, target, aux, data, log)
    sizes = export_head(head, spec, out, pc.export_dtype)
    facts = _facts(pc, aux, head, spec, data, data_minutes, res, sizes)
    # New weights: default-suite figures are measured afresh (`python -m bench.bench_eagle3 --card`).
    write_card(out, facts)
    log(f"head: {facts['params']:,} parameters, {sum(sizes.values()):,} bytes in {out}")
    return facts


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="pocket")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    run(OmegaConf.to_object(cfg.pocket_eagle3), log.info)
