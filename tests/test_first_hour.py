"""A newcomer's first hour with the console scripts: mistakes are one ``error:`` line, runs are quiet.

The error cases call each script's ``cli()`` (what the console script runs) with ``sys.argv`` set, in this
process; the quiet-run test starts the real console scripts in child processes on the demo configs, shrunk
to a few steps, and records every warning they show with the code that raised it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lightning_opt._errors import TRACEBACK_ENV, console_status
from lightning_opt.data import write_shard

GPT2_TINY = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
             "--trainer.enable_model_summary", "false", "--model.model_config.n_layer", "1",
             "--model.model_config.n_embd", "32", "--model.model_config.n_head", "2", "--data.batch_size", "2",
             "--data.seq_len", "32", "--model.model_config.block_size", "32"]


def _cli(monkeypatch, capsys, script: str, *argv: str) -> tuple[int, str]:
    """Run ``lightning_opt.<script>``'s console entry with ``argv``; (exit status, stderr)."""
    import importlib

    module = importlib.import_module(script)
    entry = getattr(module, "cli", None) or (lambda: sys.exit(module.main()))
    monkeypatch.setattr(sys, "argv", [script, *argv])
    # Lightning's log handlers keep the stderr of the time they were made (an earlier test's capture)
    for logger in [logging.root, *logging.root.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
                monkeypatch.setattr(handler, "stream", sys.stderr)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        entry()
        raise SystemExit(0)
    return info.value.code, capsys.readouterr().err


def _one_error_line(status: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert status == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def _printed_config(capsys, script: str, *argv: str) -> str:
    """What ``lightning-opt-<script> ARGV --print_config`` prints."""
    import importlib

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        importlib.import_module(f"lightning_opt.recipes.{script}").main([*argv, "--print_config"])
    assert info.value.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


def test_short_config_flag_takes_shipped_configs(tmp_path, monkeypatch, capsys):
    """``-c NAME`` is ``--config NAME``: the same shipped config, and a wrong name gets the same list."""
    monkeypatch.chdir(tmp_path)
    for script, name in (("gpt2", "gpt2/demo"), ("clt", "clt_demo"), ("spd", "spd_tms_5-2")):
        long_form = _printed_config(capsys, script, "--config", name)
        assert "model:" in long_form and "trainer:" in long_form, long_form
        for form in (["-c", name], [f"-c={name}"], [f"-c{name}"]):
            assert _printed_config(capsys, script, *form) == long_form, form
    gpt2 = "lightning_opt.recipes.gpt2"
    line = _one_error_line(*_cli(monkeypatch, capsys, gpt2, "-c", "gpt2/demoo"))
    assert line == _one_error_line(*_cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demoo"))
    assert "'gpt2/demoo' is neither a file nor a shipped config" in line and "gpt2/demo," in line

def test_recipe_mistakes_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    gpt2 = "lightning_opt.recipes.gpt2"
    line = _one_error_line(*_cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demoo"))
    assert "'gpt2/demoo' is neither a file nor a shipped config" in line and "gpt2/demo," in line
    assert "spd_tms_5-2" in line

    # an abbreviated flag is refused, not expanded to --trainer.max_steps
    line = _one_error_line(*_cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demo", "--trainer.max_step", "3"))
    assert "--trainer.max_step" in line and "see --help" in line

    line = _one_error_line(*_cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demo", "--model.model_config.n_layer",
                                 "four"))
    assert line == "error: model.model_config.n_layer: Expected a <class 'int'>. Got value: four (see --help)"

    line = _one_error_line(*_cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demo", "--model.optim.lr", "-1"))
    assert line == "error: optimizer lr=-1.0 must be positive"

    line = _one_error_line(*_cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demo",
                                 "--data.train_files", "nothing/*.bin"))
    assert "'nothing/*.bin' matches no files" in line

    # shards: one cut short, one of another tokenizer's ids (the demo's vocabulary is 256 bytes)
    write_shard(tmp_path / "wide_train_000000.bin", np.full(4096, 300, dtype=np.uint16))
    line = _one_error_line(*_cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demo",
                                 "--data.train_files", "wide_train_*.bin", "--data.val_files", "wide_train_*.bin"))
    assert "token id 300" in line and "vocab_size 256" in line
    cut = tmp_path / "cut_train_000000.bin"
    cut.write_bytes((tmp_path / "wide_train_000000.bin").read_bytes()[:2000])
    line = _one_error_line(*_cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demo", "--data.train_files", str(cut)))
    assert "cut_train_000000.bin" in line

    line = _one_error_line(*_cli(monkeypatch, capsys, "lightning_opt.recipes.spd", "--config", "spd_tms_5-2",
                                 "--model.optim.lr", "-1"))
    assert "lr" in line and "must be positive" in line
    line = _one_error_line(*_cli(monkeypatch, capsys, "lightning_opt.recipes.clt", "--config", "clt_demo",
                                 "--model.optim.lr", "-1"))
    assert "lr=-1.0 must be positive" in line

    line = _one_error_line(*_cli(monkeypatch, capsys, "lightning_opt.recipes.sample", "--ckpt_path", "nope.ckpt"))
    assert "'nope.ckpt' does not exist" in line
    line = _one_error_line(*_cli(monkeypatch, capsys, "lightning_opt.recipes.sample", "--ckpt_path", "x",
                                 "--max_new", "5"))
    assert "--max_new" in line

    # LIGHTNING_OPT_TRACEBACK=1: the traceback too, then the same line
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    status, err = _cli(monkeypatch, capsys, gpt2, "--config", "gpt2/demo", "--model.optim.lr", "-1")
    assert status == 2 and "Traceback" in err and err.rstrip().endswith("error: optimizer lr=-1.0 must be positive")


def test_unwritable_checkpoint_folder_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocked = tmp_path / "file"
    blocked.write_text("a file where the checkpoint folder would go")
    line = _one_error_line(*_cli(monkeypatch, capsys, "lightning_opt.recipes.gpt2", "--config", "gpt2/demo",
                                 *GPT2_TINY, "--callbacks.async_checkpoint.dirpath", str(blocked / "ckpt")))
    assert str(blocked) in line and "check the path" in line


def test_data_cli_mistakes_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = "lightning_opt.data.cli"
    line = _one_error_line(*_cli(monkeypatch, capsys, data, "prepare", "--input", "texts/*.txt", "--out-dir", "out"))
    assert "'texts/*.txt' matches no files" in line
    line = _one_error_line(*_cli(monkeypatch, capsys, data, "prepare", "--inp", "a.txt", "--out-dir", "out"))
    assert "--inp" in line  # not taken for --input


def test_bugs_keep_their_traceback():
    def bug():
        return [][1]

    with pytest.raises(IndexError):
        console_status(bug)

    def torch_value_error():  # a ValueError raised inside torch, not by our checks: a bug, not a mistake
        import torch

        torch.nn.functional.cross_entropy(torch.zeros(2, 3), torch.zeros(5, dtype=torch.long))

    with pytest.raises(ValueError):
        console_status(torch_value_error)


# -- quiet runs -------------------------------------------------------------------------------------

# sitecustomize for the children: every warning shown, with the file of the code that raised it (past
# warnings' and Lightning's rank_zero helpers), as JSON lines into $FIRST_HOUR_WARNINGS
_RECORDER = textwrap.dedent('''
    import json, os, sys, warnings
    _show = warnings.showwarning
    _HELPERS = ("warnings.py", "rank_zero.py", "sitecustomize.py", "/lightning_utilities/")

    def showwarning(message, category, filename, lineno, file=None, line=None):
        frame, origin = sys._getframe(1), filename
        while frame is not None:
            name = frame.f_code.co_filename
            if not any(h in name for h in _HELPERS):
                origin = name
                break
            frame = frame.f_back
        with open(os.environ["FIRST_HOUR_WARNINGS"], "a") as f:
            f.write(json.dumps({"message": str(message), "category": category.__name__, "origin": origin}) + "\\n")
        _show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
''')

RUNS = {
    "gpt2": ["--config", "gpt2/demo", *GPT2_TINY, "--data.val_tokens", "64",
             "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "runs",
             "--trainer.log_every_n_steps", "1"],
    "clt": ["--config", "clt_demo", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"],
    "spd": ["--config", "spd_tms_5-2", "--trainer.max_steps", "3", "--model.target.train_steps", "5",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"],
}
NOISE = ("args parameter is intended", "litlogger", "LeafSpec", "but have no `val_dataloader`",
         "module(s) in eval mode")


def test_demo_runs_are_quiet(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_RECORDER)
    scripts = Path(sys.executable).parent
    procs = {}
    for name, argv in RUNS.items():
        folder = tmp_path / name
        folder.mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               "FIRST_HOUR_WARNINGS": str(folder / "warnings.jsonl"), "PYTHONWARNINGS": "default"}
        script = scripts / f"lightning-opt-{name}"
        cmd = [str(script), *argv] if script.exists() else [sys.executable, "-m", f"lightning_opt.recipes.{name}", *argv]
        procs[name] = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        folder = tmp_path / name
        assert proc.returncode == 0, f"{name}:\n{out[-3000:]}"
        log = folder / "warnings.jsonl"
        shown = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
        ours = [w for w in shown if f"{os.sep}lightning_opt{os.sep}" in w["origin"]]
        assert not ours, f"{name}: warnings raised by lightning_opt: {ours}"
        noise = [w for w in shown if any(n in w["message"] for n in NOISE)]
        assert not noise, f"{name}: {noise}"
        assert not any(n in out for n in NOISE), f"{name}:\n{out[-3000:]}"
        assert not list(folder.rglob(".writing")), f"{name}: an empty staging folder was left behind"
        if name == "spd":
            assert "TensorBoard logs: runs/spd_tms_5-2/version_0" in out, out[-2000:]
    # the CSV logger, offline, through the recipe: a metrics.csv with the val loss
    csv = tmp_path / "gpt2" / "runs" / "gpt2-demo" / "version_0" / "metrics.csv"  # the config keeps its name
    header = csv.read_text().splitlines()[0].split(",")
    assert "val/loss" in header and "train/loss" in header, header
    shutil.rmtree(tmp_path / "site")
