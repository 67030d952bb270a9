"""Several machines through Lightning's standard launch: two "nodes" on localhost with ``torchrun``.

Each case trains a recipe (CPU, gloo) three times, every run launched by ``torchrun`` exactly as on a cluster:

* reference: one node with two processes (``--nnodes=1 --nproc-per-node=2``), steps 0 -> 4, checkpoints at 2
  and 4;
* two nodes with one process each (two ``torchrun --nnodes=2 --nproc-per-node=1 --node-rank=<0|1>``
  processes, ``--trainer.num_nodes 2 --trainer.devices 1``), steps 0 -> 2;
* the same two nodes resumed with ``--ckpt_path`` from that checkpoint, steps 2 -> 4.

Checked: the two-node step-2 checkpoint equals the reference's step-2 checkpoint (weights and optimizer
state), the resumed run starts at step 2 and stops at step 4, and its step-4 checkpoint equals the
uninterrupted reference's, for the CLT recipe with ``GlobalBatchTopKStrategy`` and with
``DecoderShardingStrategy`` (consolidated checkpoints) and for the GPT-2 recipe with DDP.

The CLT's online activation stream has no saved position (a resume restarts the epoch's stream), so the CLT
cases train epochs of exactly two steps (``--data.train_tokens``) and resume at an epoch boundary; the GPT-2
data module restores its position and resumes mid-epoch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_opt.recipes import CONFIGS
from tests.strategies._clt_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TIMEOUT = 180

# A constant learning rate after one warm-up step: the schedule does not depend on max_steps, so a run that stops
# at step 2 (max_steps 2) and resumes to 4 follows the same schedule as one that runs to 4.
_COMMON = ["--model.schedule.name", "constant", "--model.schedule.warmup_steps", "1",
           "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
           "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
           "--trainer.num_sanity_val_steps", "0"]

_CLT = ["--config", str(CONFIGS / "clt_demo.yaml"),
        "--data.seq_len", "32", "--data.tokens_per_batch", "64", "--data.stats_tokens", "512",
        "--data.val_tokens", "128",  # one validation batch per data rank (GlobalBatchTopKStrategy: two)
        "--model.clt.n_layers", "2", "--model.clt.d_model", "32", "--model.clt.n_features", "64",
        "--model.clt.k", "8", "--model.aux_k", "8",
        "--model.sparsity_coef", "0",  # its ramp spans max_steps (the first segment stops early instead)
        "--trainer.val_check_interval", "null", "--trainer.check_val_every_n_epoch", "1",
        "--trainer.limit_val_batches", "1"]

_GPT2 = ["--config", str(CONFIGS / "gpt2/demo.yaml"),
         "--model.model_config.n_layer", "2", "--model.model_config.n_embd", "32",
         "--model.model_config.n_head", "2", "--model.model_config.block_size", "32",
         "--data.seq_len", "32", "--data.batch_size", "2", "--data.val_tokens", "256",
         "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1"]

CASES: dict[str, tuple[str, list[str]]] = {
    # epochs of two steps (--data.train_tokens: two data ranks, then one), so the resume is at an epoch boundary
    "clt_global_batchtopk": ("clt", [*_CLT, "--data.train_tokens", "256", "--trainer.strategy.class_path",
                                     "lightning_opt.strategies.GlobalBatchTopKStrategy"]),
    "clt_decoder_sharding": ("clt", [*_CLT, "--data.train_tokens", "128", "--trainer.strategy.class_path",
                                     "lightning_opt.strategies.DecoderShardingStrategy",
                                     "--trainer.strategy.init_args.shard_encoder", "true"]),
    "gpt2_ddp": ("gpt2", [*_GPT2, "--trainer.strategy", "ddp"]),
}


@pytest.fixture(scope="module")
def target_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny byte-level GPT as the CLT's target (the demo target would be trained first)."""
    from lightning_opt.models.gpt2 import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64)
    path = tmp_path_factory.mktemp("multinode_target") / "target.pt"
    torch.save({"config": cfg.to_dict(), "model": GPT(cfg).state_dict()}, path)
    return str(path)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "LOCAL_", "WORLD_",
                                                                       "NODE_RANK", "GROUP_RANK", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


def _args(recipe_args: list[str], run: Path, max_steps: int, nodes: int, devices: int) -> list[str]:
    return [*recipe_args, *_COMMON,
            "--trainer.num_nodes", str(nodes), "--trainer.devices", str(devices),
            "--trainer.max_steps", str(max_steps),
            "--trainer.logger.init_args.save_dir", str(run / "runs"),
            "--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(run / "ckpt"), "--trainer.callbacks.every_n_train_steps", "2",
            "--trainer.callbacks.save_top_k", "-1", "--trainer.callbacks.filename", "{step}"]


