"""kill -9 at random moments (including mid-write) and SIGTERM, with AsyncCheckpoint: nothing is lost.

Every trial trains TinyLM on a shuffled token shard (dropout on, so RNG state matters; 3 epochs, so
the data position and the reshuffle matter) in a child process, kills it, then checks that every
checkpoint under its final name loads, that ``last.ckpt`` points at a complete file, and that a run
resumed from the newest checkpoint logs the same losses, bit for bit, as an uninterrupted run and
ends with the same parameters and optimizer state.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reliability._harness import (
    BATCH,
    ORDERS,
    SEQ_LEN,
    ckpt_run,
    join_or_kill,
    kill9,
    loads,
    make_shard,
    read_losses,
    start,
    state_diff,
    step_files,
    wait_for,
)

MAX_STEPS = 30  # 3 epochs of 10 steps
CHILD_TIMEOUT = 60.0


def _reference(root: Path, **spec_kw: Any) -> dict[str, Any]:
    shard = make_shard(root / "train.bin", 10 * BATCH * SEQ_LEN + 1)
    spec = _spec(root, shard, "ref", **spec_kw)
    proc = start(ckpt_run, spec)
    assert join_or_kill(proc, CHILD_TIMEOUT) and proc.exitcode == 0, "the uninterrupted run failed"
    losses = read_losses(Path(spec["loss_log"]))
    assert sorted(losses) == list(range(MAX_STEPS))
    return {"shard": shard, "losses": losses, "state": torch.load(spec["out"], weights_only=False), **spec_kw}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _reference(tmp_path_factory.mktemp("reference"))


# NaN / Inf at fixed batch indices of every epoch, skipped by NaNSkip (also in the reference run)
NAN_FAULTS = {1: "nan_loss", 4: "inf_grad", 5: "nan_grad", 9: "inf_loss"}


@pytest.fixture(scope="module")
def reference_nan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ref = _reference(tmp_path_factory.mktemp("reference_nan"), faults=NAN_FAULTS)
    assert ref["state"]["skipped"] == len(NAN_FAULTS) * MAX_STEPS // 10  # every epoch's faulty steps
    return ref


def _spec(root: Path, shard: Path, name: str, **kw: Any) -> dict[str, Any]:
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    spec = {
        "shard": str(shard), "root": str(run), "ckdir": str(root / "ck"), "loss_log": str(run / "losses.txt"),
        "max_steps": MAX_STEPS, "every_n_steps": 3, "out": str(run / "final.pt"),
    }
    spec.update(kw)
    return spec


def _audit_and_resume(
    root: Path, reference: dict[str, Any], killed_after: int, **spec_kw: Any
) -> tuple[bool, bool, bool, str]:
    """After a kill: (survived, data lost, hang, note). ``spec_kw`` must repeat the model's settings."""
    ckdir = root / "ck"
    files = step_files(ckdir) if ckdir.exists() else []
    broken = [p.name for _, p in files if loads(p) is None]
    last = ckdir / "last.ckpt"
    last_ok = True
    if os.path.lexists(last):
        target = ckdir / os.readlink(last)
        # last may lag the newest file (killed between rename and relink) but must be complete
        last_ok = target.exists() and loads(target) is not None
    if broken or not last_ok:
        return False, True, False, f"broken checkpoints {broken}, last ok: {last_ok}"
    resume_from = files[-1][1] if files else None
    start_step = loads(resume_from)["global_step"] if resume_from else 0
    if start_step > killed_after + 1:
        return False, True, False, f"checkpoint at step {start_step} is newer than the run ({killed_after})"
    for key in ("faults", "all_callbacks"):
        if reference.get(key):
            spec_kw[key] = reference[key]
    spec = _spec(root, reference["shard"], "resumed", ckpt_path=str(resume_from) if resume_from else None, **spec_kw)
    proc = start(ckpt_run, spec)
    if not join_or_kill(proc, CHILD_TIMEOUT):
        return False, False, True, "resumed run hung"
    if proc.exitcode != 0:
        return False, False, False, f"resumed run exited with {proc.exitcode}"
    losses = read_losses(Path(spec["loss_log"]))
    want = {s: h for s, h in reference["losses"].items() if s >= start_step}
    if losses != want:
        bad = [s for s in want if losses.get(s) != want[s]][:3]
        return False, True, False, f"resumed from step {start_step}: losses differ at steps {bad}"
    final = torch.load(spec["out"], weights_only=False)
    diffs = state_diff(final, reference["state"])
    if final.get("skipped") != reference["state"].get("skipped"):
        diffs.append(f"skipped steps {final.get('skipped')} vs {reference['state'].get('skipped')}")
    if diffs:
        return False, True, False, f"resumed from step {start_step}: final state differs in {diffs[:3]}"
    return True, False, False, ""


