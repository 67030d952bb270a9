from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_opt.models.gpt2 import GPTConfig, GPTExecution
from lightning_opt.modules.base import CompileConfig
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule
from lightning_opt.optim.combined import CombinedOptimizer
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig

CFG = GPTConfig(vocab_size=32, n_layer=2, n_head=2, n_embd=32, block_size=16, pos_emb="rope", norm="rmsnorm",
                bias=False, mlp="relu2", tie_embeddings=False, zero_init_proj=True)


def _loader(n=64, t=16, seed=0):
    # a learnable sequence: next token = (token + 1) mod 32, starting anywhere
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 32, (n, 1), generator=g)
    seq = (start + torch.arange(t + 1)) % 32
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=8, shuffle=False)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_fit_lowers_loss(tmp_path, optim):
    torch.manual_seed(0)
    module = GPT2SpeedrunModule(CFG, OptimConfig(name=optim, lr=3e-3, muon_lr=0.02),
                                ScheduleConfig(name="cosine", warmup_steps=2))
    trainer = L.Trainer(max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, gradient_clip_val=1.0, accumulate_grad_batches=2,
                        default_root_dir=tmp_path, enable_model_summary=False)
    before = trainer.validate(module, _loader(seed=1), verbose=False)[0]["val/loss"]
    trainer.fit(module, _loader(), _loader(seed=1))
    after = trainer.validate(module, _loader(seed=1), verbose=False)[0]["val/loss"]
    assert after < 0.5 * before
    assert module.tokens_seen == 40 * 2 * 8 * 16
    assert module.flops_per_batch and module.flops_per_batch > 0
    if optim == "muon":
        assert isinstance(trainer.optimizers[0], CombinedOptimizer)


def test_subclass_custom_loss(tmp_path):
    class LabelSmoothed(GPT2SpeedrunModule):
        def compute_loss(self, x, y):
            logits = self.model(x)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=0.1)

    module = LabelSmoothed(CFG, OptimConfig(lr=3e-3))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, _loader())
    assert trainer.global_step == 3


def test_checkpoint_resume_restores_optimizer_and_tokens(tmp_path):
    torch.manual_seed(0)
    module = GPT2SpeedrunModule(CFG, OptimConfig(name="muon", lr=3e-3, muon_lr=0.02))
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False)
    trainer.fit(module, _loader())
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    module2 = GPT2SpeedrunModule(CFG, OptimConfig(name="muon", lr=3e-3, muon_lr=0.02))
    trainer2 = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False)
    trainer2.fit(module2, _loader(), ckpt_path=ckpt)
    assert trainer2.global_step == 6
    assert module2.tokens_seen == 6 * 8 * 16


def _trainer(tmp_path, steps: int) -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False)


def _one_step_checkpoint(tmp_path):
    trainer = _trainer(tmp_path, 1)
    trainer.fit(GPT2SpeedrunModule(CFG), _loader())
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    return ckpt


def test_checkpoint_from_other_model_is_rejected(tmp_path):
    ckpt = _one_step_checkpoint(tmp_path)
    other = GPT2SpeedrunModule(GPTConfig(vocab_size=32, n_layer=3, n_head=2, n_embd=32, block_size=16))
    with pytest.raises(ValueError, match=r"another model: .*n_layer=2 vs 3"):
        _trainer(tmp_path, 2).fit(other, _loader(), ckpt_path=ckpt)


def test_checkpoint_resumes_with_other_execution_options(tmp_path):
    """How the model is computed (attention kernel, loss kernel, FP8 head, recomputation) may change on resume;
    the execution is saved beside the architecture in the hyperparameters."""
    ckpt = _one_step_checkpoint(tmp_path)
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["execution"] == GPTExecution()
    execution = GPTExecution(attn_backend="math", loss_impl="chunked", loss_chunk_size=7, head_fp8="auto",
                             mlp_fp8="auto", attn_fp8="auto", grad_checkpoint=True, dropout=0.1, layer_drop=0.1)
    again = GPT2SpeedrunModule(CFG, execution=execution)
    assert again.hparams["execution"] == execution and again.model.execution == execution
    trainer2 = _trainer(tmp_path, 2)
    trainer2.fit(again, _loader(), ckpt_path=ckpt)
    assert trainer2.global_step == 2
    resumed = tmp_path / "b.ckpt"
    trainer2.save_checkpoint(resumed)
    loaded = GPT2SpeedrunModule.load_from_checkpoint(resumed)
    assert loaded.execution == execution and loaded.model_config == CFG
    # another execution at load time
    assert GPT2SpeedrunModule.load_from_checkpoint(resumed, execution=GPTExecution()).execution == GPTExecution()


