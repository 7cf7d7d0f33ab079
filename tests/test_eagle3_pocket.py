"""The pocket EAGLE-3 head: training matches drafting, the shipped head loads, decodes losslessly,
and `model=pocket_eagle3` records traces whose manifest names the drafter and its layers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from decode.baseline import autoregressive_decode
from decode.recording import record_traces
from decode.stream import DecodeSettings
from pairs.config import DataConfig, PromptSource
from pairs.eagle3.layout import read_head_config
from pairs.eagle3.pool import run_head
from pairs.models import load_model_pair
from pairs.prompts import encode_prompt, load_prompts
from recipes.pocket.config import PocketEagle3Config
from recipes.pocket.eagle3 import run as train_head
from recipes.pocket.eagle3 import target_view, ttt_steps
from specrank.settings.paths import PROJECT_ROOT
from specrank.store.trace_schema import trace_store
from tests.eagle3_heads import head_spec, pocket_eagle3_config, random_head, tiny_target
from tests.recording import decode_recorded, greedy_acceptance, make_run_stages
from tests.tiny_models import one_thread
from tree.config import DecodeConfig, PoolConfig, SelectConfig

HEAD = PROJECT_ROOT / "models" / "pocket" / "eagle3"


def test_training_time_test_equals_drafting_along_the_path(tmp_path):
    """Step k of the training forward at window position j = drafting, one position at a time,
    the depth-k node x_{j+k+1} below the root pair (feature j, x_{j+1}) (float32, atol 1e-4)."""
    target_dir = tiny_target(tmp_path, "llama")
    spec = head_spec(target_dir, draft_vocab=50)
    head = random_head(spec, 3, seed=4)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    head.share(target.get_input_embeddings(), None)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, target.config.vocab_size, (1, 14), generator=g)
    steps = 2
    with one_thread(), torch.no_grad():
        feats, _ = target_view(target, x, (2, 3, 4))
        trained = {
            k: head.logits(h).float().log_softmax(-1) for k, h in ttt_steps(head, feats, x, steps)
        }
        for j in (0, 4, 9):
            for k in range(steps + 1):
                cache, out = DynamicCache(config=head.config), None
                for i in range(j + 1 + k):  # pairs 0..j, then the path's nodes
                    hidden = head.fuse(feats[0, i : i + 1]) if i <= j else out
                    vis = torch.ones(1, i + 1, dtype=torch.bool)
                    out = run_head(head, hidden, x[0, i + 1 : i + 2], torch.tensor([i]), vis, cache)
                want = head.logits(out)[0].float().log_softmax(-1)
                torch.testing.assert_close(trained[k][0, j], want, atol=1e-4, rtol=0)


def test_the_shipped_head_is_small_documented_and_loads():
    files = {p.name: p.stat().st_size for p in HEAD.iterdir()}
    assert {"config.json", "model.safetensors", "MODEL_CARD.md", "recipe.json"} <= files.keys()
    assert files["model.safetensors"] < 3_000_000  # a few MB at most
    spec = read_head_config(HEAD)
    assert spec.layout == "eagle3" and spec.aux_layer_ids == (1, 2, 3) and spec.n_layers == 1
    facts = json.loads((HEAD / "recipe.json").read_text())
    assert facts["sizes"]["model.safetensors"] == files["model.safetensors"]
    card = (HEAD / "MODEL_CARD.md").read_text()
    assert f"{facts['params']:,} parameters" in card and "ENTERING target layers [1, 2, 3]" in card
    assert PocketEagle3Config().aux_layers == [1, 2, 3]


@pytest.fixture(scope="module")
def pocket():
    with one_thread():
        yield load_model_pair(pocket_eagle3_config())


def _suite(n: int):
    data = DataConfig(name="t", sources=[PromptSource(kind="humaneval", task="coding", limit=n)])
    return load_prompts(data)


@pytest.mark.parametrize("budget", [8, 59])
def test_greedy_with_the_pocket_head_equals_plain_greedy(pocket, budget):
    pool = PoolConfig() if budget == 59 else PoolConfig(top_k=6, expand_steps=5, expand=6)
    s = DecodeSettings(
        pool=pool, select=SelectConfig(budget=budget), decode=DecodeConfig(max_new_tokens=32)
    )
    with one_thread():
        accepted, rounds = greedy_acceptance(pocket, [p.text for p in _suite(2)], s)
    assert accepted > rounds  # the trained head drafts: more than one accepted token per round


def test_recording_with_the_head_writes_its_kind_and_layers_to_the_manifest(pocket, tmp_path):
    s = DecodeSettings(
        pool=PoolConfig(top_k=4, expand_steps=3, expand=3),
        select=SelectConfig(budget=8),
        decode=DecodeConfig(max_new_tokens=8),
    )
    config = {"model": {"drafter_kind": "eagle3"}}
    with one_thread():
        report = record_traces(tmp_path / "t", pocket, _suite(1), s, 1, config, progress=False)
    assert report.rounds > 0
    manifest = trace_store(tmp_path / "t").manifest()
    assert manifest["models"]["drafter_kind"] == "eagle3"
    assert manifest["models"]["aux_layers"] == "1,2,3"  # input convention, resolved


@pytest.mark.slow
def test_the_recipe_trains_and_ships_a_head_that_decodes_losslessly(tmp_path):
    pc = PocketEagle3Config(
        out_dir=str(tmp_path / "head"), code_chars=60_000, rollout_prompts=8, rollout_tokens=8
    )
    pc.train = replace(pc.train, steps=3, batch=2, seq_len=32, warmup=1, eval_every=3)
    with one_thread():
        facts = train_head(pc, log=lambda _: None)
        cfg = replace(pocket_eagle3_config(), drafter=str(tmp_path / "head"))
        pair = load_model_pair(cfg)
        prompt = encode_prompt(pair.tokenizer, _suite(1)[0].text)
        s = DecodeSettings(decode=DecodeConfig(max_new_tokens=16))
        res = decode_recorded(pair.target, pair.drafter, prompt, s, frozenset())
        assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))
    assert facts["train"]["steps"] == 3 and (tmp_path / "head" / "MODEL_CARD.md").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_make_run_with_model_pocket_eagle3_records_extracts_and_trains(tmp_path):
    """`make run RUN_ARGS="model=pocket_eagle3 debug=default ..."`, stage by stage, on the default
    suite's first 6 + 6 prompts (rerank.train on all of them takes half an hour on 2 cores)."""
    make_run_stages("pocket_eagle3", tmp_path)
    manifest = trace_store(tmp_path / "t").manifest()
    assert manifest["config"]["model"]["drafter_kind"] == "eagle3"
    assert manifest["models"]["aux_layers"] == "1,2,3"
