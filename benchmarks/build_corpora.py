"""Build three GPT-2-BPE token corpora of different kinds, offline and reproducibly, each cut to the novels' budget.

* ``novels``: prose; the novels shards re-cut (their train shard is exactly the budget, so it is copied
  byte for byte; validation is a prefix of whole documents of the novels val shard).
* ``code``: Python source files of the standard library and of the installed packages (``sysconfig``'s
  ``stdlib``, ``purelib`` and ``platlib``), one file per document.
* ``docs``: technical documentation: the English man pages (``/usr/share/man/man*``) rendered to plain
  text with groff, plus the plain-text README / NEWS / changelog / ``.txt`` / ``.md`` / ``.rst`` files of
  ``/usr/share/doc``; one page or file per document.

The recipe is tuned on ``novels`` and ``code`` and confirmed, unchanged, on ``docs`` (held out).

Rule (the same for ``code`` and ``docs``): candidate files are listed in sorted path order; files in
excluded folders, tests, symlinks, files over 512 KiB (generated), code with a line over 4096 characters,
non-UTF-8 and empty files are dropped; identical files (same sha256) keep the first in sorted order;
man pages sharing a name prefix before the first ``_`` keep the first 64 (16,630 generated
``gcloud_*`` command pages would otherwise be most of the corpus). The survivors are put in a fixed
pseudo-random order (sha256 of the document's key, e.g. ``stdlib/json/decoder.py``) so a prefix samples
every package; document ``i`` of that order is validation when ``floor((i+1)/10) > floor(i/10)`` (every
10th, ``lightning_opt.data.prepare.is_val_doc``), else train. Train is the train documents in order, the
last one cut so that train holds exactly ``--train-tokens`` (16,649,031, the novels' train shard);
validation is the validation documents in order, whole, until it holds at least ``--val-tokens``
(1,048,576, what ``benchmarks/gpt2_record.py`` evaluates). Tokenization is ``lightning-opt-data
prepare``'s Python API (:func:`lightning_opt.data.prepare.write_documents`), each document preceded by
the end-of-text token. The output depends only on the source files and the BPE file, not on how much of
the source is read, so a build is byte-for-byte reproducible on the same machine image.

Writes ``<out>/<corpus>/<corpus>_{train,val}_000000.bin``, ``documents.tsv`` (split, index, tokens,
sha256 and key of every document used) and ``manifest.json`` (sources, file counts, token counts, the
rule, sha256 of each shard); ``<out>/corpora_manifest.json`` merges the manifests. A full build of all
three also writes ``benchmarks/results/corpora_manifest.json`` and ``docs/benchmarks/corpora.md``.
Refuses to overwrite without ``--overwrite``. Runs on CPU::

    python -m benchmarks.build_corpora --bpe-file r50k_base.tiktoken --novels-dir DIR   # minutes
    python -m benchmarks.build_corpora --smoke --out /tmp/corpora                         # seconds
    python -m benchmarks.build_corpora --report   # rewrite the docs page from the committed manifest

``--novels-dir`` defaults to ``$LIGHTNING_OPT_SHARED_DATA/novels``, else ``$LIGHTNING_OPT_DATA_DIR``,
else ``.data/novels``; ``--bpe-file`` to ``$LIGHTNING_OPT_BPE_FILE``, else
``$LIGHTNING_OPT_SHARED_DATA/gpt2/r50k_base.tiktoken``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._results import command_line, environment, load_result, payload, write_result
from lightning_opt.data.prepare import is_val_doc, write_documents
from lightning_opt.data.shards import read_shard, resolve_files, write_shard
from lightning_opt.data.tokenizer import BPE_FILE_ENV, ByteTokenizer, GPT2Tokenizer, get_tokenizer

ROOT = Path(__file__).resolve().parents[1]

CORPORA = ("novels", "code", "docs")
TUNED_ON = ("novels", "code")
HELD_OUT = "docs"
TRAIN_TOKENS = 16_649_031  # the novels train shard
VAL_TOKENS = 1_048_576  # benchmarks/gpt2_common.py VAL_TOKENS: what the record benchmark evaluates
SMOKE_TRAIN_TOKENS, SMOKE_VAL_TOKENS, SMOKE_MAX_FILES = 3000, 1000, 120
VAL_FRACTION = 0.1
MAX_FILE_BYTES = 512 * 1024
MAX_LINE_CHARS = 4096
MAN_FAMILY_CAP = 64
ROUND_DOCS, ROUND_CHARS = 512, 4_000_000
SHARED_ENV, DATA_DIR_ENV = "LIGHTNING_OPT_SHARED_DATA", "LIGHTNING_OPT_DATA_DIR"
MAN_DIR, DOC_DIR = Path("/usr/share/man"), Path("/usr/share/doc")  # Debian/FHS system locations
RESULTS_MANIFEST = ROOT / "benchmarks" / "results" / "corpora_manifest.json"
DOCS_PAGE = ROOT / "docs" / "benchmarks" / "corpora.md"

CODE_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", "testing", "idle_test",
                  ".git", "node_modules"}
DOC_NAME = re.compile(r"^(readme|news|changes|changelog|history)([._-].*)?$|\.(txt|md|rst)$", re.I)
MAN_SECTION = re.compile(r"^man[1-9n]\w*$")
GROFF = ["groff", "-mandoc", "-t", "-k", "-Tutf8", "-P-c", "-P-b", "-P-o", "-P-u", "-rLL=78n", "-rcR=1",
         "-rHY=0"]
ORDER_RULE = "sorted by sha256 of the document key (a fixed pseudo-random order; a prefix samples every source)"
SPLIT_RULE = ("document i of that order is val when floor((i+1)*0.1) > floor(i*0.1) (every 10th, "
              "lightning_opt.data.prepare.is_val_doc), else train; train = train documents in order, the last "
              "one cut to give exactly train_tokens; val = val documents in order, whole, until >= val_tokens")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------
@dataclass
class Doc:
    key: str  # source name / path relative to its root, e.g. "stdlib/json/decoder.py"
    sha256: str  # of the source bytes (decompressed)
    load: Callable[[], str | None]  # the document's text (None: drop it)


def sorted_walk(root: Path, skip_dir: Callable[[str], bool] = lambda name: False) -> Iterator[Path]:
    """Files under ``root`` in sorted path order (names compared per component); symlinked folders are not
    followed, symlinked files are yielded (the caller decides)."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            if not skip_dir(e.name):
                yield from sorted_walk(Path(e.path), skip_dir)
        elif e.is_file() or e.is_symlink():
            yield Path(e.path)


