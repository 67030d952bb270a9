from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from lightning_opt.data.activations import CLTDataModule
from lightning_opt.data.shards import write_shard
from lightning_opt.models.clt import CLTConfig
from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.modules.clt import CLTModule, FVUMetric, replacement_kl
from lightning_opt.optim.factory import OptimConfig


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=32)).eval()


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("tok") / "tok_000000.bin"
    write_shard(path, rng.integers(0, 64, size=20_000, dtype=np.uint16))
    return str(path)


def _dm(gpt: GPT, shard: str, **kw) -> CLTDataModule:
    base = dict(target=gpt, train_files=shard, val_files=shard, seq_len=16, tokens_per_batch=128,
                train_tokens=None, val_tokens=512, cache_dir=None, dtype="float32", stats_tokens=2048)
    return CLTDataModule(**{**base, **kw})


def _trainer(tmp_path, steps: int, **kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **kw,
    )


@pytest.mark.parametrize("activation,decode", [("batchtopk_global", "sparse")])
def test_fit_lowers_fvu(gpt: GPT, shard: str, tmp_path, activation: str, decode: str) -> None:
    torch.manual_seed(0)
    cfg = CLTConfig(n_layers=2, d_model=16, n_features=64, activation=activation,
                    k=8 if activation != "relu" else None, normalization="mean_std")
    module = CLTModule(cfg, optim=OptimConfig(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.0),
                       sparsity_coef=1e-4, preact_coef=1e-6, aux_coef=1 / 32, aux_k=4, dead_tokens=256,
                       decode=decode)
    dm = _dm(gpt, shard)
    trainer = _trainer(tmp_path, 0, limit_val_batches=4)
    before = trainer.validate(module, datamodule=dm, verbose=False)[0]
    trainer = _trainer(tmp_path, 60, limit_val_batches=4, val_check_interval=60)
    trainer.fit(module, datamodule=dm)
    after = trainer.callback_metrics
    assert float(after["val/fvu"]) < 0.7 * before["val/fvu"]
    for key in ("val/fvu_layer0", "val/fvu_layer1", "val/explained_variance", "val/l0", "val/l0_layer1",
                "val/dead_fraction", "val/kl", "val/next_token_agreement", "train/loss", "train/fvu",
                "train/l0", "train/auxk", "train/sparsity", "train/preact"):
        assert key in after, key
    assert float(after["val/kl"]) >= 0 and 0 <= float(after["val/next_token_agreement"]) <= 1
    if activation == "batchtopk_global":
        assert float(after["val/l0"]) == pytest.approx(8, rel=0.05)
    # the normalisation came from the data
    assert not torch.equal(module.model.in_scale, torch.ones_like(module.model.in_scale))


def test_layer_and_width_mismatch_with_target_are_clear(gpt: GPT, shard: str, tmp_path) -> None:
    dm = _dm(gpt, shard)
    bad_layers = CLTModule(CLTConfig(n_layers=3, d_model=16, n_features=32, activation="relu"))
    with pytest.raises(ValueError, match="target model has 2 layers"):
        _trainer(tmp_path, 1).fit(bad_layers, datamodule=dm)
    bad_width = CLTModule(CLTConfig(n_layers=2, d_model=8, n_features=32, activation="relu"))
    with pytest.raises(ValueError, match="width is 16"):
        _trainer(tmp_path, 1).fit(bad_width, datamodule=dm)


def test_module_argument_errors() -> None:
    with pytest.raises(ValueError, match="needs a CLTConfig"):
        CLTModule()
    cfg = CLTConfig(n_layers=2, d_model=8, n_features=16, activation="relu")
    with pytest.raises(ValueError, match="decode="):
        CLTModule(cfg, decode="fast")
    with pytest.raises(ValueError, match="sparsity_coef"):
        CLTModule(cfg, sparsity_coef=-1)


def test_fvu_metric_pools_over_batches() -> None:
    torch.manual_seed(0)
    y, p = torch.randn(40, 2, 5), torch.randn(40, 2, 5)
    m = FVUMetric(2, 5)
    m.update(p[:10], y[:10])
    m.update(p[10:], y[10:])
    per_layer, total = m.compute()
    sse = (y - p).pow(2).sum(dim=(0, 2))
    sst = (y - y.mean(0)).pow(2).sum(dim=(0, 2))
    torch.testing.assert_close(per_layer, sse / sst)
    torch.testing.assert_close(total, sse.sum() / sst.sum())


