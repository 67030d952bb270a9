"""``lightning-opt-data``: make, fetch and inspect token shards.

Commands:
    prepare            tokenize text files or a Hugging Face dataset into train/val shards
    download-fineweb   download pre-tokenized FineWeb shards (kjj0/fineweb10B-gpt2)
    corpus             build the offline default corpus and print its shard paths
    info               print each shard's token count and largest token id
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning_opt._errors import UsageError, console_status
from lightning_opt.data import prepare
from lightning_opt.data.corpus import default_corpus_shards
from lightning_opt.data.download import FINEWEB_REPO, download_fineweb
from lightning_opt.data.prepare import DEFAULT_SHARD_TOKENS
from lightning_opt.data.shards import max_token_id, read_header, resolve_files


class _Parser(argparse.ArgumentParser):
    """Refuses a command line with :class:`~lightning_opt._errors.UsageError` (one line), not a usage text;
    takes no abbreviated options (the sub-commands' parsers are of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lightning-opt-data", description="Make, fetch and inspect token shards."
    )
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("prepare", help="tokenize text into FineWeb-format train/val shards")
    src = pr.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="text files or globs, one document per file (quote globs)")
    src.add_argument("--hf-dataset", help="Hugging Face dataset id to stream (needs the hf extra)")
    pr.add_argument("--out-dir", required=True, help="output folder")
    pr.add_argument("--tokenizer", choices=["gpt2", "byte"], default="gpt2")
    pr.add_argument(
        "--bpe-file",
        help="r50k_base.tiktoken file for the GPT-2 BPE (default: $LIGHTNING_OPT_BPE_FILE, else the copy "
        "shipped with lightning-opt; nothing is downloaded)",
    )
    pr.add_argument("--val-fraction", type=float, default=0.1, help="share of documents for validation")
    pr.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    pr.add_argument("--prefix", default="data", help="shard names are PREFIX_{train,val}_NNNNNN.bin")
    pr.add_argument("--overwrite", action="store_true", help="replace existing shards with this prefix")
    pr.add_argument("--hf-split", default="train", help="dataset split (with --hf-dataset)")
    pr.add_argument("--hf-config", default=None, help="dataset configuration (with --hf-dataset)")
    pr.add_argument("--text-field", default="text", help="record field with the text (with --hf-dataset)")
    pr.add_argument(
        "--max-docs", type=int, default=None, help="stop after this many documents (--hf-dataset)"
    )

    dl = sub.add_parser("download-fineweb", help="download FineWeb GPT-2 shards from the Hugging Face Hub")
    dl.add_argument("--out-dir", required=True)
    dl.add_argument("--num-train-shards", type=int, default=1, help="100M-token train shards to fetch")
    dl.add_argument("--no-val", action="store_true", help="skip the val shard")
    dl.add_argument("--repo-id", default=None, help="Hub dataset repository (default kjj0/fineweb10B-gpt2)")

    co = sub.add_parser("corpus", help="build the offline default corpus; print its train and val paths")
    co.add_argument("--cache-dir", default=None)

    info = sub.add_parser("info", help="print token count and max token id of shards")
    info.add_argument("files", nargs="+", help="shard paths or globs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status. A mistake (a glob that matches nothing, a wrong flag, existing
    shards) prints one ``error: ...`` line on stderr and returns 2 (``LIGHTNING_OPT_TRACEBACK=1`` shows its
    traceback too)."""
    return console_status(lambda: _run(_parser().parse_args(argv)))


def _run(args: argparse.Namespace) -> int:
    if args.command == "prepare":
        common = dict(
            out_dir=args.out_dir,
            tokenizer=args.tokenizer,
            bpe_file=args.bpe_file,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            prefix=args.prefix,
            overwrite=args.overwrite,
        )
        if args.hf_dataset:
            meta = prepare.prepare_hf_dataset(
                args.hf_dataset,
                split=args.hf_split,
                text_field=args.text_field,
                config=args.hf_config,
                max_docs=args.max_docs,
                **common,
            )
        else:
            meta = prepare.prepare_text_files(args.input, **common)
        print(json.dumps({k: meta[k] for k in ("tokenizer", "documents", "tokens", "files")}, indent=2))
    elif args.command == "download-fineweb":
        paths = download_fineweb(
            args.out_dir, args.num_train_shards, 0 if args.no_val else 1, args.repo_id or FINEWEB_REPO
        )
        for path in paths:
            print(path)
    elif args.command == "corpus":
        for path in default_corpus_shards(args.cache_dir):
            print(path)
    elif args.command == "info":
        for path in resolve_files(args.files):
            print(f"{path}\ttokens={read_header(path)}\tmax_id={max_token_id(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