def read_maybe_gz(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def portable(path: str) -> str:
    """A source root as ``{base_prefix}/...`` / ``{prefix}/...`` so manifests name no checkout path."""
    for name, prefix in (("prefix", sys.prefix), ("base_prefix", sys.base_prefix)):
        if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            return "{" + name + "}" + path[len(prefix):]
    return path


def code_roots(overrides: list[str]) -> list[tuple[str, Path]]:
    if overrides:
        return [(name, Path(p)) for name, p in (o.split("=", 1) for o in overrides)]
    paths = sysconfig.get_paths()
    roots: list[tuple[str, Path]] = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and all(p.resolve() != r.resolve() for _, r in roots):
            roots.append((key, p))
    return roots


class Counter(collections.Counter):
    def drop(self, reason: str) -> None:
        self[f"dropped: {reason}"] += 1


def text_file_doc(path: Path, key: str, counts: Counter, max_line: int | None = None) -> Doc | None:
    """A text file (gzip decompressed) as a document, or ``None`` (counted under why) for a symlink, an
    unreadable, oversized, non-UTF-8 or empty file, or one with a line over ``max_line`` characters."""
    if path.is_symlink():
        counts.drop("symlink")
        return None
    try:
        data = read_maybe_gz(path)
    except (OSError, EOFError, gzip.BadGzipFile):
        counts.drop("unreadable")
        return None
    if len(data) > MAX_FILE_BYTES:
        counts.drop(f"over {MAX_FILE_BYTES // 1024} KiB")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        counts.drop("not UTF-8")
        return None
    if not text.strip():
        counts.drop("empty")
        return None
    if max_line is not None and max(map(len, text.splitlines())) > max_line:
        counts.drop(f"a line over {max_line} characters (generated)")
        return None
    sha = hashlib.sha256(data).hexdigest()
    return Doc(key, sha, _text_loader(path, sha))


def code_docs(roots: list[tuple[str, Path]], max_files: int | None, counts: Counter) -> list[Doc]:
    docs: list[Doc] = []
    for name, root in roots:
        n = 0
        for path in sorted_walk(root, lambda d: d in CODE_SKIP_DIRS or d.endswith((".dist-info", ".egg-info"))):
            if path.suffix != ".py":
                continue
            if max_files is not None and n >= max_files:
                break
            n += 1
            counts["python files seen"] += 1
            stem = path.stem
            if stem.startswith("test_") or stem.endswith("_test") or stem == "conftest":
                counts.drop("test file")
                continue
            doc = text_file_doc(path, f"{name}/{path.relative_to(root).as_posix()}", counts, MAX_LINE_CHARS)
            if doc is not None:
                docs.append(doc)
    return docs


def _read_checked(path: Path, sha: str) -> bytes:
    data = read_maybe_gz(path)
    if hashlib.sha256(data).hexdigest() != sha:
        raise RuntimeError(f"'{path}' changed during the build; run it again")
    return data


def _text_loader(path: Path, sha: str) -> Callable[[], str | None]:
    return lambda: _read_checked(path, sha).decode("utf-8")


def _man_loader(path: Path, sha: str) -> Callable[[], str | None]:
    def load() -> str | None:
        data = _read_checked(path, sha)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        try:
            out = subprocess.run(GROFF, input=data, capture_output=True, env=env, timeout=60, check=True)
        except (subprocess.SubprocessError, OSError):
            return None
        text = out.stdout.decode("utf-8", errors="replace")
        text = "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")
        return text + "\n" if text.strip() else None
    return load


