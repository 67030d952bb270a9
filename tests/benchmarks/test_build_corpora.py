"""benchmarks/build_corpora.py --smoke: shard format, exact train budget, train/val disjoint, reproducible bytes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from benchmarks import build_corpora
from lightning_opt.data.shards import HEADER_INTS, MAGIC, VERSION
from tests.data._shared import BPE, SHARED

NOVELS = SHARED / "novels"
HAVE_BPE = BPE.is_file()
HAVE_NOVELS = HAVE_BPE and (NOVELS / "novels_train_000000.bin").is_file()
TRAIN, VAL = 2500, 800


@pytest.fixture(scope="module")
def bc():
    return build_corpora


def _code_roots(tmp: Path) -> list[str]:
    """A small, fixed code root (synthetic files, so the test does not depend on what is installed) plus the
    standard library's json package."""
    root = tmp / "src"
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    for i in range(40):
        (root / "pkg" / f"mod_{i:02d}.py").write_text(f'"""Module {i}."""\n\n\ndef f{i}(x):\n    return x * {i}\n' * 3)
    (root / "pkg" / "copy_of_mod_00.py").write_text((root / "pkg" / "mod_00.py").read_text())  # a duplicate
    (root / "pkg" / "tests" / "test_x.py").write_text("def test_x():\n    pass\n")
    (root / "pkg" / "test_y.py").write_text("def test_y():\n    pass\n")
    (root / "pkg" / "empty.py").write_text("\n")
    (root / "pkg" / "__pycache__" / "cached.py").write_text("x = 1\n")
    json_pkg = Path(json.__file__).parent
    return [f"src={root}", f"stdlib={json_pkg}"]


def _args(out: Path, roots: list[str], corpora: str) -> list[str]:
    args = ["--smoke", "--out", str(out), "--corpora", corpora, "--train-tokens", str(TRAIN),
            "--val-tokens", str(VAL), "--max-files", "60", "--workers", "2"]
    for r in roots:
        args += ["--code-root", r]
    if HAVE_BPE:
        args += ["--tokenizer", "gpt2", "--bpe-file", str(BPE)]
    else:
        args += ["--tokenizer", "byte"]
    if HAVE_NOVELS:
        args += ["--novels-dir", str(NOVELS)]
    return args


def _read(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    header = np.frombuffer(raw[: HEADER_INTS * 4], dtype="<i4")
    assert header[0] == MAGIC and header[1] == VERSION
    tokens = np.frombuffer(raw[HEADER_INTS * 4:], dtype="<u2")
    assert header[2] == len(tokens)
    return tokens


def _docs(tokens: np.ndarray, eot: int) -> list[bytes]:
    starts = np.flatnonzero(tokens == eot)
    assert len(starts) and starts[0] == 0, "every document starts with the end-of-text token"
    return [d.tobytes() for d in np.split(tokens, starts[1:])]


@pytest.fixture(scope="module")
def builds(bc, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpora")
    roots = _code_roots(tmp)
    corpora = ",".join(c for c in bc.CORPORA if c != "novels" or HAVE_NOVELS)
    if not (shutil.which("groff") and bc.MAN_DIR.is_dir()):  # the docs corpus needs man pages and groff
        corpora = corpora.replace(",docs", "")
    outs = []
    for name in ("a", "b"):
        bc.main(_args(tmp / name, roots, corpora))
        outs.append(tmp / name)
    return outs, corpora.split(","), roots, tmp


def test_format_budget_and_disjoint_split(bc, builds):
    (out, _), corpora, _, _ = builds
    merged = json.loads((out / "corpora_manifest.json").read_text())
    assert merged["held_out"] == "docs" and merged["tuned_on"] == ["novels", "code"]
    for corpus in corpora:
        m = json.loads((out / corpus / "manifest.json").read_text())
        assert merged["corpora"][corpus]["shards"] == m["shards"]
        eot = m["tokenizer"]["eot"]
        train = _read(out / corpus / f"{corpus}_train_000000.bin")
        val = _read(out / corpus / f"{corpus}_val_000000.bin")
        assert len(train) == TRAIN == m["tokens"]["train"]  # cut exactly to the budget
        assert len(val) >= VAL and len(val) == m["tokens"]["val"]
        val_docs = _docs(val, eot)
        assert len(val_docs) == m["documents"]["val"]
        # val is whole documents: dropping its last document leaves less than the minimum
        assert len(val) - len(val_docs[-1]) // 2 < VAL
        train_docs = _docs(train, eot)
        assert len(train_docs) == m["documents"]["train"]
        rows = [line.split("\t") for line in (out / corpus / "documents.tsv").read_text().splitlines()[1:]]
        keys = {s: {r[5] for r in rows if r[0] == s} for s in ("train", "val")}
        shas = {s: {r[4] for r in rows if r[0] == s} for s in ("train", "val")}
        assert keys["train"] and keys["val"] and not keys["train"] & keys["val"]
        assert not shas["train"] & shas["val"]
        # no val document appears in train (the last train document may be cut, so compare as prefixes too)
        assert not set(train_docs[:-1]) & set(val_docs)
        assert not any(v.startswith(train_docs[-1]) for v in val_docs)
        for name, info in m["shards"].items():
            assert hashlib.sha256((out / corpus / name).read_bytes()).hexdigest() == info["sha256"]
        if corpus == "code":
            used = keys["train"] | keys["val"]
            assert not any("/tests/" in k or "test_" in k or "__pycache__" in k for k in used)
            assert not {"src/pkg/copy_of_mod_00.py", "src/pkg/mod_00.py"} <= used  # deduplicated
            assert m["files"]["dropped: duplicate (same sha256 as an earlier file)"] == 1


def test_two_builds_are_identical(builds):
    (a, b), corpora, _, _ = builds
    for corpus in corpora:
        for name in (f"{corpus}_train_000000.bin", f"{corpus}_val_000000.bin", "documents.tsv", "manifest.json"):
            assert (a / corpus / name).read_bytes() == (b / corpus / name).read_bytes(), (corpus, name)


def test_refuses_to_overwrite(bc, builds):
    (a, _), corpora, roots, _ = builds
    before = (a / "code" / "code_train_000000.bin").read_bytes()
    with pytest.raises(SystemExit, match="--overwrite"):
        bc.main(_args(a, roots, "code"))
    assert (a / "code" / "code_train_000000.bin").read_bytes() == before
    bc.main([*_args(a, roots, "code"), "--overwrite"])
    assert (a / "code" / "code_train_000000.bin").read_bytes() == before


def test_novels_recut_matches_the_shared_shards(bc, builds):
    if not HAVE_NOVELS:
        pytest.skip("shared novels shards not present")
    (a, _), _, _, _ = builds
    src = _read(NOVELS / "novels_train_000000.bin")
    assert np.array_equal(_read(a / "novels" / "novels_train_000000.bin"), src[:TRAIN])
    val = _read(a / "novels" / "novels_val_000000.bin")
    assert np.array_equal(val, _read(NOVELS / "novels_val_000000.bin")[: len(val)])


def test_page_renders_from_the_manifest(bc, builds, monkeypatch):
    (a, _), _, _, tmp = builds
    page = bc.write_page(json.loads((a / "corpora_manifest.json").read_text()), tmp / "corpora.md")
    text = page.read_text()
    assert "tuned on two corpora, **novels** and **code**" in text and "confirmed" in text
    assert f"{TRAIN:,}" in text
