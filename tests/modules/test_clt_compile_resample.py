"""CLTModule(compile=True) against eager, and dead-feature resampling (revival, optimizer state, resume)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_opt.models.clt import CLTConfig
from lightning_opt.modules.clt import CLTModule
from lightning_opt.optim.factory import OptimConfig

N_TOKENS, N_LAYERS, D_MODEL = 32, 2, 8


def _batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(N_TOKENS, N_LAYERS, D_MODEL, generator=g)
        out.append((x, 0.5 * x + torch.randn(N_TOKENS, N_LAYERS, D_MODEL, generator=g)))
    return out


def _loader(batches: list) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(batches, batch_size=None)


def _trainer(tmp_path, steps: int, callbacks: list | None = None, **kw) -> L.Trainer:
    base = dict(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                default_root_dir=tmp_path, callbacks=callbacks or [])
    return L.Trainer(**{**base, **kw})


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())


def _inductor_works() -> bool:
    try:
        fn = torch.compile(lambda t: (t * 2).sum(), fullgraph=True, dynamic=False)
        return bool(fn(torch.ones(3)) == 6)
    except Exception:
        return False


# ------------------------------------------------------------------ compile
@pytest.mark.skipif(not _inductor_works(), reason="inductor cannot compile on this machine")
def test_compiled_fit_matches_eager_loss_trajectory(tmp_path) -> None:
    cfg = CLTConfig(n_layers=N_LAYERS, d_model=D_MODEL, n_features=32, activation="batchtopk_global", k=4,
                    normalization="mean_std")
    batches = _batches(4)
    stats = {"in_mean": torch.full((N_LAYERS, D_MODEL), 0.1), "in_std": torch.full((N_LAYERS, D_MODEL), 1.5),
             "out_mean": torch.full((N_LAYERS, D_MODEL), -0.2), "out_std": torch.full((N_LAYERS, D_MODEL), 1.2)}
    runs = {}
    for compile in (False, True):
        torch.manual_seed(0)
        # the sparsity weight ramps from 0 (a second graph once the penalty is on); pre-activation loss and AuxK on
        module = CLTModule(cfg, optim=OptimConfig(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0),
                           sparsity_coef=1e-3, preact_coef=1e-4, aux_coef=0.03, aux_k=2, aux_max_dead=8,
                           dead_tokens=N_TOKENS, eval_replacement=False, compile=compile)
        module.model.set_normalization(stats)
        losses = _Losses()
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        _trainer(tmp_path, 4, [losses]).fit(module, train_dataloaders=_loader(batches))
        runs[compile] = (torch.stack(losses.losses), dict(module.named_parameters()),
                         torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before)
        assert module.hparams["compile"] is compile
    (eager, eager_params, eager_graphs), (compiled, compiled_params, compiled_graphs) = runs[False], runs[True]
    assert eager_graphs == 0 and compiled_graphs >= 2  # the encoder and the loss regions really compiled
    assert len(compiled) == 4 and bool((compiled[1:] != compiled[0]).any())  # the loss moved
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for name, p in eager_params.items():
        torch.testing.assert_close(compiled_params[name], p, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_refuses_a_sharded_clt(tmp_path) -> None:
    cfg = CLTConfig(n_layers=N_LAYERS, d_model=D_MODEL, n_features=16, activation="batchtopk_global", k=4)
    module = CLTModule(cfg, compile=True)
    module.model.shard_decoder_(0, D_MODEL // 2)
    with pytest.raises(ValueError, match="compile=True does not support a sharded CLT"):
        _trainer(tmp_path, 1).fit(module, train_dataloaders=_loader(_batches(1)))
    with pytest.raises(ValueError, match="compile.mode='yes' is unknown"):
        CLTModule(cfg, compile="yes")  # type: ignore[arg-type]
    over_ranks = CLTModule(cfg, compile=True)
    over_ranks.model.topk_group = "a process group"  # what GlobalBatchTopK attaches at setup; refused before use
    with pytest.raises(ValueError, match="BatchTopK over ranks"):
        _trainer(tmp_path, 1).fit(over_ranks, train_dataloaders=_loader(_batches(1)))


# ------------------------------------------------------------------ resampling
def _resampling_module(activation: str = "batchtopk_global", n_features: int = 16, k: int = 4, **kw) -> CLTModule:
    torch.manual_seed(0)
    cfg = CLTConfig(n_layers=N_LAYERS, d_model=D_MODEL, n_features=n_features, activation=activation,
                    k=k if activation != "relu" else None)
    base = dict(optim=OptimConfig(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0), dead_tokens=2 * N_TOKENS,
                eval_replacement=False, resample_dead_every=3)
    return CLTModule(cfg, **{**base, **kw})


@pytest.mark.parametrize("activation,scale", [("relu", 0.2), ("batchtopk_global", 1.0)])
def test_resampling_revives_forced_dead_features(tmp_path, activation: str, scale: float) -> None:
    module = _resampling_module(activation)
    assert module.resample_encoder_scale == scale  # the default for the activation
    forced = torch.zeros(N_LAYERS, 16, dtype=torch.bool)
    forced[:, :4] = True
    with torch.no_grad():
        module.model.b_enc[forced] = -100.0  # these never fire
    seen: dict[str, torch.Tensor] = {}

    class AfterResample(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 3:  # right after the resampling at the end of step 3
                seen["b_enc"] = pl_module.model.b_enc.detach().clone()
                seen["resampled"] = pl_module.last_resampled.clone()
                seen["since"] = pl_module.tokens_since_fired.clone()

    _trainer(tmp_path, 6, [AfterResample()]).fit(module, train_dataloaders=_loader(_batches(6)))
    resampled = seen["resampled"]
    assert bool(resampled[forced].all())  # every forced-dead feature was dead and got resampled
    assert module.resampled_total == int(resampled.sum()) and module.resampled_total >= int(forced.sum())
    torch.testing.assert_close(seen["b_enc"][resampled], torch.zeros(int(resampled.sum())))
    assert bool((seen["since"][resampled] == 0).all())
    # alive again: the resampled features fired in the three steps after (96 tokens < the 64-token window + 32)
    since = module.tokens_since_fired
    assert bool((since[forced] < 3 * N_TOKENS).all()), since[forced]
    if activation == "relu":  # every feature fires on random data: none was dead but the forced ones
        assert torch.equal(resampled, forced)


def test_resampled_rows_get_zero_moments_and_others_keep_theirs(tmp_path) -> None:
    # a few steps without resampling build Adam moments; then one resampling on the next batch
    module = _resampling_module(dead_tokens=N_TOKENS, resample_dead_every=None, resample_encoder_scale=0.5)
    trainer = _trainer(tmp_path, 3)
    batches = _batches(4)
    trainer.fit(module, train_dataloaders=_loader(batches[:3]))
    opt = trainer.optimizers[0]
    m = module.model
    params = {"W_enc": m.W_enc, "b_enc": m.b_enc, **{f"W_dec{s}": w for s, w in enumerate(m.W_dec)}}

    def snapshot() -> dict:
        return {name: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for name, p in params.items()}

    before = snapshot()
    x, y = batches[3]
    with torch.no_grad():
        residual = m.normalize_targets(y) - m(x).recon
    count = module.resample_dead_features(x, residual, trainer.optimizers)
    after = snapshot()
    dead = module.last_resampled
    assert count == int(dead.sum()) and 0 < count < dead.numel()
    assert not bool((module.tokens_since_fired[dead] != 0).any())
    for key in ("exp_avg", "exp_avg_sq"):
        enc_b, enc_a = before["W_enc"][key].transpose(1, 2), after["W_enc"][key].transpose(1, 2)  # [L, F, d]
        assert bool((enc_b[dead] != 0).any())  # they were not zero before
        assert bool((enc_a[dead] == 0).all())
        assert torch.equal(enc_a[~dead], enc_b[~dead])
        assert bool((after["b_enc"][key][dead] == 0).all())
        assert torch.equal(after["b_enc"][key][~dead], before["b_enc"][key][~dead])
        for s in range(N_LAYERS):
            dec_b, dec_a = before[f"W_dec{s}"][key], after[f"W_dec{s}"][key]  # [F, L - s, d]
            assert bool((dec_a[dead[s]] == 0).all())
            assert torch.equal(dec_a[~dead[s]], dec_b[~dead[s]])
    # the resampled encoder columns have the live columns' mean norm x the scale (0.5 here)
    enc_norm = torch.linalg.vector_norm(m.W_enc, dim=1)
    for layer in range(N_LAYERS):
        live = enc_norm[layer][~dead[layer]].mean()
        torch.testing.assert_close(enc_norm[layer][dead[layer]], (0.5 * live).expand(int(dead[layer].sum())))
        # ... and point along the input of one of the batch's tokens; the decoder rows along its residual
        inputs = torch.nn.functional.normalize(x[:, layer], dim=1)  # [N, d] (no normalisation configured)
        cols = torch.nn.functional.normalize(m.W_enc[layer][:, dead[layer]].t(), dim=1)  # [D, d]
        cos = cols @ inputs.t()  # [D, N]
        torch.testing.assert_close(cos.max(1).values, torch.ones(cols.shape[0]))
        token = cos.argmax(1)
        rows = torch.nn.functional.normalize(m.W_dec[layer][dead[layer]].flatten(1), dim=1)
        want = torch.nn.functional.normalize(residual[token, layer:].flatten(1), dim=1)
        torch.testing.assert_close(rows, want)


def test_resume_across_a_resampling_is_exact(tmp_path) -> None:
    # 3 batches per epoch, a resampling after steps 3 and 6; the checkpoint of step 3 is written after that
    # step's resampling, and the one of step 6 draws its tokens from the generator state the checkpoint holds
    from lightning.pytorch.callbacks import ModelCheckpoint

    batches = _batches(3)
    kw = dict(n_features=64, k=1, dead_tokens=N_TOKENS, resample_dead_every=3)  # most features silent per batch
    full = _resampling_module(**kw)
    ckpts = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    _trainer(tmp_path / "full", 6, [ckpts], enable_checkpointing=True).fit(full, train_dataloaders=_loader(batches))
    ckpt = str(tmp_path / "ckpt" / "step=3.ckpt")
    saved = torch.load(ckpt, weights_only=False)  # written by this test
    first = saved["clt_resampling"]["resampled_total"]
    assert 0 < first < full.resampled_total  # both resamplings re-initialised features
    assert not torch.equal(saved["clt_resampling"]["rng_state"], torch.Generator().manual_seed(0).get_state())
    assert int((saved["state_dict"]["tokens_since_fired"] == 0).sum()) >= first  # saved after the resampling

    resumed = _resampling_module(**kw)
    _trainer(tmp_path / "resumed", 6).fit(resumed, train_dataloaders=_loader(batches), ckpt_path=ckpt,
                                          weights_only=False)  # written by this test
    assert resumed.resampled_total == full.resampled_total
    assert torch.equal(resumed._resample_rng_state, full._resample_rng_state)
    assert torch.equal(resumed.tokens_since_fired, full.tokens_since_fired)
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_resampling_argument_errors(tmp_path) -> None:
    cfg = CLTConfig(n_layers=N_LAYERS, d_model=D_MODEL, n_features=16, activation="batchtopk_global", k=4)
    with pytest.raises(ValueError, match="resample_dead_every"):
        CLTModule(cfg, resample_dead_every=0)
    with pytest.raises(ValueError, match="resample_encoder_scale"):
        CLTModule(cfg, resample_dead_every=5, resample_encoder_scale=0.0)
    tied = CLTConfig(n_layers=N_LAYERS, d_model=D_MODEL, n_features=16, activation="relu", k=None,
                     decoder_tying="per_target")
    with pytest.raises(ValueError, match="per_target"):
        CLTModule(tied, resample_dead_every=5)
    sharded = CLTModule(cfg, resample_dead_every=5)
    sharded.model.shard_decoder_(0, D_MODEL // 2)
    with pytest.raises(ValueError, match="single-process, unsharded"):
        _trainer(tmp_path, 1).fit(sharded, train_dataloaders=_loader(_batches(1)))
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        _trainer(tmp_path, 1, accumulate_grad_batches=2).fit(CLTModule(cfg, resample_dead_every=5),
                                                             train_dataloaders=_loader(_batches(2)))