def docs_docs(man_dir: Path, doc_dir: Path, max_files: int | None, counts: Counter) -> list[Doc]:
    docs: list[Doc] = []
    family: collections.Counter[str] = collections.Counter()
    n = 0
    sections = sorted(p for p in man_dir.iterdir() if MAN_SECTION.match(p.name)) if man_dir.is_dir() else []
    for section in sections:
        for path in sorted_walk(section):
            if max_files is not None and n >= max_files:
                break
            n += 1
            counts["man pages seen"] += 1
            if path.is_symlink():
                counts.drop("man page symlink (alias)")
                continue
            name = path.name.removesuffix(".gz").rsplit(".", 1)[0]
            fam = name.split("_", 1)[0] if "_" in name else name
            if family[fam] >= MAN_FAMILY_CAP:
                counts.drop(f"man page beyond the first {MAN_FAMILY_CAP} of its name prefix")
                continue
            try:
                data = read_maybe_gz(path)
            except (OSError, EOFError, gzip.BadGzipFile):
                counts.drop("unreadable")
                continue
            first = next((ln for ln in data.splitlines() if ln.strip() and not ln.startswith((b'.\\"', b"'\\\""))),
                         b"")
            if first.startswith(b".so "):
                counts.drop("man page alias (.so)")
                continue
            family[fam] += 1
            sha = hashlib.sha256(data).hexdigest()
            docs.append(Doc(f"man/{path.relative_to(man_dir).as_posix()}", sha, _man_loader(path, sha)))
    n = 0
    if doc_dir.is_dir():
        for path in sorted_walk(doc_dir):
            base = path.name.removesuffix(".gz")
            if not DOC_NAME.search(base):
                continue
            if max_files is not None and n >= max_files:
                break
            n += 1
            counts["doc files seen"] += 1
            doc = text_file_doc(path, f"doc/{path.relative_to(doc_dir).as_posix()}", counts)
            if doc is not None:
                docs.append(doc)
    return docs


def dedupe_and_order(docs: list[Doc], counts: Counter) -> list[Doc]:
    seen: set[str] = set()
    unique = []
    for d in sorted(docs, key=lambda d: d.key):
        if d.sha256 in seen:
            counts.drop("duplicate (same sha256 as an earlier file)")
            continue
        seen.add(d.sha256)
        unique.append(d)
    counts["candidate documents"] = len(unique)
    return sorted(unique, key=lambda d: hashlib.sha256(d.key.encode()).hexdigest())


def loaded(docs: list[Doc], workers: int) -> Iterator[tuple[Doc, str | None]]:
    """Each document with its text, loaded (man pages rendered) ``workers`` at a time, in order, lazily."""
    window: collections.deque[tuple[Doc, Future]] = collections.deque()
    with ThreadPoolExecutor(workers) as pool:
        it = iter(docs)
        for d in it:
            window.append((d, pool.submit(d.load)))
            if len(window) >= 2 * workers:
                break
        while window:
            d, fut = window.popleft()
            nxt = next(it, None)
            if nxt is not None:
                window.append((nxt, pool.submit(nxt.load)))
            yield d, fut.result()


