"""The recipes: command-line entry points with their shipped YAML configs.

* ``lightning-opt-gpt2`` (``python -m lightning_opt.recipes.gpt2``): configs ``gpt2/demo``, ``gpt2/gpt2-124m-*``, ...
* ``lightning-opt-clt`` (``python -m lightning_opt.recipes.clt``): ``clt_demo``, ``clt_gpt2_small``
* ``lightning-opt-spd`` (``python -m lightning_opt.recipes.spd``): ``spd_tms_5-2``, ``spd_resid_mlp1``, ...
* ``lightning-opt-sample`` (``python -m lightning_opt.recipes.sample``): text from a GPT-2 run's checkpoint

``--config`` takes a YAML path or the name of a shipped config: its path under ``CONFIGS`` (this package's
``configs/`` folder) without ``.yaml``. A file at the given path wins over a shipped config of that name.
"""

from __future__ import annotations

from lightning_opt.cli import CONFIGS, resolve_config, shipped_configs

__all__ = ["CONFIGS", "resolve_config", "shipped_configs"]
