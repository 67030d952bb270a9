"""SPDModule: a real Trainer.fit on TMS 5-2, PGD, evaluation metrics, torch.compile, and DDP (gloo)."""

from __future__ import annotations

import json
import math
import os
import socket

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_opt.models import spd as S
from lightning_opt.models.toy import TMSConfig, train_tms
from lightning_opt.modules.spd import PGDConfig, SPDLossConfig, SPDModule, SPDTargetConfig, SPDTrainConfig
from lightning_opt.optim.factory import OptimConfig
from tests._fork import fork_ranks

torch.set_num_threads(1)

_TMS = None


def _target():
    global _TMS
    if _TMS is None:  # train once per session: 1500 steps is enough for a clean 5-2 pentagon
        _TMS = train_tms(TMSConfig(5, 2), steps=1500, batch_size=256, lr=1e-2, seed=0)
    import copy

    return copy.deepcopy(_TMS)


def _module(loss: SPDLossConfig | None = None, lr: float = 1e-3, **train) -> SPDModule:
    train.setdefault("batch_size", 256)
    train.setdefault("faithfulness_warmup_steps", 50)
    train.setdefault("identity_patterns", ["linear1", "linear2"])
    train.setdefault("eval_batches", 1)
    return SPDModule(
        target=_target(),
        spd=S.SPDConfig(components=[{"pattern": "linear1", "C": 10}, {"pattern": "linear2", "C": 10}]),
        loss=loss or SPDLossConfig(),
        train=SPDTrainConfig(**train),
        optim=OptimConfig(lr=lr, betas=(0.9, 0.999), weight_decay=0.0),
    )


def _loader(module: SPDModule):
    from torch.utils.data import DataLoader

    from lightning_opt.models.toy import SparseFeatureDataset

    return DataLoader(SparseFeatureDataset(5, 0.05, module.train_cfg.batch_size, seed=3), batch_size=None)


