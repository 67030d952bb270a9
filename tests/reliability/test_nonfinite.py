"""NaN / Inf in the loss or the gradients at random steps: NaNSkip skips exactly those steps.

The check is against a run that never saw the faulty batches: parameters, AdamW moments and step
counts, and the LR schedule must be bit-identical. Under 2-rank DDP the fault is on one rank only (the
other rank sees a finite loss), and nothing may hang.
"""

from __future__ import annotations

import random

import pytest
import torch

from lightning_opt.callbacks import AsyncCheckpoint, NaNSkip
from tests.reliability._harness import (
    FAULTS,
    Batches,
    TinyLM,
    random_batches,
    run_ddp,
    state,
    state_diff,
    trainer,
)

STEPS = 16


def _random_faults(rng: random.Random, steps: int, kinds: tuple[str, ...]) -> dict[int, str]:
    n = rng.randint(1, 4)
    return {s: rng.choice(kinds) for s in rng.sample(range(steps), n)}


def _single_trial(tmp_path, seed: int, kinds: tuple[str, ...], mode: str = "device", fused: bool = False,
                  accumulate: int = 1, **trainer_kw):
    """A run with faults at random batches vs a run without the optimizer steps those batches belong to."""
    rng = random.Random(seed)
    faults = _random_faults(rng, STEPS, kinds)
    if seed % 2 == 0:  # the first step too: the optimizer has no state yet (NaNSkip's host path)
        faults.setdefault(0, rng.choice(kinds))
    bad_steps = {b // accumulate for b in faults}
    batches = random_batches(STEPS, seed)
    skip = NaNSkip(mode=mode, max_consecutive_skips=None)
    faulty = TinyLM(dropout=0.0, fused=fused, faults=faults)
    kw = {"accumulate_grad_batches": accumulate, **trainer_kw}
    t1 = trainer(tmp_path / f"f{seed}", [skip], **kw)
    t1.fit(faulty, train_dataloaders=Batches(batches))
    skip.resolve()
    clean = TinyLM(dropout=0.0, fused=fused)
    t2 = trainer(tmp_path / f"r{seed}", [], **kw)
    t2.fit(clean, train_dataloaders=Batches([b for i, b in enumerate(batches) if i // accumulate not in bad_steps]))
    diffs = state_diff(state(faulty, t1), state(clean, t2))
    return bad_steps, skip.skipped_total, diffs


def _check_single(fault, tmp_path, kind: str, seeds: range, variants: list[tuple[str, bool]]) -> None:
    fault(f"{kind.replace('_', '-')} at random steps", f"{kind.replace('_', ' ')} at 1-4 random steps, 1 process")
    failures = []
    for seed in seeds:
        for mode, fused in variants:
            faults, skipped, diffs = _single_trial(tmp_path, seed, (kind,), mode, fused)
            ok = skipped == len(faults) and not diffs
            fault.trial(ok, data_lost=bool(diffs), note="" if ok else f"seed {seed} {mode}: {diffs[:3]}")
            if not ok:
                failures.append((seed, mode, fused, faults, skipped, diffs[:5]))
    assert not failures, failures


@pytest.mark.parametrize("kind", FAULTS)
def test_nonfinite_at_random_steps(fault, tmp_path, kind):
    _check_single(fault, tmp_path, kind, range(1), [("device", False)])


# (fault kind, what, trainer settings): the same random faults with the Trainer features that touch the step
SETTINGS = [
    ("with gradient accumulation", "accumulate_grad_batches=2: one bad micro-batch skips the whole step",
     {"accumulate": 2}),
    ("with gradient clipping", "gradient_clip_val=0.5 (clipping NaN gradients must not hide them)",
     {"gradient_clip_val": 0.5}),
    ("under bf16-mixed autocast", "precision='bf16-mixed' on CPU", {"precision": "bf16-mixed"}),
]


@pytest.mark.parametrize("name,what,kw", SETTINGS, ids=[s[0].split()[-1] for s in SETTINGS])
def test_nonfinite_with_trainer_features(fault, tmp_path, name, what, kw):
    fault(f"NaN/Inf {name}", f"NaN/Inf in loss or gradient at random steps, {what}")
    problems = []
    for seed in range(2):
        bad, skipped, diffs = _single_trial(tmp_path / str(seed), seed, FAULTS, **kw)
        ok = skipped == len(bad) and not diffs
        fault.trial(ok, data_lost=bool(diffs), note="" if ok else f"seed {seed}: skipped {skipped}/{len(bad)} {diffs[:3]}")
        if not ok:
            problems.append((seed, skipped, len(bad), diffs[:5]))
    assert not problems, problems


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAULTS)
def test_nonfinite_at_random_steps_long(fault, tmp_path, kind):
    variants = [("device", False), ("host", False), ("device", True)]
    _check_single(fault, tmp_path, kind, range(1, 9), variants)


def test_persistent_divergence_stops_with_clear_error_and_keeps_last_good_state(fault, tmp_path):
    fault("persistent divergence", "NaN loss at every step from step 5 on (NaNSkip + AsyncCheckpoint)")
    faults = {s: "nan_loss" for s in range(5, STEPS)}
    model = TinyLM(dropout=0.0, faults=faults)
    ckdir = tmp_path / "ck"
    cbs = [NaNSkip(max_consecutive_skips=3), AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=100)]
    with pytest.raises(RuntimeError) as info:
        trainer(tmp_path, cbs).fit(model, train_dataloaders=Batches(random_batches(STEPS, 0)))
    msg = str(info.value)
    clean = TinyLM(dropout=0.0)
    t = trainer(tmp_path / "ref", [])
    t.fit(clean, train_dataloaders=Batches(random_batches(5, 0)))
    saved = [p for p in ckdir.glob("*.ckpt") if p.name != "last.ckpt"]
    params_ok = len(saved) == 1 and all(
        torch.equal(v, clean.state_dict()[k])
        for k, v in torch.load(saved[0], weights_only=False)["state_dict"].items()
    )
    clear = "3 consecutive optimizer steps were skipped" in msg and "[5, 6, 7]" in msg and "learning rate" in msg
    fault.trial(clear and params_ok, data_lost=not params_ok)
    assert clear, msg
    assert params_ok, "the checkpoint written at the failure must hold the last good parameters"


# -- 2-rank DDP (gloo) -----------------------------------------------------------------------------


def _ddp_trials(seeds: range) -> list[dict]:
    trials = []
    for seed in seeds:
        rng = random.Random(100 + seed)
        one = {s: rng.choice(FAULTS) for s in rng.sample(range(STEPS), 3)}
        # one-rank faults: rank 0 or 1 at random per step; "both": the same step on both ranks
        per_rank: dict[int, dict[int, str]] = {0: {}, 1: {}}
        for s, k in one.items():
            per_rank[rng.randint(0, 1)][s] = k
        both_step = rng.choice([s for s in range(STEPS) if s not in one])
        per_rank[0][both_step], per_rank[1][both_step] = "nan_loss", "inf_grad"
        trials.append({"steps": STEPS, "faults": per_rank, "mode": rng.choice(["device", "host"]),
                       "fused": seed > 0 and rng.random() < 0.5})
    return trials


def _check_ddp(fault, tmp_path, seeds: range, timeout: float) -> None:
    fault("NaN/Inf on one rank (DDP)", "NaN/Inf loss or grad on one of 2 gloo ranks (plus one step on both)")
    trials = _ddp_trials(seeds)
    finished, results = run_ddp(trials, tmp_path, timeout)
    problems = []
    for trial, per_rank in zip(trials, results):
        if per_rank[0] is None or per_rank[1] is None:
            fault.trial(False, hang=not finished, note="no result (hang or crash)")
            problems.append(("no result", trial))
            continue
        n_bad = len(set(trial["faults"][0]) | set(trial["faults"][1]))
        diffs = []
        for r in (0, 1):
            diffs += [f"rank{r}: {d}" for d in state_diff(per_rank[r]["faulty"], per_rank[r]["reference"])]
            if per_rank[r]["skipped"] != n_bad:
                diffs.append(f"rank{r} skipped {per_rank[r]['skipped']} of {n_bad}")
        diffs += ["ranks differ: " + d for d in state_diff(per_rank[0]["faulty"], per_rank[1]["faulty"])]
        fault.trial(not diffs, data_lost=bool(diffs), note="; ".join(diffs[:3]))
        if diffs:
            problems.append((trial, diffs[:5]))
    assert finished, f"DDP run did not finish within {timeout}s (a hang)"
    assert not problems, problems


def test_nonfinite_on_one_rank_ddp(fault, tmp_path):
    _check_ddp(fault, tmp_path, range(1), timeout=90)


@pytest.mark.slow
def test_nonfinite_on_one_rank_ddp_long(fault, tmp_path):
    _check_ddp(fault, tmp_path, range(1, 17), timeout=400)
