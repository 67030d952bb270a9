"""Time crosslayer-coding's CLT training step (its tensor-parallel model) for benchmarks/clt_scaling.py.

Imports the peer from ``.peers/crosslayer-coding`` (git-ignored; fetched separately). Runs its model with its own
BatchTopK, MSE over every layer, backward, its shared-gradient averaging across ranks and AdamW, in
bf16 autocast like its trainer's ``precision="bf16"``. Every rank gets the same batch (its tensor-parallel
layout). Works in one process or inside an initialised process group (one rank per GPU).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".peers", "crosslayer-coding")


def peer_step_times(
    n_features: int,
    tokens: int,
    k: int,
    n_layers: int,
    d_model: int,
    steps: int,
    warmup: int,
    smoke: bool = False,
) -> dict[str, Any]:
    """Median step time (ms) and mean active features per token of crosslayer-coding's CLT."""
    if _PEER not in sys.path:
        sys.path.insert(0, _PEER)
    from clt.config import CLTConfig
    from clt.models.clt import CrossLayerTranscoder
    from clt.training.distributed_utils import average_shared_parameter_grads

    use_cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    group = dist.group.WORLD if dist.is_initialized() else None
    world = dist.get_world_size() if group is not None else 1
    cfg = CLTConfig(
        num_features=n_features,
        num_layers=n_layers,
        d_model=d_model,
        activation_fn="batchtopk",
        batchtopk_k=k,
    )
    torch.manual_seed(0)
    model = CrossLayerTranscoder(cfg, process_group=group, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cpu").manual_seed(1234)  # the same batch on every rank
    inputs = {layer: torch.randn(tokens, d_model, generator=gen).to(device) for layer in range(n_layers)}
    targets = {layer: torch.randn(tokens, d_model, generator=gen).to(device) for layer in range(n_layers)}

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda):
            outputs = model(inputs)
            loss = sum(torch.nn.functional.mse_loss(outputs[i].float(), targets[i]) for i in outputs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            average_shared_parameter_grads(model, world)
        opt.step()

    times = []
    for i in range(warmup + steps):
        if use_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if use_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda):
        acts = model.get_feature_activations(inputs)
        active = sum(int((a != 0).sum()) for a in acts.values())
        width = next(iter(acts.values())).shape[-1]
    return {
        "step_ms": statistics.median(times),
        "active_per_token": active / tokens,
        "activation_width_per_layer": width,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if use_cuda else None,
        "note": "same batch on every rank (tensor parallel); L0 counted on rank 0's activations",
    }
