"""Sequence-length curriculum and batch-size schedule in TokenShardDataModule, and their exact resume."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_opt.data.datamodule import TokenShardDataModule
from lightning_opt.data.schedule import BatchGeometry
from lightning_opt.data.shards import write_shard


def _shards(tmp_path: Path, n_train: int = 2001) -> tuple[Path, Path]:
    """Train tokens 0..n_train-1 (token value == stream position, mod 2^16), val tokens from 40000."""
    train = write_shard(tmp_path / "t.bin", np.arange(n_train) % 65536)
    val = write_shard(tmp_path / "v.bin", 40_000 + np.arange(301))
    return train, val


def test_geometry_at_known_points():
    g = BatchGeometry.build(16, 2, seq_len_schedule=[[0, 4], [10, 8], [20, 16]])
    assert [g.at(p) for p in (0, 9, 10, 19, 20, 99)] == [(8, 4), (8, 4), (4, 8), (4, 8), (2, 16), (2, 16)]
    assert [g.stage(p) for p in (0, 9, 10, 25)] == [0, 0, 1, 2]
    plain = BatchGeometry.build(16, 2, seq_len_schedule=[[0, 4], [10, 8]], batch_size_schedule=[[5, 3]],
                                keep_tokens=False)
    assert [plain.at(p) for p in (0, 5, 10, 30)] == [(2, 4), (3, 4), (3, 8), (3, 8)]
    both = BatchGeometry.build(16, 2, seq_len_schedule=[[0, 8]], batch_size_schedule=[[5, 4]])
    assert [both.at(p) for p in (0, 5)] == [(4, 8), (8, 8)]  # keep_tokens: 4 x 16 tokens in rows of 8
    assert both.boundaries() == [0, 5] and not BatchGeometry.build(16, 2).scheduled


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len_schedule=[[0, 32]]), "above seq_len"),
    (dict(seq_len_schedule=[[5, 4], [5, 8]]), "increasing"),
    (dict(batch_size_schedule=[[0, 0]]), "positive"),
    (dict(seq_len_schedule=[[0, 6]]), "do not split"),
])
def test_geometry_is_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchGeometry.build(16, 2, **kwargs)


def test_scheduled_batches_follow_each_other_in_the_stream(tmp_path):
    train, val = _shards(tmp_path)
    dm = TokenShardDataModule(train, val, seq_len=16, batch_size=2, seq_len_schedule=[[0, 4], [3, 8], [6, 16]],
                              batch_size_schedule=[[8, 3]])
    it = iter(dm.train_dataloader())
    batches = [next(it) for _ in range(60)]
    shapes = [tuple(x.shape) for x, _ in batches]
    assert shapes[:9] == [(8, 4)] * 3 + [(4, 8)] * 3 + [(2, 16)] * 2 + [(3, 16)]
    start = 0
    for x, y in batches:  # each batch continues where the previous one ended; a pass wraps to the start
        n = x.numel()
        if start + n + 1 > 2001:
            start = 0
        torch.testing.assert_close(x.flatten(), torch.arange(start, start + n))
        torch.testing.assert_close(y, x + 1)
        start += n
    assert start < 60 * 48  # the 2001-token stream was passed more than once


def test_schedule_with_shuffle_is_refused(tmp_path):
    train, val = _shards(tmp_path)
    with pytest.raises(ValueError, match="shuffle"):
        TokenShardDataModule(train, val, seq_len=16, batch_size=2, seq_len_schedule=[[0, 8]], shuffle=True)


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(65536, 4)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen.append(x.clone())
        return self.emb(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(root: Path, max_steps: int, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root, limit_val_batches=0,
                      num_sanity_val_steps=0, **kw)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_across_a_schedule_boundary_gives_the_uninterrupted_batches(tmp_path, accumulate):
    train, val = _shards(tmp_path, n_train=301)  # the 20 batches below read 704 tokens: two wraps
    kw = dict(seq_len=16, batch_size=2, seq_len_schedule=[[0, 4], [6, 8], [12, 16]],
              batch_size_schedule=[[16, 3]])
    acc = dict(accumulate_grad_batches=accumulate)
    steps = 20 // accumulate  # 20 micro-batches: every stage

    full = _Recorder()
    _trainer(tmp_path / "a", steps, **acc).fit(full, datamodule=TokenShardDataModule(train, val, **kw))
    assert len(full.seen) == 20

    ckpt_dir = tmp_path / "ckpt"
    first = _Recorder()
    cb = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4 // accumulate, save_top_k=-1)
    _trainer(tmp_path / "b", 8 // accumulate, callbacks=[cb], **acc).fit(
        first, datamodule=TokenShardDataModule(train, val, **kw))
    ckpt = next(ckpt_dir.glob(f"*step={4 // accumulate}.ckpt"))
    state = torch.load(ckpt, weights_only=True)["TokenShardDataModule"]
    assert state["position"] == 4 and state["stage"] == 0  # stopped in the first stage, 2 batches before a boundary
    assert state["schedule"]["seq_len"] == [[0, 4], [6, 8], [12, 16]]

    second = _Recorder()
    _trainer(tmp_path / "c", steps, **acc).fit(second, datamodule=TokenShardDataModule(train, val, **kw),
                                                ckpt_path=ckpt)
    resumed = first.seen[:4] + second.seen
    assert [tuple(x.shape) for x in resumed] == [tuple(x.shape) for x in full.seen]
    for a, b in zip(resumed, full.seen, strict=True):
        assert torch.equal(a, b)
    assert any(int(b[0, 0]) < int(a[-1, -1]) for a, b in zip(full.seen, full.seen[1:]))  # the stream wrapped


def test_resume_with_another_schedule_is_refused(tmp_path):
    train, val = _shards(tmp_path)
    dm = TokenShardDataModule(train, val, seq_len=16, batch_size=2, seq_len_schedule=[[0, 4], [6, 8]])
    it = iter(dm.train_dataloader())
    for _ in range(3):
        next(it)
    state = dm.state_dict()
    other = TokenShardDataModule(train, val, seq_len=16, batch_size=2, seq_len_schedule=[[0, 4], [10, 8]])
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="batch schedule"):
        next(iter(other.train_dataloader()))
