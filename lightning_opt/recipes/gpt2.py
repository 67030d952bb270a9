"""GPT-2 speedrun recipe.

    lightning-opt-gpt2 --config gpt2/demo
    lightning-opt-gpt2 --config gpt2/gpt2-124m-speedrun \
        --data.train_files '/data/fineweb_train_*.bin' --data.val_files '/data/fineweb_val_*.bin'

Any value can be overridden on the command line (``--trainer.accumulate_grad_batches 2``); ``--print_config``
shows the full configuration. ``--train_tokens N`` sets the run's length as a token budget: ``trainer.max_steps``
becomes ``ceil(N / (data.batch_size x data.seq_len x trainer.accumulate_grad_batches x world size))`` (the
learning-rate schedule follows ``max_steps``); give it or ``--trainer.max_steps``, not both. Logs go to
TensorBoard under ``runs/``; ``metrics.json`` is written into the run directory at the end.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lightning_opt._errors import run_console
from lightning_opt._internals import set_max_steps
from lightning_opt.cli import RecipeCLI, build_recipe_cli, run_recipe
from lightning_opt.data.datamodule import TokenShardDataModule
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule


def steps_for_tokens(train_tokens: int, batch_size: int, seq_len: int, accumulate: int, world_size: int) -> int:
    """Optimizer steps that cover ``train_tokens``: each step trains ``batch_size x seq_len x accumulate`` tokens on
    each of ``world_size`` processes (the last step may run past the budget by less than one step)."""
    return math.ceil(train_tokens / (batch_size * seq_len * accumulate * world_size))


class GPT2RecipeCLI(RecipeCLI):
    """The recipe's CLI with ``train_tokens``: the run's length as a token budget, turned into
    ``trainer.max_steps`` once the Trainer knows its world size (devices x nodes, as Lightning resolves
    ``devices: auto``) and before ``fit``. The saved ``config.yaml`` keeps ``train_tokens`` (and
    ``trainer.max_steps`` as given), so a run started from it computes the same steps."""

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument(
            "--train_tokens", type=int | None, default=None,
            help="the run's token budget: sets trainer.max_steps = ceil(train_tokens / (data.batch_size x "
                 "data.seq_len x trainer.accumulate_grad_batches x world size)); null: trainer.max_steps as given",
        )

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        tokens = self.config.get("train_tokens")
        if tokens is None:
            return
        if isinstance(tokens, bool) or tokens <= 0:
            raise ValueError(f"train_tokens={tokens!r} must be a positive number of tokens, or null")
        max_steps = self.config.trainer.get("max_steps")
        if max_steps not in (None, -1):
            raise ValueError(
                f"train_tokens={tokens} and trainer.max_steps={max_steps} both set the run's length; drop one: "
                "pass --train_tokens null to train for trainer.max_steps, or leave trainer.max_steps out (-1) to "
                "train for train_tokens"
            )
        data = self.config.get("data")
        for key in ("batch_size_schedule", "seq_len_schedule"):
            if data is not None and data.get(key):
                raise ValueError(
                    f"train_tokens needs a fixed number of tokens per step; data.{key} changes it: set "
                    "trainer.max_steps (and --train_tokens null) instead"
                )

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        tokens = self.config.get("train_tokens")
        if tokens is None:
            return super().instantiate_trainer(**kwargs)
        data = self.datamodule
        batch_size, seq_len = getattr(data, "batch_size", None), getattr(data, "seq_len", None)
        if batch_size is None or seq_len is None:
            raise ValueError(f"train_tokens needs a datamodule with batch_size and seq_len, not {type(data).__name__}")
        trainer = super().instantiate_trainer(**kwargs)
        # Lightning turns max_steps into its loop limits when fit starts: set here, it bounds the run and the
        # module's schedules (which span trainer.max_steps)
        world = trainer.num_nodes * trainer.num_devices
        steps = steps_for_tokens(tokens, batch_size, seq_len, trainer.accumulate_grad_batches, world)
        set_max_steps(trainer, steps)
        rank_zero_info(f"train_tokens={tokens:,}: max_steps={steps} of {batch_size} x {seq_len} x "
                       f"{trainer.accumulate_grad_batches} x {world} tokens (batch x seq_len x accumulation x processes)")
        return trainer


def main(args: list[str] | None = None) -> dict:
    cli, summary = build_recipe_cli(GPT2SpeedrunModule, TokenShardDataModule, args, cli_class=GPT2RecipeCLI)
    return run_recipe(cli, summary, recipe="gpt2_speedrun")


def cli() -> None:
    """The ``lightning-opt-gpt2`` console script: ``main`` on the command line. A user's mistake (a wrong flag or value, a
    missing file) prints one ``error: ...`` line and exits with status 2 (``LIGHTNING_OPT_TRACEBACK=1`` shows its
    traceback); a bug raises with its traceback."""
    run_console(main)


if __name__ == "__main__":
    cli()
