"""The head recipe end to end: data, capture, training, export (`python -m decode.train_head`).

The capture is the target's: `head.work_dir/<capture_name>/` (git-ignored; by default the
target's folder name, so `model=smollm2` and `model=smollm2_dspark` share one); checkpoints
are the drafter's: `head.work_dir/<model.name>/checkpoint`. A rerun after an interruption
skips what is done: the windows (`windows.npz`), each captured shard, and training from its
last checkpoint. The block-family drafters (`recipes.block_head`) train on the same capture.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
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
from specrank.settings.errors import Refusal
from specrank.settings.paths import project_path
from specrank.store.files import atomic_write


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


def capture_name(hc: HeadRecipeConfig, model: ModelConfig) -> str:
    """The capture's folder under `head.work_dir`: `head.capture`, or the target's name (the
    folder under models/ holding it: models/smollm2/target/... -> smollm2; elsewhere its file
    or folder name), so every drafter kind of one target reuses one capture."""
    if hc.capture:
        return hc.capture
    parts = Path(model.target).parts
    return parts[1] if len(parts) > 2 and parts[0] == "models" else Path(model.target).stem


@dataclass
class Capture:
    """The captured windows of a target (`captured`): ids and loss mask [n, L], the held-out
    and training rows of them, the draft vocabulary (target ids, ascending) and the shards."""

    ids: np.ndarray
    mask: np.ndarray
    val: np.ndarray
    trn: np.ndarray
    draft: np.ndarray
    aux: tuple[int, ...]
    shards: dict[str, list[Path]]
    minutes: float  # replies and capture, summed over interrupted runs
    folder: Path


def load_capture_target(hc: HeadRecipeConfig, model: ModelConfig):
    """(target in `head.capture_dtype`, frozen, and its tokenizer); torch on `head.threads`."""
    check(hc)
    torch.set_num_threads(hc.threads)
    target_dir = checkpoint_dir(str(project_path(model.target)), "model.target", model.fetch)
    target = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=DTYPES[hc.capture_dtype], local_files_only=True
    ).eval()
    target.requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(target_dir, local_files_only=True)


def _check_capture_target(folder: Path, model: ModelConfig) -> None:
    """A capture records its target (`capture.json`); another target's is refused by name."""
    path = folder / "capture.json"
    if path.is_file():
        made = json.loads(path.read_text())["target"]
        if made != model.target:
            raise Refusal(f"head.capture: {folder} holds the capture of {made!r}, not of "
                          f"model.target={model.target!r}; set head.capture to another "
                          "folder name")  # fmt: skip
    elif not (folder / "windows.npz").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps({"target": model.target}) + "\n"))


def captured(target, tok, hc: HeadRecipeConfig, model: ModelConfig, log) -> Capture:
    """The target's capture in `head.work_dir/<capture_name>`, made (or completed) when
    missing: windows, their held-out split, draft vocabulary and shards (`recipes.eagle3.data`)."""
    work = project_path(hc.work_dir) / capture_name(hc, model)
    _check_capture_target(work, model)
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
    minutes = reply_minutes + data.capture_minutes(work)
    log(f"data: {ids.size:,} tokens in {len(ids)} windows ({n_val} held back), captured")
    return Capture(ids, mask, val, trn, draft, tuple(aux), shards, minutes, work)


def run(hc: HeadRecipeConfig, model: ModelConfig, log) -> dict:
    """Data, capture, training and export into `model.drafter`; the recipe's facts."""
    target, tok = load_capture_target(hc, model)
    cap = captured(target, tok, hc, model, log)
    out, work = project_path(model.drafter), project_path(hc.work_dir) / model.name
    aux, draft, shards, ids, mask = cap.aux, cap.draft, cap.shards, cap.ids, cap.mask
    n_val, trn, data_minutes = len(cap.val), cap.trn, cap.minutes
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
