"""Train Karpathy's nanoGPT ``model.py`` the way its ``bench.py`` does, on our data and clock.

Their code is never copied into this repository: it is imported at run time from ``.peers/nanoGPT/model.py``
(git-ignored; export it with ``git show HEAD:model.py`` from a clone of github.com/karpathy/nanoGPT).
What follows bench.py: ``GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, bias=False,
dropout=0, vocab_size=50304)``, fused AdamW from its ``configure_optimizers`` (betas 0.9/0.95),
``torch.compile(model)``, bf16 autocast, one optimizer step per micro-batch, TF32 matmuls on. What differs,
so that its val loss means something: the learning rate (6e-4 with warmup + cosine, the schedule of
nanoGPT's train.py and of our classic config, instead of bench.py's fixed 1e-4 and weight decay 0.1
instead of 1e-2) and the data order (our in-order windows, the same as every other runner).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpt2_common import ROOT, RunSpec, Tokens, run_loop, schedule_for, summarize

PEER_MODEL = ROOT / ".peers" / "nanoGPT" / "model.py"


def load_nanogpt(path: Path = PEER_MODEL):
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: export nanoGPT's model.py there (git show HEAD:model.py from a clone of "
            "github.com/karpathy/nanoGPT); it is git-ignored and never committed"
        )
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train_nanogpt(spec: RunSpec, data: Tokens, shape: dict[str, int] | None = None,
                  lr: float = 6e-4, weight_decay: float = 0.1, vocab_size: int = 50304,
                  bias: bool = False) -> dict[str, Any]:
    """``spec`` gives steps, micro-batch, seq_len, compile, amp, schedule and validation; ``shape`` the model;
    ``bias`` its linear and LayerNorm biases (bench.py: ``False``; GPT-2 itself and nanoGPT's default: ``True``)."""
    mod = load_nanogpt()
    dev = data.device
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(dev)
    shape = shape or dict(n_layer=12, n_head=12, n_embd=768)
    torch.manual_seed(spec.seed)
    cfg = mod.GPTConfig(block_size=spec.seq_len, vocab_size=vocab_size, dropout=0.0, bias=bias, **shape)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints parameter counts
        model = mod.GPT(cfg).to(dev)
        opt = model.configure_optimizers(weight_decay=weight_decay, learning_rate=lr, betas=(0.9, 0.95),
                                         device_type=dev.type)
    fused = any(g.get("fused") for g in opt.param_groups) or bool(opt.defaults.get("fused"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_for(spec))
    raw = model
    if spec.compile:
        model = torch.compile(model)

    def val_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return raw(x, y)[1]  # eager: no second compile for validation

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, y)[1]

    r = run_loop(spec, data, raw, loss_fn, val_fn, opt, sched)
    n_params = raw.get_num_params()  # their count: without position embeddings, tied head included
    fpt = 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * spec.seq_len  # their estimate_mfu formula
    return summarize(spec, raw, r["end"], r["t_warm"], r["steps"], r["tokens"], r["curve"], dev,
                     {"runner": "nanoGPT", "bias": bias, "fpt": fpt, "fused_adamw": fused, "stopped": r["stopped"],
                      "lr": lr, "weight_decay": weight_decay, "spec": spec.describe()})
