"""Files a run reads never execute code: malicious pickles, planted cache files, path traversal, YAML.

The payload is a real malicious pickle: its ``__reduce__`` makes unpickling call ``os.system("touch MARKER")``
(``test_the_payloads_are_live`` proves that a plain ``torch.load(weights_only=False)`` runs it). Each case hands
it to a recipe or loader the way a user or an attacker would and expects a clear refusal, with the marker file
never written:

* as the CLT recipe's target model (``--data.target FILE``), in torch's zip format and as a raw pickle;
* planted as the cached demo target (``target: demo`` reads a cached ``demo_gpt_<key>.pt``);
* dropped into an activation cache folder as a shard (shards are memory-mapped numbers, never unpickled);
* an activation cache whose ``meta.json`` names a shard outside the cache folder (``../secret.bin``, an
  absolute path, a link leading out);
* a YAML config whose logger ``class_path`` is ``os.system`` (the SPD recipe's removed ``--plain`` parser
  instantiated any ``class_path``).

``test_no_code_executing_loads_in_the_source`` keeps ``pickle.load``, ``yaml.load``, ``eval`` and
``torch.load`` without ``weights_only=True`` out of ``lightning_opt`` and ``recipes``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.reliability._recipes import CONFIGS, recipe_main, run_bad

ROOT = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this calls ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _torch_file(tmp_path: Path, marker: Path) -> Path:
    """A torch.save'd (zip) 'target checkpoint' whose config unpickles to the payload."""
    path = tmp_path / "evil_target.pt"
    torch.save({"config": _Payload(marker), "model": {}}, path)
    return path


def _raw_pickle(tmp_path: Path, marker: Path) -> Path:
    path = tmp_path / "evil_target.pkl"
    path.write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    return path


MAKERS = {"torch_zip": _torch_file, "raw_pickle": _raw_pickle}


@pytest.mark.parametrize("form", sorted(MAKERS))
def test_the_payloads_are_live(tmp_path, form: str) -> None:
    """The control: an unrestricted load of the payload does run it (so the refusals below mean something)."""
    marker = tmp_path / "ran"
    path = MAKERS[form](tmp_path, marker)
    try:
        torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 - the raw pickle is no torch file; unpickling its header already ran it
        pass
    assert marker.exists()


@pytest.mark.parametrize("form", sorted(MAKERS))
def test_malicious_target_file_is_refused_by_the_clt_recipe(fault, tmp_path, monkeypatch, capsys, form: str) -> None:
    fault("untrusted file: malicious target pickle", "recipes/clt.py --data.target <a pickle that runs a command>")
    marker = tmp_path / "ran"
    path = MAKERS[form](tmp_path, marker)
    message, trained = run_bad("clt", ["--data.target", str(path)], tmp_path, monkeypatch, capsys, when="trained")
    ok = "refusing to unpickle" in message and str(path) in message
    fault.trial(ok and not marker.exists() and not trained, note=f"marker written: {marker.exists()}")
    fault.shown(message, "refusing")
    assert not marker.exists(), "the pickle's code ran"
    assert ok, f"no clear refusal naming the file:\n{message[-1500:]}"
    assert not trained


def test_malicious_file_planted_as_the_cached_demo_target_is_refused(fault, tmp_path, monkeypatch, capsys) -> None:
    """``target: demo`` reuses ``<cache>/clt_demo/demo_gpt_<key>.pt`` when it exists: a file planted there is
    read with ``weights_only=True`` and refused."""
    from lightning_opt.data import activations

    fault("untrusted file: pickle planted in the cache", "a malicious demo_gpt_<key>.pt in the target cache folder")
    marker = tmp_path / "ran"
    cache = tmp_path / "cache"
    planted = activations.demo_target_path(cache_dir=cache)
    planted.parent.mkdir(parents=True)
    torch.save({"config": _Payload(marker), "model": {}}, planted)

    with pytest.raises(ValueError, match="refusing to unpickle") as err:
        activations.load_target_model("demo", cache_dir=cache)
    assert str(planted) in str(err.value) and not marker.exists()

    # the recipe's default target ("demo") finds the planted file where it caches the demo target
    original = activations.demo_target_path
    monkeypatch.setattr(activations, "demo_target_path", lambda *a, **k: original(*a, **{**k, "cache_dir": cache}))
    message, trained = run_bad("clt", ["--data.target", "demo"], tmp_path, monkeypatch, capsys, when="trained")
    fault.trial("refusing to unpickle" in message and not marker.exists() and not trained)
    fault.shown(message, "refusing")
    assert "refusing to unpickle" in message and str(planted) in message, message[-1500:]
    assert not marker.exists() and not trained