def test_replacement_with_exact_outputs_has_zero_kl(gpt: GPT) -> None:
    from lightning_opt.data.activations import MLPActivationCapture

    cap = MLPActivationCapture(gpt, dtype=torch.float32)
    tokens = torch.randint(0, 64, (2, 16))
    _, y = cap.run(tokens)
    cap.remove()
    kl, agree = replacement_kl(gpt, tokens, y)
    assert float(kl) == pytest.approx(0.0, abs=1e-5) and float(agree) == 1.0
    kl2, _ = replacement_kl(gpt, tokens, 3 * torch.randn_like(y))
    assert float(kl2) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt2_small_clt_fits_one_80gb_gpu(tmp_path) -> None:
    # lightning_opt/recipes/configs/clt_gpt2_small.yaml's model: 12 x 768, 32768 features, global BatchTopK k=200, 4096 tokens
    cfg = CLTConfig(n_layers=12, d_model=768, n_features=32768, activation="batchtopk_global", k=200,
                    normalization="mean_std")
    with torch.device("cuda"):
        module = CLTModule(cfg, sparsity_coef=1e-4, preact_coef=3e-6, aux_coef=0.03, aux_k=16, dead_tokens=4096,
                           eval_replacement=False)
        x, y = torch.randn(4096, 12, 768), torch.randn(4096, 12, 768)

    class Repeat(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield x, y

    torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(Repeat(), batch_size=None))
    assert torch.cuda.max_memory_allocated() < 78e9
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def _xy_loader(batches: int, n: int = 32, layers: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(n, layers, d, generator=g), torch.randn(n, layers, d, generator=g)) for _ in range(batches)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def test_train_metrics_only_on_logging_steps(tmp_path) -> None:
    import csv

    from lightning.pytorch.loggers import CSVLogger

    cfg = CLTConfig(n_layers=2, d_model=8, n_features=32, activation="batchtopk_global", k=4)
    module = CLTModule(cfg, sparsity_coef=1e-4, aux_coef=0.03, aux_k=4, aux_max_dead=8, dead_tokens=32)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=CSVLogger(tmp_path, name="m"),
                        log_every_n_steps=3, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, train_dataloaders=_xy_loader(7))
    rows = list(csv.DictReader(open(trainer.logger.log_dir + "/metrics.csv")))
    steps_with = lambda key: sorted(int(r["step"]) for r in rows if r.get(key))  # noqa: E731
    assert steps_with("train/fvu") == [2, 5]  # the logger writes every 3rd step
    assert steps_with("train/auxk") == [2, 5] and steps_with("train/l0") == [2, 5]
    assert steps_with("train/loss") == [2, 5]
    # callbacks (e.g. a checkpoint monitor) see the latest values
    for key in ("train/loss", "train/fvu", "train/l0", "train/dead_fraction"):
        assert key in trainer.callback_metrics, key


@pytest.mark.parametrize("activation,expect_dead", [("relu", False), ("batchtopk_global", True)])
def test_auxk_is_skipped_while_no_feature_is_dead(tmp_path, activation: str, expect_dead: bool) -> None:
    # relu on random data: every feature fires in every batch, so none is ever dead and AuxK is skipped
    # (without a host sync on GPU); k=1 of 2 * 256 features leaves most of them dead.
    cfg = CLTConfig(n_layers=2, d_model=8, n_features=256, activation=activation,
                    k=1 if activation != "relu" else None)
    module = CLTModule(cfg, aux_coef=0.03, aux_k=4, aux_max_dead=16, dead_tokens=32)
    trainer = _trainer(tmp_path, 3, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=_xy_loader(3))
    dead_now = bool((module.tokens_since_fired >= module.dead_tokens).any())
    assert dead_now == expect_dead and module._maybe_dead() == expect_dead
    import copy

    assert copy.deepcopy(module)._maybe_dead()  # a copy does not carry the flag (nor a CUDA event)
    with pytest.raises(ValueError, match="aux_max_dead"):
        CLTModule(cfg, aux_k=8, aux_max_dead=4)


def _triton_interpreted() -> bool:
    import os

    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_interpreted(), reason="needs triton with TRITON_INTERPRET=1 (the GPU's kernels on CPU)")
