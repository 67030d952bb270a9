"""Pre-emption and exceptions with gradient accumulation: checkpoints only at optimizer-step boundaries.

Every run trains TinyLM (dropout on, a shuffled token shard of 8 micro-batches per epoch, so RNG and data
position matter) with ``accumulate_grad_batches=4`` and AsyncCheckpoint, in child processes that receive
real SIGTERMs. The child pauses inside a chosen micro-batch (``training_step``), the test signals it and
lets it go on; the run must finish that optimizer step, save at the boundary, exit 0, and a run resumed
from ``last.ckpt`` must log the same per-micro-batch losses and end with the same parameters, optimizer
state and scheduler, bit for bit, as a run that was never interrupted.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.reliability._harness import (
    BATCH,
    SEQ_LEN,
    TinyLM,
    context,
    free_port,
    join_or_kill,
    kill9,
    loads,
    make_shard,
    start,
    state,
    state_diff,
    step_files,
    trainer,
    wait_for,
)

ACCUMULATE = 4
BATCHES_PER_EPOCH = 8  # two windows per epoch
MAX_STEPS = 5  # 20 micro-batches: the third epoch is cut after its first window
TIMEOUT = 60.0
EXIT_BOUND_S = 20.0  # SIGTERM to exit 0: the rest of one optimizer step (milliseconds here) and the save


class _Probe(TinyLM):
    """TinyLM that logs each micro-batch's loss by its index over the whole fit, and can pause inside a
    chosen micro-batch (until the test says go) or fail after one's forward pass."""

    def __init__(self, log: str, root: str, pause_at: int | None = None, pause_rank: int = 0,
                 raise_at: int | None = None, step_sleep: float = 0.0) -> None:
        super().__init__(step_sleep=step_sleep)
        self.loss_file, self.root = log, root
        self.pause_at, self.pause_rank, self.raise_at = pause_at, pause_rank, raise_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx = self.trainer.fit_loop.total_batch_idx  # restored on resume: the micro-batch's place in the run
        loss = super().training_step(batch, batch_idx)
        if idx == self.raise_at:
            raise RuntimeError(f"injected failure in micro-batch {idx}")
        with open(f"{self.loss_file}.rank{self.global_rank}", "a") as f:
            f.write(f"{idx} {float(loss.detach()).hex()}\n")
        if idx == self.pause_at and self.global_rank == self.pause_rank:
            Path(self.root, "PAUSED").touch()
            go = Path(self.root, "GO")
            deadline = time.monotonic() + TIMEOUT
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        return loss


def _run(spec: dict[str, Any]) -> None:
    """Child entry: one fit (optionally resumed); rank 0 saves the final state to ``spec["out"]``."""
    from lightning_opt.callbacks import AsyncCheckpoint
    from lightning_opt.data import TokenShardDataModule

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    dm = TokenShardDataModule(spec["shard"], None, seq_len=SEQ_LEN, batch_size=BATCH, shuffle=True, seed=3)
    model = _Probe(spec["log"], spec["root"], spec.get("pause_at"), spec.get("pause_rank", 0),
                   spec.get("raise_at"), spec.get("step_sleep", 0.0))
    ckpt = AsyncCheckpoint(dirpath=spec["ckdir"], every_n_steps=spec.get("every_n_steps"),
                           every_minutes=spec.get("every_minutes"), decide_every_n_steps=1, keep_last_k=None)
    ddp = {"strategy": "ddp", "devices": 2} if spec.get("ddp") else {}
    t = trainer(spec["root"], [ckpt], max_steps=spec.get("max_steps", MAX_STEPS), max_epochs=-1,
                accumulate_grad_batches=ACCUMULATE, **ddp)
    t.fit(model, datamodule=dm, ckpt_path=spec.get("ckpt_path"))
    if spec.get("out") and t.is_global_zero:
        torch.save(state(model, t), spec["out"])


def _ddp_rank(rank: int, port: int, spec: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE="2", NODE_RANK="0")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    _run({**spec, "ddp": True})


