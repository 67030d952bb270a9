"""SPD on a GPT target: regional compilation (the repeated blocks, the masked layers and the KL compiled once each)
gives eager's loss and gradients, traces without graph breaks, and compiles a bounded set of graphs; the prefix
replay reuses exactly the blocks before the decomposed layer; the compile mode is a config value saved with the
run, and the recipe trains and resumes with it."""

from __future__ import annotations

import copy
import glob

import pytest
import torch
import torch._dynamo

from lightning_opt.models import spd as S
from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.modules.base import CompileConfig
from lightning_opt.modules.spd import PGDConfig, SPDLossConfig, SPDModule, SPDTrainConfig

torch.set_num_threads(1)

_GPT = None


def _target() -> GPT:
    global _GPT
    if _GPT is None:
        torch.manual_seed(0)
        _GPT = GPT(GPTConfig(vocab_size=64, n_layer=4, n_head=2, n_embd=32, block_size=16)).eval()
    return copy.deepcopy(_GPT)


def _module(compile: str = "none", backend: str = "inductor", **loss) -> SPDModule:
    """Block 2 of 4 decomposed (blocks 0-1 before it, block 3 after): stochastic, layerwise and PGD terms."""
    torch.manual_seed(0)
    kw = dict(importance_minimality=1e-3, p=2.0, p_final=0.5, p_anneal_start=0.0, stochastic_recon=1.0,
              stochastic_recon_layerwise=1.0, pgd_recon=1.0, pgd=PGDConfig(n_steps=1, step_size=0.1), output="kl")
    kw.update(loss)
    return SPDModule(
        target=_target(),
        spd=S.SPDConfig(components=[{"pattern": "blocks.2.mlp.c_fc", "C": 8}, {"pattern": "blocks.2.mlp.c_proj", "C": 8}],
                        ci_fn="shared_mlp", ci_hidden=[16]),
        loss=SPDLossConfig(**kw),
        train=SPDTrainConfig(faithfulness_warmup_steps=0),
        compile=CompileConfig(mode=compile, backend=backend),
    )


def _batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(m: SPDModule, seed: int = 5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    total, _ = m.losses(_batch(), torch.tensor(0.3))
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in m.spd.named_parameters() if p.grad is not None}


