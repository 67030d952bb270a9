"""Running a recipe's ``main(args)`` the way a user does, and watching whether training started."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_opt.recipes import CONFIGS

RECIPES = {
    "gpt2": ("gpt2", CONFIGS / "gpt2" / "demo.yaml"),
    "spd": ("spd", CONFIGS / "spd_tms_5-2.yaml"),
    "clt": ("clt", CONFIGS / "clt_demo.yaml"),
}
COMMON = ["--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false"]


def recipe_main(recipe: str) -> Any:
    module, _ = RECIPES[recipe]
    return importlib.import_module(f"lightning_opt.recipes.{module}").main


class _FitWatch:
    """Records whether Trainer.fit started and whether a training batch began."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = False
        self.trained = False
        original = pl.Trainer.fit
        watch = self

        class Probe(pl.Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                watch.trained = True

        def fit(trainer: pl.Trainer, *a: Any, **k: Any) -> Any:
            self.started = True
            trainer.callbacks.append(Probe())
            return original(trainer, *a, **k)

        monkeypatch.setattr(pl.Trainer, "fit", fit)


def run_bad(recipe: str, args: list[str], tmp_path: Path, monkeypatch, capsys, when: str = "started") -> tuple[str, bool]:
    """Runs the recipe; returns (the error text, whether fit had ``started`` or a batch had been
    ``trained``, per ``when``). Fails if nothing is raised."""
    monkeypatch.chdir(tmp_path)
    watch = _FitWatch(monkeypatch)
    main = recipe_main(recipe)
    config = RECIPES[recipe][1]
    try:
        main(["--config", str(config), *COMMON, *args])
    except SystemExit as err:  # jsonargparse prints the reason and exits 2
        return f"{err}\n{capsys.readouterr().err}", getattr(watch, when)
    except Exception as err:  # noqa: BLE001 - any clear exception is acceptable; its text is checked
        return f"{type(err).__name__}: {err}", getattr(watch, when)
    pytest.fail(f"{recipe} {args}: no error")
