"""Pre-emption of a 2-GPU GPT-2 speedrun started from the console script: SIGTERM to one rank.

Runs ``python -m lightning_opt.recipes.gpt2 --config gpt2/gpt2-124m-speedrun`` shrunk to a tiny model (4
layers, 128 wide, byte vocabulary, the built-in offline corpus, 1024-token sequences, 4 micro-batches per
optimizer step as shipped, compiled, FlexAttention) on 2 GPUs, with deterministic algorithms, and checks:

* (a) SIGTERM to rank 1 (the process Lightning's launcher started) while the first micro-batch compiles:
  rank 0 (the console script) exits with status 0 within ``COMPILE_EXIT_S`` and rank 1 is gone, without a
  checkpoint (there is no optimizer step to save);
* (b) SIGTERM to rank 1, and to rank 0 alone, mid-training: exit 0 within ``STEP_EXIT_S``, one ``step=N-exception.ckpt`` at an
  optimizer-step boundary, and a run resumed from ``last.ckpt`` ends with parameters and optimizer state
  bit-identical to an uninterrupted run with the same settings.

With ``LO_GPU_RESULT=<file>`` each case writes its result (device, command, timings, pass/fail) into that
JSON file. Needs 2 GPUs (skipped otherwise); several minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reliability.test_preemption import _boundary  # accumulation 4, as gpt2-124m-speedrun ships

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

MAX_STEPS = 200  # long enough that a SIGTERM sent after step MARK_STEP lands well before the end
MARK_STEP = 50  # the first periodic save: training is under way
COMPILE_EXIT_S = 180.0  # the rest of the micro-batch being compiled, then exit
STEP_EXIT_S = 60.0  # the rest of one optimizer step, the save, then exit
START_S = 600.0  # a run's start-up and compilation
OVERRIDES = [
    "--config", "gpt2/gpt2-124m-speedrun",
    "--train_tokens", "null", "--trainer.max_steps", str(MAX_STEPS),
    "--trainer.devices", "2", "--trainer.deterministic", "warn",
    "--trainer.val_check_interval", "100000", "--trainer.log_every_n_steps", "1",
    "--trainer.enable_progress_bar", "false",
    "--model.model_config.vocab_size", "256", "--model.model_config.eot_token", "0",
    "--model.model_config.n_layer", "4", "--model.model_config.n_head", "2", "--model.model_config.n_embd", "128",
    "--model.model_config.block_size", "1024", "--model.model_config.n_value_embeds", "1",
    "--model.model_config.skip_attn_layers", "[]", "--model.model_config.window_schedule", "[128, 512]",
    "--data.train_files", "builtin", "--data.val_files", "builtin",
    "--data.seq_len", "1024", "--data.batch_size", "1", "--data.val_tokens", "8192",
    "--callbacks.async_checkpoint.every_n_steps", str(MARK_STEP), "--callbacks.async_checkpoint.keep_last_k", "null",
]


def _record(case: str, **result: Any) -> None:
    out = os.environ.get("LO_GPU_RESULT")
    if not out:
        return
    path = Path(out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("device", torch.cuda.get_device_name(0))
    data.setdefault("gpus", torch.cuda.device_count())
    data.setdefault("torch", torch.__version__)
    data.setdefault("cases", {})[case] = result
    path.write_text(json.dumps(data, indent=2))


class _Run:
    """One recipe run (rank 0 is the console script; Lightning's launcher starts rank 1 as its child)."""

    def __init__(self, root: Path, name: str, cache: Path, *extra: str) -> None:
        self.ck = root / f"ck_{name.split('+')[0]}"  # a resumed run ("<name>+resumed") writes into its first run's
        self.cmd = [sys.executable, "-m", "lightning_opt.recipes.gpt2", *OVERRIDES,
                    "--callbacks.async_checkpoint.dirpath", str(self.ck), *extra]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        self.log = open(root / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def rank1(self) -> int | None:
        """Rank 1's pid: the child of rank 0 whose environment says LOCAL_RANK=1."""
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                status = (proc / "status").read_text()
                parent = int(status.split("PPid:")[1].split()[0])
                if parent == self.proc.pid and b"LOCAL_RANK=1\0" in (proc / "environ").read_bytes():
                    return int(proc.name)
            except (OSError, IndexError, ValueError):
                continue
        return None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Kill whatever is left of the run (rank 1 and compile workers share rank 0's process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")  # a zombie has exited


def _wait_for(predicate: Any, timeout: float, run: _Run) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if run.proc.poll() is not None:
            return predicate()
        time.sleep(0.01)
    return False


def _ckpts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("step=*.ckpt")) if folder.exists() else []


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of parameters / optimizer tensors that are not bit-identical."""
    out = [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"].get(k, torch.empty(0)))]

    def tensors(obj: Any, prefix: str) -> dict[str, torch.Tensor]:
        if torch.is_tensor(obj):
            return {prefix: obj}
        if isinstance(obj, dict):
            return {k2: v2 for k, v in obj.items() for k2, v2 in tensors(v, f"{prefix}.{k}").items()}
        if isinstance(obj, (list, tuple)):
            return {k2: v2 for i, v in enumerate(obj) for k2, v2 in tensors(v, f"{prefix}[{i}]").items()}
        return {}

    ta, tb = tensors(a["optimizer_states"], "opt"), tensors(b["optimizer_states"], "opt")
    out += [k for k in ta if k not in tb or not torch.equal(ta[k], tb[k])]
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inductor_cache")


def test_sigterm_to_rank1_during_compile_exits_without_a_checkpoint(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh_cache"  # nothing cached: the first micro-batch really compiles
    run = _Run(tmp_path, "compile", fresh)
    result: dict[str, Any] = {"command": " ".join(run.cmd), "bound_s": COMPILE_EXIT_S}
    try:
        compiling = _wait_for(lambda: fresh.exists() and any(p.is_file() for p in fresh.rglob("*")), START_S, run)
        time.sleep(2.0)  # inside the first micro-batch's compilation, which takes well over this
        rank1 = run.rank1()
        result["signal_after_start_s"] = round(time.monotonic() - run.t0, 1)
        assert compiling and rank1 is not None, f"never reached compilation (exit {run.proc.poll()})"
        os.kill(rank1, signal.SIGTERM)
        t0 = time.monotonic()
        code = run.wait(COMPILE_EXIT_S)
        result["exit_code"] = code
        result["exit_s"] = round(time.monotonic() - t0, 1)
        gone = _wait_for(lambda: not _alive(rank1), 10.0, run)
        result["rank1_gone"] = gone
        result["checkpoints"] = _ckpts(run.ck)
        result["passed"] = code == 0 and gone and not result["checkpoints"]
    finally:
        run.stop()
        _record("sigterm_rank1_during_compile", **result)
    assert result["passed"], result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gpu_reference")
    ref = _Run(root, "ref", cache)
    try:
        code = ref.wait(START_S)
    finally:
        ref.stop()
    assert code == 0, f"the uninterrupted run failed; see {ref.log.name}"
    return {"final": _load(ref.ck / f"step={MAX_STEPS:09d}.ckpt"), "command": " ".join(ref.cmd),
            "seconds": round(time.monotonic() - ref.t0, 1)}


@pytest.mark.parametrize("rank", [1, 0])
def test_sigterm_to_one_rank_mid_training_resumes_exactly(tmp_path: Path, cache: Path, reference: dict[str, Any],
                                                          rank: int) -> None:
    """Rank 1 is the launcher's child (rank 0 does not see the signal); rank 0 is the console script."""
    result: dict[str, Any] = {"bound_s": STEP_EXIT_S, "reference_command": reference["command"],
                              "reference_s": reference["seconds"]}
    try:
        first = _Run(tmp_path, "cut", cache)
        result["command"] = " ".join(first.cmd)
        try:
            marked = _wait_for(lambda: (first.ck / f"step={MARK_STEP:09d}.ckpt").exists(), START_S, first)
            assert marked, f"no step {MARK_STEP} (exit {first.proc.poll()})"
            pid = first.rank1() if rank == 1 else first.proc.pid
            assert pid is not None, "rank 1 not found"
            other = first.rank1()
            os.kill(pid, signal.SIGTERM)
            t0 = time.monotonic()
            code = first.wait(STEP_EXIT_S)
            result["exit_code"], result["exit_s"] = code, round(time.monotonic() - t0, 1)
            result["rank1_gone"] = _wait_for(lambda: not _alive(other), 10.0, first)
        finally:
            first.stop()
        result["checkpoints"] = files = _ckpts(first.ck)
        assert code == 0 and result["rank1_gone"], result
        # The stop's checkpoint is step=N-exception.ckpt, unless the run stopped at a periodic save's step
        # (every MARK_STEP steps), which then is that checkpoint.
        stop = os.readlink(first.ck / "last.ckpt")
        assert stop == files[-1] and (stop.endswith("-exception.ckpt") or stop != f"step={MARK_STEP:09d}.ckpt"), result
        cut = _load(first.ck / stop)
        result["stopped_at_step"] = cut["global_step"]
        assert cut["global_step"] < MAX_STEPS, result
        assert _boundary(cut), f"{stop} is not at an optimizer-step boundary"

        resumed = _Run(tmp_path, "cut+resumed", cache, "--ckpt_path", str(first.ck / "last.ckpt"))
        result["resume_command"] = " ".join(resumed.cmd)
        try:
            code = resumed.wait(START_S)
        finally:
            resumed.stop()
        assert code == 0, f"the resumed run failed; see {resumed.log.name}"
        diffs = _diff(reference["final"], _load(first.ck / f"step={MAX_STEPS:09d}.ckpt"))
        result["differs"] = diffs[:20]
        result["passed"] = not diffs
    finally:
        result.setdefault("passed", False)
        _record(f"sigterm_rank{rank}_mid_training", **result)
    assert result["passed"], result