# --------------------------------------------------------------------------------------------------
# Tokenizing and cutting
# --------------------------------------------------------------------------------------------------
def tokenize_round(texts: list[str], tok: ByteTokenizer | GPT2Tokenizer, staging: Path) -> list[np.ndarray]:
    """Tokenize documents with ``lightning-opt-data prepare``'s API; one array per document, each starting
    with the end-of-text token."""
    write_documents(texts, staging, tok, val_fraction=0.0, shard_tokens=2**40, prefix="round", overwrite=True,
                    source="build_corpora round")
    tokens = np.array(read_shard(staging / "round_train_000000.bin"))
    starts = np.flatnonzero(tokens == tok.eot)
    if len(starts) != len(texts) or (len(starts) and starts[0] != 0):
        raise RuntimeError(f"expected {len(texts)} documents in the round, found {len(starts)} end-of-text tokens")
    return np.split(tokens, starts[1:])


class Cutter:
    """Routes documents (in order) to train / val and cuts train at exactly ``train_tokens``."""

    def __init__(self, train_tokens: int, val_tokens: int) -> None:
        self.train_budget, self.val_min = train_tokens, val_tokens
        self.parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        self.n = {"train": 0, "val": 0}
        self.rows: list[tuple[str, int, int, int, str, str]] = []  # split, index, used, total, sha256, key
        self.index = 0

    @property
    def done(self) -> bool:
        return self.n["train"] >= self.train_budget and self.n["val"] >= self.val_min

    def add(self, tokens: np.ndarray, sha: str, key: str) -> bool:
        """Route the next document; whether any of it was used."""
        i = self.index
        self.index += 1
        split = "val" if is_val_doc(i, VAL_FRACTION) else "train"
        if split == "train":
            left = self.train_budget - self.n["train"]
            if left <= 0:
                return False
            used = tokens[:left]
        else:
            if self.n["val"] >= self.val_min:
                return False
            used = tokens
        self.parts[split].append(used)
        self.n[split] += len(used)
        self.rows.append((split, i, len(used), len(tokens), sha, key))
        return True

    def arrays(self) -> dict[str, np.ndarray]:
        return {s: np.concatenate(p) if p else np.empty(0, np.uint16) for s, p in self.parts.items()}


def build_from_files(corpus: str, docs: list[Doc], tok: ByteTokenizer | GPT2Tokenizer, train_tokens: int,
                     val_tokens: int, counts: Counter, workers: int) -> Cutter:
    cut = Cutter(train_tokens, val_tokens)
    t0, last = time.time(), 0.0
    with tempfile.TemporaryDirectory(prefix=f"build_corpora_{corpus}_") as tmp:
        staging = Path(tmp)
        batch: list[tuple[int, Doc, str]] = []
        chars, round_docs, read, last_used = 0, 16, 0, -1
        failed: list[int] = []  # positions in the order of documents that rendered to nothing

        def flush() -> None:
            nonlocal batch, chars, last, last_used
            for (pos, d, _), tokens in zip(batch, tokenize_round([t for _, _, t in batch], tok, staging)):
                if cut.add(tokens, d.sha256, d.key):
                    last_used = pos
            batch, chars = [], 0
            if time.time() - last > 5 or cut.done:
                last = time.time()
                log(f"[{corpus}] {read:,}/{counts['candidate documents']:,} documents read, "
                    f"train {cut.n['train']:,}/{train_tokens:,}, val {cut.n['val']:,}/{val_tokens:,} tokens, "
                    f"{last - t0:.0f}s")

        for pos, (d, text) in enumerate(loaded(docs, workers)):
            read = pos + 1
            if text is None or not text.strip():
                failed.append(pos)
                continue
            batch.append((pos, d, text))
            chars += len(text)
            if len(batch) >= round_docs or chars >= ROUND_CHARS:
                flush()
                round_docs = min(2 * round_docs, ROUND_DOCS)  # small first rounds: a tiny budget reads little
                if cut.done:
                    break
        if batch and not cut.done:
            flush()
    # counted up to the last document used, so the counts do not depend on how far the build read ahead
    counts["documents in order up to the last one used"] = last_used + 1
    n_failed = sum(pos < last_used for pos in failed)
    if n_failed:
        counts["dropped: rendered to nothing / failed to render"] = n_failed
    if not cut.done:
        raise RuntimeError(
            f"corpus '{corpus}' has only {cut.n['train']:,} train / {cut.n['val']:,} val tokens in "
            f"{counts['candidate documents']:,} documents; it needs {train_tokens:,} / {val_tokens:,}"
        )
    return cut


