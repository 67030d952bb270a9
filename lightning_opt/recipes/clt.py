"""Cross-layer transcoder (CLT) recipe.

    lightning-opt-clt --config clt_demo          # CPU, offline, < 2 min
    lightning-opt-clt --config clt_gpt2_small \
        --data.train_files '/data/fineweb_train_*.bin' --data.val_files '/data/fineweb_val_*.bin'

The demo trains a tiny byte-level GPT on the built-in corpus first (cached after the first run), then a CLT
on its MLP activations. ``metrics.json`` in the run directory holds the final FVU (per layer and total),
L0, dead fraction, the replacement model's KL and next-token agreement, tokens/s and peak memory; with
``--export_dir`` the trained CLT is also written in circuit-tracer's format. See ``docs/clt.md``.
"""

from __future__ import annotations

from lightning_opt._errors import run_console
from lightning_opt.cli import RecipeCLI, build_recipe_cli, run_dir, run_recipe, write_metrics
from lightning_opt.data.activations import CLTDataModule
from lightning_opt.models.clt import save_circuit_tracer
from lightning_opt.modules.clt import CLTModule


class CLTRecipeCLI(RecipeCLI):
    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--export_dir", type=str | None, default=None,
                            help="write the trained CLT in circuit-tracer format here (ReLU/JumpReLU CLTs)")


def main(args: list[str] | None = None) -> dict:
    cli, summary = build_recipe_cli(CLTModule, CLTDataModule, args, cli_class=CLTRecipeCLI)
    metrics = run_recipe(cli, summary, recipe="clt")
    trainer, model = cli.trainer, cli.model
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and not k.endswith("_pb")}
    metrics.update({"final": final, "clt_config": model.clt_config.to_dict()})
    export = cli.config.get("export_dir")
    if export and trainer.is_global_zero:
        save_circuit_tracer(model.model, export)
        metrics["export_dir"] = export
    write_metrics(run_dir(trainer) / cli.config.get("metrics_file", "metrics.json"), metrics)
    if trainer.is_global_zero:
        keys = ("val/fvu", "val/l0", "val/kl", "val/next_token_agreement", "val/dead_fraction")
        print("final " + "  ".join(f"{k} {final[k]:.4g}" for k in keys if k in final))
    return metrics


def cli() -> None:
    """The ``lightning-opt-clt`` console script: ``main`` on the command line. A user's mistake (a wrong flag or value, a
    missing file) prints one ``error: ...`` line and exits with status 2 (``LIGHTNING_OPT_TRACEBACK=1`` shows its
    traceback); a bug raises with its traceback."""
    run_console(main)


if __name__ == "__main__":
    cli()
