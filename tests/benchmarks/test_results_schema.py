"""Every committed result file has the one schema of benchmarks._results, and the writer refuses what does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._results import KEYS, RESULTS, SCHEMA, environment, load_result, validate, write_result

FILES = sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_result_file_fits_the_schema(path: Path) -> None:
    result = load_result(path)
    assert list(result) == list(KEYS) and result["schema"] == SCHEMA
    assert result["env"]["device"]


def test_write_result_round_trips_and_refuses_a_bad_baseline(tmp_path: Path) -> None:
    env = environment(on_gpu=False)
    out = tmp_path / "sub" / "x_cpu.json"
    written = write_result(out, benchmark="x", env=env, command="python -m benchmarks.x --smoke",
                           baseline={"name": "eager", "ms": 2.0}, results={"rows": [{"ms": 1.0}]}, notes="n")
    assert load_result(out) == written == json.loads(out.read_text())
    assert env["gpus"] == 0 and env["device"].startswith("cpu") and env["torch"]
    with pytest.raises(ValueError, match="baseline"):
        write_result(out, benchmark="x", env=env, command=None, baseline={"ms": 2.0}, results={})
    assert validate({**written, "env": {"device": "cpu"}}) == [f"env lacks {[k for k in written['env'] if k != 'device']}"]
    (tmp_path / "flat.json").write_text(json.dumps({"device": "cpu", "rows": []}))
    with pytest.raises(ValueError, match="not a benchmark result"):
        load_result(tmp_path / "flat.json")
