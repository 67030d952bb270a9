"""The docs: every page is reachable and its links resolve, every shell line and Python snippet runs (or is checked
where it cannot run here), every YAML block parses."""

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



def _anchors(page: Path) -> set[str]:
    """The ``#anchor`` of each heading of ``page``, as GitHub renders it (a repeated heading gets ``-1``, ...)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = next(i for i in range(100) if (slug if i == 0 else f"{slug}-{i}") not in found)
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_docs_links_to_sections_resolve():
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            file, _, anchor = link.partition("#")
            target = page.parent / file if file else page
            if anchor and not link.startswith("http") and target.suffix == ".md" and target.exists():
                if anchor not in _anchors(target):
                    broken.append(f"{page.relative_to(ROOT)} -> {link}")
    assert not broken, f"links to sections that do not exist: {broken}"

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


# -- every documented shell line runs or is checked --------------------------------------------------
#
# Every line of a ```bash (sh, shell, console) block of README.md and docs/ (not docs/benchmarks/, whose pages are
# results) is a command this test knows, and each is run here or checked as far as it can be without running it.
# A fenced block names its language (```text for a diagram or output), so no command hides in an untyped block.
#
# Run, in-process, in a scratch folder with texts/*.txt, FineWeb-named shards and the BPE file, offline:
#   lightning-opt-gpt2|clt|spd|sample ..., python -m lightning_opt.recipes.<name> ...
#                       with tiny overrides (one training step, one val batch); any launcher or path before the
#                       script (`.venv/bin/`, `srun`, `torchrun ... -m`) is dropped
#   lightning-opt-data ...                  as written
#   python -c '...'                         the code, in a fresh namespace
#   python -m benchmarks.X --smoke ...      a benchmark's smoke variant (--smoke, --cpu-smoke), in a child process
# A command that cannot run here says why on the line before it (or at its end), and is checked instead:
#   # [GPU] ...        a recipe: its configuration and overrides are parsed (--print_config);
#                      a benchmark: `--help` exits 0 and lists every flag the line uses
#   # [network] ...    lightning-opt-data: its arguments are parsed (nothing is downloaded)
#   # [long] ...       runs for minutes on a CPU (a benchmark's full run): checked like [GPU]
# Commands that install, open a tool or run the test suite are never run here; what they name must exist:
#   make TARGET [VAR=...]      TARGET is a Makefile target and VAR a variable the Makefile reads
#   pip install ...[EXTRA]     EXTRA is one of pyproject.toml's optional dependencies
#   source VENV/bin/activate   VENV is the Makefile's virtualenv folder
#   pytest [-m EXPR] PATH...   every PATH (a node id's file) exists and EXPR names registered markers
#   tensorboard --logdir DIR   DIR is where the recipes' TensorBoard logger writes (its save_dir)
# The hand-written result notes (docs/benchmarks/*_notes.md) reproduce their runs with recipe commands: those are
# run or checked the same way; their other lines (benchmark scripts at full size, peers' checkouts) are not.

_SHELL = ("bash", "sh", "shell", "console")
_RECIPE_SCRIPT = re.compile(r"lightning-opt-(gpt2|clt|spd|sample)$")
_RECIPE_MODULE = re.compile(r"lightning_opt\.recipes\.(gpt2|clt|spd|sample)$")
_MARKER = re.compile(r"#\s*\[(GPU|network|long)\]")
_SMOKE = ("--smoke", "--cpu-smoke")
RECIPE_TINY = {
    "gpt2": ["--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
                         "--trainer.limit_val_batches", "1", "--data.val_tokens", "1024"],
    "clt": ["--trainer.max_steps", "1", "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1"],
    "spd": ["--trainer.max_steps", "1", "--model.target.train_steps", "2", "--model.target.train_batch_size", "64",
               "--model.train.batch_size", "64", "--model.train.faithfulness_warmup_steps", "0",
               "--model.train.eval_batches", "1"],
}
COMMON_TINY = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
USER_PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "benchmarks" not in p.relative_to(DOCS).parts)]
NOTES_PAGES = sorted((DOCS / "benchmarks").glob("*_notes.md"))


def _doc_commands(pages: list[Path]) -> list[tuple[str, str, str | None]]:
    """``(where, command, marker)`` for every shell line of ``pages`` (continuation lines joined)."""
    found = []
    for page in pages:
        lines = page.read_text().split("\n")
        fence, marker, i = None, None, 0
        while i < len(lines):
            start, line = i, lines[i]
            i += 1
            if line.lstrip().startswith("```"):
                fence = None if fence is not None else line.strip()[3:].strip()
                marker = None
                continue
            if fence not in _SHELL:
                continue
            while line.rstrip().endswith("\\") and i < len(lines):
                line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
            stripped = line.strip()
            if stripped.startswith("#"):
                m = _MARKER.search(stripped)
                marker = m.group(1) if m else marker
                continue
            if not stripped:
                marker = None
                continue
            command, _, comment = stripped.partition(" #")
            m = _MARKER.search("#" + comment)
            found.append((f"{page.relative_to(ROOT)}:{start + 1}", command.strip(), m.group(1) if m else marker))
            marker = None
    return found


def test_docs_commands_are_found():
    assert len(COMMANDS) >= 40, COMMANDS
    assert any("lightning-opt-data" in c for _, c, _ in COMMANDS)
    assert any(c.startswith("pytest") for _, c, _ in COMMANDS) and any(c.startswith("make") for _, c, _ in COMMANDS)


def test_docs_fences_name_their_language():
    untyped = []
    for page in USER_PAGES:
        fence = None
        for i, line in enumerate(page.read_text().split("\n")):
            if line.lstrip().startswith("```"):
                if fence is None and not line.strip()[3:].strip():
                    untyped.append(f"{page.relative_to(ROOT)}:{i + 1}")
                fence = None if fence is not None else line
    assert not untyped, f"fenced blocks without a language (```bash for commands, ```text otherwise): {untyped}"


def _recipe_main(name: str):
    import importlib

    return importlib.import_module(f"lightning_opt.recipes.{name}").main


def _recipe_call(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(recipe, its arguments)`` for a console script or ``python -m lightning_opt.recipes.<recipe>``, after
    any launcher (``srun``, ``torchrun ... -m``)."""
    for i, arg in enumerate(argv):
        if m := _RECIPE_SCRIPT.search(arg):
            return m.group(1), argv[i + 1 :]
        if i > 0 and argv[i - 1] == "-m" and (m := _RECIPE_MODULE.fullmatch(arg)):
            return m.group(1), argv[i + 1 :]
    return None


