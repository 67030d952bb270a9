"""Shared plumbing for the recipes: a LightningCLI with run directories, precision and ``metrics.json``."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import sys
import time
import typing
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_opt._errors import parser_reason, refuse
from lightning_opt.callbacks.async_checkpoint import (
    AsyncCheckpoint,
    checkpoint_step,
    checkpoints_after,
    default_dirpath,
    intact_checkpoint,
    newest_intact_checkpoint,
    refuse_damaged_checkpoint,
)


def device_name(trainer: L.Trainer | None = None) -> str:
    if torch.cuda.is_available() and (trainer is None or trainer.strategy.root_device.type == "cuda"):
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


class RunSummary(Callback):
    """Prints the validation loss as it falls and writes ``metrics.json`` into the run directory.

    Training wall time excludes validation (as the speedrun rules do), including a validation run after
    ``fit``. The clock is read at the boundaries of validation, at the start and end of training and once at
    the end of the warm-up window (the segment's first ``warmup_steps`` optimizer steps: ``torch.compile``,
    autotuning, allocator growth), after a device synchronisation there: no per-step synchronisation.

    Logged to ``metrics.json``: ``final_val_loss``, ``val_history``, ``tokens_seen`` (all segments of a
    resumed run), ``steps``, ``train_time_s`` (this segment), ``segment_tokens`` (trained in this
    segment), ``tokens_per_s`` (``segment_tokens / train_time_s``: this segment's speed, also after a
    resume, warm-up included), ``warmup_steps``, ``warmup_s`` (train time of the warm-up window; None when the
    segment was shorter), ``steady_tokens_per_s`` (tokens after the warm-up window over train time after it:
    the speed a longer run settles at; None without steps after the window), ``train_time_total_s`` (all
    segments: the earlier ones' time is carried in checkpoints), ``wall_time_s``, ``peak_memory_bytes``,
    ``device``, versions.

    Args:
        warmup_steps: optimizer steps at the start of each segment counted as warm-up, not steady speed.
    """

    def __init__(self, warmup_steps: int = 3) -> None:
        if warmup_steps < 1:
            raise ValueError(f"RunSummary: warmup_steps={warmup_steps}; it must be >= 1.")
        self.warmup_steps = warmup_steps
        self._step0 = 0  # global_step when this segment's training started
        self._warm: tuple[float, int, float] | None = None  # clock, tokens_seen, validation time at warm-up end
        self.val_history: list[dict[str, float]] = []
        self._t0 = self._val_start = 0.0
        self._val_time = 0.0
        self._train_end: float | None = None
        self._start_wall = time.time()
        self._tokens0 = 0  # tokens_seen when this segment's training started (restored on resume)
        self._earlier_time = 0.0  # train time of the segments before a resume, from the checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"train_time_total_s": self._earlier_time + self.train_time()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._earlier_time = float(state_dict.get("train_time_total_s", 0.0))

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync(trainer)
        self._t0 = time.perf_counter()
        self._val_time = 0.0
        self._train_end = None
        self._tokens0 = int(getattr(pl_module, "tokens_seen", 0))
        self._step0 = trainer.global_step
        self._warm = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._warm is None and trainer.global_step - self._step0 >= self.warmup_steps:
            self._sync(trainer)  # once per segment, at the end of the warm-up window
            self._warm = (time.perf_counter(), int(getattr(pl_module, "tokens_seen", 0)), self._val_time)

    def _in_training(self, trainer: L.Trainer) -> bool:
        # validation inside fit (not the sanity check before it, nor trainer.validate after it)
        return trainer.state.fn == "fit" and not trainer.sanity_checking and self._train_end is None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync(trainer)
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync(trainer)
        if self._in_training(trainer):
            self._val_time += time.perf_counter() - self._val_start
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val/loss")
        if val is not None:
            row = {"step": trainer.global_step, "val_loss": float(val), "train_time_s": self.train_time()}
            if not self.val_history or self.val_history[-1]["step"] != row["step"]:
                self.val_history.append(row)
            self._print(f"step {row['step']:>6} | val/loss {row['val_loss']:.4f} | train time {row['train_time_s']:.1f}s")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync(trainer)
        self._train_end = time.perf_counter()

    def train_time(self) -> float:
        if not self._t0:  # training has not started
            return 0.0
        end = self._train_end if self._train_end is not None else time.perf_counter()
        return max(0.0, end - self._t0 - self._val_time)

    def warmup_time(self) -> float | None:
        """Train time (validation excluded) of this segment's warm-up window; None before its end."""
        if self._warm is None:
            return None
        clock, _, val_time = self._warm
        return max(0.0, clock - self._t0 - val_time)

    @rank_zero_only
    def _print(self, msg: str) -> None:
        print(msg, flush=True)

    @staticmethod
    def final_line(metrics: dict[str, Any]) -> str:
        """The recipes' last line: the loss, this segment's speed, and its steady speed after the warm-up."""

        def rate(speed: float | None) -> str:
            return "n/a" if speed is None else f"{speed:,.0f}" if speed >= 100 else f"{speed:.3g}"

        line = (f"final val/loss {metrics['final_val_loss']}  |  {rate(metrics['tokens_per_s'])} tokens/s "
                f"({metrics['segment_tokens']:,} tokens in {metrics['train_time_s']:.1f} s of training)")
        if metrics.get("steady_tokens_per_s") is not None:
            line += (f"  |  steady {rate(metrics['steady_tokens_per_s'])} tokens/s after {metrics['warmup_s']:.1f} s "
                     f"of warm-up (the first {metrics['warmup_steps']} steps, compilation included)")
        return line

    def summary(self, trainer: L.Trainer, pl_module: L.LightningModule, **extra: Any) -> dict[str, Any]:
        tokens = int(getattr(pl_module, "tokens_seen", 0))
        segment_tokens = tokens - self._tokens0
        train_time = self.train_time()
        warmup_s = self.warmup_time()
        steady = None
        if self._warm is not None and warmup_s is not None and train_time - warmup_s > 0 and tokens > self._warm[1]:
            steady = (tokens - self._warm[1]) / (train_time - warmup_s)
        dev = trainer.strategy.root_device
        final = self.val_history[-1]["val_loss"] if self.val_history else None
        return {
            "final_val_loss": final,
            "val_history": self.val_history,
            "tokens_seen": tokens,
            "steps": trainer.global_step,
            "train_time_s": train_time,
            "segment_tokens": segment_tokens,
            "tokens_per_s": segment_tokens / train_time if train_time > 0 else None,
            "warmup_steps": self.warmup_steps,
            "warmup_s": warmup_s,
            "steady_tokens_per_s": steady,
            "train_time_total_s": self._earlier_time + train_time,
            "wall_time_s": time.time() - self._start_wall,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            "device": device_name(trainer),
            "world_size": trainer.world_size,
            "precision": str(trainer.precision),
            "versions": {"torch": torch.__version__, "lightning": L.__version__},
            **extra,
        }


def _where_instead(parser: Any, message: str) -> str:
    """For a key the parser does not accept (``model.train: Option 'lr' is not accepted``, ``unrecognized
    arguments: --model.compile_options ...``): the accepted keys with the same name elsewhere (``model.optim.lr``)
    or with its last ``_`` as a level (``model.compile.options``), as ``; use --KEY`` (empty when none)."""
    m = re.search(r"([\w.]+): Option '(\w+)' is not accepted", message) or re.search(
        r'Parser key "([\w.]+)":.*?Option \'(\w+)\' is not accepted', message, re.S)
    key = f"{m.group(1)}.{m.group(2)}" if m else None
    if key is None:
        m = re.search(r"unrecognized arguments: --([\w.]+)", message)
        key = m.group(1) if m else None
    if key is None:
        return ""
    def leaves(prefix: str, hint: Any) -> list[str]:
        """``prefix`` and, for a dataclass type (or a union holding one), the keys of its fields."""
        out = [prefix]
        for t in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(t) and isinstance(t, type):
                hints = typing.get_type_hints(t)
                out += [k for f in dataclasses.fields(t) for k in leaves(f"{prefix}.{f.name}", hints.get(f.name))]
        return out

    try:  # the parser's keys, with the fields of dataclass-typed ones (which the parser holds as one value)
        known = [k for a in parser._actions if isinstance(getattr(a, "dest", None), str)
                 and not a.dest.endswith(".help") for k in leaves(a.dest, getattr(a, "_typehint", None))]
    except Exception:  # no suggestion: the parser's reason stands alone
        return ""
    leaf = key.rsplit(".", 1)[-1]
    head, _, tail = key.rpartition("_")
    found = [k for k in known if k != key and (k.rsplit(".", 1)[-1] == leaf or (tail and k == f"{head}.{tail}"))]
    return f"; use {' or '.join('--' + k for k in sorted(found)[:3])}" if found else ""


def run_dir(trainer: L.Trainer) -> Path:
    if trainer.logger is not None and trainer.logger.log_dir:
        return Path(trainer.logger.log_dir)
    return Path(trainer.default_root_dir)


@rank_zero_only
def write_metrics(path: Path, metrics: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(metrics, indent=2, default=str))
    os.replace(tmp, path)


CONFIGS = Path(__file__).resolve().parent / "recipes" / "configs"  # the recipes' shipped YAML configs


def shipped_configs() -> list[str]:
    """The names ``--config`` accepts besides paths, e.g. ``gpt2/demo``, ``clt_demo``, ``spd_tms_5-2``."""
    return sorted(str(p.relative_to(CONFIGS).with_suffix("")) for p in CONFIGS.rglob("*.yaml"))


def resolve_config(value: str) -> str:
    """``value`` when it names an existing file (or is not a shipped config's name), else that config's path."""
    if Path(value).exists():
        return value
    name = value[: -len(".yaml")] if value.endswith(".yaml") else value
    path = CONFIGS / f"{name}.yaml"
    return str(path) if name and path.is_file() and path.resolve().is_relative_to(CONFIGS) else value


def resolve_config_args(args: list[str]) -> list[str]:
    """``--config NAME`` (or ``--config=NAME``) of a shipped config becomes its path; paths pass as given.

    The short form ``-c NAME`` (``-c=NAME``, ``-cNAME``) is written as ``--config``, so it finds shipped configs
    and a wrong name is refused with their list just the same."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i], out[i + 1] = "--config", resolve_config(out[i + 1])
        elif arg.startswith(("--config=", "-c=")):
            out[i] = "--config=" + resolve_config(arg.partition("=")[2])
        elif arg.startswith("-c") and not arg.startswith("--") and len(arg) > 2:
            out[i] = "--config=" + resolve_config(arg[2:])
    return out


RECIPE_CALLBACKS: dict[str, str] = {
    # key under ``callbacks:`` -> the callback every recipe attaches (``--callbacks.<key>.enabled false`` drops it)
    "nan_skip": "lightning_opt.callbacks.nan_skip.NaNSkip",
    "loss_clamp": "lightning_opt.callbacks.loss_clamp.LossClamp",
    "async_checkpoint": "lightning_opt.callbacks.async_checkpoint.AsyncCheckpoint",
    "eval_throttle": "lightning_opt.callbacks.eval_throttle.EvalThrottle",
    "cuda_memory": "lightning_opt.callbacks.cuda_memory.CudaMemoryHygiene",
    "speed_monitor": "lightning_opt.callbacks.speed_monitor.SpeedMonitor",
    "lr_monitor": "lightning.pytorch.callbacks.LearningRateMonitor",
}
RECIPE_CALLBACK_DEFAULTS = {"lr_monitor": {"logging_interval": "step"}}  # where the recipes differ from the class


def _callback_class(path: str) -> type[Callback]:
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


class RecipeCLI(LightningCLI):
    """LightningCLI that picks bf16-mixed on a GPU and 32-bit on CPU when ``trainer.precision`` is unset,
    and takes ``--config NAME`` for a shipped config (``gpt2/demo``, ``clt_demo``, ``spd_tms_5-2``).

    Every recipe attaches the callback suite of :data:`RECIPE_CALLBACKS` (``NaNSkip``, ``LossClamp``,
    ``AsyncCheckpoint``, ``EvalThrottle``, ``CudaMemoryHygiene``, ``SpeedMonitor``, Lightning's
    ``LearningRateMonitor``), set under ``callbacks:`` with each class's init arguments
    (``--callbacks.loss_clamp.max 50``) and switched off with ``--callbacks.<key>.enabled false``. A callback
    of the same class in ``trainer.callbacks`` replaces the suite's; ``trainer.enable_checkpointing: false``
    drops ``AsyncCheckpoint`` and ``trainer.logger: false`` the ``LearningRateMonitor`` (it needs a logger).
    """

    def init_parser(self, **kwargs: Any) -> Any:
        kwargs.setdefault("allow_abbrev", False)  # `--trainer.max_step 3` is a typo, not `--trainer.max_steps`
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser, args) -> None:
        """Parse ``args`` (``None``: the command line). A refused command line prints one ``error: ...`` line
        (the parser's reason, not a usage text) and raises :class:`~lightning_opt._errors.UsageError`, a
        ``SystemExit`` with status 2 whose ``str()`` is the full reason."""
        from jsonargparse import ArgumentError, Namespace

        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
            return
        # given args are the whole command line (the recipes' main(args)): sys.argv is not looked at
        args = resolve_config_args(sys.argv[1:] if args is None else list(args))
        for i, arg in enumerate(args):
            value = args[i + 1] if arg == "--config" and i + 1 < len(args) else arg.partition("=")[2]
            if (arg == "--config" or arg.startswith("--config=")) and value and not Path(value).exists():
                refuse(f"--config {value!r} is neither a file nor a shipped config; shipped configs: "
                       f"{', '.join(shipped_configs())}")
        exit_on_error = parser.exit_on_error
        parser.exit_on_error = False
        try:
            self.config = parser.parse_args(args)
        except ArgumentError as err:
            refuse(parser_reason(str(err)) + _where_instead(parser, str(err)))
        finally:
            parser.exit_on_error = exit_on_error

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="resume from this checkpoint")
        parser.add_argument("--metrics_file", type=str, default="metrics.json", help="written into the run dir")
        for key, path in RECIPE_CALLBACKS.items():
            parser.add_class_arguments(_callback_class(path), f"callbacks.{key}", instantiate=False,
                                       fail_untyped=False, sub_configs=True)
            parser.add_argument(f"--callbacks.{key}.enabled", type=bool, default=True,
                                help=f"attach {path.rsplit('.', 1)[1]} (false: leave it out)")
        parser.set_defaults({f"callbacks.{key}.{name}": value for key, values in RECIPE_CALLBACK_DEFAULTS.items()
                             for name, value in values.items()})

    def recipe_callbacks(self, trainer_config: Any) -> list[Callback]:
        """The suite's enabled callbacks, less those whose class ``trainer_config.callbacks`` already holds."""
        settings = self._get(self.config_init, "callbacks")
        present = trainer_config.get("callbacks") or []
        present = present if isinstance(present, list) else [present]
        logger = trainer_config.get("logger")
        out = []
        for key, path in RECIPE_CALLBACKS.items():
            kwargs = settings[key].as_dict()
            cls = _callback_class(path)
            if not kwargs.pop("enabled") or any(isinstance(c, cls) for c in present):
                continue
            if key == "async_checkpoint" and trainer_config.get("enable_checkpointing") is False:
                continue
            if key == "lr_monitor" and (logger is False or logger == []):
                continue
            out.append(cls(**kwargs))
        return out

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        trainer_config = self._get(self.config_init, "trainer")
        callbacks = trainer_config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        trainer_config["callbacks"] = [*callbacks, *self.recipe_callbacks(trainer_config)]
        return super().instantiate_trainer(**kwargs)

    def before_instantiate_classes(self) -> None:
        cfg = self.config
        data = cfg.get("data")
        model_cfg = cfg.get("model", {}).get("model_config") if cfg.get("model") is not None else None
        if data is not None and "vocab_size" in data and data.get("vocab_size") is None and model_cfg is not None:
            # refuse shards made with another tokenizer before training, not with an index error mid-run
            data.vocab_size = model_cfg.get("vocab_size")
        callbacks = cfg.trainer.get("callbacks")
        has_bar = isinstance(callbacks, list) and any(
            str(getattr(c, "class_path", "")).endswith("ProgressBar") for c in callbacks
        )
        if cfg.trainer.get("enable_progress_bar") is False and has_bar:
            # `--trainer.enable_progress_bar=false` must win over a config's progress bar (Lightning
            # would refuse the combination)
            cfg.trainer.callbacks = [
                c for c in callbacks if not str(getattr(c, "class_path", "")).endswith("ProgressBar")
            ]
        elif cfg.trainer.get("enable_progress_bar") is not False and not has_bar:
            # Lightning's default bar reads prog_bar=True metrics after every batch (a sync each); our
            # modules log without prog_bar and this bar shows train/loss when it redraws
            from jsonargparse import Namespace

            bar = Namespace(class_path="lightning_opt.callbacks.LazyProgressBar",
                            init_args=Namespace(refresh_rate=10, keys=["train/loss"], process_position=0, leave=False))
            cfg.trainer.callbacks = [*(callbacks or []), bar]
        if cfg.trainer.get("precision") is None:
            on_gpu = torch.cuda.is_available() and cfg.trainer.get("accelerator") in (None, "auto", "gpu", "cuda")
            cfg.trainer.precision = "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"


def check_checkpoint_file(path: str | os.PathLike) -> None:
    """Refuse a missing, truncated or damaged checkpoint before any work starts, naming the file.

    Damaged means: not a readable archive, or not matching its ``.sha256`` sidecar (when it has one)."""
    import zipfile

    p = Path(path)
    if not p.is_file():
        dangling = " (a link to a file that no longer exists)" if p.is_symlink() else ""
        raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist or is not a file{dangling}; check --ckpt_path")
    try:
        with zipfile.ZipFile(p):  # torch.save writes a zip archive; a cut file has no central directory
            pass
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(
            f"checkpoint {str(p)!r} is truncated or damaged ({err}); resume from an earlier checkpoint "
            "(AsyncCheckpoint keeps the last K) or start without --ckpt_path"
        ) from err
    refuse_damaged_checkpoint(p)


def _async_checkpoint(trainer: L.Trainer) -> Any:
    return next((cb for cb in trainer.callbacks if isinstance(cb, AsyncCheckpoint)), None)


def checkpoint_folders(trainer: L.Trainer) -> tuple[str | None, list[str]]:
    """The folder this run's ``AsyncCheckpoint`` writes into (None without one), and the folders
    ``--ckpt_path last`` looks in, in order: a configured ``dirpath``; else this run's own folder (a fixed
    logger version) and then the earlier ``version_*`` folders of the same logger name, newest first."""
    cb = _async_checkpoint(trainer)
    if cb is None:
        return None, []
    if cb.config.dirpath is not None:
        own = os.path.abspath(cb.config.dirpath)
        return own, [own]
    own = os.path.abspath(default_dirpath(trainer))
    if not trainer.loggers:
        return own, [own]
    version_dir = Path(own).parent
    earlier = []
    for d in version_dir.parent.glob("version_*"):
        number = d.name.removeprefix("version_")
        if d != version_dir and number.isdigit():
            earlier.append((int(number), str(d / "checkpoints")))
    return own, [own, *(path for _, path in sorted(earlier, reverse=True))]


def _global_step(path: str) -> int:
    """The global step a checkpoint resumes at: from its ``step=N`` name, else from the file (memory-mapped)."""
    step = checkpoint_step(path)
    if step is not None:
        return step
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step", 0))


@rank_zero_only
def _say(msg: str) -> None:
    print(msg, flush=True)


def resolve_resume(trainer: L.Trainer, ckpt_path: str | None) -> str | None:
    """The checkpoint a recipe run resumes from, verified, or None for a fresh start.

    ``last`` is the newest intact checkpoint of the first of :func:`checkpoint_folders` that holds one (a
    fresh start, said in one line, when none does). A file that fails its ``.sha256`` check is replaced by
    the newest intact checkpoint of its own folder, with a warning naming both. A run that would write into a
    folder holding checkpoints newer than its start (another run's) is refused before it overwrites them.
    """
    if ckpt_path in ("hpc", "best", "registry"):
        return ckpt_path  # Lightning's own lookups
    own, folders = checkpoint_folders(trainer)
    skipped: list[str] = []
    if ckpt_path == "last":
        if own is None:
            return ckpt_path  # no AsyncCheckpoint: Lightning's ModelCheckpoint resolves "last"
        for folder in folders:
            found, skipped = newest_intact_checkpoint(folder)
            if found is not None:
                if skipped:
                    rank_zero_warn(f"--ckpt_path last: {', '.join(skipped)} failed the checksum or archive check; "
                                   f"resuming from {found}, the newest intact checkpoint in {folder}")
                ckpt_path = found
                break
            if skipped:
                raise ValueError(
                    f"--ckpt_path last: every checkpoint in {folder} is damaged ({', '.join(skipped)}); resume "
                    "from a copy of the run kept elsewhere, or start without --ckpt_path"
                )
        else:
            where = ", ".join(f for f in folders if os.path.isdir(f)) or folders[0]
            _say(f"--ckpt_path last: no checkpoint in {where}; starting from scratch")
            ckpt_path = None
        if ckpt_path is not None:
            _say(f"--ckpt_path last: resuming from {ckpt_path}")
    elif ckpt_path is not None:
        if not Path(ckpt_path).is_file():
            check_checkpoint_file(ckpt_path)  # names the missing file
        ckpt_path = intact_checkpoint(ckpt_path)
        check_checkpoint_file(ckpt_path)
    if own is not None and (ckpt_path is None or Path(ckpt_path).is_file()):
        start = 0 if ckpt_path is None else _global_step(ckpt_path)
        newer = checkpoints_after(own, start, skip=set(skipped))
        if newer:
            raise ValueError(
                f"the checkpoint folder {own} already holds checkpoints of another run up to "
                f"{os.path.basename(newer[-1])}, and this run starts at step {start}: it would overwrite them. "
                "Resume that run with --ckpt_path last, or write into a new folder (another "
                "--callbacks.async_checkpoint.dirpath, or no fixed logger version)"
            )
    return ckpt_path


def build_recipe_cli(
    module_class: type, datamodule_class: type, args: list[str] | None, cli_class: type[RecipeCLI] = RecipeCLI
) -> tuple[RecipeCLI, RunSummary]:
    """The recipe's CLI, parsed and instantiated but not run, with a :class:`RunSummary` attached."""
    summary = RunSummary()
    cli = cli_class(
        module_class,
        datamodule_class,
        args=args,
        run=False,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"callbacks": [summary]},
    )
    return cli, summary


def print_logger_paths(trainer: L.Trainer) -> None:
    """One line per logger saying where its logs are (TensorBoard's with the command that shows them)."""
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if isinstance(logger, TensorBoardLogger):
            print(f"TensorBoard logs: {log_dir}  (tensorboard --logdir {Path(log_dir).parent})")
        elif log_dir:
            print(f"{type(logger).__name__} logs: {log_dir}")


def run_recipe(cli: RecipeCLI, summary: RunSummary, **extra: Any) -> dict[str, Any]:
    """Fit, validate once more if the last step was not validated (with validation data), write ``metrics.json``
    (the run summary and ``extra``) into the run directory and return it. A run stopped by SIGTERM writes the
    summary of what it trained (with ``stopped_by: "SIGTERM"``) before the stop propagates."""
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    block = getattr(getattr(model, "model_config", None), "block_size", None)
    seq_len = getattr(data, "seq_len", None)
    if block is not None and seq_len is not None and seq_len > block:
        raise ValueError(
            f"data.seq_len={seq_len} exceeds the model's context model.model_config.block_size={block}; "
            "lower data.seq_len or raise block_size"
        )
    if trainer.max_steps == 0 or trainer.max_epochs == 0:
        raise ValueError(
            f"trainer.max_steps={trainer.max_steps}, trainer.max_epochs={trainer.max_epochs}: the run would train "
            "nothing; give --trainer.max_steps a positive number of steps (or -1 to train for max_epochs)"
        )
    ckpt_path = resolve_resume(trainer, cli.config.get("ckpt_path"))
    name = cli.config.get("metrics_file", "metrics.json")
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, weights_only=True)  # never unpickle code
    except SIGTERMException:
        # pre-empted: the checkpoint of the last step is saved; the segment's summary is kept too (rank 0 writes)
        write_metrics(run_dir(trainer) / name, summary.summary(trainer, model, stopped_by="SIGTERM", **extra))
        raise
    has_val_data = is_overridden("val_dataloader", data if data is not None else model)
    if has_val_data and (not summary.val_history or summary.val_history[-1]["step"] != trainer.global_step):
        trainer.validate(model, datamodule=data, verbose=False, weights_only=True)
    metrics = summary.summary(trainer, model, **extra)
    path = run_dir(trainer) / name
    if trainer.is_global_zero:
        write_metrics(path, metrics)
        print(summary.final_line(metrics))
        print_logger_paths(trainer)
        print(f"metrics: {path}")
    return metrics
