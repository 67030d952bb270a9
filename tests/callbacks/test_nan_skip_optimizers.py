"""NaNSkip's device-side pieces and the optimizers of the GPT-2 speedrun recipe (Muon beside AdamW, combined)."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback

from lightning_opt.callbacks import NaNSkip
from lightning_opt.callbacks._flagged_copy import FlaggedCopy
from lightning_opt.callbacks._nonfinite import _CHUNK, NonFiniteCheck
from lightning_opt.callbacks.nan_skip import flag_nonfinite
from lightning_opt.optim.combined import CombinedOptimizer
from lightning_opt.optim.factory import OptimConfig, build_optimizer
from tests.callbacks.conftest import TinyModule, WindowProbe, make_batches, make_trainer, optimizer_state


def _kernel_runs_here() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# -- the check ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_flag_nonfinite_sets_only_the_flag_of_the_part_that_has_a_bad_value(dtype):
    dev = _device()
    big = torch.finfo(dtype).max  # finite: its inf-norm is finite too (a 2-norm would overflow)
    grads = [torch.randn(5, 3, device=dev, dtype=dtype), torch.full((7,), big, device=dev, dtype=dtype)]
    losses = [torch.tensor(2.0, device=dev)]  # float32 beside grads of another dtype: two groups, one call each
    one = torch.ones((), device=dev)
    for bad in (None, float("nan"), float("inf"), -float("inf")):
        flags = torch.zeros(2, device=dev)
        g = [t.clone() for t in grads]
        if bad is not None:
            g[0][4, 2] = bad
        flag_nonfinite([(losses, flags[0]), (g, flags[1])], one)
        assert flags.tolist() == [0.0, 0.0 if bad is None else 1.0]
    flags = torch.zeros(2, device=dev)
    flag_nonfinite([(losses + [torch.tensor(float("nan"), device=dev)], flags[0]), (grads, flags[1])], one)
    assert flags.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nonfinite_kernel_flags_the_slot_of_the_bad_tensor_and_the_any_slot(dtype):
    if not _kernel_runs_here():
        pytest.skip("needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
    dev = _device()
    big = torch.finfo(dtype).max  # finite: x - x is 0 (no overflow)
    # a tensor over one chunk (its last chunk partial), a small one, an empty one, a float32 loss beside them
    grads = [torch.full((_CHUNK + 5,), big, device=dev, dtype=dtype), torch.randn(5, 3, device=dev).to(dtype),
             torch.zeros(0, device=dev, dtype=dtype)]
    losses = [torch.tensor(2.0, device=dev)]
    check = NonFiniteCheck()
    for bad in (None, float("nan"), float("inf"), -float("inf")):
        for where in ((0, _CHUNK + 4), (0, 0), (1, 7)):
            g = [t.clone() for t in grads]
            if bad is not None:
                g[where[0]].view(-1)[where[1]] = bad
            flags = torch.zeros(3, device=dev)
            assert check([(losses, 0), (g, 1)], flags, 2)
            assert check.uses_kernel
            assert flags.tolist() == ([0.0, 0.0, 0.0] if bad is None else [0.0, 1.0, 1.0]), (bad, where)
    flags = torch.zeros(3, device=dev)
    assert check([([torch.tensor(float("nan"), device=dev)], 0), (grads, 1)], flags, 2)
    assert flags.tolist() == [1.0, 0.0, 1.0]
    # what it does not take (integers, a strided view) it leaves to the torch path, touching nothing
    flags = torch.zeros(3, device=dev)
    assert not check([([torch.ones(3, device=dev, dtype=torch.int64)], 0)], flags, 2)
    assert not check([([torch.randn(4, 4, device=dev).t()], 0)], flags, 2)
    assert not check.uses_kernel


# -- the flagged copy ---------------------------------------------------------------------------------------
def _pairs(dev: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (0,), (2, 3, 4)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16]
    src = [torch.randn(s, generator=g).to(dt).to(dev) for s, dt in zip(shapes, dtypes)]
    src[0][1, 1] = float("nan")  # copied bit for bit
    dst = [torch.randn(s, generator=g).to(dt).to(dev) for s, dt in zip(shapes, dtypes)]
    return dst, src


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_flagged_copy_copies_bit_exactly_only_when_the_flag_is_set(path, monkeypatch):
    if path == "kernel" and not _kernel_runs_here():
        pytest.skip("needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
    if path == "torch":
        monkeypatch.setattr("lightning_opt.callbacks._flagged_copy._has_triton", False)
    dev = _device()
    dst, src = _pairs(dev)
    before = [d.clone() for d in dst]
    copy = FlaggedCopy()
    copy(torch.zeros((), device=dev), dst, src)
    assert copy.uses_kernel == (path == "kernel")
    for d, b in zip(dst, before):
        assert torch.equal(d.view(torch.uint8), b.view(torch.uint8))
    copy(torch.ones((), device=dev), dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8))


def test_flagged_copy_refuses_mismatched_lists():
    with pytest.raises(ValueError, match="cannot copy"):
        FlaggedCopy()(torch.ones(()), [torch.zeros(3)], [torch.zeros(4)])


# -- Muon and the combined optimizer ------------------------------------------------------------------------
class _MuonModule(TinyModule):
    """The MLP's weight matrices on Muon (momentum warmup: a host step counter), biases on AdamW: one Muon, or
    Muon + AdamW in a CombinedOptimizer as the speedrun recipe builds them."""

    def __init__(self, combined: bool = True, fused: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.combined, self.fused_adam = combined, fused

    def configure_optimizers(self):
        cfg = OptimConfig(name="muon", lr=1e-2, muon_lr=0.02, muon_momentum_start=0.85,
                          muon_momentum_warmup_steps=4, fused=self.fused_adam)
        hidden = [self.net[0].weight, self.net[3].weight]
        opts = build_optimizer(self.net, cfg, hidden=hidden, embeddings=[], head=[])
        opt = CombinedOptimizer(opts) if self.combined else opts[0]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _muon_steps(trainer) -> list[int]:
    return [g["steps_done"] for g in trainer.optimizers[0].param_groups if "steps_done" in g]


class _LeafProbe(Callback):
    """How NaNSkip applies its decision to each optimizer, seen mid-fit."""

    def __init__(self, skip: NaNSkip) -> None:
        self.skip, self.kinds = skip, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 3:
            self.kinds = [(type(leaf.optimizer).__name__, leaf.fused) for leaf in self.skip._guards[0].leaves]


@pytest.mark.parametrize("mode", ["device", "host"])
@pytest.mark.parametrize("combined,fused", [(True, True), (True, False), (False, False)])
def test_muon_skip_is_exact_momentum_warmup_included(tmp_path, mode, combined, fused):
    """A NaN batch inside Muon's momentum warmup: params, Muon momentum, AdamW moments, Muon's step counter and
    the schedule end bit-identical to a run that never saw the batch."""
    batches = make_batches(7)
    bad = 2
    skip = NaNSkip(mode=mode)
    probe, leaves = WindowProbe(bad, bad), _LeafProbe(skip)
    m = _MuonModule(combined=combined, fused=fused, batches=batches, nan_at=(bad,))
    t1 = make_trainer(tmp_path, [skip, probe, leaves])
    t1.fit(m)
    probe.assert_unchanged()
    assert skip.skipped_total == 1 and skip.steps_seen == len(batches)
    ref = _MuonModule(combined=combined, fused=fused, batches=[b for i, b in enumerate(batches) if i != bad])
    t2 = make_trainer(tmp_path, [])
    t2.fit(ref)
    for a, b in zip(optimizer_state(t1), optimizer_state(t2), strict=True):
        assert torch.equal(a, b)
    assert _muon_steps(t1) == _muon_steps(t2) == [len(batches) - 1]
    assert t1.lr_scheduler_configs[0].scheduler.last_epoch == t2.lr_scheduler_configs[0].scheduler.last_epoch
    if mode == "device":  # the check and the flagged copy take their Triton kernels wherever Triton runs
        kernel = _kernel_runs_here()
        assert skip.paths["check"] == ("triton" if kernel else "foreach_norm")
        assert skip.paths["0:Muon"] == ("flagged_copy_triton" if kernel else "flagged_copy_torch")
    if combined:
        assert leaves.kinds == [("Muon", False), ("AdamW", fused)]
        if mode == "device":
            assert skip.paths["1:AdamW"] == ("found_inf" if fused else skip.paths["0:Muon"])
        # the inner optimizers' steps are unwrapped with the outer one
        assert all("step" not in o.__dict__ for o in t1.optimizers[0].optimizers)