def build_novels(novels_dir: Path, tok: ByteTokenizer | GPT2Tokenizer, train_tokens: int,
                 val_tokens: int, counts: Counter) -> tuple[Cutter, dict[str, Any]]:
    """Re-cut the novels shards: train = the first ``train_tokens`` of the train shards, val = whole
    documents of the val shards until ``val_tokens``. Documents are the end-of-text-separated runs."""
    if not isinstance(tok, GPT2Tokenizer):
        raise ValueError("the novels shards hold GPT-2 token ids; build 'novels' with --tokenizer gpt2")
    cut = Cutter(train_tokens, val_tokens)
    sources: dict[str, Any] = {}
    for split in ("train", "val"):
        files = resolve_files(str(novels_dir / f"novels_{split}_*.bin"))
        sources[split] = [{"file": p.name, "tokens": int(len(read_shard(p))), "sha256": sha256_file(p)}
                          for p in files]
        stream = np.concatenate([np.array(read_shard(p)) for p in files])
        starts = np.flatnonzero(stream == tok.eot)
        if not len(starts) or starts[0] != 0:
            raise ValueError(f"novels {split} shards do not start with the end-of-text token {tok.eot}")
        counts[f"{split} documents in the source shards"] = len(starts)
        for j, doc in enumerate(np.split(stream, starts[1:])):
            key = f"novels_{split}#{j}"
            sha = hashlib.sha256(doc.astype("<u2").tobytes()).hexdigest()
            if split == "train":
                if cut.n["train"] >= train_tokens:
                    break
                used = doc[: train_tokens - cut.n["train"]]
            else:
                if cut.n["val"] >= val_tokens:
                    break
                used = doc
            cut.parts[split].append(used)
            cut.n[split] += len(used)
            cut.rows.append((split, j, len(used), len(doc), sha, key))
    if not cut.done:
        raise RuntimeError(f"the novels shards in '{novels_dir}' hold {cut.n['train']:,} train / "
                           f"{cut.n['val']:,} val tokens; {train_tokens:,} / {val_tokens:,} are needed")
    return cut, sources


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------
def output_names(corpus: str) -> list[str]:
    return [f"{corpus}_train_000000.bin", f"{corpus}_val_000000.bin", "documents.tsv", "manifest.json"]


def check_free(out: Path, corpora: list[str], overwrite: bool) -> None:
    for corpus in corpora:
        existing = [n for n in output_names(corpus) if (out / corpus / n).exists()]
        if existing and not overwrite:
            raise FileExistsError(f"'{out / corpus}' already has {', '.join(existing)}; pass --overwrite to "
                                  f"replace them, or choose another --out")


def write_corpus(out: Path, corpus: str, cut: Cutter, manifest: dict[str, Any]) -> dict[str, Any]:
    folder = out / corpus
    folder.mkdir(parents=True, exist_ok=True)
    for n in output_names(corpus):
        (folder / n).unlink(missing_ok=True)
    arrays = cut.arrays()
    shards = {}
    for split in ("train", "val"):
        path = write_shard(folder / f"{corpus}_{split}_000000.bin", arrays[split])
        shards[path.name] = {"split": split, "tokens": int(len(arrays[split])), "bytes": path.stat().st_size,
                             "sha256": sha256_file(path)}
    tsv = folder / "documents.tsv"
    lines = ["split\tindex\ttokens_used\ttokens\tsha256\tkey"]
    lines += ["\t".join(map(str, row)) for row in cut.rows]
    tsv.write_text("\n".join(lines) + "\n")
    docs = {s: sum(r[0] == s for r in cut.rows) for s in ("train", "val")}
    last_train = next((r for r in reversed(cut.rows) if r[0] == "train"), None)
    manifest.update({
        "tokens": {s: int(len(arrays[s])) for s in ("train", "val")},
        "documents": {**docs, "train_last_cut": f"{last_train[2]} of {last_train[3]} tokens" if last_train else ""},
        "shards": shards,
        "document_list": {"file": tsv.name, "rows": len(cut.rows), "sha256": sha256_file(tsv)},
    })
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def tool_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "not found"
    return (out.stdout.strip().splitlines() or ["unknown"])[0]


def installed_packages() -> list[str]:
    from importlib import metadata

    return sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]},
                  key=str.lower)


