from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_opt.data.prepare import normalize_text
from lightning_opt.data.shards import read_shard
from lightning_opt.data.tokenizer import ByteTokenizer, get_tokenizer, gpt2_encoding
from tests.data._shared import BPE, SHARED

needs_bpe = pytest.mark.skipif(not BPE.exists(), reason="shared GPT-2 BPE file not present")


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "naïve café — 東京\n"
    ids = tok.encode(text)
    assert max(ids) < 255 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert (
        tok.decode([tok.eot, *tok.encode("a"), tok.eot, *tok.encode("b")]) == "<|endoftext|>a<|endoftext|>b"
    )


@needs_bpe
def test_gpt2_from_local_bpe_file() -> None:
    enc = gpt2_encoding(BPE)
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.decode(enc.encode_ordinary(" it's 2024!")) == " it's 2024!"


def test_bad_bpe_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.tiktoken' does not exist"):
        gpt2_encoding(tmp_path / "nope.tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("this is not base64 at all\n")
    with pytest.raises(ValueError, match="bad.tiktoken' is not a .tiktoken BPE file"):
        gpt2_encoding(bad)
    with pytest.raises(ValueError, match="unknown tokenizer 'sentencepiece'"):
        get_tokenizer("sentencepiece")


@needs_bpe
@pytest.mark.skipif(not (SHARED / "novels" / "raw").exists(), reason="shared novels not present")
def test_raw_novel_tokenizes_to_a_span_of_the_shared_train_shard() -> None:
    enc = gpt2_encoding(BPE)
    train = read_shard(SHARED / "novels" / "novels_train_000000.bin")
    for path in sorted((SHARED / "novels" / "raw").glob("*.txt")):
        ids = np.array(enc.encode_ordinary(normalize_text(path.read_text(encoding="utf-8"))), dtype=np.uint16)
        head = ids[:32]
        hits = [
            int(i)
            for i in np.flatnonzero(train[: len(train) - len(ids)] == head[0])
            if (train[i : i + 32] == head).all()
        ]
        assert len(hits) == 1, f"{path.name}: {len(hits)} matches of the opening tokens"
        start = hits[0]
        assert train[start - 1] == 50256  # the document separator
        np.testing.assert_array_equal(train[start : start + len(ids)], ids)
        assert start + len(ids) == len(train) or train[start + len(ids)] == 50256


def test_gpt2_without_a_file_reads_the_shipped_bpe_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from lightning_opt.data.tokenizer import BPE_FILE_ENV, SHIPPED_BPE_FILE

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # nothing cached
    monkeypatch.delenv(BPE_FILE_ENV, raising=False)
    enc = gpt2_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    # the hash tiktoken itself checks for r50k_base
    digest = hashlib.sha256(SHIPPED_BPE_FILE.read_bytes()).hexdigest()
    assert digest == "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
