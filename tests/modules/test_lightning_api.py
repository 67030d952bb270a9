"""The three LightningModules behave like Lightning modules: ``trainer.test`` and ``trainer.predict`` run on tiny
data and return values that agree with validation, ``save_hyperparameters`` + ``load_from_checkpoint`` rebuild a
module made in Python (its configs read with ``weights_only=True``), and every Lightning hook they implement is
marked ``@override``."""

from __future__ import annotations

import inspect
import math

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_opt.data.activations import CLTDataModule
from lightning_opt.data.shards import write_shard
from lightning_opt.models import spd as S
from lightning_opt.models.clt import CLTConfig
from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.models.toy import TMSConfig, TMSModel
from lightning_opt.modules.clt import CLTModule
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule
from lightning_opt.modules.spd import SPDModule, SPDTargetConfig, SPDTrainConfig
from lightning_opt.optim.factory import OptimConfig


def _trainer(tmp_path, steps: int = 0, **kw) -> L.Trainer:
    base = dict(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False)
    return L.Trainer(**{**base, **kw})


def _same_state(a: L.LightningModule, b: L.LightningModule) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _save(trainer: L.Trainer, tmp_path, name: str) -> str:
    path = str(tmp_path / name)
    trainer.save_checkpoint(path)
    return path


# -- GPT-2 -----------------------------------------------------------------------------------------------------

GPT_CFG = GPTConfig(vocab_size=32, n_layer=2, n_head=2, n_embd=32, block_size=16, pos_emb="rope", norm="rmsnorm",
                    bias=False, mlp="relu2", tie_embeddings=False, skip_attn_layers=[1])


def _tokens(n: int = 32, t: int = 16, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    seq = (torch.randint(0, 32, (n, 1), generator=g) + torch.arange(t + 1)) % 32
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=8)


def test_gpt2_test_predict_and_load_from_checkpoint(tmp_path) -> None:
    torch.manual_seed(0)
    module = GPT2SpeedrunModule(GPT_CFG, OptimConfig(lr=3e-3))
    trainer = _trainer(tmp_path, 4)
    trainer.fit(module, _tokens())

    tested = trainer.test(module, _tokens(seed=1), verbose=False)[0]
    validated = trainer.validate(module, _tokens(seed=1), verbose=False)[0]
    assert math.isfinite(tested["test/loss"]) and 0 < tested["test/loss"] < 2 * math.log(32)
    assert tested["test/loss"] == pytest.approx(validated["val/loss"], rel=1e-6)
    assert tested["test/ppl"] == pytest.approx(math.exp(tested["test/loss"]), rel=1e-5)

    logits = trainer.predict(module, _tokens(seed=1))
    assert len(logits) == 4 and logits[0].shape == (8, 16, 32) and logits[0].dtype == torch.float32
    x, y = next(iter(_tokens(seed=1)))
    assert torch.allclose(logits[0], module(x).float())
    ce = torch.stack([F.cross_entropy(lg.flatten(0, 1), yy.flatten())
                      for lg, (_, yy) in zip(logits, _tokens(seed=1))]).mean()
    assert float(ce) == pytest.approx(tested["test/loss"], rel=1e-5)

    # made in Python: the checkpoint's hyperparameters hold a GPTConfig (list skip_attn_layers normalised)
    path = _save(trainer, tmp_path, "gpt2.ckpt")
    loaded = GPT2SpeedrunModule.load_from_checkpoint(path)
    assert loaded.model_config == module.model_config and loaded.model_config.skip_attn_layers == (1,)
    assert _same_state(loaded, module)


def test_gpt2_checkpoint_config_saved_as_a_dict_with_lists_resumes(tmp_path) -> None:
    """What LightningCLI saves: model_config as the parsed YAML (lists for tuples). It resumes and loads."""
    torch.manual_seed(0)
    module = GPT2SpeedrunModule(GPT_CFG)
    trainer = _trainer(tmp_path, 1)
    trainer.fit(module, _tokens())
    path = _save(trainer, tmp_path, "as_dict.ckpt")
    state = torch.load(path, weights_only=True)
    as_yaml = GPT_CFG.to_dict()
    as_yaml["skip_attn_layers"] = [1]
    state["hyper_parameters"]["model_config"] = as_yaml
    torch.save(state, path)
    assert GPTConfig.from_dict(as_yaml) == GPT_CFG

    trainer = _trainer(tmp_path, 2)
    trainer.fit(GPT2SpeedrunModule(GPT_CFG), _tokens(), ckpt_path=path)
    assert trainer.global_step == 2
    assert GPT2SpeedrunModule.load_from_checkpoint(path).model_config == GPT_CFG


# -- CLT -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clt_data(tmp_path_factory) -> tuple[GPT, str]:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=32)).eval()
    path = tmp_path_factory.mktemp("tok") / "tok_000000.bin"
    write_shard(path, np.random.default_rng(0).integers(0, 64, size=8_000, dtype=np.uint16))
    return gpt, str(path)


