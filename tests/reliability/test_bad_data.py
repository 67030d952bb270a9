"""Bad token shards: each is refused when the DataModule is built (before any training), with an error
that names the file, what is wrong with it, and how to fix it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from lightning_opt.data import TokenShardDataModule, write_shard
from lightning_opt.data.shards import HEADER_INTS, MAGIC, VERSION
from tests.reliability._recipes import run_bad

GOOD_TOKENS = np.arange(4096, dtype=np.uint16) % 64


def _raw(path: Path, header: tuple[int, int, int], tokens: np.ndarray) -> Path:
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:3] = header
    path.write_bytes(h.tobytes() + tokens.astype("<u2").tobytes())
    return path


def wrong_magic(d: Path) -> Path:
    return _raw(d / "s.bin", (1234, VERSION, len(GOOD_TOKENS)), GOOD_TOKENS)


def wrong_version(d: Path) -> Path:
    return _raw(d / "s.bin", (MAGIC, 7, len(GOOD_TOKENS)), GOOD_TOKENS)


def truncated(d: Path) -> Path:  # the download stopped half way
    p = write_shard(d / "s.bin", GOOD_TOKENS)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)
    return p


def count_mismatch(d: Path) -> Path:  # more tokens than the header says
    return _raw(d / "s.bin", (MAGIC, VERSION, 1000), GOOD_TOKENS)


def negative_count(d: Path) -> Path:
    return _raw(d / "s.bin", (MAGIC, VERSION, -5), GOOD_TOKENS)


def truncated_header(d: Path) -> Path:
    p = d / "s.bin"
    p.write_bytes(np.array([MAGIC, VERSION], dtype="<i4").tobytes())
    return p


def empty(d: Path) -> Path:
    p = d / "s.bin"
    p.touch()
    return p


def directory(d: Path) -> Path:
    p = d / "shards"
    p.mkdir()
    write_shard(p / "a.bin", GOOD_TOKENS)
    return p


def missing_glob(d: Path) -> str:
    write_shard(d / "train_000.bin", GOOD_TOKENS)
    return str(d / "fineweb_train_*.bin")  # a typo'd prefix: matches nothing


def missing_file(d: Path) -> Path:
    return d / "does_not_exist.bin"


def too_small(d: Path) -> Path:
    return write_shard(d / "s.bin", GOOD_TOKENS[:5])  # not one window of seq_len + 1 = 9 tokens


STRAY_AT = (1 << 24) + 777  # past the first 16M tokens of a shard larger than 16M tokens


def _stray(path: Path) -> Path:
    tokens = np.resize(GOOD_TOKENS, STRAY_AT + 1000)
    tokens[STRAY_AT] = 64
    return write_shard(path, tokens)


# (fault kind, make the bad input, the DataModule keyword it goes to, every needle must be in the message)
# (a dict of needles per role: the message is about the shards' total, so it need not name a file)
CASES: list[tuple[str, Callable[[Path], object], dict, list[str] | dict[str, list[str]]]] = [
    ("wrong magic", wrong_magic, {}, ["magic 1234", "expected 20240520", "lightning-opt-data prepare"]),
    ("wrong version", wrong_version, {}, ["version 7", "expected 1", "lightning-opt-data prepare"]),
    ("truncated shard", truncated, {}, ["token count mismatch", "truncated", "re-create"]),
    ("header count mismatch", count_mismatch, {}, ["header says 1000 tokens", "longer", "re-create"]),
    ("negative header count", negative_count, {}, ["negative token count", "re-create"]),
    ("truncated header", truncated_header, {}, ["truncated header", "re-create"]),
    ("empty file", empty, {}, ["empty (0 bytes)", "re-create"]),
    ("directory instead of file", directory, {}, ["is a directory", "*.bin"]),
    ("glob matches no files", missing_glob, {}, ["matches no files", "check the pattern"]),
    ("missing file", missing_file, {}, ["does not exist", "check the path"]),
    ("too few tokens", too_small, {}, {"train": ["5 tokens", "fewer than one batch", "smaller seq_len/batch_size"],
                                        "val": ["hold 5 tokens", "seq_len+1=9", "more validation data"]}),
    ("token ids out of vocab range", lambda d: write_shard(d / "s.bin", GOOD_TOKENS + 100), {"vocab_size": 64},
     ["token id 100 at token offset 0", ">= vocab_size 64", "different tokenizer"]),
    ("one stray token id in a large shard", lambda d: _stray(d / "s.bin"), {"vocab_size": 64},
     [f"token id 64 at token offset {STRAY_AT}", ">= vocab_size 64"]),
]


@pytest.mark.parametrize("kind,make,kwargs,needles", CASES, ids=[c[0].replace(" ", "_") for c in CASES])
@pytest.mark.parametrize("role", ["train", "val"])
def test_bad_shard_is_refused_at_construction(fault, tmp_path, kind, make, kwargs, needles, role):
    fault(f"bad data: {kind}", f"{kind}, as a train and as a val shard")
    bad = make(tmp_path)
    good = write_shard(tmp_path / "good.bin", GOOD_TOKENS)
    files = {"train_files": bad, "val_files": good} if role == "train" else {"train_files": good, "val_files": bad}
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        TokenShardDataModule(**files, seq_len=8, batch_size=4, val_tokens=256, **kwargs)
    msg = str(info.value)
    needles = needles[role] if isinstance(needles, dict) else [*needles, Path(str(bad)).name]
    missing = [n for n in needles if n not in msg]
    fault.trial(not missing, note=f"missing {missing}: {msg[:200]}" if missing else "")
    fault.shown(msg)
    assert not missing, f"{msg!r} does not say {missing}"


def test_out_of_vocab_shard_in_the_gpt2_recipe_is_refused_before_training(fault, tmp_path, monkeypatch, capsys):
    """The demo model has vocab_size 256; a GPT-2-tokenized shard (ids up to 50256) must not reach fit."""
    fault("bad data: token ids out of vocab range (recipe)", "a GPT-2 tokenized shard with the byte-level model")
    shard = write_shard(tmp_path / "gpt2_tokens.bin", (np.arange(20000) * 37) % 50257)
    message, started = run_bad(
        "gpt2", ["--data.train_files", str(shard), "--data.val_files", str(shard), "--data.val_tokens", "1024"],
        tmp_path, monkeypatch, capsys,
    )
    ok = "vocab_size" in message and not started
    fault.trial(ok, note=f"fit started: {started}: {message[-200:]}")
    fault.shown(message, "vocab_size")
    assert "vocab_size" in message, message[-2000:]
    assert not started, f"refused only inside Trainer.fit: {message[-500:]}"


def test_out_of_vocab_shard_in_the_clt_recipe_is_refused_before_training(fault, tmp_path, monkeypatch, capsys):
    """A CLT's target with 64 token ids and a shard holding ids up to 299: refused naming the shard and the
    target before the target runs on a batch (online and when an activation cache is to be written)."""
    import torch

    from lightning_opt.models.gpt2 import GPT, GPTConfig

    fault("bad data: token ids out of vocab range (CLT recipe)", "a shard with ids >= the CLT target's vocabulary")
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=16)
    target = tmp_path / "target.pt"
    torch.save({"config": cfg.to_dict(), "model": GPT(cfg).state_dict()}, target)
    shard = write_shard(tmp_path / "wide.bin", np.arange(8192) % 300)
    good = write_shard(tmp_path / "good.bin", GOOD_TOKENS)
    small = ["--data.target", str(target), "--data.seq_len", "16", "--data.tokens_per_batch", "64",
             "--data.val_tokens", "64", "--data.stats_tokens", "256", "--model.clt.n_layers", "2",
             "--model.clt.d_model", "16", "--model.clt.n_features", "32", "--model.clt.k", "4", "--model.aux_k", "4"]
    cases = {"train": ["--data.train_files", str(shard), "--data.val_files", str(good)],
             "val": ["--data.train_files", str(good), "--data.val_files", str(shard)],
             "cache": ["--data.train_files", str(shard), "--data.val_files", str(good),
                       "--data.cache_dir", str(tmp_path / "acts")]}
    for case, files in cases.items():
        message, trained = run_bad("clt", [*small, *files], tmp_path, monkeypatch, capsys, when="trained")
        ok = "wide.bin" in message and ">= vocab_size 64" in message and str(target) in message and not trained
        fault.trial(ok, note=f"{case}: trained {trained}: {message[-200:]}")
        fault.shown(message, "vocab_size")
        assert ok, f"{case}: trained {trained}: {message[-2000:]}"
    assert not (tmp_path / "acts" / "meta.json").exists()


def test_own_train_shards_on_the_demo_config_keep_its_builtin_val_shard(fault, tmp_path, monkeypatch):
    """Only ``--data.train_files`` overridden on ``gpt2/demo.yaml`` (its val_files stay ``builtin``): the run
    trains on the given shard and warns that the val loss is measured on the built-in corpus."""
    import warnings

    from tests.reliability._recipes import COMMON, RECIPES, recipe_main

    fault("own train shards, built-in val shard (recipe)", "gpt2/demo.yaml with only --data.train_files overridden")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_OPT_CACHE", str(tmp_path / "cache"))
    shard = write_shard(tmp_path / "mine.bin", np.arange(20000) % 256)
    args = ["--config", str(RECIPES["gpt2"][1]), *COMMON, "--data.train_files", str(shard),
            "--data.seq_len", "32", "--data.batch_size", "2", "--data.val_tokens", "256",
            "--model.model_config.n_layer", "1", "--model.model_config.n_embd", "32", "--model.model_config.n_head", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out, error = recipe_main("gpt2")(args), ""
        except Exception as err:  # noqa: BLE001 - recorded as a trial that did not survive
            out, error = {}, f"{type(err).__name__}: {err}"
    said = "\n".join(str(w.message) for w in caught)
    warned = "val loss is measured on the built-in corpus" in said
    ok = not error and out.get("steps") == 2 and warned
    fault.trial(ok, note=error[:200] or f"steps {out.get('steps')}, warned {warned}")
    fault.shown(said, "built-in corpus")
    assert not error, error
    assert out["steps"] == 2 and warned, (out, said[-1000:])


def test_recipe_names_missing_data(fault, tmp_path, monkeypatch, capsys):
    fault("bad data: missing files (recipe)", "the GPT-2 recipe pointed at a glob that matches nothing")
    message, started = run_bad(
        "gpt2", ["--data.train_files", str(tmp_path / "nope_*.bin")], tmp_path, monkeypatch, capsys
    )
    ok = "matches no files" in message and "nope_*.bin" in message and not started
    fault.trial(ok, note=message[-200:])
    fault.shown(message, "matches no files")
    assert ok, message[-2000:]



def test_val_shard_of_exactly_seq_len_tokens_is_refused_at_construction(fault, tmp_path):
    fault("bad data: val shard of seq_len tokens", "a val shard one token short of one window (seq_len+1)")
    good = write_shard(tmp_path / "good.bin", GOOD_TOKENS)
    val = write_shard(tmp_path / "val.bin", GOOD_TOKENS[:64])
    with pytest.raises(ValueError) as info:
        TokenShardDataModule(good, val, seq_len=64, batch_size=4, val_tokens=64)
    msg = str(info.value)
    ok = "hold 64 tokens" in msg and "seq_len+1=65" in msg
    fault.trial(ok, note=msg[:200])
    fault.shown(msg)
    assert ok, msg