def _start(recipe: str, args: list[str], run: Path, nodes: int) -> tuple[list[subprocess.Popen], list[Any]]:
    """``torchrun`` on each of ``nodes`` "nodes" (one process each), or one node with two processes."""
    run.mkdir(parents=True, exist_ok=True)
    script = ["-m", f"lightning_opt.recipes.{recipe}"]
    port = str(free_port())
    if nodes == 1:
        cmds = [[TORCHRUN, "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                 f"--master-port={port}", *script, *args]]
    else:
        cmds = [[TORCHRUN, f"--nnodes={nodes}", "--nproc-per-node=1", f"--node-rank={r}",
                 "--master-addr=127.0.0.1", f"--master-port={port}", *script, *args] for r in range(nodes)]
    logs = [open(run / f"node{r}.log", "w") for r in range(len(cmds))]  # noqa: SIM115 - closed in _finish
    procs = [subprocess.Popen(c, cwd=run, env=_env(), stdout=log, stderr=subprocess.STDOUT)
             for c, log in zip(cmds, logs)]
    return procs, logs


def _finish(recipe: str, launched: tuple[list[subprocess.Popen], list[Any]], run: Path) -> None:
    """Wait for a :func:`_start`; fail with every node's log tail when one exits non-zero."""
    procs, logs = launched
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(codes):
        tails = "\n".join(f"--- node {r} (exit {c}) ---\n" + (run / f"node{r}.log").read_text()[-4000:]
                          for r, c in enumerate(codes))
        pytest.fail(f"{recipe} on {len(procs)} torchrun(s) failed:\n{tails}")


def _ckpt(run: Path, step: int) -> dict[str, Any]:
    files = sorted((run / "ckpt").glob(f"step={step}*.ckpt"))
    assert len(files) == 1, f"expected one step-{step} checkpoint in {run / 'ckpt'}, found {files}"
    return torch.load(files[0], map_location="cpu", weights_only=False)


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict/list, by path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


def _assert_same_state(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["global_step"] == want["global_step"], what
    a = _tensors({"model": got["state_dict"], "optim": got["optimizer_states"]})
    b = _tensors({"model": want["state_dict"], "optim": want["optimizer_states"]})
    assert a.keys() == b.keys(), f"{what}: different entries {sorted(a.keys() ^ b.keys())}"
    assert any(k.startswith("/optim") for k in a), f"{what}: no optimizer state in the checkpoint"
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{what} {k}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_two_nodes_train_and_resume_like_one_node(case: str, tmp_path: Path, target_ckpt: str) -> None:
    recipe, recipe_args = CASES[case]
    if recipe == "clt":
        recipe_args = [*recipe_args, "--data.target", target_ckpt]

    one, two, resumed = tmp_path / "one_node", tmp_path / "two_nodes", tmp_path / "resumed"
    # the reference and the first two-node run are independent: they run side by side
    reference = _start(recipe, _args(recipe_args, one, 4, nodes=1, devices=2), one, 1)
    try:
        _finish(recipe, _start(recipe, _args(recipe_args, two, 2, nodes=2, devices=1), two, 2), two)
    finally:
        _finish(recipe, reference, one)
    first = _ckpt(two, 2)
    resume = [*_args(recipe_args, resumed, 4, nodes=2, devices=1),
              "--ckpt_path", str(sorted((two / "ckpt").glob("step=2*.ckpt"))[0])]
    _finish(recipe, _start(recipe, resume, resumed, 2), resumed)

    ref2, ref4 = _ckpt(one, 2), _ckpt(one, 4)
    assert first["global_step"] == 2 and ref4["global_step"] == 4
    _assert_same_state(first, ref2, f"{case}: 2 nodes x 1 process vs 1 node x 2 processes at step 2")
    # the resumed run writes only its own steps: it started at step 2
    assert not list((resumed / "ckpt").glob("step=2*.ckpt"))
    _assert_same_state(_ckpt(resumed, 4), ref4,
                       f"{case}: 2 nodes resumed at step 2 vs 1 node uninterrupted at step 4")
    # training moved the weights: the comparison is not between two copies of the initial state
    moved = [not torch.equal(ref2["state_dict"][k], ref4["state_dict"][k]) for k in ref4["state_dict"]
             if ref4["state_dict"][k].is_floating_point()]
    assert any(moved)
