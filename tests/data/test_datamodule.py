from __future__ import annotations

import socket
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightning_opt.data.datamodule import TokenShardDataModule
from lightning_opt.data.shards import read_shard, write_shard
from tests._fork import fork_ranks, one_thread_for_forks

T, B = 8, 4


def _shards(
    tmp_path: Path, n_train: int = 1001, n_val: int = 301, pieces: int = 3
) -> tuple[list[Path], Path]:
    """Train tokens 0..n_train-1 over ``pieces`` shards (token value == stream position), val tokens
    offset by 40000 so the two are told apart."""
    cuts = np.linspace(0, n_train, pieces + 1).astype(int)
    train = [
        write_shard(tmp_path / f"t_{i:03d}.bin", np.arange(a, b))
        for i, (a, b) in enumerate(zip(cuts, cuts[1:]))
    ]
    val = write_shard(tmp_path / "v_000.bin", 40_000 + np.arange(n_val))
    return train, val


def _starts(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    return batch[0][:, 0].tolist()


def test_batches_have_shapes_and_shift(tmp_path: Path) -> None:
    _shards(tmp_path)
    dm = TokenShardDataModule(str(tmp_path / "t_*.bin"), tmp_path / "v_000.bin", seq_len=T, batch_size=B)
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == dm.steps_per_epoch() == (1000 // T) // B == 31
    for i, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
        # windows start every T tokens and run across shard boundaries (shards cut at 333, 667)
        expected = torch.arange(i * B * T, (i + 1) * B * T).view(B, T)
        torch.testing.assert_close(x, expected)
        torch.testing.assert_close(y, expected + 1)


def test_fixed_val_set_is_the_first_val_tokens_and_identical_across_instances(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    kw = dict(seq_len=T, batch_size=B, val_tokens=100, shuffle=True)
    a = list(TokenShardDataModule(train, val, seed=1, **kw).val_dataloader())
    b = list(TokenShardDataModule(train, val, seed=2, **kw).val_dataloader())
    assert [x.shape[0] for x, _ in a] == [4, 4, 4]  # 100 // 8 = 12 windows, batch 4
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x = torch.cat([x for x, _ in a])
    y = torch.cat([y for _, y in a])
    torch.testing.assert_close(x.flatten(), 40_000 + torch.arange(96))
    torch.testing.assert_close(y.flatten(), 40_001 + torch.arange(96))


def test_val_split_over_ranks_is_disjoint_and_even(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    seen = []
    for rank in range(3):
        dm = TokenShardDataModule(
            train, val, seq_len=T, batch_size=B, val_tokens=100, rank=rank, world_size=3
        )
        seen.append([s for batch in dm.val_dataloader() for s in _starts(batch)])
    assert all(len(s) == 4 for s in seen)  # 12 windows / 3 ranks
    flat = sorted(s for rank in seen for s in rank)
    assert flat == [40_000 + T * k for k in range(12)]


def _epoch_starts(dm: TokenShardDataModule) -> list[int]:
    return [s for batch in dm.train_dataloader() for s in _starts(batch)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_read_disjoint_windows_that_cover_the_epoch(tmp_path: Path, shuffle: bool) -> None:
    train, val = _shards(tmp_path)
    per_rank = [
        _epoch_starts(
            TokenShardDataModule(train, val, seq_len=T, batch_size=B, shuffle=shuffle, rank=r, world_size=2)
        )
        for r in range(2)
    ]
    assert len(per_rank[0]) == len(per_rank[1]) == 15 * B  # 125 windows // (4*2) = 15 steps
    assert not set(per_rank[0]) & set(per_rank[1])
    all_windows = {T * k for k in range(125)}
    covered = set(per_rank[0]) | set(per_rank[1])
    assert (
        covered <= all_windows and len(all_windows - covered) == 125 - 120
    )  # only the remainder is left out


def test_shuffle_is_seeded_and_changes_per_epoch(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    a = TokenShardDataModule(train, val, seq_len=T, batch_size=B, shuffle=True, seed=3)
    b = TokenShardDataModule(train, val, seq_len=T, batch_size=B, shuffle=True, seed=3)
    a1, a2 = _epoch_starts(a), _epoch_starts(a)
    assert a1 == _epoch_starts(b)
    assert a1 != a2
    # each epoch uses 124 distinct windows of 125; the one left out changes with the shuffle
    assert len(set(a1)) == len(set(a2)) == 124 and len(set(a1) | set(a2)) <= 125
    assert a1 != sorted(a1)
    c = TokenShardDataModule(train, val, seq_len=T, batch_size=B, shuffle=True, seed=4)
    assert _epoch_starts(c) != a1


def _dist_worker(rank: int, port: int, train: list[str], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        dm = TokenShardDataModule(train, None, seq_len=T, batch_size=B)  # rank/world from torch.distributed
        starts = _epoch_starts(dm)
        gathered: list[list[int] | None] = [None, None]
        dist.all_gather_object(gathered, starts)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def test_real_torch_distributed_ranks_do_not_overlap(tmp_path: Path) -> None:
    train, _ = _shards(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "starts.pt")
    fork_ranks(_dist_worker, (port, [str(p) for p in train], out), 2)
    r0, r1 = torch.load(out)
    assert len(r0) == len(r1) == 15 * B
    assert not set(r0) & set(r1)
    assert set(r0) | set(r1) <= {T * k for k in range(125)}


@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_resume_from_state_dict(tmp_path: Path, shuffle: bool) -> None:
    train, val = _shards(tmp_path)
    kw = dict(seq_len=T, batch_size=B, shuffle=shuffle, seed=5)
    ref = TokenShardDataModule(train, val, **kw)
    reference = _epoch_starts(ref) + _epoch_starts(ref)  # two epochs, uninterrupted

    dm = TokenShardDataModule(train, val, **kw)
    consumed = 0
    for _ in range(2):  # stop in the second epoch
        for _batch in dm.train_dataloader():
            consumed += 1
            if consumed == 40:
                break
    state = dm.state_dict()
    assert state["position"] == 40

    resumed = TokenShardDataModule(train, val, **kw)
    resumed.load_state_dict(state)
    nxt = next(iter(resumed.train_dataloader()))
    assert _starts(nxt) == reference[40 * B : 41 * B]
    rest = [s for batch in resumed.train_dataloader() for s in _starts(batch)]
    assert reference[40 * B : 41 * B] + rest == reference[40 * B :]  # finishes epoch 2 exactly


def test_workers_keep_order_and_resume(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    plain = _epoch_starts(TokenShardDataModule(train, val, seq_len=T, batch_size=B, shuffle=True))
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=B, shuffle=True, num_workers=2)
    it = iter(dm.train_dataloader())
    first = [s for _ in range(5) for s in _starts(next(it))]
    state = dm.state_dict()  # the workers have prefetched more, but only 5 batches were handed out
    del it
    assert state["position"] == 5 and first == plain[: 5 * B]
    dm2 = TokenShardDataModule(train, val, seq_len=T, batch_size=B, shuffle=True, num_workers=2)
    dm2.load_state_dict(state)
    assert _epoch_starts(dm2) == plain[5 * B :]


def test_changed_layout_resumes_at_same_token_count_with_warning(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=B, rank=0, world_size=1)
    it = iter(dm.train_dataloader())
    for _ in range(6):
        next(it)
    state = dm.state_dict()
    dm2 = TokenShardDataModule(train, val, seq_len=T, batch_size=B, rank=0, world_size=2)
    dm2.load_state_dict(state)
    with pytest.warns(UserWarning, match="not an exact resume"):
        batch = next(iter(dm2.train_dataloader()))
    assert dm2.state_dict()["position"] == 4  # 6*32 tokens / (2 ranks * 32) = 3 consumed + this one
    assert _starts(batch)[0] == 3 * 2 * B * T


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(seq_len=0), "seq_len must be a positive integer"),
        (dict(batch_size=-2), "batch_size must be a positive integer"),
        (dict(val_tokens=4), r"val_tokens=4 is smaller than one window of seq_len=8"),
        (dict(batch_size=200), r"fewer than one batch of batch_size=200"),
        (dict(vocab_size=300), r"t_000\.bin' contains token id 300 at token offset 300, which is >= vocab_size 300"),
        (dict(rank=2, world_size=2), "need 0 <= rank < world_size"),
    ],
)
def test_invalid_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    train, val = _shards(tmp_path)
    args = dict(seq_len=T, batch_size=B) | kwargs
    with pytest.raises(ValueError, match=match):
        TokenShardDataModule(train, val, **args)


def test_val_tokens_beyond_the_split_validate_on_all_of_it(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    with pytest.warns(UserWarning, match=r"val_tokens=10000 but the val shards hold only 301 tokens; validating on all 300"):
        dm = TokenShardDataModule(train, val, seq_len=T, batch_size=B, val_tokens=10_000)
    whole = TokenShardDataModule(train, val, seq_len=T, batch_size=B, val_tokens=None)
    assert (dm.val_tokens, dm.num_val_windows) == (whole.val_tokens, whole.num_val_windows) == (300, 300 // T)


def test_too_little_data_for_the_world_size(tmp_path: Path) -> None:
    train, val = _shards(tmp_path, n_train=41)  # 5 windows: one batch of 4, not two
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=B, rank=1, world_size=2)
    with pytest.raises(ValueError, match="cannot fill one batch on each of 2 ranks"):
        dm.train_dataloader()


# -- through a real Trainer --------------------------------------------------------------------


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(65536, 4)
        self.head = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x[:, 0].tolist())
        return (self.head(self.emb(x)).squeeze(-1) - (y % 7).float()).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.log("val_x", x.float().mean(), batch_size=x.shape[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(tmp_path: Path, max_steps: int, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        **kw,
    )


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_through_trainer_fit_checkpoint(tmp_path: Path, accumulate: int) -> None:
    # 321 tokens: 40 windows of 8 -> 10 batches per epoch at batch 4 (even, so accumulation never
    # meets a short epoch end); 12 steps cross an epoch boundary.
    train, val = _shards(tmp_path, n_train=321, pieces=2)
    kw = dict(seq_len=T, batch_size=B, val_tokens=64, shuffle=True, seed=9)
    acc = dict(accumulate_grad_batches=accumulate)

    full = _Recorder()
    _trainer(tmp_path / "a", 12, **acc).fit(full, datamodule=TokenShardDataModule(train, val, **kw))
    assert len(full.seen) == 12 * accumulate

    ckpt_dir = tmp_path / "ckpt"
    first = _Recorder()
    cb = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1)
    _trainer(tmp_path / "b", 7, callbacks=[cb], **acc).fit(
        first, datamodule=TokenShardDataModule(train, val, **kw)
    )
    ckpt = next(ckpt_dir.glob("*step=5*.ckpt"))
    consumed = 5 * accumulate  # micro-batches
    assert torch.load(ckpt, weights_only=False)["TokenShardDataModule"]["position"] == consumed

    second = _Recorder()
    _trainer(tmp_path / "c", 12, **acc).fit(
        second, datamodule=TokenShardDataModule(train, val, **kw), ckpt_path=ckpt
    )
    assert first.seen[:consumed] + second.seen == full.seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefetch_gives_same_batches(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    ref = _Recorder()
    _trainer(tmp_path / "cpu", 6).fit(
        ref, datamodule=TokenShardDataModule(train, val, seq_len=T, batch_size=B)
    )
    gpu = _Recorder()
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / "gpu",
        limit_val_batches=0,
    )
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=B, gpu_prefetch=True)
    trainer.fit(gpu, datamodule=dm)
    assert dm._prefetched >= 6 and dm.state_dict()["position"] == 6
    assert gpu.seen == ref.seen


def test_no_val_files_means_no_validation(tmp_path: Path) -> None:
    train, _ = _shards(tmp_path)
    dm = TokenShardDataModule(train, None, seq_len=T, batch_size=B)
    assert dm.val_dataloader() == []


def test_printing_does_not_iterate_or_move_the_position(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=B)
    assert "seq_len=8" in str(dm) and "position=0" in repr(dm)
    assert _starts(next(iter(dm.train_dataloader()))) == [0, 8, 16, 24]


def test_lightning_epochs_shorter_than_the_data_continue_the_stream(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    model = _Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=TokenShardDataModule(train, val, seq_len=T, batch_size=B))
    # epoch 2 picks up at batch 3 instead of re-reading batches 0-2
    assert [row[0] for row in model.seen] == [i * B * T for i in range(6)]


class _RankRecorder(_Recorder):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def on_train_end(self) -> None:
        torch.save(self.seen, self.out / f"rank{self.global_rank}.pt")


def test_ddp_trainer_ranks_read_what_explicit_ranks_predict(tmp_path: Path) -> None:
    train, val = _shards(tmp_path)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        max_steps=4,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    kw = dict(seq_len=T, batch_size=B, shuffle=True, seed=11)
    with one_thread_for_forks():
        trainer.fit(_RankRecorder(tmp_path), datamodule=TokenShardDataModule(train, val, **kw))
    seen = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in range(2):
        it = iter(TokenShardDataModule(train, val, rank=rank, world_size=2, **kw).train_dataloader())
        assert seen[rank] == [_starts(next(it)) for _ in range(4)]
    flat = [s for rank in seen for row in rank for s in row]
    assert len(flat) == len(set(flat)) == 2 * 4 * B


def test_val_shards_smaller_than_one_window(tmp_path: Path) -> None:
    train, _ = _shards(tmp_path)
    tiny = write_shard(tmp_path / "tiny_val.bin", np.arange(5))
    with pytest.raises(ValueError, match="val shards hold only 5 tokens, less than one window"):
        TokenShardDataModule(train, tiny, seq_len=T, batch_size=B)


def test_shuffled_windows_hold_the_right_tokens_across_shard_boundaries(tmp_path: Path) -> None:
    train, val = _shards(tmp_path, pieces=7)  # many boundaries
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=B, shuffle=True)
    for x, y in dm.train_dataloader():
        expected = x[:, :1] + torch.arange(T)  # token value == stream position
        assert torch.equal(x, expected) and torch.equal(y, expected + 1)
        assert bool((x[:, 0] % T == 0).all())


def test_val_shard_of_exactly_seq_len_tokens_is_refused_at_construction(tmp_path: Path) -> None:
    train, _ = _shards(tmp_path)
    val = write_shard(tmp_path / "short_val.bin", np.arange(64))
    with pytest.raises(ValueError, match=r"val shards hold 64 tokens; one validation window needs seq_len\+1=65"):
        TokenShardDataModule(train, val, seq_len=64, batch_size=1, val_tokens=64)
    val = write_shard(tmp_path / "ok_val.bin", np.arange(65))  # one more token: one window
    dm = TokenShardDataModule(train, val, seq_len=64, batch_size=1, val_tokens=64)
    assert [x.shape for x, _ in dm.val_dataloader()] == [(1, 64)]


def test_val_windows_too_few_for_the_ranks_says_what_to_raise(tmp_path: Path) -> None:
    train, _ = _shards(tmp_path, n_train=4001)
    val = write_shard(tmp_path / "val.bin", np.arange(16))  # 15 targets: one window of 8, not two
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=1, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"val shards hold 16 tokens, 2 windows need 17"):
        dm.val_dataloader()
    val = write_shard(tmp_path / "val.bin", np.arange(100))
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=1, val_tokens=8, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"raise val_tokens \(now 8\) to at least 16"):
        dm.val_dataloader()
    dm = TokenShardDataModule(train, val, seq_len=T, batch_size=1, val_tokens=16, rank=1, world_size=2)
    assert [x[0, 0].item() for x, _ in dm.val_dataloader()] == [8]


def test_builtin_corpus_without_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_opt.data.corpus import default_corpus_shards

    monkeypatch.setenv("LIGHTNING_OPT_CACHE", str(tmp_path / "cache"))
    train, val = default_corpus_shards()
    dm = TokenShardDataModule("builtin", "builtin", seq_len=64, batch_size=4, val_tokens=4096, vocab_size=256)
    assert dm.train_files == [train] and dm.val_files == [val] and dm.val_tokens == 4096
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 64) and int(x.max()) < 256
    assert dm.hparams.train_files == "builtin"  # the checkpoint records the name, not this machine's path
    with pytest.warns(UserWarning, match=r"built-in corpus has \d+ val tokens; val_tokens=100000000 is lowered"):
        dm = TokenShardDataModule("builtin", "builtin", seq_len=64, batch_size=4, val_tokens=100_000_000)
    assert dm.val_tokens == read_shard(val).shape[0] - 1


def test_own_train_shards_with_the_builtin_val_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_OPT_CACHE", str(tmp_path / "cache"))
    train, _ = _shards(tmp_path)
    with pytest.warns(UserWarning, match=r"val_files is 'builtin'.*val loss is measured on the built-in corpus"):
        dm = TokenShardDataModule(train, "builtin", seq_len=T, batch_size=B, val_tokens=64)
    assert dm.num_val_windows == 8 and "pydoc_topics" in dm.val_files[0].name


def test_val_files_that_are_the_train_files_warn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train, _ = _shards(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"val shards are the train shards .*measured on training data"):
        TokenShardDataModule(str(tmp_path / "t_*.bin"), ["t_000.bin", "t_001.bin", "t_002.bin"], seq_len=T,
                             batch_size=B)
    with pytest.warns(UserWarning, match=r"val shards include train shards .*t_001\.bin"):
        TokenShardDataModule(train[:2], [train[1], tmp_path / "v_000.bin"], seq_len=T, batch_size=1)
