from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_opt.data.cli import main
from lightning_opt.data.datamodule import TokenShardDataModule
from lightning_opt.data.download import DownloadError, download_fineweb, fineweb_filenames
from lightning_opt.data.prepare import is_val_doc
from lightning_opt.data.shards import read_shard, resolve_files, write_shard
from lightning_opt.data.tokenizer import ByteTokenizer, gpt2_encoding
from tests.data._shared import BPE, SHARED

RAW = SHARED / "novels" / "raw"

DOCS = ["\ufeffFirst document.\r\nWith CRLF.\r\n", "Second: naïve café.", "Third one, the val doc."]


def _texts(folder: Path, docs: list[str] = DOCS) -> Path:
    folder.mkdir()
    for i, text in enumerate(docs):
        (folder / f"doc_{i}.txt").write_bytes(text.encode("utf-8"))
    return folder


def _split_docs(path: Path, eot: int) -> list[np.ndarray]:
    tokens = np.array(read_shard(path))
    cuts = np.flatnonzero(tokens == eot)
    assert cuts[0] == 0, "every document starts with the separator"
    return [tokens[a + 1 : b] for a, b in zip(cuts, list(cuts[1:]) + [len(tokens)])]


def test_val_doc_rule() -> None:
    assert [i for i in range(40) if is_val_doc(i, 0.1)] == [9, 19, 29, 39]
    assert not any(is_val_doc(i, 0.0) for i in range(100))


def test_prepare_cli_byte_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = _texts(tmp_path / "texts"), tmp_path / "out"
    argv = ["prepare", "--input", str(src / "*.txt"), "--out-dir", str(out), "--tokenizer", "byte"]
    assert main([*argv, "--val-fraction", "0.34"]) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == {"train": 2, "val": 1}
    tok = ByteTokenizer()
    train = _split_docs(out / "data_train_000000.bin", tok.eot)
    val = _split_docs(out / "data_val_000000.bin", tok.eot)
    assert [tok.decode(d) for d in train] == [
        "First document.\nWith CRLF.\n",
        "Second: naïve café.",
    ]  # BOM, CRLF gone
    assert [tok.decode(d) for d in val] == ["Third one, the val doc."]
    meta = json.loads((out / "data_meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["tokens"]["val"] == len(val[0]) + 1

    # existing shards are not silently mixed with new ones
    assert main([*argv, "--val-fraction", "0.34"]) == 2
    assert "already has 2 'data' shards" in capsys.readouterr().err
    # small shards: the stream is cut across files, and --overwrite removes the stale ones
    assert main([*argv, "--val-fraction", "0.34", "--shard-tokens", "16", "--overwrite"]) == 0
    shards = resolve_files(str(out / "data_train_*.bin"))
    assert len(shards) == 4  # 50 tokens in shards of 16
    joined = np.concatenate([read_shard(p) for p in shards])
    assert tok.decode(joined).split("<|endoftext|>")[1:] == [tok.decode(d) for d in train]


def test_prepare_single_document_splits_its_tail(tmp_path: Path) -> None:
    src = _texts(tmp_path / "texts", ["x" * 99])
    assert (
        main(
            [
                "prepare",
                "--input",
                str(src / "doc_0.txt"),
                "--out-dir",
                str(tmp_path / "o"),
                "--tokenizer",
                "byte",
            ]
        )
        == 0
    )
    assert read_shard(tmp_path / "o" / "data_train_000000.bin").shape == (90,)  # separator + 89 bytes
    assert read_shard(tmp_path / "o" / "data_val_000000.bin").shape == (10,)


def test_prepare_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _texts(tmp_path / "texts", ["a", "b"])
    out = str(tmp_path / "o")
    assert main(["prepare", "--input", str(src / "*.md"), "--out-dir", out, "--tokenizer", "byte"]) == 2
    assert "matches no files" in capsys.readouterr().err
    argv = [
        "prepare",
        "--input",
        str(src / "*.txt"),
        "--out-dir",
        out,
        "--tokenizer",
        "byte",
        "--shard-tokens",
        "1",
    ]
    assert main(argv) == 2
    assert "give no validation document" in capsys.readouterr().err
    assert not list(Path(out).glob("*.bin")), "a failed run must not leave shards behind"
    assert not Path(out).exists(), "a failed run must not leave the folder it created behind"
    (src / "bad.txt").write_bytes(b"\xff\xfe bad")
    assert main(["prepare", "--input", str(src / "bad.txt"), "--out-dir", out, "--tokenizer", "byte"]) == 2
    assert "bad.txt' is not valid UTF-8" in capsys.readouterr().err


@pytest.mark.skipif(not (BPE.exists() and RAW.exists()), reason="shared BPE file / raw novels not present")
def test_prepare_gpt2_reproduces_the_shared_novels_shard(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["prepare", "--input", str(RAW / "*.txt"), "--out-dir", str(out), "--bpe-file", str(BPE)]
    assert main([*argv, "--val-fraction", "0"]) == 0
    docs = _split_docs(out / "data_train_000000.bin", 50256)
    assert len(docs) == 2
    shared = read_shard(SHARED / "novels" / "novels_train_000000.bin")
    for doc in docs:
        head = doc[:32]
        hits = [
            int(i)
            for i in np.flatnonzero(shared[: -len(doc)] == head[0])
            if (shared[i : i + 32] == head).all()
        ]
        assert len(hits) == 1
        np.testing.assert_array_equal(shared[hits[0] : hits[0] + len(doc)], doc)
    enc = gpt2_encoding(BPE)
    assert enc.decode(docs[0][:50].tolist()) in (RAW / "Doyle_Hound_1902.txt").read_text("utf-8-sig").replace(
        "\r\n", "\n"
    )
    dm = TokenShardDataModule(
        out / "data_train_000000.bin", None, seq_len=256, batch_size=4, vocab_size=50257
    )
    assert next(iter(dm.train_dataloader()))[0].shape == (4, 256)


def test_console_entry_point_runs(tmp_path: Path) -> None:
    src = _texts(tmp_path / "texts")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_opt.data.cli",
            "prepare",
            "--input",
            str(src / "*.txt"),
            "--out-dir",
            str(tmp_path / "o"),
            "--tokenizer",
            "byte",
            "--val-fraction",
            "0.34",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "o" / "data_val_000000.bin").exists()


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_dataset_without_the_extra_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["prepare", "--hf-dataset", "some/dataset", "--out-dir", str(tmp_path), "--tokenizer", "byte"])
        == 2
    )
    assert "pip install 'lightning-opt[hf]'" in capsys.readouterr().err


