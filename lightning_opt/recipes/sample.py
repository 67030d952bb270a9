"""Sample text from a GPT-2 recipe checkpoint (``lightning-opt-gpt2``).

    lightning-opt-sample --ckpt_path runs/gpt2-demo/version_0 \
        --prompt "The for statement" --max_new_tokens 200 --temperature 0.8 --top_k 50 --seed 0

``--ckpt_path`` is a checkpoint file or a run directory (its ``last.ckpt``, else its newest intact checkpoint), read
with ``torch.load(weights_only=True)``: no code runs from it. A file that does not match its ``.sha256`` sidecar
is refused. The tokenizer is the run's: byte-level tokens
(vocab 256) for runs on the built-in corpus or with a vocabulary of at most 256 tokens, else the GPT-2 BPE
(tiktoken, with the BPE file that ships in the package; ``--bpe_file`` reads another copy); ``--tokenizer`` overrides the choice. Generation
uses the model's KV cache (``GPT.generate``) and stops at the tokenizer's document separator.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_opt._errors import UsageError, run_console
from lightning_opt.callbacks.async_checkpoint import newest_intact_checkpoint, verify_checkpoint
from lightning_opt.cli import check_checkpoint_file
from lightning_opt.data.tokenizer import ByteTokenizer, GPT2Tokenizer, get_tokenizer
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_path", required=True,
                   help="a checkpoint written by lightning-opt-gpt2, or its run directory (newest checkpoint)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (argmax)")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top_p", type=float, default=None, help="sample among the most likely tokens reaching this mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_samples", type=int, default=1, help="continuations of the same prompt")
    p.add_argument("--tokenizer", choices=("auto", "byte", "gpt2"), default="auto")
    p.add_argument("--bpe_file", default=None, help="local r50k_base.tiktoken file for the GPT-2 BPE (offline)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    return p


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself, or in a directory its ``last.ckpt`` when that resolves to an intact file, else the
    newest intact ``step=N.ckpt`` (else the most recently written other ``*.ckpt``), saying why on stderr."""
    path = Path(path)
    if not path.is_dir():
        return path
    lasts = [Path(root, "last.ckpt") for root, _, files in os.walk(path) if "last.ckpt" in files]  # dangling too
    good = [p for p in lasts if p.is_file() and verify_checkpoint(str(p)) is not False]
    if good:
        return max(good, key=lambda p: p.resolve().stat().st_mtime)
    newest: list[tuple[int, float, Path]] = []
    for folder in sorted({p.parent for p in path.rglob("step=*.ckpt")}):
        found, _ = newest_intact_checkpoint(str(folder))
        if found is not None:
            step = int(Path(found).name.removeprefix("step=").split(".")[0].split("-")[0])
            newest.append((step, Path(found).stat().st_mtime, Path(found)))
    others = [p for p in path.rglob("*.ckpt") if p.name != "last.ckpt" and not p.name.startswith("step=") and p.is_file()]
    if newest:
        chosen = max(newest)[2]
    elif others:
        chosen = max(others, key=lambda p: p.stat().st_mtime)
    else:
        raise FileNotFoundError(f"no intact *.ckpt file under '{path}'; pass a checkpoint file or a run directory with one")
    for last in lasts:
        why = "points at a missing file" if not last.is_file() else "fails its checksum"
        print(f"note: {last} {why} ({os.path.realpath(last)}); using {chosen}", file=sys.stderr, flush=True)
    return chosen


def run_tokenizer(checkpoint: dict[str, Any], vocab_size: int, choice: str = "auto",
                  bpe_file: str | None = None) -> ByteTokenizer | GPT2Tokenizer:
    """The tokenizer a run used: byte-level for the built-in corpus or a vocabulary of at most 256, else GPT-2."""
    if choice != "auto":
        return get_tokenizer(choice, bpe_file)
    data = checkpoint.get("datamodule_hyper_parameters") or {}
    builtin = "builtin" in (data.get("train_files"), data.get("val_files"))
    if builtin or vocab_size <= ByteTokenizer.vocab_size:
        return ByteTokenizer()
    return GPT2Tokenizer(bpe_file)


def main(args: list[str] | None = None) -> list[str]:
    """Print and return ``--num_samples`` continuations of ``--prompt`` (prompt included)."""
    ns = parser().parse_args(args)
    ckpt_path = find_checkpoint(ns.ckpt_path)
    check_checkpoint_file(ckpt_path)
    device = torch.device(ns.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    module = GPT2SpeedrunModule.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True)
    model = module.model.to(device).eval()
    cfg = model.config
    # the data settings the run saved beside the weights (read lazily: only that entry is looked at)
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    tokenizer = run_tokenizer(checkpoint, cfg.vocab_size, ns.tokenizer, ns.bpe_file)
    ids = tokenizer.encode(ns.prompt)
    if not ids:
        raise ValueError("--prompt is empty; give at least one character to continue")
    if max(ids) >= cfg.vocab_size:
        raise ValueError(f"the {tokenizer.name} tokenizer gives ids up to {max(ids)}, beyond the model's vocab_size="
                         f"{cfg.vocab_size}; pass the tokenizer the run used (--tokenizer byte or gpt2)")
    idx = torch.tensor([ids] * ns.num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(ns.seed)
    out = model.generate(idx, ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p,
                         eos_token=tokenizer.eot, generator=generator)
    texts = [tokenizer.decode(row.tolist()) for row in out]
    for i, text in enumerate(texts):
        if ns.num_samples > 1:
            print(f"--- sample {i}")
        print(text, flush=True)
    return texts


def cli() -> None:
    """The ``lightning-opt-sample`` console script: a user's mistake (a wrong flag, a missing checkpoint) prints one
    ``error: ...`` line and exits with status 2 (``LIGHTNING_OPT_TRACEBACK=1`` shows its traceback)."""
    def refuse(message: str) -> None:
        raise UsageError(message)

    check = parser()
    check.allow_abbrev = False  # `--max_new 5` is a typo, not `--max_new_tokens`
    check.error = refuse  # one line instead of argparse's usage text

    def run() -> None:
        check.parse_args(sys.argv[1:])
        main(sys.argv[1:])

    run_console(run)


if __name__ == "__main__":
    cli()
