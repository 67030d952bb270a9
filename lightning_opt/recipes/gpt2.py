"""GPT-2 speedrun recipe.

    lightning-opt-gpt2 --config gpt2/demo
    lightning-opt-gpt2 --config gpt2/gpt2-124m-speedrun \
        --data.train_files '/data/fineweb_train_*.bin' --data.val_files '/data/fineweb_val_*.bin'

Any value can be overridden on the command line (``--trainer.max_steps 100``); ``--print_config``
shows the full configuration. Logs go to TensorBoard under ``runs/``; ``metrics.json`` is written into
the run directory at the end.
"""

from __future__ import annotations

from lightning_opt.cli import build_recipe_cli, run_recipe
from lightning_opt.data.datamodule import TokenShardDataModule
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule


def main(args: list[str] | None = None) -> dict:
    cli, summary = build_recipe_cli(GPT2SpeedrunModule, TokenShardDataModule, args)
    return run_recipe(cli, summary, recipe="gpt2_speedrun")


def cli() -> None:
    """The ``lightning-opt-gpt2`` console script: ``main`` on the command line, exit status 0 when it ends."""
    main()


if __name__ == "__main__":
    cli()