def default_bpe_file() -> str | None:
    if os.environ.get(BPE_FILE_ENV):
        return os.environ[BPE_FILE_ENV]
    shared = os.environ.get(SHARED_ENV)
    if shared and (Path(shared) / "gpt2" / "r50k_base.tiktoken").is_file():
        return str(Path(shared) / "gpt2" / "r50k_base.tiktoken")
    return None


def default_novels_dir() -> Path:
    if os.environ.get(SHARED_ENV):
        return Path(os.environ[SHARED_ENV]) / "novels"
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    return ROOT / ".data" / "novels"


def merge(out: Path) -> dict[str, Any]:
    corpora = {}
    for corpus in CORPORA:
        path = out / corpus / "manifest.json"
        if path.is_file():
            corpora[corpus] = json.loads(path.read_text())
    return {
        "benchmark": "build_corpora",
        "smoke": any(m.get("smoke") for m in corpora.values()),
        "tuned_on": list(TUNED_ON),
        "held_out": HELD_OUT,
        "format": "FineWeb/llm.c .bin: 256 int32 header [20240520, 1, n_tokens] + uint16 tokens",
        "corpora": corpora,
    }


# --------------------------------------------------------------------------------------------------
# The docs page
# --------------------------------------------------------------------------------------------------
PAGE_HEAD = """<!-- generated by benchmarks/build_corpora.py --report from benchmarks/results/corpora_manifest.json -->

# Corpora: novels, code, docs

Three GPT-2-BPE token corpora of different kinds, each cut to the same budget as the novels shards
({train:,} train tokens exactly, at least {val:,} validation tokens from documents not in train), built
offline and reproducibly by `benchmarks/build_corpora.py` with the package's own tokenization
(`lightning-opt-data prepare`'s API, `lightning_opt.data.prepare.write_documents`).

**What is held out.** The GPT-2 speedrun recipe is tuned on two corpora, **{tuned}**, and confirmed
on the third, **{held}**, unchanged: no setting is chosen by looking at results on `{held}`.

## Building

```bash
python -m benchmarks.build_corpora --bpe-file r50k_base.tiktoken --novels-dir DIR   # all three, minutes on 2 cores
python -m benchmarks.build_corpora --corpora code --out .data/corpora --overwrite    # one corpus again
python -m benchmarks.build_corpora --smoke --out /tmp/corpora                         # seconds; tiny budget
```

`--bpe-file` defaults to `$LIGHTNING_OPT_BPE_FILE`, else `$LIGHTNING_OPT_SHARED_DATA/gpt2/r50k_base.tiktoken`;
`--novels-dir` to `$LIGHTNING_OPT_SHARED_DATA/novels`, else `$LIGHTNING_OPT_DATA_DIR`, else `.data/novels`.
The output goes to `.data/corpora/<corpus>/` (git-ignored): `<corpus>_{{train,val}}_000000.bin` (FineWeb
`.bin` format), `documents.tsv` (split, index, tokens used, tokens, sha256 and key of every document
used) and `manifest.json`. Existing output is kept unless `--overwrite` is passed. Use a corpus with the
record benchmark through its data folder, e.g. by linking `<corpus>_{{train,val}}_000000.bin` as
`novels_{{train,val}}_000000.bin` in a folder passed as `--data-dir`.

To verify a build, compare the shards' sha256 with
[`benchmarks/results/corpora_manifest.json`](../../benchmarks/results/corpora_manifest.json) (the three
manifests merged). `code` and `docs` depend on the files installed on the machine (the Python packages
listed in the manifest, the man pages and package documentation), so the same hashes need the same machine image;
`novels` depends only on the novels shards.

## What each contains

- **novels** (prose): the novels shards re-cut. The train shard is exactly the budget, so it is copied
  byte for byte; validation is the first whole documents of the novels val shard that reach the minimum.
- **code** (source code): the Python files of the standard library and of the installed packages
  (`sysconfig`'s `stdlib`, `purelib`, `platlib`), one file per document; folders `test`, `tests`,
  `testing`, `idle_test`, `__pycache__`, `site-packages` (under the standard library) and files
  `test_*.py`, `*_test.py`, `conftest.py` are left out, as are files over 512 KiB or with a line over
  4096 characters (generated tables), non-UTF-8 and empty files.
- **docs** (technical documentation): the English man pages (`/usr/share/man/man*`) rendered to plain
  text by groff (`{groff}`), plus README / NEWS / CHANGES / changelog / `.txt` / `.md` / `.rst` files of
  `/usr/share/doc` (gzip decompressed), one page or file per document. Aliases (symlinks, `.so` pages),
  files over 512 KiB and non-UTF-8 files are left out; man pages sharing a name prefix before the first
  `_` keep the first 64 (the machine has 16,630 generated `gcloud_*` command pages).

**Split rule (code, docs).** Identical files keep the first in sorted path order; the rest are {order}.
Then {split}.
The output depends only on the source files, not on how many of them the build reads.

## Sizes

| corpus | kind | train tokens | val tokens | train documents | val documents | candidate documents | train shard sha256 | val shard sha256 |
|---|---|---|---|---|---|---|---|---|
"""


