"""GPT-2 speedrun recipe.

    python recipes/gpt2_speedrun.py --config recipes/configs/gpt2/demo.yaml
    python recipes/gpt2_speedrun.py --config recipes/configs/gpt2/gpt2-124m-speedrun.yaml \
        --data.train_files '/data/fineweb_train_*.bin' --data.val_files '/data/fineweb_val_*.bin'

Any value can be overridden on the command line (``--trainer.max_steps 100``); ``--print_config``
shows the full configuration. Logs go to TensorBoard under ``runs/``; ``metrics.json`` is written into
the run directory at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_opt.cli import RecipeCLI, RunSummary, run_recipe  # noqa: E402
from lightning_opt.data.datamodule import TokenShardDataModule  # noqa: E402
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule  # noqa: E402


def main(args: list[str] | None = None) -> dict:
    summary = RunSummary()
    cli = RecipeCLI(
        GPT2SpeedrunModule,
        TokenShardDataModule,
        args=args,
        run=False,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"callbacks": [summary]},
    )
    return run_recipe(cli, summary, recipe="gpt2_speedrun")


if __name__ == "__main__":
    main()
