"""The docs home links every page, and the links of the README and the docs home resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not links inside code blocks
    return [m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", text) if not m.startswith(("http", "#", "mailto:"))]


def test_readme_and_docs_home_links_resolve():
    for page in (ROOT / "README.md", DOCS / "index.md", DOCS / "benchmarks" / "index.md"):
        if not page.exists():
            continue
        broken = [link for link in _links(page) if not (page.parent / link).exists()]
        assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_docs_page_is_reachable_from_the_docs_home():
    seen: set[Path] = set()
    todo = [DOCS / "index.md"]
    while todo:
        page = todo.pop().resolve()
        if page in seen or not page.exists() or page.suffix != ".md":
            continue
        seen.add(page)
        for link in _links(page):
            target = page.parent / link
            todo.append(target / "index.md" if target.is_dir() else target)
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    missing = sorted(str(p.relative_to(DOCS.resolve())) for p in pages - seen)
    assert not missing, f"docs pages that no link from docs/index.md reaches (add them to docs/index.md): {missing}"


# -- every documented command runs ------------------------------------------------------------------
#
# Shell commands in README.md and docs/**/*.md that invoke a recipe (`lightning-opt-gpt2`, `-clt`, `-spd`,
# `-sample`, or `python -m lightning_opt.recipes.<name>`), `lightning-opt-data` or `python -m` are run here, in-process, with tiny overrides (one training step, one val batch) in a scratch
# folder. A command that needs a GPU or the network carries a marker comment on the line before it (or at
# its end) that this test recognises:
#   # [GPU] ...       a recipe: its configuration and overrides are parsed and checked with --print_config
#   # [network] ...   lightning-opt-data: its arguments are parsed (nothing is downloaded)
# A command without a marker must run on the CPU, offline, within seconds.

_INVOKES = re.compile(r"(^|\s)(\S*python3?\s+-m\s+\S+|lightning-opt-(data|gpt2|clt|spd|sample))(\s|$)")
_RECIPE_SCRIPT = re.compile(r"lightning-opt-(gpt2|clt|spd|sample)$")
_RECIPE_MODULE = re.compile(r"lightning_opt\.recipes\.(gpt2|clt|spd|sample)$")
_MARKER = re.compile(r"#\s*\[(GPU|network)\]")
RECIPE_TINY = {
    "gpt2": ["--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
                         "--trainer.limit_val_batches", "1", "--data.val_tokens", "1024"],
    "clt": ["--trainer.max_steps", "1", "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1"],
    "spd": ["--trainer.max_steps", "1", "--model.target.train_steps", "2", "--model.target.train_batch_size", "64",
               "--model.train.batch_size", "64", "--model.train.faithfulness_warmup_steps", "0",
               "--model.train.eval_batches", "1"],
}
COMMON_TINY = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def _doc_commands() -> list[tuple[str, str, str | None]]:
    """``(where, command, marker)`` for every command the docs show."""
    found = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        lines = page.read_text().split("\n")
        fence, marker, i = None, None, 0
        while i < len(lines):
            start, line = i, lines[i]
            i += 1
            if line.lstrip().startswith("```"):
                fence = None if fence is not None else line.strip()[3:].strip()
                marker = None
                continue
            if fence not in ("bash", "sh", "shell", "console", ""):
                continue
            while line.rstrip().endswith("\\") and i < len(lines):
                line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
            stripped = line.strip()
            if stripped.startswith("#"):
                m = _MARKER.search(stripped)
                marker = m.group(1) if m else marker
                continue
            if not stripped or not _INVOKES.search(stripped):
                marker = None
                continue
            command, _, comment = stripped.partition(" #")
            m = _MARKER.search(comment)
            found.append((f"{page.relative_to(ROOT)}:{start + 1}", command.strip(), m.group(1) if m else marker))
            marker = None
    return found


COMMANDS = _doc_commands()


def test_docs_commands_are_found():
    assert len(COMMANDS) >= 20, COMMANDS
    assert any("lightning-opt-data" in c for _, c, _ in COMMANDS)


def _recipe_main(name: str):
    import importlib

    return importlib.import_module(f"lightning_opt.recipes.{name}").main


def _recipe_call(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(recipe, its arguments)`` for a console script or ``python -m lightning_opt.recipes.<recipe>``."""
    for i, arg in enumerate(argv):
        if m := _RECIPE_SCRIPT.search(arg):
            return m.group(1), argv[i + 1 :]
        if i > 0 and argv[i - 1] == "-m" and (m := _RECIPE_MODULE.fullmatch(arg)):
            return m.group(1), argv[i + 1 :]
    return None