def test_checkpoint_with_execution_settings_in_model_config_is_refused(tmp_path):
    """A checkpoint whose model_config holds execution settings (and no execution) is refused with an error
    naming the keys and where they belong; the file is left as it was."""
    ckpt = _one_step_checkpoint(tmp_path)
    state = torch.load(ckpt, weights_only=True)
    hp = state["hyper_parameters"]
    del hp["execution"]
    hp["model_config"] = {**CFG.to_dict(), "attn_backend": "math", "loss_impl": "chunked"}
    torch.save(state, ckpt)
    before = ckpt.read_bytes()
    with pytest.raises(ValueError, match=r"execution settings \['attn_backend', 'loss_impl'\].*model\.execution"):
        GPT2SpeedrunModule.load_from_checkpoint(ckpt)
    assert ckpt.read_bytes() == before


def test_number_logs_only_on_logger_steps(tmp_path):
    """tokens_seen is a Python number (a device copy per self.log): logged only when the logger writes."""
    calls: list[int] = []

    class Spy(GPT2SpeedrunModule):
        def log(self, name, value, *args, **kwargs) -> None:
            if name == "tokens_seen":
                calls.append(self.trainer.global_step)
            super().log(name, value, *args, **kwargs)

    module = Spy(CFG, OptimConfig(lr=3e-3))
    trainer = L.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        log_every_n_steps=5, accumulate_grad_batches=2)
    trainer.fit(module, _loader(n=256))
    # steps 4 and 9 (0-based) are logger steps: both micro-batches of each log
    assert calls == [4, 4, 9, 9]
    assert "tokens_seen" in trainer.callback_metrics
    assert not any(k.startswith("lr") for k in trainer.callback_metrics)  # LearningRateMonitor's job


@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_learning_rate_monitor_names_the_groups(tmp_path, optim):
    """Lightning's LearningRateMonitor reads our scheduler config and the (Combined)Optimizer's named groups."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    module = GPT2SpeedrunModule(CFG, OptimConfig(name=optim, lr=3e-3, muon_lr=0.02, embed_lr=0.01),
                                ScheduleConfig(name="wsd", warmup_steps=2, total_steps=6, decay_fraction=0.5))
    monitor = LearningRateMonitor(logging_interval="step")
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=CSVLogger(tmp_path), callbacks=[monitor],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, log_every_n_steps=1)
    trainer.fit(module, _loader())
    groups = {g["name"]: g for g in trainer.optimizers[0].param_groups}
    assert len(groups) == len(trainer.optimizers[0].param_groups) >= 2
    if optim == "muon":
        assert isinstance(trainer.optimizers[0], CombinedOptimizer)
        assert {"muon", "embeddings"} <= set(groups) <= {"muon", "embeddings", "head", "scalars"}
    else:
        assert set(groups) == {"decay", "no_decay"}
    assert set(monitor.lrs) == {f"lr/{name}" for name in groups}
    # one value per step, following the schedule (read at each step's start: 5 scheduler steps before the last)
    for name, group in groups.items():
        values = monitor.lrs[f"lr/{name}"]
        assert len(values) == 6
        assert values[0] < values[2]  # warmup
        assert values[-1] == pytest.approx(group["initial_lr"] * module.schedule_config(5))
    assert all(f"lr/{name}" in trainer.callback_metrics for name in groups)


def test_gradient_clipping_with_fused_adamw(tmp_path):
    """Lightning refuses to clip for fused AdamW under mixed precision; our modules clip themselves."""
    torch.manual_seed(0)
    module = GPT2SpeedrunModule(CFG, OptimConfig(name="adamw", lr=3e-3, fused=True))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", precision="bf16-mixed", gradient_clip_val=1e-3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    before = [p.detach().clone() for p in module.parameters()]
    trainer.fit(module, _loader())
    assert trainer.global_step == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_window_schedule_follows_the_trainer_steps(tmp_path):
    """The module moves a scheduled attention window with global_step / total steps (accumulation included)."""
    from dataclasses import replace

    seen = []

    class Recording(GPT2SpeedrunModule):
        def training_step(self, batch, batch_idx):
            seen.append((self.trainer.global_step, int(self.model.attn_window)))
            return super().training_step(batch, batch_idx)

    cfg = replace(CFG, window_schedule=(4, 16))
    module = Recording(cfg, OptimConfig(name="muon", lr=3e-3, muon_lr=0.02), execution=GPTExecution(attn_backend="sdpa"))
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                        default_root_dir=tmp_path)
    trainer.fit(module, _loader())
    assert seen == [(s, module.model.window_at(s / 4)) for s in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert [w for _, w in seen] == [4, 4, 4, 4, 8, 8, 12, 12]


def test_window_schedule_without_max_steps_uses_the_schedule_length(tmp_path):
    """With max_steps unset (epochs), the window follows the schedule config's total_steps, like the lr."""
    from dataclasses import replace

    cfg = replace(CFG, window_schedule=(4, 16))
    module = GPT2SpeedrunModule(cfg, OptimConfig(lr=3e-3), ScheduleConfig(name="constant", total_steps=8),
                                GPTExecution(attn_backend="sdpa"))
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, _loader())  # 8 batches: the last one starts at step 7 of 8
    assert trainer.global_step == 8
    assert int(module.model.attn_window) == module.model.window_at(7 / 8) == 12