# -- the activation cache ----------------------------------------------------------------------------------

def _tiny_cache(tmp_path: Path) -> tuple[Path, Path]:
    """A real activation cache of a tiny GPT (2 layers x 16), and the GPT's checkpoint."""
    from lightning_opt.data.activations import MLPActivationCapture, write_activation_cache
    from lightning_opt.models.gpt2 import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=16, block_size=16)  # the built-in val bytes fit
    gpt = GPT(cfg).eval()
    target = tmp_path / "target.pt"
    torch.save({"config": cfg.to_dict(), "model": gpt.state_dict()}, target)
    windows = [torch.randint(0, 64, (4, 16)) for _ in range(4)]
    cache = write_activation_cache(MLPActivationCapture(gpt, torch.float32), windows, tmp_path / "acts",
                                   tokens_per_batch=64, tokens_per_shard=128)
    return cache, target


def _tamper(cache: Path, file: str) -> None:
    meta = json.loads((cache / "meta.json").read_text())
    meta["shards"][0]["file"] = file
    (cache / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("how", ["dotdot", "nested_dotdot", "absolute", "link_out"])
def test_activation_cache_meta_naming_a_file_outside_the_cache_is_refused(fault, tmp_path, how: str) -> None:
    from lightning_opt.data.activations import CachedActivations

    fault("untrusted file: path traversal in meta.json", "an activation cache whose meta.json names ../secret.bin")
    cache, _ = _tiny_cache(tmp_path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes((cache / "acts_00000.bin").read_bytes())  # readable as a shard, were it allowed
    name = {"dotdot": "../secret.bin", "nested_dotdot": "sub/../../secret.bin", "absolute": str(secret),
            "link_out": "acts_link.bin"}[how]
    if how == "link_out":
        (cache / "acts_link.bin").symlink_to(secret)
    _tamper(cache, name)
    with pytest.raises(ValueError) as err:
        CachedActivations(cache)[0]
    message = str(err.value)
    ok = repr(name) in message and "outside" in message and "meta.json" in message
    fault.trial(ok)
    fault.shown(message, "outside")
    assert ok, message


def test_tampered_activation_cache_is_refused_by_the_clt_recipe(fault, tmp_path, monkeypatch, capsys) -> None:
    fault("untrusted file: path traversal in meta.json", "recipes/clt.py --data.cache_dir <cache naming ../secret.bin>")
    cache, target = _tiny_cache(tmp_path)
    (tmp_path / "secret.bin").write_bytes((cache / "acts_00000.bin").read_bytes())
    _tamper(cache, "../secret.bin")
    args = ["--data.target", str(target), "--data.cache_dir", str(cache), "--data.seq_len", "16",
            "--data.tokens_per_batch", "64", "--model.clt.n_layers", "2", "--model.clt.d_model", "16",
            "--model.clt.n_features", "32", "--model.clt.k", "4", "--model.aux_k", "4"]
    message, trained = run_bad("clt", args, tmp_path, monkeypatch, capsys, when="trained")
    ok = "'../secret.bin'" in message and "outside the cache" in message
    fault.trial(ok and not trained)
    fault.shown(message, "outside")
    assert ok, message[-1500:]
    assert not trained


def test_pickle_dropped_into_the_activation_cache_is_only_read_as_numbers(tmp_path) -> None:
    """Shards are memory-mapped arrays: a pickle in their place gives (garbage) numbers, never runs."""
    from lightning_opt.data.activations import CachedActivations

    cache, _ = _tiny_cache(tmp_path)
    marker = tmp_path / "ran"
    shard = cache / "acts_00000.bin"
    payload = pickle.dumps(_Payload(marker), protocol=2)
    shard.write_bytes(payload + b"\0" * (shard.stat().st_size - len(payload)))
    x, y = CachedActivations(cache)[0]
    assert x.shape == (64, 2, 16) and not marker.exists()


# -- YAML --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["spd", "clt", "gpt2"])
def test_yaml_class_path_cannot_run_a_command(fault, tmp_path, monkeypatch, capsys, recipe: str) -> None:
    """A config whose logger is ``class_path: os.system`` is refused by LightningCLI (not a Logger), unbuilt."""
    fault("untrusted file: YAML class_path", "a config naming os.system as the logger's class_path")
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"trainer:\n  logger:\n    class_path: os.system\n    init_args:\n"
                    f"      command: touch {shlex.quote(str(marker))}\n")
    message, started = run_bad(recipe, ["--config", str(evil)], tmp_path, monkeypatch, capsys)
    fault.trial(not marker.exists() and not started)
    fault.shown(message, "os.system")
    assert not marker.exists() and not started
    assert "os.system" in message, message[-1500:]


def test_spd_plain_parser_is_gone(fault, tmp_path, monkeypatch, capsys) -> None:
    """``--plain`` with a config whose logger ``class_path`` is ``os.system``: the SPD recipe has one parser
    (LightningCLI), which refuses the unknown flag; nothing from the YAML is imported or called."""
    fault("untrusted file: YAML class_path (SPD --plain)", "recipes/spd.py --plain --config <logger class_path os.system>")
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"trainer:\n  logger:\n    class_path: os.system\n    init_args:\n"
                    f"      command: touch {shlex.quote(str(marker))}\n")
    try:
        recipe_main("spd")(["--plain", "--config", str(evil), "--trainer.max_steps", "1"])
        refused = False
    except SystemExit:
        refused = True
    except Exception:  # noqa: BLE001 - any other failure is no refusal of the flag; the marker decides
        refused = False
    said = capsys.readouterr().err
    named = "os.system does not correspond to a subclass of Logger" in said
    fault.trial(refused and named and not marker.exists(), note=f"marker written: {marker.exists()}")
    fault.shown(said, "os.system")
    assert not marker.exists(), "the YAML's class_path ran"
    assert refused and named, said[-1500:]
    # and with a valid config, the flag itself is refused
    with pytest.raises(SystemExit):
        recipe_main("spd")(["--plain", "--config", str(CONFIGS / "spd_tms_5-2.yaml")])
    assert "--plain" in capsys.readouterr().err


