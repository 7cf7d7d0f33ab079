"""The block-family recipe for a real target (`recipes.block_head`, `decode.train_head` with
model.drafter_kind block / dspark / domino) at debug size: a tiny Llama target, a tiny capture
made by the EAGLE-3 recipe's own capture code, a few steps of each kind, a resumed run that
continues from its checkpoint, and an export read back by the project's loaders that drafts
losslessly. Each kind's run takes seconds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from decode.baseline import autoregressive_decode
from decode.stream import DecodeSettings
from pairs.config import ModelConfig
from pairs.models import load_model_pair
from recipes.block_head.config import BlockHeadConfig
from recipes.block_head.recipe import run
from recipes.eagle3.config import HeadCorpusConfig, HeadRecipeConfig
from recipes.schedule import HeadTrainConfig
from specrank.settings.errors import Refusal
from specrank.settings.paths import PROJECT_ROOT as ROOT
from tests.eagle3_heads import tiny_target
from tests.recording import decode_recorded
from tests.tiny_models import one_thread
from tree.config import DecodeConfig, PoolConfig, SelectConfig

LENGTH, WINDOWS = 40, 10


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny 7-layer Llama target and the windows of its capture (the shards are made by the
    first run, through `recipes.eagle3.data.capture`)."""
    root = tmp_path_factory.mktemp("block_head")
    tiny_target(root, "llama")
    rng = np.random.default_rng(0)
    ids = rng.integers(7, 60, size=(WINDOWS, LENGTH)).astype(np.int32)
    ids[:, 1::3] = ids[:, 0::3][:, : ids[:, 1::3].shape[1]]  # some structure to learn
    mask = np.zeros_like(ids, dtype=bool)
    mask[:, 8:] = True  # a prompt, then the reply
    (root / "work" / "cap").mkdir(parents=True)
    np.savez(root / "work" / "cap" / "windows.npz", ids=ids, mask=mask)
    return root


def _head(root) -> HeadRecipeConfig:
    corpus = HeadCorpusConfig(chunk=LENGTH, capture_batch=4, target_top_k=8, val_share=0.2)
    return HeadRecipeConfig(work_dir=str(root / "work"), capture="cap", threads=1,
                            draft_vocab=48, corpus=corpus)  # fmt: skip


def _block(steps: int = 3, **kw) -> BlockHeadConfig:
    train = HeadTrainConfig(steps=steps, batch=2, lr=1e-3, warmup=1, eval_every=2, max_minutes=5)
    return BlockHeadConfig(anchors=4, markov_rank=8, gru_hidden_dim=8, emb_dim=16, train=train,
                           **kw)  # fmt: skip


def _model(root, kind: str, name: str | None = None) -> ModelConfig:
    return ModelConfig(name=name or f"tiny_{kind}", target=str(root / "target"),
                       drafter=str(root / "out" / (name or kind)), drafter_kind=kind,
                       drafter_window=LENGTH - 1 - 7)  # fmt: skip


def _decodes_losslessly(cfg: ModelConfig) -> None:
    pair = load_model_pair(cfg)
    settings = DecodeSettings(pool=PoolConfig(top_k=3, expand_steps=3, expand=3),
                              select=SelectConfig(budget=6),
                              decode=DecodeConfig(max_new_tokens=12))  # fmt: skip
    for prompt in ([9, 14, 22, 9, 30], [11, 40]):
        res = decode_recorded(pair.target, pair.drafter, prompt, settings, frozenset())
        assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))


@pytest.mark.parametrize("kind", ["block", "dspark", "domino"])
def test_each_kind_trains_exports_and_its_export_drafts_losslessly(root, kind):
    with one_thread():
        facts = run(_head(root), _block(), _model(root, kind), lambda *_: None)
        assert facts["train"]["steps"] == 3 and facts["config"]["target_layer_ids"] == [1, 2, 3]
        assert facts["context_window"] == LENGTH - 1 - facts["depth"]
        out = root / "out" / kind
        assert {"MODEL_CARD.md", "recipe.json", "config.json", "model.safetensors"} <= {
            p.name for p in out.iterdir()
        }
        assert "run `python -m bench.bench_head --card --model " in " ".join(
            (out / "MODEL_CARD.md").read_text().split()
        )
        if kind == "dspark":
            assert json.loads((out / "config.json").read_text())["shared_with_target"] == [
                "embed_tokens", "lm_head"]  # fmt: skip
            assert len(facts["sts"]["temperatures"]) == facts["depth"]
        _decodes_losslessly(_model(root, kind))


def test_a_rerun_resumes_from_the_checkpoint_and_does_not_restart(root):
    logs: list[str] = []
    model = _model(root, "block", "tiny_resumed")
    with one_thread():
        first = run(_head(root), _block(steps=2), model, logs.append)
        assert first["train"]["steps"] == 2 and not any("resuming" in m for m in logs)
        again = run(_head(root), _block(steps=4), model, logs.append)
    assert any(m.startswith("resuming at step 2") for m in logs)
    assert again["train"]["steps"] == 4
    assert [r["step"] for r in again["train"]["history"]] == [2, 4]  # step 2's row kept


def test_the_backbone_starts_from_a_trained_block_drafter(root):
    with one_thread():
        run(_head(root), _block(steps=1), _model(root, "block", "tiny_init"), lambda *_: None)
        logs: list[str] = []
        run(_head(root), _block(steps=1, backbone_init=str(root / "out" / "tiny_init")),
            _model(root, "domino", "tiny_domino_init"), logs.append)  # fmt: skip
    assert any(m.startswith("backbone from") for m in logs)


def test_other_layer_ids_than_the_capture_s_are_refused_by_name(root):
    with pytest.raises(Refusal, match=r"block_head.target_layer_ids=\[0, 1, 2\]: the capture"):
        run(_head(root), _block(target_layer_ids=[0, 1, 2]), _model(root, "block"), print)


def test_the_guide_s_train_head_commands_compose(hydra_conf):
    """Every `decode.train_head` line of the SmolLM2 guide composes (overrides checked, the
    kind and its model config as the line names them); the runs themselves are the tests
    above at debug size."""
    from hydra import compose
    from omegaconf import OmegaConf

    from tests.readme_commands import ROOT, readme_commands

    lines = [c.line for c in readme_commands((ROOT / "docs/guide/smollm2.md").read_text())
             if c.line.startswith("python -m decode.train_head")]  # fmt: skip
    kinds = set()
    for line in lines:
        cfg = compose("train_head", overrides=line.split()[3:])
        model, block = OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.block_head)
        assert model.drafter == f"models/smollm2/{model.drafter_kind}"
        assert model.drafter_kind == "eagle3" or model.drafter_window is not None
        assert block.train.max_minutes <= 25
        kinds.add(model.drafter_kind)
    assert kinds == {"eagle3", "block", "dspark", "domino"}


@pytest.mark.parametrize("kind", ["block", "dspark", "domino"])
def test_a_shipped_card_is_what_its_recipe_json_writes(kind, tmp_path):
    """`bench.bench_head --card` rewrites a shipped drafter's card from its recipe.json, the
    decoding table included, with every heading on its own line."""
    from recipes.block_head.card import write_card

    shipped = ROOT / "models" / "smollm2" / kind
    facts = json.loads((shipped / "recipe.json").read_text())
    write_card(tmp_path, facts)
    text = (tmp_path / "MODEL_CARD.md").read_text()
    assert text == (shipped / "MODEL_CARD.md").read_text()
    assert "\n## Decoding\n" in text and "\n## Context window\n" in text
    assert "| T=1 | 8 |" in text