def _workspace(tmp_path: Path) -> None:
    """What the data commands expect in the current folder: texts/*.txt, FineWeb-named shards, the BPE file."""
    from lightning_opt.data.shards import write_shard
    from tests.data._shared import BPE

    (tmp_path / "texts").mkdir()
    for i in range(30):
        (tmp_path / "texts" / f"doc_{i:02d}.txt").write_text(f"Document {i}. " * 20)
    write_shard(tmp_path / "data" / "fineweb" / "fineweb_val_000000.bin", [50256, 1, 2, 3])
    if BPE.exists():
        (tmp_path / "r50k_base.tiktoken").symlink_to(BPE)


def _run_recipe(main, argv: list[str], marker: str | None, name: str) -> None:
    if marker == "GPU":
        argv = [a for a in argv if a != "--plain"]  # the jsonargparse parser (it has --print_config)
        if "--print_config" not in argv:
            argv.append("--print_config")
    if "--print_config" in argv:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code in (0, None), f"exit status {info.value.code}"
        return
    if name not in RECIPE_TINY:  # not a training recipe: runs as documented
        main(argv)
        return
    metrics = main([*argv, *RECIPE_TINY[name], *COMMON_TINY])
    assert metrics["steps"] >= 1


def _run_data_cli(argv: list[str], marker: str | None, capsys) -> None:
    from lightning_opt.data import cli

    if marker == "network":
        cli._parser().parse_args(argv)
        return
    if "--bpe-file" in argv and not Path(argv[argv.index("--bpe-file") + 1]).exists():
        pytest.skip("the GPT-2 BPE file is not here (set LIGHTNING_OPT_SHARED_DATA)")
    status = cli.main(argv)
    assert status == 0, capsys.readouterr().err


@pytest.mark.parametrize("where,command,marker", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_docs_command_runs(where, command, marker, tmp_path, monkeypatch, capsys):
    import os
    import shlex

    argv = [os.path.expandvars(a) for a in shlex.split(command)]
    argv = [str(ROOT / a) if a.startswith("docs/") else a for a in argv]
    _workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    if argv[0] == "lightning-opt-data":
        _run_data_cli(argv[1:], marker, capsys)
        return
    call = _recipe_call(argv)
    assert call is not None, f"{where}: {command!r} runs no recipe (lightning-opt-<recipe>)"
    name, args = call
    if name == "sample":  # it needs a run to sample from: the demo's, one step, where the docs train it
        _run_recipe(_recipe_main("gpt2"), ["--config", "gpt2/demo"], None, "gpt2")
        assert _recipe_main("sample")([*args, "--max_new_tokens", "8"])
        return
    _run_recipe(_recipe_main(name), args, marker, name)


# -- every documented Python snippet runs ------------------------------------------------------------
#
# ```python blocks of README.md and docs/ (not docs/benchmarks/, whose pages are results) are executed here,
# each alone in a fresh namespace, in a scratch folder, offline. A block that needs a GPU, several processes
# or the network, or that is a fragment of a larger program (a method body, a line of a training_step),
# says so on its first line with a marker comment, and is then compiled only:
#   # [GPU] ...   # [network] ...   # [fragment] ...
# ```yaml blocks are parsed with yaml.safe_load.

_PY_MARKER = re.compile(r"^#\s*\[(GPU|network|fragment)\]")
USER_PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "benchmarks" not in p.relative_to(DOCS).parts)]


def _doc_blocks(languages: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``(where, language, source)`` for every fenced block in ``languages`` on the user pages."""
    found = []
    for page in USER_PAGES:
        lines = page.read_text().split("\n")
        fence, start = None, 0
        for i, line in enumerate(lines):
            if not line.lstrip().startswith("```"):
                continue
            if fence is None:
                fence, start = line.strip()[3:].strip(), i + 1
                continue
            if fence in languages:
                found.append((f"{page.relative_to(ROOT)}:{start}", fence, "\n".join(lines[start:i])))
            fence = None
    return found


PY_BLOCKS = _doc_blocks(("python", "py"))
YAML_BLOCKS = _doc_blocks(("yaml", "yml"))


def test_docs_python_blocks_are_found():
    assert len(PY_BLOCKS) >= 15, [w for w, _, _ in PY_BLOCKS]
    run = [w for w, _, src in PY_BLOCKS if not _PY_MARKER.match(src.lstrip())]
    assert len(run) >= 10, f"most Python snippets should run as shown, not only compile: {run}"


@pytest.mark.parametrize("where,language,source", PY_BLOCKS, ids=[w for w, _, _ in PY_BLOCKS])
def test_docs_python_block_runs(where, language, source, tmp_path, monkeypatch):
    code = compile(source, where, "exec")  # every block, marked or not, is valid Python
    if _PY_MARKER.match(source.lstrip()):
        return
    _workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    exec(code, {"__name__": "__docs__"})


@pytest.mark.parametrize("where,language,source", YAML_BLOCKS, ids=[w for w, _, _ in YAML_BLOCKS])
def test_docs_yaml_block_parses(where, language, source):
    import yaml

    assert yaml.safe_load(source) is not None, f"{where}: an empty YAML block"