def _launches_ours(command: str) -> bool:
    import shlex

    argv = shlex.split(command)
    return _recipe_call(argv) is not None or argv[0].endswith("lightning-opt-data")


COMMANDS = _doc_commands(USER_PAGES) + [c for c in _doc_commands(NOTES_PAGES) if _launches_ours(c[1])]


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
    if marker is not None:
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


def _check_benchmark(where: str, module: str, args: list[str], marker: str | None, tmp_path: Path, capsys) -> None:
    """A benchmark line (``python -m benchmarks.X``): its smoke variant runs; a marked one is checked against the
    module's ``--help``."""
    import importlib.util
    import os
    import runpy
    import subprocess
    import sys

    assert importlib.util.find_spec(module) is not None, f"{where}: {module} does not exist"
    if marker is None:
        assert any(a in _SMOKE for a in args), (
            f"{where}: a benchmark's full run is not run here: show its smoke variant ({'/'.join(_SMOKE)}) or mark "
            "the line # [GPU] or # [long]")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"{where}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        return
    old_argv = sys.argv
    sys.argv = [module, "--help"]
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as info:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = old_argv
    help_text = capsys.readouterr().out
    assert info.value.code in (0, None) and "usage:" in help_text, f"{where}: --help exits {info.value.code}"
    flags = {a.partition("=")[0] for a in args if a.startswith("--")}
    unknown = sorted(f for f in flags if not re.search(rf"{re.escape(f)}\b(?!-)", help_text))
    assert not unknown, f"{where}: {module} has no {unknown} (see its --help)"