def test_short_fit_on_tms_lowers_the_loss_and_writes_metrics(tmp_path):
    torch.manual_seed(0)
    m = _module(lr=3e-3, metrics_path=str(tmp_path / "m.json"))
    m.faithfulness_warmup()
    batches = [b for _, b in zip(range(4), _loader(m))]
    with torch.no_grad():
        before = sum(float(m.compute_losses(b)[0]) for b in batches)
    m.train_cfg.faithfulness_warmup_steps = 0  # done above
    trainer = L.Trainer(
        max_steps=150, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(m, train_dataloaders=_loader(m))
    with torch.no_grad():
        after = sum(float(m.compute_losses(b)[0]) for b in batches)
    assert after < 0.7 * before, (before, after)
    metrics = json.loads((tmp_path / "m.json").read_text())
    for k in ("mmcs", "ml2r", "ci_l0", "ci_l0/linear1", "identity_ci_error/linear1", "recon/stochastic"):
        assert k in metrics and math.isfinite(metrics[k])
    assert metrics["recon/unmasked"] < metrics["recon/zero"]


def test_faithfulness_warmup_makes_components_sum_to_the_target():
    m = _module(faithfulness_warmup_steps=300)
    before = float(S.faithfulness_loss(m.spd.weight_deltas()))
    after = m.faithfulness_warmup()
    assert after < 0.05 * before


def test_each_reconstruction_term_is_zero_when_components_equal_the_target():
    """With U V = W exactly and CI pinned to 1, every masked forward is the target: all terms vanish."""
    loss = SPDLossConfig(
        importance_minimality=0.0, stochastic_recon=1.0, stochastic_recon_layerwise=1.0, stochastic_recon_subset=1.0,
        ci_masked_recon=1.0, pgd_recon=1.0, pgd_recon_subset=1.0, pgd=PGDConfig(n_steps=2, step_size=0.1, scope="unique"),
    )
    m = _module(loss)
    with torch.no_grad():
        for layer in m.spd.layers.values():  # exact rank-C factorisation: V = [I 0], U = [W; 0]
            layer.V.zero_()
            layer.U.zero_()
            d = min(layer.d_in, layer.C)
            layer.V[:d, :d] = torch.eye(d)
            layer.U[: layer.d_in] = layer.weight
        for fn in m.spd.ci_fns.values():  # importance 1 everywhere: last bias large
            fn.mlp.biases[-1].fill_(5.0)
            fn.mlp.weights[-1].zero_()
    _, terms = m.compute_losses(next(iter(_loader(m))))
    for k in ("stochastic_recon", "stochastic_recon_layerwise", "stochastic_recon_subset", "ci_masked_recon", "pgd_recon", "pgd_recon_subset"):
        assert float(terms[k]) < 1e-10, (k, float(terms[k]))
    assert float(terms["ci_l0"]) == 20.0


def test_pgd_finds_masks_at_least_as_bad_as_random_ones():
    torch.manual_seed(0)
    m = _module()
    x = next(iter(_loader(m)))
    m.spd.refresh_delta_weights()
    out, inputs = m.spd.target_forward(x)
    ci = m.spd.causal_importances(inputs).lower
    shape = x.shape[:-1]
    for scope in ("shared", "unique"):
        m.loss_cfg.pgd = PGDConfig(n_steps=0, init="random", scope=scope)
        torch.manual_seed(1)
        start = float(m.pgd_recon(x, out, ci, shape, None))
        m.loss_cfg.pgd = PGDConfig(n_steps=5, step_size=0.2, init="random", scope=scope)
        torch.manual_seed(1)
        attacked = float(m.pgd_recon(x, out, ci, shape, None))
        assert attacked > start, (scope, start, attacked)
    # init 'ones' with no steps: every mask is 1, delta included -> exact reconstruction
    m.loss_cfg.pgd = PGDConfig(n_steps=0, init="ones")
    assert float(m.pgd_recon(x, out, ci, shape, None)) < 1e-10


def test_config_errors_say_what_to_do():
    with pytest.raises(ValueError, match="kind"):
        SPDTargetConfig(kind="llama")
    with pytest.raises(ValueError, match="train_device"):
        SPDTargetConfig(train_device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            SPDTargetConfig(kind="tms", model={"n_features": 5, "n_hidden": 2}, train_steps=1, train_device="cuda").build()
    with pytest.raises(ValueError, match="every reconstruction coefficient is 0"):
        SPDLossConfig(stochastic_recon=0.0, stochastic_recon_layerwise=0.0)
    with pytest.raises(ValueError, match="scope"):
        PGDConfig(scope="global")
    with pytest.raises(ValueError, match="needs spd="):
        SPDModule(target=_target())


def test_whole_step_traces_as_one_graph():
    """Dynamo traces the full loss computation without a graph break (fullgraph=True); the backend is
    'eager' so the test stays fast on CPU; the inductor variant below is marked slow."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters are process-wide: other tests compile too
    m = _module(SPDLossConfig(stochastic_recon_subset=1.0, faithfulness=0.1, p_final=0.5, p_anneal_start=0.0, beta=0.1))
    x = next(iter(_loader(m)))
    fn = torch.compile(m.compute_losses, fullgraph=True, backend="eager")
    torch.manual_seed(1)
    compiled, _ = fn(x, torch.tensor(0.4))
    torch.manual_seed(1)
    eager, _ = m.compute_losses(x, torch.tensor(0.4))
    assert torch.allclose(eager, compiled, rtol=1e-5)
    compiled.backward()
    assert all(p.grad is not None for p in m.spd.component_parameters() + m.spd.ci_parameters())
    fn(x, torch.tensor(0.6))  # a new training fraction must not recompile into a different graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_compiled_step_matches_eager_fullgraph():
    """The whole loss computation (all terms, masks, CI, the delta component) traces as one graph."""
    import torch._inductor.config as inductor_config

    m = _module(SPDLossConfig(stochastic_recon_subset=1.0, faithfulness=0.1, p_final=0.5, p_anneal_start=0.0))
    x = next(iter(_loader(m)))
    frac = torch.tensor(0.4)
    with inductor_config.patch(fallback_random=True):  # same random numbers as eager
        torch.manual_seed(1)
        eager, _ = m.compute_losses(x, frac)
        compiled_fn = torch.compile(m.compute_losses, fullgraph=True)
        torch.manual_seed(1)
        compiled, _ = compiled_fn(x, frac)
    assert torch.allclose(eager, compiled, rtol=1e-4)
    compiled.backward()
    assert all(p.grad is not None for p in m.spd.component_parameters())


# -- DDP ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _importance_case():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(8, 6, generator=g)  # 8 positions, 6 components
    theta = torch.linspace(-0.5, 1.5, 6)
    return x, theta


def _importance(ci: dict[str, torch.Tensor], reduce_fn) -> torch.Tensor:
    return S.importance_minimality_loss(ci, 1.5, beta=0.7, eps=0.0, reduce_sums=reduce_fn)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        x, theta = _importance_case()
        theta = theta.clone().requires_grad_(True)
        local = x.chunk(world)[rank]
        m = SPDModule.__new__(SPDModule)  # only the reduction helper is needed
        loss = _importance({"l": (local * theta).clamp(0, 1)}, lambda s, n: SPDModule._reduce_sums(m, s, n))
        loss.backward()
        grad = theta.grad.clone()
        dist.all_reduce(grad)
        grad /= world  # what DDP does with the gradients
        torch.save({"loss": loss.detach(), "grad": grad}, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_importance_loss_and_gradient_equal_single_process(tmp_path):
    x, theta = _importance_case()
    theta = theta.clone().requires_grad_(True)
    single = _importance({"l": (x * theta).clamp(0, 1)}, None)
    single.backward()
    fork_ranks(_ddp_worker, (2, _free_port(), str(tmp_path)), 2)
    for r in range(2):
        res = torch.load(tmp_path / f"r{r}.pt")
        assert torch.allclose(res["loss"], single.detach(), rtol=1e-6), (r, res["loss"], single)
        assert torch.allclose(res["grad"], theta.grad, rtol=1e-5, atol=1e-7), (r, res["grad"], theta.grad)
    # the naive alternative (mean of per-rank means with a local log term) is measurably different
    halves = [_importance({"l": (c * theta.detach()).clamp(0, 1)}, None) for c in x.chunk(2)]
    assert not math.isclose(float(sum(halves) / 2), float(single), rel_tol=1e-3)


def test_hf_gpt2_target_with_conv1d_components_trains_and_reports_lm_metrics():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    m = SPDModule(
        target=hf,
        spd=S.SPDConfig(
            components=[{"pattern": "transformer.h.*.mlp.c_fc", "C": 8}, {"pattern": "transformer.h.*.attn.c_proj", "C": 8}],
            ci_fn="vector_mlp", output_attr="logits",
        ),
        loss=SPDLossConfig(output="kl", stochastic_recon_subset=1.0, importance_minimality=1e-3, beta=0.1),
        train=SPDTrainConfig(faithfulness_warmup_steps=20),
    )
    assert {layer.kind for layer in m.spd.layers.values()} == {"linear"}
    x = torch.randint(0, 50, (2, 12))
    total, terms = m.compute_losses(x)
    total.backward()
    assert all(p.grad is not None for p in m.spd.ci_parameters())
    metrics = m.evaluate([(x, torch.randint(0, 50, (2, 12)))])
    for k in ("ce/target", "ce/ci", "ce/stochastic", "ce/unmasked", "ce/zero", "kl/ci", "kl/zero", "ci_l0"):
        assert math.isfinite(metrics[k]), k
    assert min(metrics[k] for k in ("kl/ci", "kl/stochastic", "kl/unmasked", "kl/zero")) >= 0


def test_pgd_steps_schedule_sets_the_ascent_steps_per_optimizer_step():
    pgd = PGDConfig(n_steps=1, n_steps_schedule=[[3, 4], [6, 0]])
    assert [pgd.steps_at(s) for s in range(8)] == [1, 1, 1, 4, 4, 4, 0, 0]
    assert pgd.n_steps_schedule == [(3, 4), (6, 0)]
    for bad in ([[3, 4], [3, 2]], [[5, 1], [2, 1]], [[-1, 2]], [[0, -1]], [[1, 2, 3]]):
        with pytest.raises(ValueError, match="n_steps_schedule"):
            PGDConfig(n_steps_schedule=bad)
    m = _module(SPDLossConfig(pgd_recon=1.0, pgd=pgd), faithfulness_warmup_steps=0)
    seen: list[int] = []
    real = m.pgd_ascent
    m.pgd_ascent = lambda loss, srcs, n, all_reduce=False: (seen.append(n), real(loss, srcs, n, all_reduce))[1]
    trainer = L.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(m, train_dataloaders=_loader(m))
    assert seen == [1, 1, 1, 4, 4]
    m.pgd_steps_now = None  # outside training_step: loss.pgd.n_steps
    m.compute_losses(next(iter(_loader(m))))
    assert seen[-1] == 1


def _tiny_hf_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "hf")
    return str(tmp_path / "hf")


def test_gpt_target_from_hf_weights_and_from_a_recipe_checkpoint(tmp_path):
    from lightning_opt.models.gpt2 import GPT

    hf_dir = _tiny_hf_dir(tmp_path)
    reference = GPT.from_pretrained(hf_dir)
    spd = S.SPDConfig(components=[{"pattern": "blocks.1.mlp.c_fc", "C": 8}, {"pattern": "blocks.1.mlp.c_proj", "C": 8}])
    m = SPDModule(SPDTargetConfig(kind="gpt", pretrained=hf_dir), spd,
                  SPDLossConfig(output="kl", pgd_recon=1.0), SPDTrainConfig(faithfulness_warmup_steps=0))
    assert sorted(m.spd.layers) == ["blocks.1.mlp.c_fc", "blocks.1.mlp.c_proj"]
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(m.spd(x), reference(x))  # the target path is HF GPT-2's logits
    total, _ = m.compute_losses(x)
    total.backward()
    with pytest.raises(ValueError, match="brings no data"):
        m.train_dataloader()
    # a recipe checkpoint ({"config", "model"}) carries its config: no model shape needed
    path = tmp_path / "target.pt"
    torch.save({"config": reference.config.to_dict(), "model": reference.state_dict()}, path)
    m2 = SPDModule(SPDTargetConfig(kind="gpt", checkpoint=str(path)), spd, SPDLossConfig(output="kl"),
                   SPDTrainConfig(faithfulness_warmup_steps=0))
    with torch.no_grad():
        assert torch.equal(m2.spd(x), reference(x))
    for bad, match in (({"kind": "tms", "pretrained": hf_dir}, "kind='gpt'"),
                       ({"kind": "gpt", "pretrained": hf_dir, "checkpoint": str(path)}, "not both"),
                       ({"kind": "gpt", "checkpoint": "demo", "model": {"vocab_size": 9}}, "n_layer and n_embd")):
        with pytest.raises(ValueError, match=match):
            SPDTargetConfig(**bad)


def test_demo_target_decomposes_on_token_shards_with_validation(tmp_path):
    """The demo GPT on the built-in corpus through TokenShardDataModule: val/ metrics and held-out final metrics."""
    from lightning_opt.data import TokenShardDataModule

    m = SPDModule(
        SPDTargetConfig(kind="gpt", checkpoint="demo", model={"n_layer": 2, "n_embd": 32}, train_steps=5,
                        train_batch_size=4, seq_len=32),
        S.SPDConfig(components=[{"pattern": "blocks.*.mlp.c_fc", "C": 8}], ci_fn="vector_mlp", ci_hidden=[8]),
        SPDLossConfig(output="kl", pgd_recon=0.5),
        SPDTrainConfig(faithfulness_warmup_steps=2, eval_batches=1),
    )
    dm = TokenShardDataModule("builtin", "builtin", seq_len=32, batch_size=2, val_tokens=128)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, val_check_interval=2,
                        limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(m, datamodule=dm)
    assert math.isfinite(float(trainer.callback_metrics["val/kl/ci"]))
    for k in ("ce/target", "ce/ci", "kl/stochastic", "ci_l0/blocks.0.mlp.c_fc"):
        assert math.isfinite(m.final_metrics[k]), k
