from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_opt.data.corpus import corpus_documents, default_corpus_shards, split_documents
from lightning_opt.data.datamodule import TokenShardDataModule
from lightning_opt.data.shards import read_shard
from lightning_opt.data.tokenizer import ByteTokenizer


def test_corpus_is_real_text_split_by_document(tmp_path: Path) -> None:
    docs = corpus_documents()
    assert len(docs) > 50 and sum(len(t) for _, t in docs) > 300_000
    train_path, val_path = default_corpus_shards(tmp_path)
    train, val = read_shard(train_path), read_shard(val_path)
    assert int(train.max()) < 256 and int(val.max()) < 256
    train_texts, val_texts = split_documents(docs)
    assert len(val_texts) == len(docs) // 10 + (len(docs) % 10 > 5)
    # every document is preceded by the separator and decodes back to the topic text
    tok = ByteTokenizer()
    assert int((val == tok.eot).sum()) == len(val_texts)
    assert tok.decode(val).split("<|endoftext|>")[1:] == val_texts
    assert int((train == tok.eot).sum()) == len(train_texts)
    assert 'The "assert" statement' in tok.decode(train[:200])


def test_corpus_is_cached(tmp_path: Path) -> None:
    a = default_corpus_shards(tmp_path)
    inodes = [p.stat().st_ino for p in a]
    b = default_corpus_shards(tmp_path)
    assert a == b and [p.stat().st_ino for p in b] == inodes  # not rewritten


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_corpus_is_rebuilt_when_corrupt(tmp_path: Path, damage: str) -> None:
    train_path, val_path = default_corpus_shards(tmp_path)
    good = np.array(read_shard(train_path))
    ino = train_path.stat().st_ino
    if damage == "flip":  # same size, valid header: only the checksum can tell
        data = bytearray(train_path.read_bytes())
        data[5000] ^= 0xFF
        train_path.write_bytes(bytes(data))
    elif damage == "truncate":
        train_path.write_bytes(train_path.read_bytes()[:3000])
    elif damage == "delete":
        val_path.unlink()
    else:
        next(tmp_path.glob("*.json")).write_text("{not json")
    again = default_corpus_shards(tmp_path)
    assert again == (train_path, val_path)
    np.testing.assert_array_equal(read_shard(train_path), good)
    assert val_path.exists()
    if damage in ("flip", "truncate"):
        assert train_path.stat().st_ino != ino


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_OPT_CACHE", str(tmp_path / "cache"))
    train_path, _ = default_corpus_shards()
    assert train_path.parent == tmp_path / "cache" / "corpus"


def test_datamodule_on_the_default_corpus(tmp_path: Path) -> None:
    train, val = default_corpus_shards(tmp_path)
    dm = TokenShardDataModule(train, val, seq_len=128, batch_size=8, vocab_size=256, val_tokens=8192)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 128) and int(x.max()) < 256 and (x[:, 1:] == y[:, :-1]).all()
    assert sum(b[0].shape[0] for b in dm.val_dataloader()) == 8192 // 128