def _clt_dm(clt_data) -> CLTDataModule:
    gpt, shard = clt_data
    return CLTDataModule(target=gpt, train_files=shard, val_files=shard, seq_len=16, tokens_per_batch=128,
                         val_tokens=512, dtype="float32", stats_tokens=1024)


def test_clt_forward_test_predict_and_load_from_checkpoint(tmp_path, clt_data) -> None:
    torch.manual_seed(0)
    cfg = CLTConfig(n_layers=2, d_model=16, n_features=32, activation="batchtopk_global", k=4,
                    normalization="mean_std")
    module = CLTModule(cfg, optim=OptimConfig(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.0), aux_k=4)
    dm = _clt_dm(clt_data)
    trainer = _trainer(tmp_path, 3, limit_val_batches=2, val_check_interval=3)
    trainer.fit(module, datamodule=dm)

    evaluator = _trainer(tmp_path)  # all 4 validation batches (fit's trainer validates 2)
    tested = evaluator.test(module, datamodule=dm, verbose=False)[0]
    validated = evaluator.validate(module, datamodule=dm, verbose=False)[0]
    for key in ("test/fvu", "test/loss", "test/l0", "test/fvu_layer1", "test/kl", "test/next_token_agreement"):
        assert math.isfinite(tested[key]), key
    assert tested["test/fvu"] == pytest.approx(validated["val/fvu"], rel=1e-6)
    assert 0 < tested["test/fvu"] < 2 and 0 < tested["test/l0"] <= 4 * 2 + 1e-6
    assert 0 <= tested["test/next_token_agreement"] <= 1

    recon = evaluator.predict(module, datamodule=dm)
    batches = list(dm.predict_dataloader())
    assert len(recon) == len(batches) == 4 and recon[0].shape == (128, 2, 16)
    assert torch.allclose(recon[0], module(batches[0][0]).float())
    y = torch.cat([b[1] for b in batches]).double()
    pred = torch.cat(recon).double()
    fvu = (y - pred).pow(2).sum() / (y - y.mean(0)).pow(2).sum()
    assert float(fvu) == pytest.approx(tested["test/fvu"], rel=1e-4)

    # made in Python: the hyperparameters hold a CLTConfig, which weights_only loading must accept
    path = _save(trainer, tmp_path, "clt.ckpt")
    loaded = CLTModule.load_from_checkpoint(path)
    assert loaded.clt_config == cfg and _same_state(loaded, module)
    assert torch.equal(loaded(batches[0][0]), module(batches[0][0]))


# -- SPD -------------------------------------------------------------------------------------------------------

def _spd_module() -> SPDModule:
    return SPDModule(
        SPDTargetConfig("tms", {"n_features": 5, "n_hidden": 2}, train_steps=50, train_batch_size=64),
        S.SPDConfig(components=[{"pattern": "linear1", "C": 8}, {"pattern": "linear2", "C": 8}]),
        train=SPDTrainConfig(batch_size=32, eval_batches=3, faithfulness_warmup_steps=5, identity_patterns=["linear1"]),
    )


def test_spd_test_predict_and_load_from_checkpoint(tmp_path) -> None:
    module = _spd_module()
    trainer = _trainer(tmp_path, 3)
    trainer.fit(module)

    tested = trainer.test(module, verbose=False)[0]
    for key in ("test/ci_l0", "test/ci_l0/linear1", "test/recon/ci", "test/recon/stochastic", "test/recon/zero",
                "test/mmcs", "test/ml2r", "test/identity_ci_error/linear1"):
        assert math.isfinite(tested[key]), key
    assert -1 <= tested["test/mmcs"] <= 1 and tested["test/ci_l0"] >= 0
    assert tested["test/recon/unmasked"] < tested["test/recon/zero"]  # all components on beat all off
    expected = module.evaluate(list(module.test_dataloader()))
    assert tested["test/recon/ci"] == pytest.approx(expected["recon/ci"], rel=1e-5)

    out = trainer.predict(module)
    batches = list(module.predict_dataloader())
    assert len(out) == len(batches) == 3
    first = out[0]
    assert first["target"].shape == first["output"].shape == (32, 5)
    assert set(first["ci"]) == {"linear1", "linear2"} and first["ci"]["linear1"].shape == (32, 8)
    assert all(float(g.min()) >= 0 and float(g.max()) <= 1 for g in first["ci"].values())
    assert torch.allclose(first["output"], module(batches[0]))
    mse = torch.stack([(o["output"] - o["target"]).pow(2).mean() for o in out]).mean()
    assert float(mse) == pytest.approx(tested["test/recon/ci"], rel=1e-4)

    path = _save(trainer, tmp_path, "spd.ckpt")
    loaded = SPDModule.load_from_checkpoint(path)  # the target is rebuilt untrained; the weights come from the file
    assert _same_state(loaded, module)
    assert loaded.train_cfg == module.train_cfg and loaded.spd_cfg == module.spd_cfg