needs_hub = pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="needs huggingface_hub"
)


@needs_hub
def test_download_offline_mode_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at import time
    with pytest.raises(
        DownloadError, match=r"fineweb_val_000000\.bin.*no network.*lightning-opt-data prepare"
    ):
        download_fineweb(tmp_path / "fw", num_train_shards=1)


@needs_hub
def test_download_unreachable_hub_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(DownloadError, match="no network connection to the Hugging Face Hub"):
        download_fineweb(tmp_path / "fw", num_train_shards=2)
    # shards already present and valid need no network
    for name in fineweb_filenames(2):
        write_shard(tmp_path / "fw" / name, np.arange(10))
    paths = download_fineweb(tmp_path / "fw", num_train_shards=2)
    assert [p.name for p in paths] == [
        "fineweb_val_000000.bin",
        "fineweb_train_000001.bin",
        "fineweb_train_000002.bin",
    ]
    assert main(["download-fineweb", "--out-dir", str(tmp_path / "fw"), "--num-train-shards", "200"]) == 2


def test_failed_prepare_removes_only_the_folders_it_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _texts(tmp_path / "texts", ["a", "b"])
    argv = ["prepare", "--input", str(src / "*.txt"), "--tokenizer", "byte", "--shard-tokens", "1"]
    assert main([*argv, "--out-dir", str(tmp_path / "new" / "deeper" / "out")]) == 2
    assert "give no validation document" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main([*argv, "--out-dir", str(kept / "out")]) == 2
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    assert main([*argv, "--out-dir", str(kept)]) == 2
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]  # an existing folder stays, content and all


def test_gpt2_prepare_works_offline_with_the_shipped_bpe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LIGHTNING_OPT_BPE_FILE", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # nothing listens on the discard port: no network
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    src = _texts(tmp_path / "texts", ["Hello world", "Hello world", "Hello world"])
    out = tmp_path / "out"
    assert main(["prepare", "--input", str(src / "*.txt"), "--out-dir", str(out), "--val-fraction", "0.34"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["tokenizer"] == "gpt2"
    train = read_shard(out / "data_train_000000.bin")
    assert train.tolist() == [50256, 15496, 995, 50256, 15496, 995]
    monkeypatch.setenv("LIGHTNING_OPT_BPE_FILE", str(tmp_path / "missing.tiktoken"))
    assert main(["prepare", "--input", str(src / "*.txt"), "--out-dir", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "missing.tiktoken' does not exist" in err and "$LIGHTNING_OPT_BPE_FILE" in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err


@pytest.mark.skipif(not BPE.exists(), reason="shared GPT-2 BPE file not present")
def test_bpe_file_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_OPT_BPE_FILE", str(BPE))
    src = _texts(tmp_path / "texts")
    assert main(["prepare", "--input", str(src / "*.txt"), "--out-dir", str(tmp_path / "o"), "--val-fraction", "0.34"]) == 0
    assert int(read_shard(tmp_path / "o" / "data_train_000000.bin")[0]) == 50256
