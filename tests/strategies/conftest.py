"""One 2-rank gloo spawn for all strategy tests (start-up dominates), shared through a session fixture."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._fork import fork_ranks

sys.path.insert(0, str(Path(__file__).parent))  # the test modules import the helpers by module name


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from _clt_helpers import free_port
    from _fit_worker import WORLD, scenarios, worker

    out = tmp_path_factory.mktemp("strategy_runs")
    fork_ranks(worker, (free_port(), str(out)), WORLD)
    results: dict[str, dict[str, Any]] = {}
    for name in scenarios(out):
        per_rank = [torch.load(p, weights_only=False) for p in sorted(out.glob(f"{name}.rank*.pt"))]
        errors = [r["error"] for r in per_rank if not r["ok"]]
        results[name] = {"ok": False, "error": "\n".join(errors)} if errors else per_rank[0]
        results[name]["dir"] = out
    return _Checked(results)


class _Checked(dict):
    """Fail the asking test with the worker's traceback when its scenario failed."""

    def __getitem__(self, name: str) -> dict[str, Any]:
        result = super().__getitem__(name)
        if not result["ok"]:
            pytest.fail(f"scenario {name!r} failed on a worker:\n{result['error']}")
        return result
