"""The shipped pocket pair, its held-out prompt split, and the recipe at debug size."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import specrank.settings.config  # noqa: F401  (registers the root schema)
from pairs.config import DataConfig
from recipes.pocket import corpus
from recipes.pocket.config import (
    CorpusConfig,
    EvalConfig,
    NetConfig,
    PocketConfig,
    TokenizerConfig,
    TrainConfig,
)
from recipes.pocket.export import MAX_FILE_BYTES, apply_sharpen
from recipes.pocket.recipe import run
from recipes.pocket.tokenizer import fit_tokenizer
from recipes.pocket.train import init_from_target, make_llama

ROOT = Path(__file__).resolve().parents[1]
POCKET = ROOT / "models" / "pocket"
PROMPTS = ROOT / "data" / "prompts" / "sharegpt_heldout.jsonl"


# ---------------------------------------------------------------- shipped weights


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_shipped_checkpoint_loads_through_from_pretrained(which):
    folder = POCKET / which
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM)
    with safe_open(folder / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes <= {"F16", "BF16"}, (
        f"{which}: weights must ship in half precision, found {dtypes}"
    )
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True
    )
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_shipped_sizes_within_budget():
    files = [p for p in POCKET.rglob("*") if p.is_file()]
    assert all(p.stat().st_size < MAX_FILE_BYTES for p in files)
    assert sum(p.stat().st_size for p in files) <= MAX_FILE_BYTES


def test_target_and_drafter_share_the_tokenizer():
    names = sorted(
        p.name for p in (POCKET / "target").iterdir() if "token" in p.name or "chat" in p.name
    )
    assert "tokenizer.json" in names
    assert names == sorted(
        p.name for p in (POCKET / "drafter").iterdir() if "token" in p.name or "chat" in p.name
    )
    for name in names:
        a = (POCKET / "target" / name).read_bytes()
        assert a == (POCKET / "drafter" / name).read_bytes(), name
    t = AutoTokenizer.from_pretrained(POCKET / "target")
    d = AutoTokenizer.from_pretrained(POCKET / "drafter")
    assert t.get_vocab() == d.get_vocab()
    ct = json.loads((POCKET / "target" / "config.json").read_text())
    cd = json.loads((POCKET / "drafter" / "config.json").read_text())
    assert ct["vocab_size"] == cd["vocab_size"] == len(t)
    assert (
        cd["num_hidden_layers"] < ct["num_hidden_layers"] or cd["hidden_size"] < ct["hidden_size"]
    )


def test_model_card_states_the_measured_facts():
    card = (POCKET / "MODEL_CARD.md").read_text()
    recipe = json.loads((POCKET / "recipe.json").read_text())
    for key in ("val_ce_code", "val_ce_chat", "root_entropy_greedy", "val_agreement_chat"):
        assert f"{recipe['eval'][key]:.3f}" in card, key
    assert "python -m decode.train_pocket" in card


# ---------------------------------------------------------------- held-out prompts


def test_heldout_prompts_obey_the_split_rule():
    recipe = json.loads((POCKET / "recipe.json").read_text())
    cfg = CorpusConfig(**{k: v for k, v in recipe["config"]["corpus"].items()})
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == recipe["corpus"]["heldout_prompts"] > 0
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) == {"id", "task", "prompt"} and r["prompt"].strip() and r["task"]
        assert r["id"].startswith("sharegpt/")
        assert corpus.is_heldout(r["id"].removeprefix("sharegpt/"), cfg), r["id"]


def _conv(cid: str, *texts: str) -> dict:
    roles = ["human", "gpt"] * ((len(texts) + 1) // 2)
    return {
        "id": cid,
        "conversations": [
            {"from": r, "value": t} for r, t in zip(roles[: len(texts)], texts, strict=True)
        ],
    }


def test_split_keeps_parts_together_and_drops_prompts_seen_in_training():
    cfg = CorpusConfig(heldout_buckets=4, prompt_min_chars=1)
    assert corpus.base_id("AbC_12") == "AbC" and corpus.base_id("AbC") == "AbC"
    assert corpus.base_id("a_b_x") == "a_b_x"
    ids = [f"c{i}" for i in range(40)]
    held = [i for i in ids if corpus.is_heldout(i, cfg)]
    train = [i for i in ids if not corpus.is_heldout(i, cfg)]
    assert held and train
    assert all(corpus.is_heldout(f"{i}_{k}", cfg) for i in held for k in range(3))
    convs = [_conv(i, f"question of {i}?", f"answer of {i}.") for i in ids]
    convs.append(_conv(f"{held[1]}_1", "second part", "more"))
    convs.append(
        _conv(train[0] + "_1", f"question of {held[0]}?", "dup")
    )  # same text, training side
    split = corpus.split_sharegpt(convs, cfg)
    got = {p["id"].removeprefix("sharegpt/") for p in split.prompts}
    assert got == set(held[1:]) | {f"{held[1]}_1"}
    train_text = " ".join(t for t, _ in split.train)
    assert all(f"of {i}?" not in train_text for i in held[1:])


def test_iter_sharegpt_recovers_records_before_the_cut(tmp_path):
    rows = [_conv(f"x{i}_0", "hi", "hello") for i in range(3)]
    text = json.dumps(rows, indent=2)
    (tmp_path / "cut.json").write_text(text[: text.rindex('"hello"')])
    assert [r["id"] for r in corpus.iter_sharegpt(tmp_path / "cut.json")] == ["x0_0", "x1_0"]
    (tmp_path / "whole.json").write_text(text)
    assert len(list(corpus.iter_sharegpt(tmp_path / "whole.json"))) == 3
    # a broken record with whole records after it is corruption, not the cut: refused
    broken = text.replace('"hello"', '"hello', 1)
    (tmp_path / "broken.json").write_text(broken)
    with pytest.raises(ValueError, match=r"invalid JSON at byte \d+ .* more records after it"):
        list(corpus.iter_sharegpt(tmp_path / "broken.json"))


def test_chat_format_trains_on_assistant_replies_only():
    text, spans = corpus.format_chat([("user", "q"), ("assistant", "a"), ("user", "r")])
    assert text == "<|user|>\nq<|end|>\n<|assistant|>\na<|end|>\n<|user|>\nr<|end|>\n"
    assert [text[a:b] for a, b in spans] == ["a<|end|>\n"]


def test_default_data_configs_match_the_schema():
    for name in ("default", "paper"):
        cfg = OmegaConf.merge(
            OmegaConf.structured(DataConfig),
            OmegaConf.load(ROOT / "conf" / "data" / f"{name}.yaml"),
        )
        data = OmegaConf.to_object(cfg)
        assert data.name == name and data.sources
        for s in data.sources:
            assert s.kind in {"spec_bench", "humaneval", "jsonl"}
            if s.kind == "jsonl":
                assert (ROOT / s.path).is_file(), s.path


# ---------------------------------------------------------------- recipe pieces


def test_sharpen_keeps_argmax_and_lowers_entropy():
    torch.manual_seed(0)
    tok = fit_tokenizer(["def f(x):\n    return x\n"] * 4, TokenizerConfig(vocab_size=300), 0)
    m = make_llama(NetConfig(layers=1, hidden=32, intermediate=64, heads=2, kv_heads=2), tok, 0)
    x = torch.randint(0, len(tok), (1, 12))
    a = m(input_ids=x).logits
    b = apply_sharpen(m, 2.0)(input_ids=x).logits
    torch.testing.assert_close(b, 2 * a, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"pocket.sharpen: expected a positive factor, found -1"):
        apply_sharpen(m, -1.0)


def test_drafter_starts_as_the_targets_first_layers():
    tok = fit_tokenizer(["def f(x):\n    return x\n"] * 4, TokenizerConfig(vocab_size=300), 0)
    net = NetConfig(layers=3, hidden=32, intermediate=64, heads=2, kv_heads=2)
    target = make_llama(net, tok, 0)
    drafter = init_from_target(make_llama(dataclasses.replace(net, layers=1), tok, 1), target)
    x = torch.randint(0, len(tok), (1, 9))
    with torch.no_grad():
        h = target(input_ids=x, output_hidden_states=True).hidden_states[1]  # after layer 0
        expected = target.lm_head(target.model.norm(h))
        torch.testing.assert_close(drafter(input_ids=x).logits, expected)
    wide = make_llama(dataclasses.replace(net, layers=1, hidden=64), tok, 1)
    with pytest.raises(
        ValueError, match=r"drafter_init=target_layers: expected the drafter's width"
    ):
        init_from_target(wide, target)


def test_bad_settings_fail_with_clear_messages(tmp_path):
    with pytest.raises(ValueError, match=r"pocket.stages: expected names from .*found \['train'\]"):
        run(PocketConfig(stages=["train"], work_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"pocket.drafter_init: expected one of .*found 'copy'"):
        run(PocketConfig(stages=["export"], drafter_init="copy", work_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"pocket.tokenizer.vocab_size: expected at least 262"):
        fit_tokenizer(["abc"], TokenizerConfig(vocab_size=100), 0)


def _tiny_config(tmp_path: Path) -> PocketConfig:
    lib = tmp_path / "lib"
    lib.mkdir()
    for i in range(6):
        body = "".join(
            f"def f{i}_{k}(x):\n    y = x + {k}\n    return y * {i}\n\n\n" for k in range(30)
        )
        (lib / f"mod{i}.py").write_text(f'"""Module {i}."""\n\n\n' + body)
    convs = [
        _conv(f"t{i}_0", f"Tell me about item {i}, please.", f"Item {i} is a thing. " * 20)
        for i in range(120)
    ]
    (tmp_path / "sharegpt.json").write_text(json.dumps(convs))
    train = TrainConfig(steps=3, batch=2, seq_len=32, warmup=1, eval_every=3, max_minutes=1.0)
    net = NetConfig(layers=1, hidden=32, intermediate=64, heads=2, kv_heads=2, max_positions=256)
    return PocketConfig(
        out_dir=str(tmp_path / "out"),
        work_dir=str(tmp_path / "work"),
        prompts_out=str(tmp_path / "prompts.jsonl"),
        sharpen=1.5,
        corpus=CorpusConfig(
            sharegpt_path=str(tmp_path / "sharegpt.json"), stdlib_dir=str(lib), heldout_buckets=4
        ),
        tokenizer=TokenizerConfig(vocab_size=300, train_chars=20_000),
        target=net,
        target_train=train,
        drafter=dataclasses.replace(net, layers=1),
        drafter_train=train,
        eval=EvalConfig(prompts=2, new_tokens=4, agreement_tokens=64),
    )


def test_recipe_end_to_end_at_debug_size(tmp_path):
    pc = _tiny_config(tmp_path)
    facts = run(pc, log=lambda s: None)
    out = tmp_path / "out"
    for which in ("target", "drafter"):
        m = AutoModelForCausalLM.from_pretrained(out / which, dtype=torch.float32)
        assert isinstance(m, LlamaForCausalLM)
        assert (out / which / "generation_config.json").is_file()
    t32 = AutoModelForCausalLM.from_pretrained(
        tmp_path / "work" / "target_fp32", dtype=torch.float32
    )
    shipped = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
    x = torch.randint(5, 300, (1, 16))
    # the shipped target is the trained one, sharpened, through a half-precision round trip
    torch.testing.assert_close(
        shipped(input_ids=x).logits, 1.5 * t32(input_ids=x).logits, rtol=0.02, atol=0.05
    )
    assert facts["target_train"]["steps"] == 3 and facts["drafter_train"]["steps"] == 3
    assert "val_ce_code" in facts["eval"] and (out / "MODEL_CARD.md").is_file()
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert rows and all(
        corpus.is_heldout(r["id"].removeprefix("sharegpt/"), pc.corpus) for r in rows
    )


def test_pocket_config_composes_from_conf():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="pocket", overrides=["pocket.target_train.steps=7"])
    pc = OmegaConf.to_object(cfg.pocket)
    assert isinstance(pc, PocketConfig) and pc.target_train.steps == 7


@pytest.mark.slow
def test_heldout_prompt_texts_never_occur_in_training_conversations():
    recipe = json.loads((POCKET / "recipe.json").read_text())
    cfg = CorpusConfig(**recipe["config"]["corpus"])
    train_keys = {
        corpus.text_key(t)
        for conv in corpus.iter_sharegpt()
        if not corpus.is_heldout(str(conv.get("id", "")), cfg)
        for _, t in corpus.turns_of(conv)
    }
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert not [r["id"] for r in rows if corpus.text_key(r["prompt"]) in train_keys]
