"""Every recipe and every shipped config: train a few steps through the recipe's own ``main(args)``, resume
with ``--ckpt_path``, and load the checkpoint with ``<Module>.load_from_checkpoint``.

Each config runs shrunk to seconds on CPU with command-line overrides (as a user would), checkpointed by the
``AsyncCheckpoint`` every recipe attaches (into the run's ``<log_dir>/checkpoints``, at the end of training).
Checked:

* the first run stops at step 2 and its ``checkpoints/last.ckpt`` holds ``global_step`` 2;
* the resumed run was handed that checkpoint, its training started at step 2 with the saved weights (no
  re-initialisation, no SPD faithfulness warmup over them) and it stops at the new ``max_steps`` 4;
* ``load_from_checkpoint`` on the resumed run's ``last.ckpt`` gives the saved weights, equal to the trained
  module's.

``test_every_shipped_config_is_covered`` fails when a YAML under ``lightning_opt/recipes/configs`` has no case here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_opt.recipes import CONFIGS

torch.set_num_threads(1)

# --- the shrinking overrides, per recipe ---------------------------------------------------------------------

_GPT2_SMALL = ["--model.model_config.n_layer", "2", "--model.model_config.n_embd", "64",
               "--model.model_config.n_head", "2", "--model.compile", "false",
               # the built-in corpus is bytes: a 512-token vocabulary holds it (50257 rows cost seconds per step)
               "--model.model_config.vocab_size", "512", "--model.model_config.eot_token", "0",
               "--data.batch_size", "2", "--data.val_tokens", "512"]
_GPT2_SHORT = [*_GPT2_SMALL, "--model.model_config.block_size", "64", "--data.seq_len", "64",
               "--trainer.val_check_interval", "2"]
# the speedrun configs drop layer 7's attention and mix 3 value embeddings: a 2-layer model has neither; they set
# the run's length as a token budget, which these runs replace with trainer.max_steps
_GPT2_SPEEDRUN = ["--model.model_config.skip_attn_layers", "[]", "--model.model_config.n_value_embeds", "1",
                  "--train_tokens", "null"]

_CLT = ["--data.target", "{target}", "--data.seq_len", "32", "--data.tokens_per_batch", "128",
        "--data.val_tokens", "256", "--data.stats_tokens", "1024",
        "--model.clt.n_layers", "2", "--model.clt.d_model", "32", "--model.clt.n_features", "64",
        "--model.clt.k", "16", "--model.aux_k", "16",
        "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"]
_CLT_GPU = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--data.train_files", "builtin", "--data.val_files", "builtin"]

_SPD = ["--model.target.train_steps", "5", "--model.target.train_batch_size", "64", "--model.train.batch_size", "64",
        "--model.train.faithfulness_warmup_steps", "2", "--model.train.eval_batches", "1"]


# the GPU GPT-2 layer config on CPU: the cached demo GPT for GPT-2, the built-in byte corpus for FineWeb
_SPD_GPT2_LAYER = [
    "--trainer.accelerator", "cpu", "--model.target.pretrained", "null", "--model.target.checkpoint", "demo",
    "--model.target.model", "{n_layer: 2, n_embd: 32}", "--model.target.train_steps", "5",
    "--model.target.train_batch_size", "4", "--model.target.seq_len", "32",
    "--model.spd.components", '[{pattern: "blocks.1.mlp.c_fc", C: 16}, {pattern: "blocks.1.mlp.c_proj", C: 16}]',
    "--model.spd.ci_hidden", "[16]", "--model.compile", "false", "--model.train.autocast_bf16", "false",
    "--model.train.faithfulness_warmup_steps", "2", "--model.train.eval_batches", "1",
    "--data.init_args.train_files", "builtin", "--data.init_args.val_files", "builtin",
    "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "2", "--data.init_args.val_tokens", "256",
    "--data.init_args.vocab_size", "256", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
]


def _resid_mlp(n_layers: int, d_mlp: int, n_features: int = 100) -> list[str]:
    """The residual-MLP configs with a 64-wide residual stream and 16 subcomponents (1000 and 100-500 there)."""
    return [*_SPD,
            "--model.target.model", f"{{n_features: {n_features}, d_embed: 64, d_mlp: {d_mlp}, n_layers: {n_layers}}}",
            "--model.spd.components", '[{pattern: "layers.*.mlp_in", C: 16}, {pattern: "layers.*.mlp_out", C: 16}]',
            "--model.spd.ci_hidden", "[8]"]

# config (relative to lightning_opt/recipes/configs) -> (recipe, module class path, extra --config overlays, overrides)
CASES: dict[str, tuple[str, str, list[str], list[str]]] = {
    "gpt2/demo.yaml": ("gpt2", "gpt2", [], _GPT2_SHORT),
    "gpt2/gpt2-124m-classic.yaml": ("gpt2", "gpt2", [], _GPT2_SHORT),
    "gpt2/gpt2-124m-speedrun.yaml": (  # document-causal long sequences: FlexAttention's CPU fallback here
        "gpt2", "gpt2", [],
        [*_GPT2_SMALL, *_GPT2_SPEEDRUN, "--model.model_config.block_size", "256", "--data.seq_len", "256",
         "--model.model_config.window_schedule", "[128, 256]", "--trainer.val_check_interval", "8"]),
    "gpt2/gpt2-124m-speedrun-halfbatch.yaml": (  # an overlay: 1024-token geometry (64 here), 4 micro-batches per step
        "gpt2", "gpt2", ["gpt2/gpt2-124m-speedrun.yaml"],
        [*_GPT2_SHORT, *_GPT2_SPEEDRUN, "--trainer.val_check_interval", "8"]),
    "gpt2/finetune-hf-gpt2.yaml": (  # init_from: a tiny Hugging Face GPT-2 written here (no download)
        "gpt2", "gpt2", [],
        [*_GPT2_SHORT, "--model.init_from", "{hf_dir}"]),
    "clt_demo.yaml": ("clt", "clt", [], _CLT),
    "clt_gpt2_small.yaml": ("clt", "clt", [], [*_CLT, *_CLT_GPU]),
    "spd_tms_5-2.yaml": ("spd", "spd", [], _SPD),
    "spd_tms_5-2-id.yaml": ("spd", "spd", [], _SPD),
    "spd_tms_40-10.yaml": ("spd", "spd", [], _SPD),
    "spd_tms_40-10-id.yaml": ("spd", "spd", [], _SPD),
    "spd_resid_mlp1.yaml": ("spd", "spd", [], _resid_mlp(1, 50)),
    "spd_resid_mlp2.yaml": ("spd", "spd", [], _resid_mlp(2, 25)),
    "spd_resid_mlp3.yaml": ("spd", "spd", [], _resid_mlp(3, 17, n_features=102)),
    "spd_lm_demo.yaml": ("spd", "spd", [], [*_SPD, "--model.target.train_steps", "3", "--model.train.batch_size", "2"]),
    "spd_gpt2_layer.yaml": ("spd", "spd", [], _SPD_GPT2_LAYER),
}


def _module_class(kind: str) -> type[pl.LightningModule]:
    if kind == "gpt2":
        from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

        return GPT2SpeedrunModule
    if kind == "clt":
        from lightning_opt.modules.clt import CLTModule

        return CLTModule
    from lightning_opt.modules.spd import SPDModule

    return SPDModule


def _recipe_main(recipe: str) -> Any:
    return importlib.import_module(f"lightning_opt.recipes.{recipe}").main


@pytest.fixture(scope="module")
def target_ckpt(tmp_path_factory) -> str:
    """A tiny byte-level GPT as the CLT's target (the demo target would be trained first)."""
    from lightning_opt.models.gpt2 import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64)
    path = tmp_path_factory.mktemp("clt_target") / "target.pt"
    torch.save({"config": cfg.to_dict(), "model": GPT(cfg).state_dict()}, path)
    return str(path)


