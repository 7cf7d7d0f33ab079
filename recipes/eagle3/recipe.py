"""The head recipe end to end: data, capture, training, export (`python -m decode.train_head`).

Every stage keeps its output in `head.work_dir/<model.name>/` (git-ignored), so a rerun
after an interruption skips what is done: the windows (`windows.npz`), each captured shard,
and training from its last checkpoint.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pairs.config import ModelConfig
from pairs.eagle3.capture import resolve_aux_layers
from pairs.models import DTYPES, checkpoint_dir
from recipes.eagle3 import data
from recipes.eagle3.card import write_card
from recipes.eagle3.config import HeadRecipeConfig
from recipes.eagle3.fit import fit_head
from recipes.pocket.config import CorpusConfig
from recipes.pocket.eagle3 import export_head, make_head, make_spec
from specrank.settings.checks import check_choice
from specrank.settings.paths import project_path


def check(hc: HeadRecipeConfig) -> None:
    """Every setting the recipe reads, before the target loads."""
    check_choice("head.capture_dtype", hc.capture_dtype, list(DTYPES))
    check_choice("head.export_dtype", hc.export_dtype, ["float16", "bfloat16"])


def _windows(
    target, tok, hc: HeadRecipeConfig, work: Path, log
) -> tuple[np.ndarray, np.ndarray, float]:
    """Windows of conversations and replies, built once and kept in `work`; the minutes
    the replies took (when they were made)."""
    path = work / "windows.npz"
    if path.is_file():
        kept = np.load(path)
        minutes = float(kept["reply_minutes"]) if "reply_minutes" in kept.files else float("nan")
        return kept["ids"], kept["mask"], minutes
    dc = hc.corpus
    convs = data.training_conversations(CorpusConfig(), hc.seed)
    docs = data.conversation_docs(tok, convs, dc.conversation_tokens)
    rest = convs[len(docs) :]  # replies answer conversations not rendered whole
    t0 = time.time()
    replies = data.replies(target, tok, data.reply_prompts(tok, rest, dc), dc, log)
    minutes = (time.time() - t0) / 60
    log(f"replies: {sum(len(d[0]) for d in replies)} tokens in {minutes:.1f} min")
    ids, mask = data.windows(docs + replies, dc.chunk)
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / "windows.tmp.npz"
    np.savez(tmp, ids=ids, mask=mask, conversation_docs=len(docs), reply_docs=len(replies),
             reply_minutes=minutes)  # fmt: skip
    tmp.replace(path)
    return ids, mask, minutes


def run(hc: HeadRecipeConfig, model: ModelConfig, log) -> dict:
    """Data, capture, training and export into `model.drafter`; the recipe's facts."""
    check(hc)
    torch.set_num_threads(hc.threads)
    target_dir = checkpoint_dir(str(project_path(model.target)), "model.target", model.fetch)
    out, work = project_path(model.drafter), project_path(hc.work_dir) / model.name
    target = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=DTYPES[hc.capture_dtype], local_files_only=True
    ).eval()
    target.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    n_layers = target.config.num_hidden_layers
    aux = resolve_aux_layers(hc.aux_layers, None, "input", n_layers, "head.aux_layers")
    ids, mask, reply_minutes = _windows(target, tok, hc, work, log)
    order = np.random.default_rng(hc.seed).permutation(len(ids))
    n_val = max(1, round(hc.corpus.val_share * len(ids)))
    val, trn = np.sort(order[:n_val]), np.sort(order[n_val:])
    draft = data.frequent_tokens(ids[trn], mask[trn], hc.draft_vocab)
    shards = {
        name: data.capture(target, ids[sel], mask[sel], aux, draft, hc.corpus, work / name, log)
        for name, sel in (("val", val), ("train", trn))
    }
    # the stages' own times, summed over interrupted runs (a rerun skips what is done)
    data_minutes = reply_minutes + data.capture_minutes(work)
    log(f"data: {ids.size:,} tokens in {len(ids)} windows ({n_val} held back), captured")
    t = target.config
    spec = make_spec(
        target, aux, hc.draft_vocab, hc.intermediate or t.intermediate_size,
        hc.heads or t.num_attention_heads, hc.kv_heads or t.num_key_value_heads,
    )  # fmt: skip
    head = make_head(spec, target, torch.from_numpy(draft).long(), hc.seed).float()
    arrays = data.load_shards(shards["train"])
    res = fit_head(head, arrays, data.load_shards(shards["val"]), hc, work, log)
    sizes = export_head(head, spec, out, hc.export_dtype)
    facts = {
        "target": model.target,
        "config": {k: getattr(hc, k) for k in ("seed", "threads", "capture_dtype",
                                               "export_dtype", "draft_vocab", "ttt_steps",
                                               "ttt_decay")}
        | {"corpus": vars(hc.corpus), "train": vars(hc.train)},
        "aux_layers": list(aux),
        "params": sum(p.numel() for p in head.parameters()),
        "layer": {"hidden": t.hidden_size, "intermediate": spec.layer.intermediate_size,
                  "heads": spec.layer.num_attention_heads,
                  "kv_heads": spec.layer.num_key_value_heads},
        "data": {"tokens": int(ids.size), "windows": len(ids), "val_windows": n_val,
                 "loss_positions": int(mask[trn].sum()), "minutes": data_minutes},
        "train": res,
        "sizes": sizes,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }  # fmt: skip
    write_card(out, facts)
    log(f"head: {facts['params']:,} parameters, {sum(sizes.values()):,} bytes in {out}")
    return facts