def _kill_trial(
    tmp_path: Path, reference: dict[str, Any], rng: random.Random, i: int, ballast: int = 0
) -> tuple[bool, bool, bool, str]:
    root = tmp_path / f"t{i}"
    spec = _spec(root, reference["shard"], "first", out=None, step_sleep=0.005, ballast=ballast,
                 faults=reference.get("faults"), all_callbacks=reference.get("all_callbacks"))
    log = Path(spec["loss_log"])
    at = rng.randint(1, MAX_STEPS - 2)
    proc = start(ckpt_run, spec)
    if not wait_for(lambda: len(read_losses(log)) >= at, CHILD_TIMEOUT, proc):
        kill9(proc)
        return False, False, proc.exitcode is None, f"child never reached step {at}"
    time.sleep(rng.uniform(0, 0.02))  # somewhere inside the step, the save, or the write
    os.kill(proc.pid, signal.SIGKILL)
    in_write = any((root / "ck" / ".writing").glob("**/archive.tmp"))
    kill9(proc)
    ok, lost, hang, note = _audit_and_resume(root, reference, max(read_losses(log), default=0), ballast=ballast)
    return ok, lost, hang, note or ("killed inside a write" if in_write else "")


def _run_kills(fault, tmp_path, reference, trials: int, seed: int, ballast: int = 0) -> None:
    if reference.get("faults"):
        fault("kill -9 with NaN-skipped steps", "SIGKILL at a random time; NaNSkip skips 4 steps per epoch")
    else:
        what = f" (+{4 * ballast >> 20} MiB per checkpoint)" if ballast else ""
        fault("kill -9 at a random moment", f"SIGKILL at a random time during training with AsyncCheckpoint{what}")
    rng = random.Random(seed)
    notes, in_write = [], 0
    for i in range(trials):
        ok, lost, hang, note = _kill_trial(tmp_path, reference, rng, i, ballast)
        in_write += note == "killed inside a write"
        fault.trial(ok, data_lost=lost, hang=hang, note=note if not ok else "")
        if not ok:
            notes.append(note)
    fault.notes.append(f"{in_write} of {trials} kills landed inside a checkpoint write")
    assert not notes, notes


def test_kill9_at_random_moments(fault, tmp_path, reference):
    _run_kills(fault, tmp_path, reference, trials=3, seed=0)


@pytest.mark.slow
def test_kill9_at_random_moments_long(fault, tmp_path, reference):
    _run_kills(fault, tmp_path, reference, trials=24, seed=1)


@pytest.mark.slow
def test_kill9_at_random_moments_big_checkpoints_long(fault, tmp_path, reference):
    """8 MiB checkpoints: the write takes long enough that many random kills land inside it."""
    _run_kills(fault, tmp_path, reference, trials=12, seed=2, ballast=2 << 20)


def test_kill9_in_a_run_with_skipped_steps(fault, tmp_path, reference_nan):
    _run_kills(fault, tmp_path, reference_nan, trials=2, seed=3)


@pytest.mark.slow
def test_kill9_in_a_run_with_skipped_steps_long(fault, tmp_path, reference_nan):
    _run_kills(fault, tmp_path, reference_nan, trials=12, seed=4)