# -- the source ----------------------------------------------------------------------------------------------

_UNSAFE = [
    (re.compile(r"\bpickle\.loads?\("), "pickle.load"),
    (re.compile(r"\b(?:c?Pickle|dill|joblib|marshal|shelve)\.(?:loads?|open)\("), "an unpickler"),
    (re.compile(r"\byaml\.(?:load|unsafe_load|full_load|load_all)\("), "yaml.load (use yaml.safe_load)"),
    (re.compile(r"\ballow_pickle\s*=\s*True"), "numpy allow_pickle=True"),
    (re.compile(r"(?<![\w.])(?:eval|exec)\("), "eval / exec"),
]


def _torch_loads(text: str) -> list[str]:
    """``torch.load(...)`` calls (balanced parentheses) of a source file."""
    calls = []
    for m in re.finditer(r"\btorch\.load\(", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        calls.append(text[m.start():i])
    return calls


def test_no_code_executing_loads_in_the_source(fault) -> None:
    fault("untrusted file: code-executing loads in the source", "the package's source scanned for pickle.load, "
          "yaml.load, eval/exec, allow_pickle=True and torch.load without weights_only=True")
    problems = []
    for folder in ("lightning_opt", "recipes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
            for pattern, what in _UNSAFE:
                for m in pattern.finditer(code):
                    line = code[: m.start()].count("\n") + 1
                    problems.append(f"{path.relative_to(ROOT)}:~{line}: {what}")
            for call in _torch_loads(code):
                if not re.search(r"weights_only\s*=\s*True", call):
                    problems.append(f"{path.relative_to(ROOT)}: {call!r} without weights_only=True")
    assert not problems, "\n".join(problems)
    fault.trial(True)