def _makefile() -> tuple[set[str], set[str], dict[str, str]]:
    """The Makefile's targets, the variables it reads, and its ``VAR ?= default`` values."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.M))
    defaults = dict(re.findall(r"^(\w+)\s*\?=\s*(\S*)", text, flags=re.M))
    variables = set(re.findall(r"\$\((\w+)\)", text)) | set(defaults)
    return targets, variables, defaults


def _check_tool(where: str, argv: list[str]) -> None:
    """``make``, ``pip install``, ``source``, ``pytest``, ``tensorboard``: what the line names exists."""
    import shlex

    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest's own TOML parser
        import tomli as tomllib

    tool, args = argv[0], argv[1:]
    if tool == "make":
        targets, variables, _ = _makefile()
        for arg in args:
            name, eq, _ = arg.partition("=")
            if eq:
                assert name in variables, f"{where}: the Makefile reads no variable {name}"
            else:
                assert arg in targets, f"{where}: the Makefile has no target {arg!r} (it has {sorted(targets)})"
        if "PYTEST_ARGS" in " ".join(args):
            value = next(a.partition("=")[2] for a in args if a.startswith("PYTEST_ARGS="))
            _check_tool(where, ["pytest", *shlex.split(value)])
        return
    if tool in ("pip", "pip3") or argv[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
        meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        extras = set(meta.get("optional-dependencies", {}))
        assert "install" in argv, f"{where}: {' '.join(argv)!r}"
        for arg in argv[argv.index("install") + 1 :]:
            if m := re.fullmatch(r"(?:lightning-opt|\.|-e|\S*/)?\[([\w,-]+)\]", arg):
                missing = set(m.group(1).split(",")) - extras
                assert not missing, f"{where}: pyproject.toml has no extra {sorted(missing)} (it has {sorted(extras)})"
        return
    if tool in ("source", "."):
        venv = _makefile()[2].get("VENV", ".venv")
        assert args == [f"{venv}/bin/activate"], f"{where}: make creates {venv}/bin/activate, not {args}"
        return
    if tool == "pytest":
        config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
        markers = {m.split(":")[0].strip() for m in config.get("markers", [])}
        it = iter(args)
        for arg in it:
            if arg == "-m":
                names = set(re.findall(r"\w+", next(it))) - {"and", "or", "not"}
                assert names <= markers, f"{where}: no pytest marker {sorted(names - markers)} (registered: {markers})"
            elif not arg.startswith("-"):
                path = arg.split("::")[0]
                assert (ROOT / path).exists() or "<" in path, f"{where}: {path} does not exist"
        return
    if tool == "tensorboard":
        import yaml

        assert "--logdir" in args, f"{where}: tensorboard without --logdir"
        logdir = args[args.index("--logdir") + 1]
        save_dirs = set()
        for config in (ROOT / "lightning_opt" / "recipes" / "configs").rglob("*.yaml"):
            logger = (yaml.safe_load(config.read_text()) or {}).get("trainer", {}).get("logger")
            if isinstance(logger, dict) and "TensorBoard" in str(logger.get("class_path", "")):
                save_dirs.add(str(logger.get("init_args", {}).get("save_dir", "lightning_logs")))
        assert logdir.split("/")[0] in {d.split("/")[0] for d in save_dirs}, (
            f"{where}: the recipes' TensorBoard loggers write under {sorted(save_dirs)}, not {logdir}")
        return
    pytest.fail(f"{where}: {' '.join(argv)!r} is no command this test runs or checks (see the top of this section)")


@pytest.mark.parametrize("where,command,marker", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_docs_command_runs(where, command, marker, tmp_path, monkeypatch, capsys):
    import os
    import shlex

    argv = [os.path.expandvars(a) for a in shlex.split(command)]
    argv = [str(ROOT / a) if a.startswith("docs/") else a for a in argv]
    _workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    if argv[0].endswith("lightning-opt-data"):
        _run_data_cli(argv[1:], marker, capsys)
        return
    if (call := _recipe_call(argv)) is not None:
        name, args = call
        if argv[0] in ("srun", "torchrun", "mpirun"):
            assert marker == "GPU", f"{where}: a launcher's command runs on several GPUs: mark it # [GPU]"
        if name == "sample":  # it needs a run to sample from: the demo's, one step, where the docs train it
            _run_recipe(_recipe_main("gpt2"), ["--config", "gpt2/demo"], None, "gpt2")
            assert _recipe_main("sample")([*args, "--max_new_tokens", "8"])
            return
        _run_recipe(_recipe_main(name), args, marker, name)
        return
    if re.fullmatch(r"\S*python3?", argv[0]) and len(argv) > 1:
        if argv[1] == "-c":
            exec(compile(argv[2], where, "exec"), {"__name__": "__docs__"})
            return
        if argv[1] == "-m" and argv[2].startswith("benchmarks."):
            _check_benchmark(where, argv[2], argv[3:], marker, tmp_path, capsys)
            return
    _check_tool(where, argv)


# -- every documented Python snippet runs ------------------------------------------------------------
#
# ```python blocks of README.md and docs/ (not docs/benchmarks/, whose pages are results) are executed here,
# each alone in a fresh namespace, in a scratch folder, offline. A block that needs a GPU, several processes
# or the network, or that is a fragment of a larger program (a method body, a line of a training_step),
# says so on its first line with a marker comment, and is then compiled only:
#   # [GPU] ...   # [network] ...   # [fragment] ...
# ```yaml blocks are parsed with yaml.safe_load.

_PY_MARKER = re.compile(r"^#\s*\[(GPU|network|fragment)\]")


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