def test_regional_compile_gives_eager_loss_and_grads_with_inductor():
    """Inductor on CPU (tiny shapes: its C++ code generation is what takes the time here)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    eager, compiled = _module("none"), _module("regional")
    assert compiled.apply_compile() == ["blocks.0", "blocks.1", "blocks.3", "masked_linear", "kl"]
    with inductor_config.patch(fallback_random=True):  # the same random numbers as eager
        loss_e, grads_e = _loss_and_grads(eager)
        loss_c, grads_c = _loss_and_grads(compiled)
    assert grads_e.keys() == grads_c.keys() and len(grads_e) == 12  # V, U of both layers + both CI MLPs
    assert torch.allclose(loss_e, loss_c, rtol=1e-5), (loss_e, loss_c)
    for n in grads_e:
        assert torch.allclose(grads_e[n], grads_c[n], rtol=1e-4, atol=1e-7), n
    torch._dynamo.reset()


def test_regional_compile_traces_without_graph_breaks_and_compiles_each_region_once():
    """Dynamo only (backend 'eager'): one graph per region variant (the blocks with and without grad, the masked
    layers of two shapes, the KL), no graph break, and a second step with a new training fraction compiles
    nothing new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, m = _module("none"), _module("regional", backend="eager")
    m.apply_compile()
    assert m.apply_compile() == ["blocks.0", "blocks.1", "blocks.3", "masked_linear", "kl"]  # idempotent
    loss_e, _ = _loss_and_grads(eager)
    loss_c, _ = _loss_and_grads(m)
    assert torch.equal(loss_e, loss_c)
    graphs = counters["stats"]["unique_graphs"]
    assert sum(counters["graph_break"].values()) == 0
    # blocks: target pass (no grad) + masked passes; masked_linear: c_fc, c_proj with and without an input that
    # takes a gradient (the delta masks are made uniform so PGD adds no variant); the KL
    assert graphs == 6, graphs
    torch.manual_seed(6)
    m.losses(_batch(), torch.tensor(0.7))[0].backward()
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_full_compile_with_pgd_gives_eager_loss_and_grads_and_traces_the_forward_once():
    """compile='full' with AOTAutograd (backend 'aot_eager': compiled forward and backward, no code generation):
    eager's loss and gradients with PGD on; the forward before PGD, the PGD terms and the total are three
    compiled functions, so the only graph break is PGD's autograd.grad and no frame is traced twice."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, m = _module("none"), _module("full", backend="aot_eager")
    assert m.apply_compile() == ["compute_losses"]
    loss_e, grads_e = _loss_and_grads(eager)
    loss_c, grads_c = _loss_and_grads(m)
    assert grads_e.keys() == grads_c.keys() and len(grads_e) == 12
    assert torch.allclose(loss_e, loss_c, rtol=1e-6), (loss_e, loss_c)
    for n in grads_e:
        assert torch.allclose(grads_e[n], grads_c[n], rtol=1e-5, atol=1e-8), n
    breaks = counters["graph_break"]
    assert breaks and all("autograd.grad" in reason for reason in breaks), dict(breaks)
    graphs = counters["stats"]["unique_graphs"]
    torch.manual_seed(6)
    m.losses(_batch(), torch.tensor(0.7))[0].backward()  # a new training fraction compiles nothing new
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_pgd_ascent_pass_with_frozen_components_gives_the_same_output_and_no_component_grads():
    m = _module("none")
    spd, x = m.spd, _batch()
    spd.refresh_delta_weights()
    _, inputs = spd.target_forward(x)
    ci = spd.causal_importances(inputs)
    masks = {k: v.detach().requires_grad_(True) for k, v in spd.stochastic_masks(ci.lower).items()}
    dms = spd.delta_masks(ci.lower)
    plain = spd.masked_forward(x, masks=masks, delta_masks=dms)
    frozen = spd.masked_forward(x, masks=masks, delta_masks=dms, frozen_components=True)
    assert torch.equal(plain, frozen) and not spd.state.frozen_components
    params = spd.component_parameters()
    assert all(g is not None for g in torch.autograd.grad(plain.sum(), params, retain_graph=True))
    assert torch.autograd.grad(frozen.sum(), params, allow_unused=True) == (None,) * len(params)
    spd.state.delta_weights = {}


def test_whole_step_on_a_gpt_traces_as_one_graph_without_pgd():
    """compile='full' (the step as one graph): the block runners and the prefix replay trace through dynamo."""
    m = _module("none", pgd_recon=0.0)
    x, frac = _batch(), torch.tensor(0.3)
    explained = torch._dynamo.explain(m.compute_losses)(x, frac)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()


def test_prefix_replay_reuses_exactly_the_blocks_before_the_decomposed_layer():
    m = _module("none")
    spd, x = m.spd, _batch()
    spd.refresh_delta_weights()
    out, inputs = spd.target_forward(x, keep_prefix=True)
    assert sorted(spd.state.replay.outputs) == [("blocks.0", 0), ("blocks.1", 0)]
    ci = spd.causal_importances(inputs)
    torch.manual_seed(3)
    masks, dms = spd.stochastic_masks(ci.lower), spd.delta_masks(ci.lower)
    ran: list[str] = []
    hooks = [spd.target.blocks[i].register_forward_pre_hook(lambda mod, a, i=i: ran.append(i)) for i in range(4)]
    replayed = spd.masked_forward(x, masks=masks, delta_masks=dms)
    calls = dict(spd.state.replay.calls)
    other = spd.masked_forward(x.clone(), masks=masks, delta_masks=dms)  # another tensor: nothing replayed
    spd.forget_prefix()
    plain = spd.masked_forward(x, masks=masks, delta_masks=dms)
    for h in hooks:
        h.remove()
    assert calls == {f"blocks.{i}": 1 for i in range(4)}
    assert torch.equal(replayed, plain) and torch.equal(other, plain)
    assert torch.equal(spd(x), out)  # the target path is untouched
    # module hooks still run for every block (the replayed ones return before computing anything)
    assert ran == [0, 1, 2, 3] * 3
    spd.state.delta_weights = {}
    # the runners are instance attributes: the state dict is the same as without them
    assert spd.state_dict().keys() == S.SPDModel(_target(), m.spd_cfg).state_dict().keys()


def test_compile_mode_is_a_typed_config_value():
    assert CompileConfig.of(True).mode == "full"
    assert CompileConfig.of(False).mode == "none"
    assert CompileConfig.of({"mode": "regional"}).mode == "regional"
    with pytest.raises(ValueError, match="compile.mode='everything'"):
        CompileConfig(mode="everything")


def test_old_train_keys_are_refused_naming_their_section():
    with pytest.raises(ValueError, match=r"compile \(set model.compile.mode\).*lr \(set model.optim.lr\)"):
        SPDTrainConfig.from_dict({"compile": "full", "lr": 1e-3})


def test_recipe_trains_and_resumes_with_regional_compile(tmp_path):
    """spd_gpt2_layer.yaml (compile: regional) shrunk to the demo GPT: 2 steps, then a resume to 4 from the
    checkpoint; the checkpoint carries the compile mode."""
    from lightning_opt.recipes import CONFIGS, spd

    args = [
        "--config", str(CONFIGS / "spd_gpt2_layer.yaml"), "--trainer.accelerator", "cpu",
        "--model.target.pretrained", "null", "--model.target.checkpoint", "demo",
        "--model.target.model", "{n_layer: 3, n_embd: 32}", "--model.target.train_steps", "5",
        "--model.target.train_batch_size", "4", "--model.target.seq_len", "32",
        "--model.spd.components", '[{pattern: "blocks.1.mlp.c_fc", C: 16}, {pattern: "blocks.1.mlp.c_proj", C: 16}]',
        "--model.spd.ci_hidden", "[16]", "--model.compile.backend", "eager",
        "--model.train.autocast_bf16", "false", "--model.train.faithfulness_warmup_steps", "2",
        "--model.train.eval_batches", "1", "--data.init_args.train_files", "builtin",
        "--data.init_args.val_files", "builtin", "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "2",
        "--data.init_args.val_tokens", "256", "--data.init_args.vocab_size", "256",
        "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
    ]
    first = spd.main([*args, "--trainer.max_steps", "2"])
    assert first["steps"] == 2
    (ckpt,) = glob.glob(str(tmp_path / "**" / "version_0" / "checkpoints" / "last.ckpt"), recursive=True)
    resumed = spd.main([*args, "--trainer.max_steps", "4", "--ckpt_path", ckpt])
    assert resumed["steps"] == 4
    for k in ("kl/ci", "ce/ci", "kl/stochastic"):
        assert torch.isfinite(torch.tensor(resumed[k])), k
    loaded = SPDModule.load_from_checkpoint(ckpt)
    assert loaded.compile_config.mode == "regional" and loaded.compile_config.backend == "eager"
    torch._dynamo.reset()