def write_page(manifest: dict[str, Any], page: Path) -> Path:
    corpora = manifest["corpora"]
    any_m = next(iter(corpora.values()))
    groff = corpora.get("docs", {}).get("sources", {}).get("groff", "groff")
    head = PAGE_HEAD.format(train=any_m["budget"]["train_tokens"], val=any_m["budget"]["min_val_tokens"],
                            tuned="** and **".join(manifest["tuned_on"]), held=manifest["held_out"],
                            groff=groff, order=ORDER_RULE, split=SPLIT_RULE)
    rows = []
    for name, m in corpora.items():
        sh = {v["split"]: v["sha256"] for v in m["shards"].values()}
        cand = m["files"].get("candidate documents", m["files"].get("train documents in the source shards", ""))
        rows.append(f"| {name} | {m['kind']} | {m['tokens']['train']:,} | {m['tokens']['val']:,} | "
                    f"{m['documents']['train']:,} | {m['documents']['val']:,} | "
                    f"{cand if isinstance(cand, str) else format(cand, ',')} | `{sh['train'][:16]}…` | "
                    f"`{sh['val'][:16]}…` |")
    tail = ["", "The last train document is cut to make the budget exact ("
            + "; ".join(f"{n}: {m['documents']['train_last_cut']}" for n, m in corpora.items()) + ").",
            "Full sha256s, file counts (seen, dropped and why) and sources are in the manifest."]
    page.write_text(head + "\n".join(rows) + "\n" + "\n".join(tail) + "\n")
    return page


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------
def build(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    out = Path(args.out)
    corpora = [c.strip() for c in args.corpora.split(",") if c.strip()]
    unknown = set(corpora) - set(CORPORA)
    if unknown:
        raise SystemExit(f"unknown corpora {sorted(unknown)}; choose from {', '.join(CORPORA)}")
    train_tokens = args.train_tokens or (SMOKE_TRAIN_TOKENS if args.smoke else TRAIN_TOKENS)
    val_tokens = args.val_tokens or (SMOKE_VAL_TOKENS if args.smoke else VAL_TOKENS)
    max_files = args.max_files if args.max_files is not None else (SMOKE_MAX_FILES if args.smoke else None)
    check_free(out, corpora, args.overwrite)
    bpe_file = args.bpe_file or default_bpe_file()
    tok = get_tokenizer(args.tokenizer, bpe_file if args.tokenizer == "gpt2" else None)
    tokenizer = {"name": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot,
                 "bpe_sha256": sha256_file(Path(bpe_file)) if tok.name == "gpt2" and bpe_file else None,
                 "tokenization": "lightning_opt.data.prepare.write_documents (lightning-opt-data prepare)"}
    for corpus in corpora:
        t0 = time.time()
        counts = Counter()
        common = {"corpus": corpus, "smoke": bool(args.smoke), "tokenizer": tokenizer,
                  "budget": {"train_tokens": train_tokens, "min_val_tokens": val_tokens},
                  "held_out": corpus == HELD_OUT}
        if corpus == "novels":
            novels_dir = Path(args.novels_dir) if args.novels_dir else default_novels_dir()
            cut, src = build_novels(novels_dir, tok, train_tokens, val_tokens, counts)
            manifest = {**common, "kind": "prose (novels)", "sources": {"novels_shards": src},
                        "split": {"rule": "train = the first train_tokens tokens of the novels train shards; val = "
                                  "whole documents of the novels val shards, in order, until >= val_tokens"}}
        else:
            if corpus == "code":
                roots = code_roots(args.code_root)
                docs = code_docs(roots, max_files, counts)
                sources = {"roots": {n: portable(str(p)) for n, p in roots},
                           "python": sys.version.split()[0], "packages": installed_packages()}
                kind = "source code (Python)"
            else:
                man_dir, doc_dir = Path(args.man_dir), Path(args.doc_dir)
                docs = docs_docs(man_dir, doc_dir, max_files, counts)
                sources = {"man": str(man_dir) + "/man*", "doc": str(doc_dir), "groff": tool_version(["groff",
                           "--version"]), "groff_command": " ".join(GROFF)}
                kind = "technical documentation (man pages, package docs)"
            sources["max_files_per_root"] = max_files
            docs = dedupe_and_order(docs, counts)
            log(f"[{corpus}] {len(docs):,} candidate documents ({time.time() - t0:.0f}s)")
            cut = build_from_files(corpus, docs, tok, train_tokens, val_tokens, counts, args.workers)
            manifest = {**common, "kind": kind, "sources": sources,
                        "split": {"order": ORDER_RULE, "rule": SPLIT_RULE, "val_fraction": VAL_FRACTION,
                                  "max_file_bytes": MAX_FILE_BYTES, "max_line_chars": MAX_LINE_CHARS,
                                  "man_family_cap": MAN_FAMILY_CAP}}
        manifest["files"] = dict(sorted(counts.items()))
        write_corpus(out, corpus, cut, manifest)
        log(f"[{corpus}] wrote {out / corpus}: {cut.n['train']:,} train, {cut.n['val']:,} val tokens "
            f"({time.time() - t0:.0f}s)")
    merged = merge(out)
    merged["command"] = command_line(argv)
    (out / "corpora_manifest.json").write_text(json.dumps(merged, indent=2) + "\n")
    if not args.smoke and set(merged["corpora"]) == set(CORPORA) and not args.no_results:
        written = write_result(RESULTS_MANIFEST, benchmark="build_corpora", env=environment(on_gpu=False),
                               command=merged["command"], baseline=None,
                               results={k: v for k, v in merged.items() if k not in ("benchmark", "command")})
        page = write_page(payload(written), DOCS_PAGE)
        log(f"wrote {RESULTS_MANIFEST.relative_to(ROOT)} and {page.relative_to(ROOT)}")
    return merged


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / ".data" / "corpora"), help="output folder (default .data/corpora)")
    p.add_argument("--corpora", default=",".join(CORPORA), help="comma-separated subset of novels,code,docs")
    p.add_argument("--tokenizer", default="gpt2", choices=("gpt2", "byte"))
    p.add_argument("--bpe-file", default=None, help=f"r50k_base.tiktoken (default ${BPE_FILE_ENV}, else "
                   f"${SHARED_ENV}/gpt2/r50k_base.tiktoken)")
    p.add_argument("--novels-dir", default=None, help=f"folder of novels_{{train,val}}_*.bin (default "
                   f"${SHARED_ENV}/novels, else ${DATA_DIR_ENV}, else .data/novels)")
    p.add_argument("--code-root", action="append", default=[], metavar="NAME=PATH",
                   help="a code source root (repeatable; default sysconfig stdlib, purelib, platlib)")
    p.add_argument("--man-dir", default=str(MAN_DIR))
    p.add_argument("--doc-dir", default=str(DOC_DIR))
    p.add_argument("--train-tokens", type=int, default=None, help=f"exact train tokens (default {TRAIN_TOKENS:,})")
    p.add_argument("--val-tokens", type=int, default=None, help=f"minimum val tokens (default {VAL_TOKENS:,})")
    p.add_argument("--max-files", type=int, default=None, help="read at most this many files per source root "
                   "(sorted path order; --smoke: 120)")
    p.add_argument("--workers", type=int, default=4, help="man pages rendered at once")
    p.add_argument("--smoke", action="store_true", help=f"tiny budget ({SMOKE_TRAIN_TOKENS} train, "
                   f"{SMOKE_VAL_TOKENS} val tokens) and few files: seconds")
    p.add_argument("--overwrite", action="store_true", help="replace existing output")
    p.add_argument("--no-results", action="store_true", help="do not write benchmarks/results and the docs page")
    p.add_argument("--report", action="store_true", help="only rewrite docs/benchmarks/corpora.md from "
                   "benchmarks/results/corpora_manifest.json")
    args = p.parse_args(argv)
    if args.report:
        log(f"wrote {write_page(payload(load_result(RESULTS_MANIFEST)), DOCS_PAGE)}")
        return None
    try:
        return build(args, argv)
    except (FileExistsError, FileNotFoundError, ValueError, RuntimeError) as err:
        raise SystemExit(f"build_corpora: {err}") from err


if __name__ == "__main__":
    main()