def _hf_dir(tmp_path: Path) -> str:
    """A tiny Hugging Face GPT-2 (``save_pretrained``) of the shrunk config's shape."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    path = tmp_path / "hf_gpt2"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return str(path)


class _Probe(pl.Callback):
    """What a resumed run started from: the step, and the weights when training starts."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        self.first_batch_step: int | None = None
        self.start_weights: dict[str, torch.Tensor] | None = None
        self.module: pl.LightningModule | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step
        self.module = pl_module
        self.start_weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if self.first_batch_step is None:
            self.first_batch_step = trainer.global_step


def _watch_fit(monkeypatch: pytest.MonkeyPatch) -> tuple[_Probe, list[Any]]:
    probe, ckpt_paths = _Probe(), []
    original = pl.Trainer.fit

    def fit(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        ckpt_paths.append(kwargs.get("ckpt_path"))
        trainer.callbacks.append(probe)
        return original(trainer, *args, **kwargs)

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    return probe, ckpt_paths


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ (or are missing on one side)."""
    keys = set(a) | set(b)
    return sorted(k for k in keys if k not in a or k not in b or not torch.equal(a[k].cpu(), b[k].cpu()))


def _args(config: str, tmp_path: Path, target: str) -> list[str]:
    recipe, _, overlays, extra = CASES[config]
    out = []
    for c in [*overlays, config]:
        out += ["--config", str(CONFIGS / c)]
    fill = {"{target}": target, "{hf_dir}": _hf_dir(tmp_path) if "{hf_dir}" in extra else ""}
    out += [fill.get(a, a) for a in extra]
    out += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    return out


def _run_checkpoints(tmp_path: Path, run: int) -> Path:
    """The recipe's AsyncCheckpoint folder of the ``run``-th run: its own ``<log_dir>/checkpoints``."""
    (folder,) = (tmp_path / "runs").glob(f"*/version_{run}/checkpoints")
    return folder


@pytest.mark.parametrize("config", sorted(CASES))
def test_recipe_resumes_and_loads_its_checkpoint(config: str, tmp_path, monkeypatch, target_ckpt: str) -> None:
    monkeypatch.chdir(tmp_path)
    recipe, kind, _, _ = CASES[config]
    main = _recipe_main(recipe)
    base = _args(config, tmp_path, target_ckpt)

    first = main([*base, "--trainer.max_steps", "2"])  # the recipe's AsyncCheckpoint saves when training ends
    assert first["steps"] == 2
    last = _run_checkpoints(tmp_path, 0) / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 2

    probe, ckpt_paths = _watch_fit(monkeypatch)
    second = main([*base, "--trainer.max_steps", "4", "--ckpt_path", str(last)])
    monkeypatch.undo()
    assert ckpt_paths == [str(last)]
    assert probe.start_step == 2 and probe.first_batch_step == 2, (probe.start_step, probe.first_batch_step)
    assert second["steps"] == 4
    differ = _same(probe.start_weights, saved["state_dict"])
    assert not differ, f"the resumed run did not start from the saved weights: {differ[:5]}"
    if "tokens_seen" in first:
        assert second["tokens_seen"] == 2 * first["tokens_seen"] > 0

    resumed_last = _run_checkpoints(tmp_path, 1) / "last.ckpt"  # the resumed run writes into its own folder
    resumed = torch.load(resumed_last, map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 4
    cls = _module_class(kind)
    loaded = cls.load_from_checkpoint(resumed_last)
    assert type(loaded) is cls
    state = loaded.state_dict()
    differ = _same(state, resumed["state_dict"])
    assert not differ, f"load_from_checkpoint did not give the saved weights: {differ[:5]}"
    differ = _same(state, probe.module.state_dict())
    assert not differ, f"the saved weights are not the trained module's: {differ[:5]}"


def test_every_shipped_config_is_covered() -> None:
    shipped = sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml"))
    missing = [c for c in shipped if c not in CASES]
    assert not missing, f"configs without a resume test in {Path(__file__).name}: {missing}"
    stale = [c for c in CASES if not (CONFIGS / c).exists()]
    assert not stale, f"resume cases for configs that are gone: {stale}"