def _run_midwrite(fault, tmp_path, reference, trials: int, seed: int) -> None:
    fault("kill -9 mid-write", "SIGKILL while the checkpoint file is half written (random save, random fraction)")
    rng = random.Random(seed)
    notes = []
    for i in range(trials):
        root = tmp_path / f"t{i}"
        save, fraction = rng.randint(1, 5), rng.uniform(0.0, 0.99)
        spec = _spec(root, reference["shard"], "first", out=None, midwrite={"save": save, "fraction": fraction})
        proc = start(ckpt_run, spec)
        marker = Path(spec["root"], "MIDWRITE")
        reached = wait_for(marker.exists, CHILD_TIMEOUT, proc)
        kill9(proc)
        if not reached:
            fault.trial(False, note="never reached the write")
            notes.append(f"trial {i}: never reached save {save}")
            continue
        # saves land at steps 3, 6, ...: the newest final name must be the save before the torn one
        named = step_files(root / "ck")
        partial_named = (named[-1][0] if named else 0) != 3 * (save - 1)
        ok, lost, hang, note = _audit_and_resume(root, reference, max(read_losses(Path(spec["loss_log"]))))
        if partial_named:
            ok, lost, note = False, True, f"a half-written save got a final name: {[p.name for _, p in named]}"
        fault.trial(ok, data_lost=lost, hang=hang, note=note)
        if not ok:
            notes.append(f"trial {i} (save {save}, {fraction:.2f}): {note}")
    assert not notes, notes


def test_kill9_mid_write(fault, tmp_path, reference):
    _run_midwrite(fault, tmp_path, reference, trials=1, seed=0)


@pytest.mark.slow
def test_kill9_mid_write_long(fault, tmp_path, reference):
    _run_midwrite(fault, tmp_path, reference, trials=10, seed=1)


def test_kill9_between_rename_and_last_link(fault, tmp_path, reference):
    fault("kill -9 before the last link moves", "SIGKILL after a checkpoint's rename, before last.ckpt is repointed")
    spec = _spec(tmp_path, reference["shard"], "first", out=None, pause_before_link=True)
    proc = start(ckpt_run, spec)
    reached = wait_for(lambda: Path(spec["root"], "BEFORELINK").exists(), CHILD_TIMEOUT, proc)
    kill9(proc)
    assert reached, "the child never reached the link update"
    ok, lost, hang, note = _audit_and_resume(tmp_path, reference, max(read_losses(Path(spec["loss_log"]))))
    fault.trial(ok, data_lost=lost, hang=hang, note=note)
    assert ok, note


# -- SIGTERM (pre-emption) ---------------------------------------------------------------------------