def _start(spec: dict[str, Any]) -> list[Any]:
    if not spec.get("ddp"):
        return [start(_run, spec)]
    port = free_port()
    procs = [context().Process(target=_ddp_rank, args=(r, port, spec), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    return procs


def _losses(spec: dict[str, Any], rank: int = 0) -> dict[int, str]:
    path = Path(f"{spec['log']}.rank{rank}")
    if not path.exists():
        return {}
    return {int(i): h for i, h in (line.split() for line in path.read_text().splitlines())}


def _spec(root: Path, shard: Path, name: str, **kw: Any) -> dict[str, Any]:
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    return {"shard": str(shard), "root": str(run), "ckdir": str(root / "ck"), "log": str(run / "losses"),
            "out": str(run / "final.pt"), **kw}


def _finish(procs: list[Any], timeout: float = TIMEOUT) -> list[int | None]:
    try:
        for p in procs:
            assert join_or_kill(p, timeout), "a child hung"
    finally:
        for p in procs:
            kill9(p)
    return [p.exitcode for p in procs]


def _reference(root: Path, ddp: bool) -> dict[str, Any]:
    shard = make_shard(root / "train.bin", BATCHES_PER_EPOCH * BATCH * SEQ_LEN + 1)
    spec = _spec(root, shard, "ref", ddp=ddp)
    assert _finish(_start(spec)) == [0] * (2 if ddp else 1), "the uninterrupted run failed"
    ranks = (0, 1) if ddp else (0,)
    losses = {r: _losses(spec, r) for r in ranks}
    assert all(sorted(v) == list(range(MAX_STEPS * ACCUMULATE)) for v in losses.values())
    return {"shard": shard, "ddp": ddp, "losses": losses, "state": torch.load(spec["out"], weights_only=False)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _reference(tmp_path_factory.mktemp("preempt_ref"), ddp=False)


@pytest.fixture(scope="module")
def reference_ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _reference(tmp_path_factory.mktemp("preempt_ref_ddp"), ddp=True)


def _boundary(ckpt: dict[str, Any]) -> bool:
    """The checkpoint was taken at the micro-batch whose optimizer step it holds (a window's end)."""
    ready = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"]
    return ready == ckpt["global_step"] * ACCUMULATE


def _resume_matches(root: Path, ref: dict[str, Any]) -> list[str]:
    """Resume from ``last.ckpt``; what differs from the uninterrupted run (empty: bit for bit the same)."""
    last = root / "ck" / "last.ckpt"
    ckpt = loads(last)
    if ckpt is None:
        return ["last.ckpt does not load"]
    if not _boundary(ckpt):
        return [f"last.ckpt is not at an optimizer-step boundary: {ckpt['loops']['fit_loop']}"]
    spec = _spec(root, ref["shard"], "resumed", ckpt_path=str(last), ddp=ref["ddp"])
    codes = _finish(_start(spec))
    if set(codes) != {0}:
        return [f"the resumed run exited with {codes}"]
    problems = []
    first = ckpt["global_step"] * ACCUMULATE
    for rank, want in ref["losses"].items():
        got = _losses(spec, rank)
        if sorted(got) != list(range(first, MAX_STEPS * ACCUMULATE)):
            problems.append(f"rank {rank} resumed at micro-batch {min(got, default=None)}, want {first}")
        elif any(got[i] != want[i] for i in got):
            problems.append(f"rank {rank}: losses differ at micro-batches {[i for i in got if got[i] != want[i]]}")
    return problems + state_diff(torch.load(spec["out"], weights_only=False), ref["state"])


def _sigterm_trial(root: Path, ref: dict[str, Any], pause_at: int, pause_rank: int = 0) -> None:
    """SIGTERM to one process while it is inside micro-batch ``pause_at``; check exit, checkpoint, resume."""
    spec = _spec(root, ref["shard"], "first", pause_at=pause_at, pause_rank=pause_rank, ddp=ref["ddp"], out=None)
    procs = _start(spec)
    target = procs[pause_rank]
    try:
        assert wait_for(Path(spec["root"], "PAUSED").exists, TIMEOUT, target), "the child never paused"
        os.kill(target.pid, signal.SIGTERM)
        t0 = time.monotonic()
        Path(spec["root"], "GO").touch()
        exited = [join_or_kill(p, EXIT_BOUND_S) for p in procs]
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            kill9(p)
    assert all(exited), f"still running {EXIT_BOUND_S} s after SIGTERM"
    assert [p.exitcode for p in procs] == [0] * len(procs), f"exit codes {[p.exitcode for p in procs]}"
    step = pause_at // ACCUMULATE + 1  # the optimizer step the signal landed in is finished, then saved
    files = step_files(root / "ck")
    assert [(s, p.name) for s, p in files] == [(step, f"step={step:09d}-exception.ckpt")], files
    assert os.readlink(root / "ck" / "last.ckpt") == files[0][1].name
    for rank in ref["losses"]:
        ran = sorted(_losses(spec, rank))
        assert ran == list(range(step * ACCUMULATE)), f"rank {rank} ran micro-batches {ran} ({waited:.1f} s)"
    problems = _resume_matches(root, ref)
    assert not problems, problems


@pytest.mark.parametrize("position", range(ACCUMULATE))
def test_sigterm_at_each_micro_batch_of_a_window(fault, tmp_path, reference, position):
    fault("SIGTERM mid-window", f"SIGTERM in micro-batch {position} of 4 of a window: boundary save, exact resume")
    _sigterm_trial(tmp_path, reference, pause_at=ACCUMULATE + position)
    fault.trial(True)


def test_sigterm_before_the_first_step_exits_without_a_checkpoint(fault, tmp_path, reference):
    fault("SIGTERM before the first step", "SIGTERM inside the first micro-batch: exit 0 at once, nothing saved")
    spec = _spec(tmp_path, reference["shard"], "first", pause_at=0, out=None)
    (proc,) = _start(spec)
    try:
        assert wait_for(Path(spec["root"], "PAUSED").exists, TIMEOUT, proc), "the child never paused"
        os.kill(proc.pid, signal.SIGTERM)  # the child waits for GO, which never comes: it must stop by itself
        assert join_or_kill(proc, 10.0), "still running 10 s after SIGTERM"
    finally:
        kill9(proc)
    assert proc.exitcode == 0
    assert step_files(tmp_path / "ck") == [] and not os.path.lexists(tmp_path / "ck" / "last.ckpt")
    assert sorted(_losses(spec)) == [0]
    fault.trial(True)


def test_exception_in_training_step_resume_from_last_is_exact(fault, tmp_path, reference):
    """A failure mid-window: ``last.ckpt`` stays at the newest boundary save; the state at the failure goes
    to ``failed-step=N.ckpt`` only; resuming from ``last.ckpt`` equals the uninterrupted run."""
    fault("exception in training_step", "RuntimeError in micro-batch 2 of a window: resume from last is exact")
    raise_at = 3 * ACCUMULATE + 2  # in the 4th optimizer step; saves every 2 steps
    spec = _spec(tmp_path, reference["shard"], "first", raise_at=raise_at, every_n_steps=2, out=None)
    assert _finish(_start(spec)) == [1]
    files = step_files(tmp_path / "ck")
    assert [s for s, _ in files] == [2], files
    assert os.readlink(tmp_path / "ck" / "last.ckpt") == "step=000000002.ckpt"
    failed = loads(tmp_path / "ck" / "failed-step=000000003.ckpt")
    assert failed is not None and not _boundary(failed)  # the inexact state, kept for inspection only
    problems = _resume_matches(tmp_path, reference)
    fault.trial(not problems, data_lost=bool(problems), note="; ".join(problems))
    assert not problems, problems


def test_every_minutes_saves_only_at_step_boundaries(fault, tmp_path, reference):
    """Each micro-batch takes 50 ms and a save is due 0.3 s after the previous one: the time runs out
    inside windows, and the save still waits for the window's optimizer step."""
    fault("every_minutes with accumulation", "time-based saves with 4 micro-batches a step land on boundaries")
    spec = _spec(tmp_path, reference["shard"], "first", every_minutes=0.3 / 60, step_sleep=0.05, out=None)
    assert _finish(_start(spec)) == [0]
    saved = [(s, loads(p)) for s, p in step_files(tmp_path / "ck")]
    assert len(saved) >= 2, [s for s, _ in saved]
    off = [s for s, c in saved if c is None or not _boundary(c)]
    fault.trial(not off, data_lost=bool(off), note=f"saves off a boundary at steps {off}")
    assert not off


@pytest.mark.parametrize("rank", [1, 0])
def test_ddp_sigterm_to_one_rank(fault, tmp_path, reference_ddp, rank):
    """SIGTERM to one rank of two (gloo) mid-window: both finish the step, one checkpoint, both exit 0."""
    fault("SIGTERM to one DDP rank", f"SIGTERM to rank {rank} of 2 in micro-batch 1 of a window: exact resume")
    _sigterm_trial(tmp_path, reference_ddp, pause_at=ACCUMULATE + 1, pause_rank=rank)
    fault.trial(True)


def test_ddp_sigterm_before_the_first_step(fault, tmp_path, reference_ddp):
    """SIGTERM to rank 1 inside the first window (no optimizer step yet): both ranks stop at the next
    micro-batch, exit 0, and nothing is saved."""
    fault("SIGTERM to one DDP rank before the first step", "exit 0 at the next micro-batch, nothing saved")
    spec = _spec(tmp_path, reference_ddp["shard"], "first", pause_at=1, pause_rank=1, ddp=True, out=None)
    procs = _start(spec)
    try:
        assert wait_for(Path(spec["root"], "PAUSED").exists, TIMEOUT, procs[1]), "rank 1 never paused"
        os.kill(procs[1].pid, signal.SIGTERM)
        Path(spec["root"], "GO").touch()
        exited = [join_or_kill(p, EXIT_BOUND_S) for p in procs]
    finally:
        for p in procs:
            kill9(p)
    assert all(exited) and [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]
    assert step_files(tmp_path / "ck") == []
    assert [sorted(_losses(spec, r)) for r in (0, 1)] == [[0, 1], [0, 1]]
    fault.trial(True)
