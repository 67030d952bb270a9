"""Recording of fault trials for ``benchmarks/reliability_report.py`` (a no-op unless it asks).

A test takes the ``fault`` fixture, names its fault kind, and calls ``fault.trial(...)`` once per
trial. With ``RELIABILITY_LOG=<file>`` in the environment each test appends one JSON line (kind,
trials, survived, data lost, hangs, node id, seconds); a test that fails after its last recorded trial
counts one more trial that did not survive, so a crash is never reported as a success.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

os.environ.setdefault("PL_DISABLE_FORK", "1")


@dataclass
class FaultRecord:
    kind: str = ""
    description: str = ""
    trials: int = 0
    survived: int = 0
    data_lost: int = 0
    hangs: int = 0
    notes: list[str] = field(default_factory=list)

    def __call__(self, kind: str, description: str) -> FaultRecord:
        self.kind, self.description = kind, description
        return self

    def shown(self, message: str, needle: str = "") -> None:
        """Report what the user was told: the message's line holding ``needle`` (else its first line)."""
        # warnings printed on stderr ("/path/file.py:12: ...") are not what the user was told
        lines = [ln.strip(" -\t") for ln in str(message).splitlines() if ln.strip() and not ln.startswith("/")]
        line = next((ln for ln in lines if needle and needle in ln), lines[0] if lines else "")
        if line and len(self.notes) < 5:
            self.notes.append(f"says: {line[:220]}")

    def trial(self, survived: bool, data_lost: bool = False, hang: bool = False, note: str = "") -> None:
        self.trials += 1
        self.survived += int(survived and not data_lost and not hang)
        self.data_lost += int(data_lost)
        self.hangs += int(hang)
        # notes explain failures; a test adds facts worth reporting to ``notes`` itself
        if note and not (survived and not data_lost and not hang) and len(self.notes) < 5:
            self.notes.append(note)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Bit-exact comparisons between runs want the same reduction order: one intra-op thread (restored
    afterwards so that the rest of the session keeps its setting)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def fault(request: pytest.FixtureRequest) -> Iterator[FaultRecord]:
    record = FaultRecord()
    t0 = time.perf_counter()
    yield record
    log = os.environ.get("RELIABILITY_LOG")
    rep = getattr(request.node, "rep_call", None)
    # an expected failure (xfail) is a trial that did not survive, not a skip
    xfailed = rep is not None and hasattr(rep, "wasxfail") and rep.skipped
    failed = rep is not None and (rep.failed or xfailed)
    skipped = rep is not None and rep.skipped and not xfailed
    if failed and record.survived == record.trials:  # the failure is a trial that did not survive
        record.trials += 1
        text = str(rep.longrepr).splitlines() if rep.longrepr else []
        record.notes.append(text[-1][:300] if text else "failed")
    if not log or not record.kind or skipped:
        return
    row = {
        "kind": record.kind,
        "description": record.description,
        "node": request.node.nodeid,
        "slow": request.node.get_closest_marker("slow") is not None,
        "xfail": request.node.get_closest_marker("xfail") is not None,
        "trials": record.trials,
        "survived": record.survived,
        "data_lost": record.data_lost,
        "hangs": record.hangs,
        "passed": not failed,
        "seconds": round(time.perf_counter() - t0, 2),
        "notes": record.notes,
    }
    with open(log, "a") as f:
        f.write(json.dumps(row) + "\n")