def test_spd_resume_continues_without_a_second_warmup(tmp_path) -> None:
    module = _spd_module()
    trainer = _trainer(tmp_path, 2)
    trainer.fit(module)
    path = _save(trainer, tmp_path, "spd.ckpt")
    saved = torch.load(path, weights_only=True)["state_dict"]

    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["step"] = trainer.global_step
            seen["same"] = all(torch.equal(v, saved[k]) for k, v in pl_module.state_dict().items())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("batch", batch.clone())

    resumed = _spd_module()
    trainer = _trainer(tmp_path, 4, callbacks=[Probe()])
    trainer.fit(resumed, ckpt_path=path)
    assert seen["step"] == 2 and seen["same"] and trainer.global_step == 4
    # the seeded data stream goes on where the first run stopped (its third batch), not from its start
    stream = iter(resumed._own_stream(resumed.train_cfg.seed + 1))
    third = [next(stream) for _ in range(3)][2]
    assert torch.equal(seen["batch"], third)


def test_spd_with_a_module_target_loads_with_that_target(tmp_path) -> None:
    torch.manual_seed(0)
    target = TMSModel(TMSConfig(n_features=5, n_hidden=2)).untie_().requires_grad_(False).eval()
    module = SPDModule(target, S.SPDConfig(components=[{"pattern": "linear1", "C": 4}]),
                       train=SPDTrainConfig(batch_size=16, faithfulness_warmup_steps=0))
    assert "target" not in module.hparams
    trainer = _trainer(tmp_path, 1)
    trainer.fit(module, DataLoader(torch.rand(16, 16, 5), batch_size=None))
    path = _save(trainer, tmp_path, "spd_module_target.ckpt")
    with pytest.raises(ValueError, match="pass that model again"):
        SPDModule.load_from_checkpoint(path)
    fresh = TMSModel(TMSConfig(n_features=5, n_hidden=2)).untie_().requires_grad_(False).eval()
    loaded = SPDModule.load_from_checkpoint(path, target=fresh)
    assert _same_state(loaded, module)


# -- @override -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [GPT2SpeedrunModule, CLTModule, SPDModule])
def test_lightning_hooks_are_marked_override(cls) -> None:
    """Every method a module (or its base) defines that Lightning's LightningModule also has carries
    ``@override`` (typing_extensions): a renamed or misspelled hook is then a type-checker error."""
    missing = []
    for klass in cls.__mro__:
        if klass is L.LightningModule or not issubclass(klass, L.LightningModule):
            continue
        for name, attr in vars(klass).items():
            func = getattr(attr, "__func__", attr)
            if name == "__init__" or not inspect.isfunction(func) or not hasattr(L.LightningModule, name):
                continue
            if not getattr(func, "__override__", False):
                missing.append(f"{klass.__name__}.{name}")
    assert not missing, f"Lightning hooks without @override: {missing}"
    for hook in ("forward", "training_step", "validation_step" if cls is not SPDModule else "training_step",
                 "test_step", "predict_step"):
        assert hook in {n for k in cls.__mro__[:-1] if k is not L.LightningModule for n in vars(k)}, hook


# -- configs round-trip through a checkpoint -------------------------------------------------------------------

def _as_yaml(value):
    """A config as YAML / LightningCLI hand it back: dicts, and lists where the dataclass holds tuples."""
    import dataclasses

    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _as_yaml(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_yaml(v) for v in value]
    return value


def _configs() -> list:
    from lightning_opt.modules.spd import PGDConfig, SPDLossConfig
    from lightning_opt.optim.schedules import ScheduleConfig

    return [
        GPTConfig(n_layer=4, n_head=2, n_embd=32, skip_attn_layers=(1, 2), window_schedule=(128, 256)),
        OptimConfig(name="muon", betas=(0.8, 0.95)),
        ScheduleConfig(name="wsd", warmup_steps=3),
        CLTConfig(n_layers=2, d_model=16, n_features=32, k=4),
        SPDTargetConfig("tms", {"n_features": 5, "n_hidden": 2}),
        S.SPDConfig(components=[{"pattern": "linear1", "C": 8}], ci_hidden=[4, 4]),
        SPDLossConfig(pgd=PGDConfig(n_steps=2)),
        SPDTrainConfig(identity_patterns=["linear1"]),
    ]


@pytest.mark.parametrize("cfg", _configs(), ids=lambda c: type(c).__name__)
def test_configs_round_trip_through_a_checkpoint(cfg, tmp_path) -> None:
    import io

    from lightning_opt.modules.base import as_config

    cls = type(cfg)
    assert as_config(cls, _as_yaml(cfg)) == cfg  # the dict LightningCLI saves in hparams
    buf = io.BytesIO()
    torch.save({"hyper_parameters": {"cfg": cfg}}, buf)  # a module made in Python saves the object
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["hyper_parameters"]["cfg"] == cfg
