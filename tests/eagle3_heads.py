"""Tiny random EAGLE-3 heads for the tests: built from a config, saved in a layout, loaded back."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, LlamaConfig

from pairs.config import ModelConfig
from pairs.eagle3.capture import default_aux_layers
from pairs.eagle3.drafter import build_head
from pairs.eagle3.head import Eagle3Head
from pairs.eagle3.layout import HeadSpec
from pairs.eagle3.save import save_head
from tests.tiny_models import build_tiny_pair


def tiny_target(root: Path, arch: str, layers: int = 7, **kw) -> Path:
    """A tiny random target (and the usual noisy-copy drafter beside it) under `root`."""
    if not (root / "target" / "config.json").exists():
        build_tiny_pair(root, arch, layers=layers, **kw)
    return root / "target"


def head_spec(
    target_dir: Path,
    *,
    draft_vocab: int | None = None,
    n_layers: int = 1,
    aux: tuple[int, ...] | None = None,
    hidden: int | None = None,
    norm_before_residual: bool = False,
) -> HeadSpec:
    """A head for the target at `target_dir`: its vocabulary, heads 4 / kv 2, one layer by default."""
    t = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    h = hidden or t.hidden_size
    layer = LlamaConfig(
        hidden_size=h,
        intermediate_size=2 * h,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=h // 4,
        num_hidden_layers=n_layers,
        vocab_size=t.vocab_size,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
    )
    return HeadSpec(
        layer, draft_vocab or t.vocab_size, t.hidden_size, aux, norm_before_residual, "eagle3"
    )


def random_head(
    spec: HeadSpec,
    n_aux: int,
    *,
    seed: int = 0,
    init_std: float = 0.25,
    own_embed: bool = False,
    own_lm_head: bool = True,
    draft_ids: list[int] | None = None,
) -> Eagle3Head:
    """A head with random weights (norm weights near 1); the draft vocabulary, if smaller, is
    `draft_ids` or a random subset of the target's, ascending (d2t / t2d as EAGLE-3 ships them)."""
    g = torch.Generator().manual_seed(seed)
    vocab, n = spec.layer.vocab_size, spec.draft_vocab_size
    state: dict[str, torch.Tensor] = {}
    if n < vocab:
        ids = (
            torch.randperm(vocab, generator=g)[:n] if draft_ids is None else torch.tensor(draft_ids)
        )
        ids = ids.sort().values
        state["d2t"] = ids - torch.arange(n)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    shell = Eagle3Head(
        spec.layer,
        n_aux,
        spec.target_hidden_size,
        n,
        spec.norm_before_residual,
        own_embed=own_embed,
        own_lm_head=own_lm_head,
    )
    for key, p in shell.state_dict().items():
        if key.endswith("norm.weight"):
            state[key] = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            state[key] = init_std * torch.randn(p.shape, generator=g)
    return build_head(spec, n_aux, state, "sdpa")


def fit_head(
    head: Eagle3Head, target_dir: Path, aux: tuple[int, ...], steps: int = 60, seed: int = 0
) -> Eagle3Head:
    """A few AdamW steps of the pocket recipe's training-time-test loss on the target's own
    T=1 samples, so that drafts get accepted often (the sampling-law test needs a used tree)."""
    from transformers import AutoModelForCausalLM

    from recipes.pocket.eagle3 import continuations, ttt_loss

    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True).eval()
    target.requires_grad_(False)
    head.share(target.get_input_embeddings(), target.get_output_embeddings())
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prompts = torch.randint(0, vocab, (64, 4), generator=g).tolist()
    ids, _ = continuations(target, prompts, 28, pad=0, stop=set(), seed=seed)
    x_all = torch.from_numpy(ids.astype("int64")).view(64, 32)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    head.train()
    for _ in range(steps):
        x = x_all[torch.randint(0, 64, (8,), generator=g)]
        loss = ttt_loss(head, target, x, torch.ones(8, 31, dtype=torch.bool), aux, 2, 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def write_head(
    folder: Path,
    target_dir: Path,
    *,
    layout: str = "eagle3",
    fmt: str = "safetensors",
    prefix: bool = False,
    seed: int = 0,
    fit: int = 0,
    **spec_kw,
) -> Path:
    """A random head for `target_dir` (`fit` > 0: then that many training steps) saved at
    `folder` in `layout`; returns the folder."""
    own = {k: spec_kw.pop(k) for k in ("own_embed", "own_lm_head", "draft_ids") if k in spec_kw}
    spec = head_spec(target_dir, **spec_kw)
    n_layers = AutoConfig.from_pretrained(target_dir, local_files_only=True).num_hidden_layers
    aux = spec.aux_layer_ids or default_aux_layers(n_layers)
    head = random_head(spec, len(aux), seed=seed, **own)
    if fit:
        head = fit_head(head, target_dir, tuple(aux), fit, seed)
    save_head(folder, head.own_state(), spec, layout, fmt, prefix)
    return folder


def eagle3_config(target_dir: Path, head_dir: Path, **kw) -> ModelConfig:
    kw.setdefault("drafter_kind", "eagle3")
    return ModelConfig(name="tiny_eagle3", target=str(target_dir), drafter=str(head_dir), **kw)


def pocket_eagle3_config() -> ModelConfig:
    """`model=pocket_eagle3` as Hydra composes it (conf/model/pocket_eagle3.yaml), paths resolved."""
    from omegaconf import OmegaConf

    from specrank.settings.paths import PROJECT_ROOT, project_path

    raw = OmegaConf.load(PROJECT_ROOT / "conf" / "model" / "pocket_eagle3.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    return ModelConfig(
        **{
            **vars(cfg),
            "target": str(project_path(cfg.target)),
            "drafter": str(project_path(cfg.drafter)),
        }
    )
