from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_opt.data.activations import (
    CachedActivations,
    CLTDataModule,
    MLPActivationCapture,
    iter_activation_batches,
    token_windows,
    write_activation_cache,
)
from lightning_opt.data.shards import write_shard
from lightning_opt.models.gpt2 import GPT, GPTConfig


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_layer=3, n_head=2, n_embd=16, block_size=32)).eval()


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("tok") / "train_000000.bin"
    write_shard(path, rng.integers(0, 64, size=5000, dtype=np.uint16))
    return str(path)


def test_capture_matches_manual_mlp_io(gpt: GPT) -> None:
    cap = MLPActivationCapture(gpt, dtype=torch.float32)
    tokens = torch.randint(0, 64, (2, 16))
    x, y = cap.run(tokens)
    assert x.shape == (32, 3, 16) and y.shape == (32, 3, 16)
    # recompute layer by layer
    with torch.no_grad():
        h = None
        seen = []
        hooks = [b.ln_2.register_forward_hook(lambda m, i, o: seen.append(o)) for b in gpt.blocks]
        gpt(tokens)
        for hk in hooks:
            hk.remove()
        for layer, blk in enumerate(gpt.blocks):
            h = seen[layer].reshape(-1, 16)
            torch.testing.assert_close(x[:, layer], h)
            torch.testing.assert_close(y[:, layer], blk.mlp(seen[layer]).reshape(-1, 16))
    # the hooks stay registered and are inert outside run()
    assert len(cap._handles) == 3
    gpt(tokens)
    cap.remove()


def test_online_equals_cached(gpt: GPT, shard: str, tmp_path) -> None:
    cap = MLPActivationCapture(gpt, dtype=torch.bfloat16)
    online = list(iter_activation_batches(cap, token_windows(shard, 16, 4, 3000), 96))
    cache = write_activation_cache(
        cap, token_windows(shard, 16, 4, 3000), tmp_path / "c", 96, tokens_per_shard=200
    )
    ds = CachedActivations(cache)
    meta = json.loads((cache / "meta.json").read_text())
    assert len(meta["shards"]) > 1  # batches cross shard boundaries
    assert len(ds) == len(online) == 3000 // 16 // 4 * 64 // 96
    for i, (x, y) in enumerate(online):
        cx, cy = ds[i]
        assert cx.dtype == torch.bfloat16
        assert torch.equal(cx, x) and torch.equal(cy, y)
    # statistics stored with the cache
    allx = torch.cat([b[0] for b in online]).double()
    np.testing.assert_allclose(np.array(meta["stats"]["in_mean"]), allx.mean(0).numpy(), rtol=1e-5, atol=1e-6)
    assert meta["stats"]["tokens"] == allx.shape[0]
    # a DataLoader with workers streams the same batches
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, prefetch_factor=2)
    for (x, _), (lx, _) in zip(online, loader):
        assert torch.equal(x, lx)


def test_cache_without_meta_is_an_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="not completed"):
        CachedActivations(tmp_path)


def test_datamodule_cached_and_online_give_the_same_train_batches(gpt: GPT, shard: str, tmp_path) -> None:
    kw = dict(
        target=gpt,
        train_files=shard,
        val_files=shard,
        seq_len=16,
        tokens_per_batch=64,
        train_tokens=1024,
        val_tokens=128,
        shuffle=False,
    )
    cached = CLTDataModule(cache_dir=str(tmp_path / "cache"), **kw)
    online = CLTDataModule(cache_dir=None, **kw)
    cached.setup("fit")
    online.setup("fit")
    a = list(cached.train_dataloader())
    b = list(online.train_dataloader())
    assert len(a) == len(b) == 16
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert cached.n_layers == 3 and cached.d_model == 16
    val = list(online.val_dataloader())
    assert len(val) == 2 and val[0][2].shape == (4, 16)  # tokens travel with validation batches


def test_datamodule_rejects_bad_batching(gpt: GPT) -> None:
    with pytest.raises(ValueError, match="multiple of seq_len"):
        CLTDataModule(target=gpt, seq_len=16, tokens_per_batch=40)


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot find the MLPs"):
        MLPActivationCapture(torch.nn.Linear(2, 2))


def test_hf_gpt2_capture() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    cap = MLPActivationCapture(hf, dtype=torch.float32)
    tokens = torch.randint(0, 50, (2, 8))
    x, y = cap.run(tokens)
    assert x.shape == (16, 2, 16)
    with torch.no_grad():
        hs = hf(tokens, output_hidden_states=True).hidden_states
        blk = hf.transformer.h[0]
        h_mid = hs[0] + blk.attn(blk.ln_1(hs[0]))[0]
        torch.testing.assert_close(x[:, 0], blk.ln_2(h_mid).reshape(-1, 16), rtol=1e-5, atol=1e-5)


def test_online_stream_shards_windows_by_data_rank(gpt: GPT, shard: str) -> None:
    kw = dict(target=gpt, train_files=shard, val_files=None, seq_len=16, tokens_per_batch=64,
              train_tokens=1024, shuffle=False, stats_tokens=256)
    one = CLTDataModule(**kw)
    second_of_two = CLTDataModule(rank=1, world_size=2, **kw)
    for dm in (one, second_of_two):
        dm.setup("fit")
    full, mine = list(one.train_dataloader()), list(second_of_two.train_dataloader())
    assert len(mine) == len(full) // 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(mine, full[1::2]))
    with pytest.raises(ValueError, match="rank and world_size"):
        CLTDataModule(target=gpt, rank=2, world_size=2)


def test_random_gpt2_target_has_gpt2_small_shape() -> None:
    from lightning_opt.data.activations import load_target_model

    m = load_target_model("gpt2-random")
    cap = MLPActivationCapture(m)
    assert (cap.n_layers, cap.d_model) == (12, 768)
    cap.remove()
