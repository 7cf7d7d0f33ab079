"""Resumable training on captured data, shared by the real-target recipes (`recipes.eagle3`,
`recipes.block_head`): one checkpoint format and one loop.

A checkpoint is a folder: the module's trained weights as safetensors (`head.safetensors`;
frozen parameters, copies of the target's, are left out and rebuilt as the run made them), the
optimizer state (`optimizer.pt`, read back with `weights_only=True`: tensors and plain
containers only, no code), and the step, elapsed seconds and history as JSON. It is written
into a temporary folder and renamed into place, so an interruption leaves the previous one.
The loop saves one at most every `checkpoint_minutes` and at the end; a rerun continues from
it with the same batches (step s draws from a generator seeded by (seed, s), the caller's
`loss_at`) and the same schedule (AdamW, linear warm-up, cosine over the run's progress: steps
or wall time, whichever binds, `recipes.pocket.train.lr_at`).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from recipes.pocket import train

CKPT = "checkpoint"
CHECKPOINT_WEIGHTS = "head.safetensors"


def save_checkpoint(folder: Path, module: torch.nn.Module, opt, state: dict) -> None:
    """`folder` (renamed into place) holding `module`'s weights, `opt`'s state and `state`."""
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    frozen = _frozen(module)
    state_dict = {k: v.contiguous() for k, v in module.state_dict().items() if k not in frozen}
    save_file(state_dict, str(tmp / CHECKPOINT_WEIGHTS))
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    old = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _frozen(module: torch.nn.Module) -> set[str]:
    """Names of frozen parameters (copies of the target's): not checkpointed, rebuilt as made."""
    return {k for k, p in module.named_parameters() if not p.requires_grad}


def load_checkpoint(folder: Path, module: torch.nn.Module, opt) -> dict | None:
    """The saved state, `module` and `opt` restored from `folder`; None when there is none."""
    if not (folder / "state.json").is_file():
        return None
    missing, unexpected = module.load_state_dict(
        load_file(str(folder / CHECKPOINT_WEIGHTS)), strict=False
    )
    if unexpected or set(missing) - _frozen(module):
        raise ValueError(
            f"{folder}: a checkpoint of another module (missing "
            f"{sorted(set(missing) - _frozen(module))}, unexpected {unexpected})"
        )
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    return json.loads((folder / "state.json").read_text())


def _row_text(row: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def fit_resumable(module: torch.nn.Module, opt, loss_at: Callable[[int, float], torch.Tensor],
        evaluate: Callable[[], dict], cfg, folder: Path, log) -> dict:  # fmt: skip
    """Train `module` from `folder`'s checkpoint (if any) until `cfg.steps` or
    `cfg.max_minutes`; `loss_at(step, progress)` gives the step's loss, `evaluate()` held-out
    figures every `cfg.eval_every` steps. The final state (step, seconds, history)."""
    state = load_checkpoint(folder, module, opt) or {"step": 0, "seconds": 0.0, "history": []}
    if state["step"]:
        log(f"resuming at step {state['step']} ({state['seconds'] / 60:.1f} min done)")
    module.train()
    start, saved = time.time() - state["seconds"], time.time()
    step = state["step"]
    while True:
        progress = train.progress_of(step, time.time() - start, cfg)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = train.lr_at(step, progress, cfg)
        loss = loss_at(step, progress)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], 1.0)
        opt.step()
        step += 1
        if step % cfg.eval_every == 0:
            row = {"step": step, "minutes": (time.time() - start) / 60,
                   "train_loss": float(loss.detach())} | evaluate()  # fmt: skip
            module.train()
            state["history"].append(row)
            log(_row_text(row))
        if time.time() - saved > 60 * cfg.checkpoint_minutes:
            state |= {"step": step, "seconds": time.time() - start}
            save_checkpoint(folder, module, opt, state)
            saved = time.time()
    state |= {"step": step, "seconds": time.time() - start}
    save_checkpoint(folder, module, opt, state)
    module.eval()
    return state
