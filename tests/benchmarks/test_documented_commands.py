"""benchmarks/documented_commands.py in its CPU smoke mode: real console-script subprocesses on gloo."""

from __future__ import annotations

from benchmarks import documented_commands
from benchmarks._results import load_result


def test_sharded_clt_commands_pass_every_phase_and_are_recorded(tmp_path) -> None:
    out = tmp_path / "result.json"
    # the 2-process DecoderShardingStrategy run (shard_encoder) of the CLT demo, then its resume with --ckpt_path
    documented_commands.main(["--cpu-smoke", "--only", "decoder_sharding", "--work-dir", str(tmp_path / "work"),
                              "--out", str(out), "--timeout-s", "300"])
    written = load_result(out)
    assert written["benchmark"] == "documented_commands" and written["env"]["torch"] and written["env"]["device"]
    result = written["results"]
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["clt_demo_decoder_sharding_shard_encoder", "clt_demo_decoder_sharding_shard_encoder_resume"]
    run, resumed = rows.values()
    for row in (run, resumed):
        assert row["passed"] is True, row.get("error_tail")
        assert row["gpus"] == 2 and row["world_size"] == 2 and row["steps"] == 8
        assert row["seconds"] > 0 and row["steady_tokens_per_s"] > 0
        assert row["command"].startswith("lightning-opt-clt --config clt_demo")
    assert "--ckpt_path" in resumed["command"] and "step=000000004" in resumed["command"]
    # the phases: AuxK on dead features, resampling, validation twice
    assert run["phases"]["auxk_ran_on_dead_features"] and run["phases"]["resampled_features"] > 0
    assert run["phases"]["val/fvu"]["steps"] == 2
    assert result["summary"] == {**result["summary"], "passed": 2, "failed": 0, "skipped": 0}


def test_deadline_stops_starting_commands_and_still_writes_the_file(tmp_path) -> None:
    out = tmp_path / "result.json"
    documented_commands.main(["--cpu-smoke", "--deadline-s", "0", "--work-dir", str(tmp_path / "work"),
                              "--out", str(out)])
    rows = load_result(out)["results"]["rows"]
    assert rows and all(r["passed"] is None and r["skipped"] == "past --deadline-s" for r in rows)
    assert {r["gpus"] for r in rows} == {1, 2}
    assert any(r["name"] == "sample" for r in rows) and all(r["command"].startswith("lightning-opt-") for r in rows)
