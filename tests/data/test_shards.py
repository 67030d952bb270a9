from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_opt.data.shards import (
    HEADER_BYTES,
    MAGIC,
    check_vocab,
    first_token_at_least,
    max_token_id,
    read_header,
    read_shard,
    resolve_files,
    write_shard,
)
from tests.data._shared import SHARED as _SHARED

SHARED = _SHARED / "novels"


def _raw_shard(path: Path, header: list[int], tokens: np.ndarray) -> Path:
    h = np.zeros(256, dtype="<i4")
    h[: len(header)] = header
    path.write_bytes(h.tobytes() + tokens.astype("<u2").tobytes())
    return path


def test_round_trip_is_a_read_only_memmap(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 65536, size=10_000)
    path = write_shard(tmp_path / "sub" / "a.bin", tokens)
    got = read_shard(path)
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, tokens)
    assert path.stat().st_size == HEADER_BYTES + 2 * tokens.size
    assert np.fromfile(path, dtype="<i4", count=3).tolist() == [MAGIC, 1, tokens.size]
    with pytest.raises(ValueError):
        got[0] = 1  # read-only: nobody scribbles on a shared shard
    assert not list(path.parent.glob(".*.tmp")), "temporary file left behind"


def test_write_accepts_lists_and_tensors_and_empty(tmp_path: Path) -> None:
    np.testing.assert_array_equal(read_shard(write_shard(tmp_path / "l.bin", [1, 2, 65535])), [1, 2, 65535])
    np.testing.assert_array_equal(read_shard(write_shard(tmp_path / "t.bin", torch.arange(5))), np.arange(5))
    assert read_shard(write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.int64))).shape == (0,)


@pytest.mark.parametrize("bad", [[-1, 3], [0, 65536]])
def test_write_rejects_out_of_range_tokens(tmp_path: Path, bad: list[int]) -> None:
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_shard(tmp_path / "x.bin", bad)
    assert not (tmp_path / "x.bin").exists()