@pytest.mark.parametrize("activation", ["batchtopk_global", "batchtopk"])
def test_training_step_reads_nothing_back_from_the_device(tmp_path, activation: str) -> None:
    """The training step the GPU runs (bf16 pre-activations: the one-pass Triton selection; the dense decode's
    gradient at the kept entries in one Triton launch), here through Triton's interpreter on CPU: from the step's
    start to its optimizer step (forward, loss, AuxK, backward) no tensor is read back to Python (``item``,
    ``tolist``, ``bool``, ``nonzero``, ...) except the dead-feature flag, a pinned host tensor on CUDA."""
    import traceback

    from torch.overrides import TorchFunctionMode

    class HostReads(TorchFunctionMode):
        NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu"}

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, str]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in self.NAMES:
                self.calls.append((name, "".join(traceback.format_stack(limit=4))))
            return func(*args, **(kwargs or {}))

    watched: dict[str, HostReads] = {}

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 2:  # after the first steps' one-time self-checks; not a logging step
                watched["mode"] = HostReads()
                watched["mode"].__enter__()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == 2:
                watched["mode"].__exit__(None, None, None)

    def reads(select_backend: str) -> list[tuple[str, str]]:
        cfg = CLTConfig(n_layers=2, d_model=16, n_features=128, activation=activation, k=4,
                        topk_select_backend=select_backend)
        module = CLTModule(cfg, sparsity_coef=1e-4, preact_coef=1e-6, aux_coef=0.03, aux_k=4, aux_max_dead=16,
                           dead_tokens=64, decode="dense")
        trainer = _trainer(tmp_path, 4, limit_val_batches=0, log_every_n_steps=50, callbacks=[Watch()],
                           precision="bf16-mixed")
        trainer.fit(module, train_dataloaders=_xy_loader(4, n=64, d=16))
        assert module.tokens_seen == 4 * 64 and torch.isfinite(trainer.callback_metrics["train/loss"])
        return watched.pop("mode").calls

    calls = reads("auto")
    assert calls and all("_maybe_dead" in stack for _, stack in calls), [name for name, _ in calls]
    # the control: the two-pass selection reads its candidate count back (its one host sync on a GPU)
    assert any(name == "tolist" for name, _ in reads("triton_2pass"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_step_makes_no_host_sync_on_gpu(tmp_path) -> None:
    """The training step outside the logging steps (bf16-mixed, global BatchTopK, dense decode, AuxK active):
    ``torch.cuda.set_sync_debug_mode`` warns on no host sync."""
    pytest.importorskip("triton")
    import warnings

    caught: dict[str, list] = {}

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 3:
                torch.cuda.synchronize()
                caught["cm"] = warnings.catch_warnings(record=True)
                caught["w"] = caught["cm"].__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 3:
                torch.cuda.set_sync_debug_mode(0)
                caught["cm"].__exit__(None, None, None)

    cfg = CLTConfig(n_layers=4, d_model=64, n_features=2048, activation="batchtopk_global", k=16)
    with torch.device("cuda"):
        module = CLTModule(cfg, sparsity_coef=1e-4, preact_coef=1e-6, aux_coef=0.03, aux_k=8, aux_max_dead=64,
                           dead_tokens=512, decode="dense")
    g = torch.Generator(device="cuda").manual_seed(0)
    data = [(torch.randn(512, 4, 64, device="cuda", generator=g), torch.randn(512, 4, 64, device="cuda", generator=g))
            for _ in range(5)]
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, log_every_n_steps=50, default_root_dir=tmp_path, callbacks=[Count()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    syncs = [str(w.message) for w in caught["w"] if "synchroniz" in str(w.message)]
    assert syncs == []


# ------------------------------------------------------------------ dead-feature resampling
def _resample_setup(n_dead: int, n_tokens: int = 32, weighting: str = "loss", heavy: bool = True):
    """A module whose first ``n_dead`` features of each layer are dead, and a batch whose first token's error is
    1000x the others' (a heavy tail: the case where draws with replacement give many features one token)."""
    torch.manual_seed(0)
    cfg = CLTConfig(n_layers=2, d_model=8, n_features=64, activation="batchtopk_global", k=4)
    module = CLTModule(cfg, dead_tokens=n_tokens, resample_weighting=weighting)
    module.tokens_since_fired[:, :n_dead] = n_tokens
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_tokens, 2, 8, generator=g)
    residual = torch.randn(n_tokens, 2, 8, generator=g)
    if heavy:
        residual[0] *= 1000.0
    return module, x, residual


def _drawn_tokens(module: CLTModule, x: torch.Tensor, layer: int) -> torch.Tensor:
    """The token each resampled feature of ``layer`` got: the input its encoder column points along."""
    cols = torch.nn.functional.normalize(module.model.W_enc[layer][:, module.last_resampled[layer]].t(), dim=1)
    cos = cols @ torch.nn.functional.normalize(x[:, layer], dim=1).t()  # [D, N]
    torch.testing.assert_close(cos.max(1).values, torch.ones(cols.shape[0]))
    return cos.argmax(1)


@pytest.mark.parametrize("weighting", ["loss", "loss_squared", "uniform"])
def test_resampled_features_get_distinct_directions(weighting: str) -> None:
    module, x, residual = _resample_setup(n_dead=20, weighting=weighting)
    assert module.resample_dead_features(x, residual) == 40
    for layer in range(2):
        tokens = _drawn_tokens(module, x, layer)
        assert tokens.unique().numel() == 20  # one token per feature, even with one token 1000x the others
        dec = module.model.W_dec[layer][module.last_resampled[layer]].flatten(1)
        assert torch.unique(dec, dim=0).shape[0] == 20
        torch.testing.assert_close(torch.nn.functional.normalize(dec, dim=1),
                                   torch.nn.functional.normalize(residual[tokens, layer:].flatten(1), dim=1))


def test_resampling_spreads_tokens_when_dead_features_outnumber_them() -> None:
    # 40 dead features per layer, 16 tokens with an error (the others reconstructed exactly): every token with an
    # error is used 2 or 3 times, no feature gets an error-free token (its residual has no direction)
    module, x, residual = _resample_setup(n_dead=40, heavy=False)
    residual[16:] = 0
    module.resample_dead_features(x, residual)
    for layer in range(2):
        counts = torch.bincount(_drawn_tokens(module, x, layer), minlength=32)
        assert bool((counts[:16] >= 2).all() and (counts[:16] <= 3).all()) and int(counts[16:].sum()) == 0


def test_loss_weighting_prefers_high_loss_tokens() -> None:
    # 4 of 32 tokens carry almost all the loss: drawn for 4 dead features, they are the ones chosen
    module, x, residual = _resample_setup(n_dead=4, heavy=False)
    residual[4:] *= 1e-3
    module.resample_dead_features(x, residual)
    for layer in range(2):
        assert sorted(_drawn_tokens(module, x, layer).tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="resample_weighting"):
        CLTModule(module.clt_config, resample_weighting="cubic")


def test_resampling_in_fit_resets_optimizer_state_and_resumes(tmp_path) -> None:
    # a real Trainer: features forced dead are resampled after step 3's update; the Adam moments of their rows
    # are zero right after it (every other row keeps nonzero ones); a run resumed from that step's checkpoint
    # ends where the uninterrupted one does and keeps the weighting
    from lightning.pytorch.callbacks import ModelCheckpoint

    def make() -> CLTModule:
        torch.manual_seed(0)
        cfg = CLTConfig(n_layers=2, d_model=8, n_features=16, activation="batchtopk_global", k=4)
        m = CLTModule(cfg, optim=OptimConfig(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0), dead_tokens=64,
                      eval_replacement=False, resample_dead_every=3, resample_weighting="loss_squared")
        with torch.no_grad():
            m.model.b_enc[:, :4] = -100.0  # these never fire
        return m

    seen: dict[str, torch.Tensor] = {}

    class AfterResample(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 3:
                state = trainer.optimizers[0].state
                m = pl_module.model
                seen["dead"] = pl_module.last_resampled.clone()
                seen["enc"] = torch.stack([state[m.W_enc][k].transpose(1, 2) for k in ("exp_avg", "exp_avg_sq")])
                seen["b"] = torch.stack([state[m.b_enc][k] for k in ("exp_avg", "exp_avg_sq")])
                seen["dec0"] = torch.stack([state[m.W_dec[0]][k] for k in ("exp_avg", "exp_avg_sq")])

    ckpts = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    full = make()
    L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path / "full",
              callbacks=[AfterResample(), ckpts]).fit(full, train_dataloaders=_xy_loader(3))
    dead = seen["dead"]
    assert bool(dead[:, :4].all()) and full.resampled_total >= 8
    assert bool((seen["enc"][:, dead] == 0).all()) and bool((seen["enc"][:, ~dead] != 0).any(-1).all())
    assert bool((seen["b"][:, dead] == 0).all()) and bool((seen["b"][:, ~dead] != 0).all())
    assert bool((seen["dec0"][:, dead[0]] == 0).all())
    assert bool((full.tokens_since_fired[:, :4] < 3 * 32).all())  # the revived features fired since

    resumed = make()
    _trainer(tmp_path / "resumed", 6, limit_val_batches=0).fit(
        resumed, train_dataloaders=_xy_loader(3), ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"),
        weights_only=False)  # written by this test
    assert resumed.resampled_total == full.resampled_total
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    loaded = CLTModule.load_from_checkpoint(str(tmp_path / "ckpt" / "step=6.ckpt"), weights_only=False)
    assert loaded.resample_weighting == "loss_squared"