def _sigterm_trial(root: Path, reference: dict[str, Any], at: int, grace: float) -> tuple[bool, bool, bool, str]:
    spec = _spec(root, reference["shard"], "first", out=None, step_sleep=0.02, every_n_steps=1000,
                 faults=reference.get("faults"), all_callbacks=reference.get("all_callbacks"))
    log = Path(spec["loss_log"])
    proc = start(ckpt_run, spec)
    if not wait_for(lambda: len(read_losses(log)) >= at, CHILD_TIMEOUT, proc):
        kill9(proc)
        return False, False, False, f"child never reached step {at}"
    os.kill(proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    if not join_or_kill(proc, grace):
        return False, False, True, f"still running {grace}s after SIGTERM"
    waited = time.monotonic() - t0
    if proc.exitcode != 0:
        return False, False, False, f"exit code {proc.exitcode} after SIGTERM (want a clean exit, 0)"
    files = step_files(root / "ck")
    if not files or not files[-1][1].name.endswith("-exception.ckpt"):
        return False, True, False, f"no checkpoint written on SIGTERM ({[p.name for _, p in files]})"
    steps_run = max(read_losses(log)) + 1
    if files[-1][0] != steps_run:
        return False, True, False, f"SIGTERM checkpoint at step {files[-1][0]}, but {steps_run} steps ran"
    ok, lost, hang, note = _audit_and_resume(root, reference, steps_run - 1)
    return ok, lost, hang, note or f"exited {waited:.1f}s after SIGTERM"


def test_sigterm_checkpoints_and_exits_cleanly(fault, tmp_path, reference):
    fault("SIGTERM (pre-emption)", "SIGTERM at a random step: checkpoint, exit 0, exact resume")
    at = random.Random(0).randint(2, MAX_STEPS - 12)
    ok, lost, hang, note = _sigterm_trial(tmp_path, reference, at, grace=30)
    fault.trial(ok, data_lost=lost, hang=hang, note=note)
    assert ok, note


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_cleanly_long(fault, tmp_path, reference):
    fault("SIGTERM (pre-emption)", "SIGTERM at a random step: checkpoint, exit 0, exact resume")
    rng = random.Random(1)
    notes = []
    for i in range(6):
        ok, lost, hang, note = _sigterm_trial(tmp_path / f"t{i}", reference, rng.randint(1, MAX_STEPS - 12), 30)
        fault.trial(ok, data_lost=lost, hang=hang, note=note)
        if not ok:
            notes.append(note)
    assert not notes, notes


def test_sigterm_in_a_long_epoch_exits_promptly(fault, tmp_path, reference):
    """Pre-emption grace periods are short (SLURM, Kubernetes: ~30 s); one epoch may be the whole run."""
    fault("SIGTERM mid-epoch (long epoch)", "SIGTERM in a 4000-step (80 s) epoch: checkpoint and exit within 20 s")
    shard = make_shard(tmp_path / "long.bin", 4000 * BATCH * SEQ_LEN + 1)
    spec = _spec(tmp_path, shard, "first", out=None, step_sleep=0.02, every_n_steps=10_000, max_steps=4000)
    log = Path(spec["loss_log"])
    proc = start(ckpt_run, spec)
    assert wait_for(lambda: len(read_losses(log)) >= 3, CHILD_TIMEOUT, proc), "child never started"
    os.kill(proc.pid, signal.SIGTERM)
    exited = join_or_kill(proc, 20.0)
    files = step_files(tmp_path / "ck")
    ok = exited and proc.exitcode == 0 and bool(files) and loads(files[-1][1]) is not None
    note = f"exited: {exited}, exit code {proc.exitcode}, checkpoints {[p.name for _, p in files]}"
    fault.trial(ok, hang=not exited, note=note)
    assert ok, note


# -- a rank dies under DDP ---------------------------------------------------------------------------


def _rank_death_trial(root: Path, reference: dict[str, Any], at: int) -> tuple[bool, bool, bool, str]:
    from tests.reliability._harness import ddp_ckpt_worker, start_ddp

    spec = _spec(root, reference["shard"], "ddp", out=None, step_sleep=0.01, max_steps=2 * MAX_STEPS)
    procs = start_ddp(ddp_ckpt_worker, spec)
    log1 = Path(spec["loss_log"] + ".rank1")
    try:
        if not wait_for(lambda: len(read_losses(log1)) >= at, CHILD_TIMEOUT, procs[1]):
            return False, False, False, f"rank 1 never reached step {at}"
        kill9(procs[1])
        survivor_exited = join_or_kill(procs[0], 60.0)
    finally:
        for p in procs:
            kill9(p)
    files = step_files(root / "ck")
    broken = [p.name for _, p in files if loads(p) is None]
    last = root / "ck" / "last.ckpt"
    last_ok = not os.path.lexists(last) or loads(last) is not None
    note = f"rank 0 exited: {survivor_exited} (code {procs[0].exitcode}); checkpoints {[p.name for _, p in files]}"
    ok = survivor_exited and not broken and last_ok
    return ok, bool(broken) or not last_ok, not survivor_exited, note


def test_ddp_rank_killed_the_other_rank_does_not_hang(fault, tmp_path, reference):
    fault("one DDP rank killed", "SIGKILL of rank 1 of 2 (gloo) at a random step: rank 0 must fail, not hang")
    ok, lost, hang, note = _rank_death_trial(tmp_path, reference, random.Random(0).randint(2, MAX_STEPS))
    fault.trial(ok, data_lost=lost, hang=hang, note=note)
    assert ok, note


def test_sigterm_to_both_ddp_ranks(fault, tmp_path, reference):
    """A scheduler's pre-emption signals every rank: both must checkpoint (rank 0 writes) and exit 0."""
    from tests.reliability._harness import ddp_ckpt_worker, start_ddp

    fault("SIGTERM to both DDP ranks", "SIGTERM to both ranks of a 2-rank gloo run at a random step")
    spec = _spec(tmp_path, reference["shard"], "ddp", out=None, step_sleep=0.02, every_n_steps=1000,
                 max_steps=2 * MAX_STEPS)
    procs = start_ddp(ddp_ckpt_worker, spec)
    log0 = Path(spec["loss_log"] + ".rank0")
    try:
        started = wait_for(lambda: len(read_losses(log0)) >= random.Random(0).randint(2, 8), CHILD_TIMEOUT, procs[0])
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        exited = [join_or_kill(p, 30.0) for p in procs]
    finally:
        for p in procs:
            kill9(p)
    files = step_files(tmp_path / "ck")
    loaded = loads(files[-1][1]) if files else None
    on_signal = bool(files) and files[-1][1].name.endswith("-exception.ckpt")  # periodic saves are off
    ok = started and all(exited) and [p.exitcode for p in procs] == [0, 0] and loaded is not None and on_signal
    note = f"exited {exited}, codes {[p.exitcode for p in procs]}, checkpoints {[p.name for _, p in files]}"
    fault.trial(ok, hang=not all(exited), note=note)
    assert ok, note


# -- all six callbacks attached, in two orders -------------------------------------------------------


@pytest.fixture(scope="module", params=ORDERS)
def reference_all(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run with NaNSkip, LossClamp, AsyncCheckpoint, EvalThrottle, CudaMemoryHygiene and
    SpeedMonitor attached (NaNSkip first or last), with NaN-skipped steps in every epoch."""
    return _reference(tmp_path_factory.mktemp(f"reference_{request.param}"), faults=NAN_FAULTS,
                      all_callbacks=request.param)


def test_sigterm_with_all_callbacks_resumes_exactly(fault, tmp_path, reference_all):
    """NaNSkip's device-mode decision for the last step is still pending when SIGTERM stops the run: the
    exception checkpoint must hold the scheduler with that step applied, whatever the callback order."""
    fault("SIGTERM with all callbacks", "SIGTERM with the six callbacks attached (NaNSkip first or last)")
    at = random.Random(5).randint(2, MAX_STEPS - 12)
    ok, lost, hang, note = _sigterm_trial(tmp_path, reference_all, at, grace=30)
    fault.trial(ok, data_lost=lost, hang=hang, note=note)
    assert ok, note


def test_kill9_with_all_callbacks_resumes_exactly(fault, tmp_path, reference_all):
    _run_kills(fault, tmp_path, reference_all, trials=1, seed=6)


def test_normal_stop_with_all_callbacks_resumes_exactly(fault, tmp_path, reference_all):
    """A run that ends at max_steps=12 (periodic saves every 3 steps), then a run resumed from its
    last.ckpt to step 30: the same losses and final state as the uninterrupted run."""
    fault("stop and resume with all callbacks", "stop at max_steps, resume with the six callbacks attached")
    spec = _spec(tmp_path, reference_all["shard"], "first", out=None, max_steps=12,
                 faults=reference_all["faults"], all_callbacks=reference_all["all_callbacks"])
    proc = start(ckpt_run, spec)
    assert join_or_kill(proc, CHILD_TIMEOUT) and proc.exitcode == 0, "the first run failed"
    ok, lost, hang, note = _audit_and_resume(tmp_path, reference_all, 11)
    fault.trial(ok, data_lost=lost, hang=hang, note=note)
    assert ok, note