def test_write_rejects_non_integer_and_2d(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="integers"):
        write_shard(tmp_path / "f.bin", np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        write_shard(tmp_path / "m.bin", np.zeros((2, 2), dtype=np.int64))


def test_overwrite_is_atomic_replacement(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "a.bin", [1, 2, 3])
    old = read_shard(path)  # an open memmap keeps the old inode alive
    write_shard(path, [7, 8])
    assert read_shard(path).tolist() == [7, 8]
    assert old.tolist() == [1, 2, 3]


def test_wrong_magic(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "m.bin", [1234, 1, 3], np.arange(3))
    with pytest.raises(ValueError, match=r"m\.bin.*magic 1234, expected 20240520"):
        read_shard(path)


def test_wrong_version(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "v.bin", [MAGIC, 2, 3], np.arange(3))
    with pytest.raises(ValueError, match=r"v\.bin.*version 2, expected 1"):
        read_shard(path)


def test_truncated_header(tmp_path: Path) -> None:
    path = tmp_path / "h.bin"
    path.write_bytes(np.array([MAGIC, 1, 3], dtype="<i4").tobytes())
    with pytest.raises(ValueError, match=r"h\.bin.*truncated header: 12 bytes"):
        read_shard(path)


def test_file_shorter_than_header_says(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "s.bin", [MAGIC, 1, 10], np.arange(7))
    with pytest.raises(ValueError, match=r"s\.bin.*token count mismatch.*10 tokens.*shorter"):
        read_shard(path)


def test_file_longer_than_header_says(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "l.bin", [MAGIC, 1, 5], np.arange(9))
    with pytest.raises(ValueError, match=r"l\.bin.*token count mismatch.*5 tokens.*longer"):
        read_shard(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "e.bin"
    path.touch()
    with pytest.raises(ValueError, match=r"e\.bin.*empty \(0 bytes\)"):
        read_shard(path)


def test_directory_is_not_a_shard(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"'{tmp_path}' is a directory"):
        read_shard(tmp_path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.bin.*does not exist"):
        read_shard(tmp_path / "nope.bin")


def test_resolve_files_sorts_globs_and_keeps_pattern_order(tmp_path: Path) -> None:
    for name in ["b_002.bin", "b_000.bin", "b_001.bin", "a.bin"]:
        write_shard(tmp_path / name, [1])
    with pytest.warns(UserWarning, match=r"given more than once are read once: '.*b_000\.bin'"):
        got = resolve_files([tmp_path / "b_*.bin", str(tmp_path / "a.bin"), tmp_path / "b_000.bin"])
    assert [p.name for p in got] == ["b_000.bin", "b_001.bin", "b_002.bin", "a.bin"]
    assert resolve_files(str(tmp_path / "a.bin")) == [tmp_path / "a.bin"]


def test_resolve_files_no_match(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"glob pattern '.*nothing_\*\.bin' matches no files"):
        resolve_files(str(tmp_path / "nothing_*.bin"))
    with pytest.raises(FileNotFoundError, match="no token shard files given"):
        resolve_files([])


def test_vocab_check(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "v.bin", [3, 300, 7])
    assert max_token_id(path) == 300
    check_vocab([path], 301)
    with pytest.raises(ValueError, match=r"v\.bin.*token id 300.*vocab_size 256"):
        check_vocab([path], 256)


def test_shard_mode_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        assert write_shard(tmp_path / "a.bin", [1, 2]).stat().st_mode & 0o777 == 0o644
        os.umask(0o002)
        assert write_shard(tmp_path / "b.bin", [1, 2]).stat().st_mode & 0o777 == 0o664
        assert write_shard(tmp_path / "a.bin", [3]).stat().st_mode & 0o777 == 0o664  # replacing, too
    finally:
        os.umask(old)


def test_resolve_files_reads_a_file_named_twice_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_shard(tmp_path / "a.bin", [1])
    (tmp_path / "link.bin").symlink_to(tmp_path / "a.bin")
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"read once: 'a\.bin' \(same file as '.*a\.bin'\)"):
        assert resolve_files([tmp_path / "a.bin", "a.bin"]) == [tmp_path / "a.bin"]
    with pytest.warns(UserWarning, match=r"'.*link\.bin' \(same file as 'a\.bin'\)"):
        assert resolve_files(["a.bin", tmp_path / "link.bin"]) == [Path("a.bin")]
    with pytest.warns(UserWarning, match=r"'link\.bin' \(same file as 'a\.bin'\)"):
        assert resolve_files(["*.bin"]) == [Path("a.bin")]  # a glob matching a file and a link to it
    (tmp_path / "link.bin").unlink()
    write_shard(tmp_path / "b.bin", [2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # distinct files: no warning
        assert resolve_files(["*.bin"]) == [Path("a.bin"), Path("b.bin")]


def test_vocab_check_finds_one_stray_id_anywhere_in_a_large_shard(tmp_path: Path) -> None:
    n = (1 << 24) + 4096  # larger than max_token_id's full-scan size: its sampling misses the stray id
    tokens = np.zeros(n, dtype=np.uint16)
    tokens[(1 << 23) + 12345] = 300
    path = write_shard(tmp_path / "big.bin", tokens)
    assert max_token_id(path) == 0  # sampled: quick, but not a check
    assert first_token_at_least(path, 256) == ((1 << 23) + 12345, 300)
    assert first_token_at_least(path, 256, chunk=1000) == ((1 << 23) + 12345, 300)
    assert first_token_at_least(path, 301) is None
    with pytest.raises(ValueError, match=rf"big\.bin' contains token id 300 at token offset {(1 << 23) + 12345}"):
        check_vocab([path], 256)


def test_vocab_check_samples_large_shards(tmp_path: Path) -> None:
    tokens = np.zeros(1 << 18, dtype=np.int64)
    tokens[-1] = 999  # the last block is always sampled
    path = write_shard(tmp_path / "big.bin", tokens)
    assert max_token_id(path, full_scan_tokens=1 << 10, sample_blocks=4, block=1 << 10) == 999


@pytest.mark.skipif(not SHARED.exists(), reason="shared novels shards not present")
def test_shared_novels_shards_read() -> None:
    train = read_shard(SHARED / "novels_train_000000.bin")
    val = read_shard(SHARED / "novels_val_000000.bin")
    assert train.shape == (16_649_031,) and val.shape == (1_925_196,)
    assert read_header(SHARED / "novels_train_000000.bin") == 16_649_031
    assert train[0] == 50256 and val[0] == 50256  # each document starts with end-of-text
    assert int(train[:1_000_000].max()) < 50257