def test_checkpoint_from_before_a_new_model_field_resumes(tmp_path):
    """A checkpoint whose model_config predates a field (saved as a plain dict without norm_weight) resumes
    into a model with that field's default, and is refused when this run sets the field otherwise."""
    from dataclasses import replace

    ckpt = _one_step_checkpoint(tmp_path)
    state = torch.load(ckpt, weights_only=True)
    old = state["hyper_parameters"]["model_config"].to_dict()
    del old["norm_weight"]
    state["hyper_parameters"]["model_config"] = old
    torch.save(state, ckpt)
    trainer2 = _trainer(tmp_path, 2)
    trainer2.fit(GPT2SpeedrunModule(CFG), _loader(), ckpt_path=ckpt)
    assert trainer2.global_step == 2
    with pytest.raises(ValueError, match=r"norm_weight=True vs False"):
        _trainer(tmp_path, 3).fit(GPT2SpeedrunModule(replace(CFG, norm_weight=False)), _loader(), ckpt_path=ckpt)


def test_compile_options_reach_inductor_and_bad_ones_are_refused(tmp_path):
    with pytest.warns(UserWarning, match="take effect only with compile.mode full or regional"):
        GPT2SpeedrunModule(CFG, compile=CompileConfig(options={"coordinate_descent_tuning": True}))
    with pytest.raises(ValueError, match="not torch._inductor.config"):  # a misspelt name fails with compile off too
        GPT2SpeedrunModule(CFG, compile={"options": {"coordinate_descent_tunning": True}})
    with pytest.raises(ValueError, match=r"\['coordinate_descent_tunning'\] are not torch._inductor.config"):
        GPT2SpeedrunModule(CFG, compile=CompileConfig("full", options={"coordinate_descent_tunning": True}))
    with pytest.raises(ValueError, match="compile.mode='regional' is not one of GPT2SpeedrunModule's modes"):
        GPT2SpeedrunModule(CFG, compile="regional")
    torch.manual_seed(0)
    compile = CompileConfig("full", options={"coordinate_descent_tuning": True})
    module = GPT2SpeedrunModule(CFG, OptimConfig(name="adamw", lr=3e-3), compile=compile)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path, enable_model_summary=False)
    trainer.fit(module, _loader())
    assert module.compile_config.options == {"coordinate_descent_tuning": True}
    assert module.hparams["compile"] == compile  # saved with checkpoints
    # the compiled forward ran (a graph was captured) and the run trained
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert module.tokens_seen == 3 * 8 * 16
