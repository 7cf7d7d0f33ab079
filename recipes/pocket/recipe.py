"""The pocket recipe as plain stages over a `PocketConfig` (the Hydra entry is `__main__`)."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from recipes.pocket import corpus, evaluate, export, tokenizer, train
from recipes.pocket.card import write_card
from recipes.pocket.config import DRAFTER_INITS, RECIPE_STAGES, PocketConfig
from recipes.pocket.train import Log


def _paths(pc: PocketConfig) -> dict[str, Path]:
    work, out = corpus.resolve(pc.work_dir), corpus.resolve(pc.out_dir)
    return {
        "work": work,
        "tok": work / "tokenizer",
        "streams": work / "streams",
        "target32": work / "target_fp32",
        "drafter32": work / "drafter_fp32",
        "facts": work / "facts.json",
        "out": out,
        "target": out / "target",
        "drafter": out / "drafter",
        "prompts": corpus.resolve(pc.prompts_out),
    }


def _facts(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_facts(path: Path, facts: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(facts, indent=2) + "\n")


def _streams(folder: Path, split: str) -> train.Streams:
    ci, cm = tokenizer.load_stream(folder / f"code_{split}.npz")
    hi, hm = tokenizer.load_stream(folder / f"chat_{split}.npz")
    return train.Streams(ci, cm, hi, hm)


def _load(folder: Path) -> LlamaForCausalLM:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no checkpoint; run the stage that writes it first")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def stage_corpus(pc: PocketConfig, p: dict, log: Log) -> dict:
    stats = corpus.build_corpus(pc.corpus, p["work"], p["prompts"], pc.seed)
    log(f"corpus: {stats}")
    return {"corpus": stats}


def stage_tokenizer(pc: PocketConfig, p: dict, log: Log) -> dict:
    docs = {
        n: corpus.read_docs(p["work"] / "corpus" / f"{n}.jsonl")
        for n in ("code_train", "code_val", "chat_train", "chat_val")
    }
    texts = [t for t, _ in docs["code_train"]] + [t for t, _ in docs["chat_train"]]
    tok = tokenizer.fit_tokenizer(texts, pc.tokenizer, pc.seed)
    export.save_tokenizer(tok, p["tok"], pc.target.max_positions)
    counts = {}
    for name, d in docs.items():
        ids, mask = tokenizer.encode_docs(tok, d)
        tokenizer.save_stream(p["streams"] / f"{name}.npz", ids, mask)
        counts[f"{name}_tokens"] = len(ids)
    log(f"tokenizer: vocab {len(tok)}, streams {counts}")
    return {"vocab": len(tok), "streams": counts}


def stage_target(pc: PocketConfig, p: dict, log: Log) -> dict:
    tok = AutoTokenizer.from_pretrained(p["tok"])
    model = train.make_llama(pc.target, tok, pc.seed)
    res = train.train_target(
        model, _streams(p["streams"], "train"), _streams(p["streams"], "val"),
        pc.target_train, pc.seed, log,
    )  # fmt: skip
    model.save_pretrained(p["target32"])
    return {"target_train": res, "target_params": sum(x.numel() for x in model.parameters())}


def stage_drafter(pc: PocketConfig, p: dict, log: Log) -> dict:
    tok = AutoTokenizer.from_pretrained(p["tok"])
    target = export.apply_sharpen(_load(p["target32"]), pc.sharpen)
    drafter = train.make_llama(pc.drafter, tok, pc.seed + 1)
    if pc.drafter_init == "target_layers":
        drafter = train.init_from_target(drafter, target)
    res = train.distill_drafter(
        drafter, target, _streams(p["streams"], "train"), _streams(p["streams"], "val"),
        pc.drafter_train, pc.seed + 1, log,
    )  # fmt: skip
    drafter.save_pretrained(p["drafter32"])
    return {"drafter_train": res, "drafter_params": sum(x.numel() for x in drafter.parameters())}


def stage_export(pc: PocketConfig, p: dict, log: Log) -> dict:
    tok = AutoTokenizer.from_pretrained(p["tok"])
    export.export_model(
        export.apply_sharpen(_load(p["target32"]), pc.sharpen), tok, p["target"], pc.export_dtype
    )
    export.export_model(_load(p["drafter32"]), tok, p["drafter"], pc.export_dtype)
    sizes = export.check_sizes([p["target"], p["drafter"]])
    sizes = {Path(k).relative_to(p["out"]).as_posix(): v for k, v in sizes.items()}
    log(f"export: {sum(sizes.values()):,} bytes")
    return {"sizes": sizes}


def stage_evaluate(pc: PocketConfig, p: dict, log: Log) -> dict:
    target, drafter = _load(p["target"]), _load(p["drafter"])
    target.eval()
    drafter.eval()
    tok = AutoTokenizer.from_pretrained(p["target"])
    val = _streams(p["streams"], "val")
    res = evaluate.text_metrics(
        target, drafter,
        {"code": (val.code_ids, val.code_mask), "chat": (val.chat_ids, val.chat_mask)},
        pc.target_train.seq_len, pc.eval.agreement_tokens, pc.sharpen,
    )  # fmt: skip
    prompts = evaluate.suite_prompts(p["prompts"], pc.eval.prompts)
    res.update(
        evaluate.suite_metrics(
            target, drafter, tok, prompts, pc.eval.new_tokens, pc.seed, pc.sharpen
        )
    )
    log(f"evaluate: { {k: v for k, v in res.items() if k != 'samples'} }")
    return {"eval": res}


_RUN = {
    "corpus": stage_corpus,
    "tokenizer": stage_tokenizer,
    "target": stage_target,
    "drafter": stage_drafter,
    "export": stage_export,
    "evaluate": stage_evaluate,
}


def run(pc: PocketConfig, log: Log = print) -> dict:
    """Run `pc.stages` in order; facts accumulate in `work_dir/facts.json`; the last stage
    that has every fact writes `recipe.json` and `MODEL_CARD.md` beside the shipped folders."""
    bad = [s for s in pc.stages if s not in RECIPE_STAGES]
    if bad:
        raise ValueError(f"pocket.stages: expected names from {list(RECIPE_STAGES)}, found {bad}")
    if pc.drafter_init not in DRAFTER_INITS:
        raise ValueError(
            f"pocket.drafter_init: expected one of {list(DRAFTER_INITS)}, found {pc.drafter_init!r}"
        )
    torch.set_num_threads(pc.threads)
    p = _paths(pc)
    facts = _facts(p["facts"])
    for stage in [s for s in RECIPE_STAGES if s in pc.stages]:
        t0 = time.time()
        log(f"stage {stage} ...")
        facts.update(_RUN[stage](pc, p, log))
        facts.setdefault("stage_minutes", {})[stage] = (time.time() - t0) / 60
        facts["config"] = dataclasses.asdict(pc)
        facts["python"] = platform.python_version()
        facts["torch"] = torch.__version__
        _save_facts(p["facts"], facts)
    needed = {"corpus", "target_train", "drafter_train", "eval", "sizes", "vocab"}
    if "evaluate" in pc.stages and needed <= facts.keys():
        (p["out"] / "recipe.json").write_text(json.dumps(facts, indent=2) + "\n")
        write_card(p["out"], facts)
    return facts
