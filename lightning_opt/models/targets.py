"""Frozen target models: the language models that CLT and SPD study, loaded from a file or trained here.

Plain torch. :func:`load_gpt_checkpoint` reads a GPT from a recipe checkpoint or a ``{"config", "model"}``
file without running code from it; :func:`train_language_model` is the one loop that trains a small target
(the demo GPTs of the CLT and SPD recipes) on a stream of ``(x, y)`` token batches.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_opt._serialization import register_safe_globals
from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig

__all__ = ["load_checkpoint_file", "load_gpt_checkpoint", "train_language_model"]

# a GPT2SpeedrunModule checkpoint holds these in its hyperparameters
register_safe_globals(GPTConfig, GPTExecution, OptimConfig, ScheduleConfig)


def load_checkpoint_file(path: str | os.PathLike, what: str = "checkpoint") -> Any:
    """``torch.load(path, weights_only=True)``: tensors, plain Python data and our config dataclasses only.

    A file that holds any other object (a pickle whose ``__reduce__`` would call a function, say) is refused
    with a ``ValueError`` before anything in it runs: loading a file never executes code from it.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message: boilerplate, then what was refused ("Trying to load unsupported GLOBAL posix.system ...")
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[-1] if lines else "")
        raise ValueError(
            f"{what} {str(path)!r} holds objects other than tensors and plain data ({why}); refusing to "
            "unpickle it, since that could run code from the file. Use a GPT2SpeedrunModule checkpoint or a "
            "{'config': GPTConfig.to_dict(), 'model': state_dict} file saved with torch.save"
        ) from None
    except (RuntimeError, EOFError, OSError) as err:  # not a torch file, truncated, unreadable
        raise ValueError(f"{what} {str(path)!r} cannot be read as a torch checkpoint ({err})") from None


def load_gpt_checkpoint(path: str | os.PathLike) -> GPT:
    """A :class:`~lightning_opt.models.gpt2.GPT` from a ``GPT2SpeedrunModule`` Lightning checkpoint or a
    ``{"config": GPTConfig.to_dict(), "model": state_dict}`` file (its config travels with its weights)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"target checkpoint {path} not found (or use target='demo' / 'hf:gpt2')")
    ckpt = load_checkpoint_file(path, "target checkpoint")
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} holds a {type(ckpt).__name__}, not a checkpoint dict")
    if "config" in ckpt and "model" in ckpt:
        model = GPT(GPTConfig.from_dict(ckpt["config"]))
        model.load_state_dict(ckpt["model"])
        return model
    hp = ckpt.get("hyper_parameters", {})
    cfg = hp.get("model_config") or hp.get("config")
    if cfg is None:
        raise ValueError(f"{path} holds neither {{'config', 'model'}} nor a GPT2SpeedrunModule checkpoint")
    model = GPT(GPTConfig.from_dict(cfg))
    sd = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(sd)
    return model


def train_language_model(
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    lr: float,
    lr_at: Callable[[int], float] | None = None,
) -> float:
    """Train ``model`` (called as ``model(x, y) -> loss``) for ``steps`` AdamW steps (no weight decay) on
    ``batches``; ``lr_at(step)`` gives each step's learning rate (default ``lr`` throughout). Leaves the model in
    eval mode and returns the last step's loss (``nan`` for zero steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.full((), float("nan"))
    for step in range(steps):
        x, y = next(batches)
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())
