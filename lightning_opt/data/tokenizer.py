"""Tokenizers: a byte-level one (vocab 256) and the GPT-2 BPE via tiktoken, both offline.

The GPT-2 BPE's mergeable ranks ship with the package (``r50k_base.tiktoken``, the file tiktoken itself
downloads for ``gpt2``; see ``docs/data.md`` for its source and licence), so nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GPT2_EOT = 50256
GPT2_VOCAB = 50257
BPE_FILE_ENV = "LIGHTNING_OPT_BPE_FILE"  # a local r50k_base.tiktoken, used when no bpe_file is passed
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
# the GPT-2 BPE shipped in the package (SHA-256 306cd27f..., the hash tiktoken expects for r50k_base)
SHIPPED_BPE_FILE = Path(__file__).resolve().parent / "r50k_base.tiktoken"
# The r50k/gpt2 split pattern (as in tiktoken's openai_public; kept here so offline use needs no plugin).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256); byte 255 (never valid in UTF-8) is the document separator.

    Needs no vocabulary file, so it works on a fresh offline machine.
    """

    vocab_size = 256
    eot = 255
    name = "byte"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def encode_ordinary(self, text: str) -> list[int]:
        """Same as :meth:`encode` (there are no special tokens inside text)."""
        return self.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; separators become ``<|endoftext|>``, invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids)
        return "<|endoftext|>".join(
            part.decode("utf-8", errors="replace") for part in data.split(bytes([self.eot]))
        )


class GPT2Tokenizer:
    """The GPT-2 BPE (tiktoken) behind the same small interface as :class:`ByteTokenizer`."""

    vocab_size = GPT2_VOCAB
    eot = GPT2_EOT
    name = "gpt2"

    def __init__(self, bpe_file: str | os.PathLike | None = None) -> None:
        self.encoding = gpt2_encoding(bpe_file)

    def encode(self, text: str) -> list[int]:
        """BPE ids of ``text``; special-token strings inside it are encoded as ordinary text."""
        return self.encoding.encode_ordinary(text)

    encode_ordinary = encode

    def encode_batch(self, texts: list[str], num_threads: int = 8) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])


def gpt2_encoding(bpe_file: str | os.PathLike | None = None) -> Any:
    """The GPT-2 ``tiktoken.Encoding``, read from a local BPE file: no download.

    Args:
        bpe_file: a ``.tiktoken`` mergeable-ranks file for r50k_base/gpt2 (base64 token, rank per line),
            e.g. ``r50k_base.tiktoken``. ``None`` uses ``$LIGHTNING_OPT_BPE_FILE`` when set, else the copy
            shipped with the package (:data:`SHIPPED_BPE_FILE`).

    Raises:
        FileNotFoundError: ``bpe_file`` does not exist.
        ValueError: ``bpe_file`` is not a GPT-2 BPE file.
    """
    import tiktoken

    if bpe_file is None:
        bpe_file = os.environ.get(BPE_FILE_ENV) or SHIPPED_BPE_FILE
    path = Path(bpe_file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"GPT-2 BPE file '{path}' does not exist (from --bpe-file / bpe_file= or ${BPE_FILE_ENV}); "
            f"pass the path of an r50k_base.tiktoken file (from {R50K_URL})"
        )
    from tiktoken.load import load_tiktoken_bpe

    try:
        ranks = load_tiktoken_bpe(str(path))
    except Exception as err:
        raise ValueError(
            f"'{path}' is not a .tiktoken BPE file (base64 token and rank on each line): {err}"
        ) from err
    if len(ranks) != GPT2_EOT:
        raise ValueError(
            f"'{path}' has {len(ranks)} mergeable ranks, the GPT-2 BPE has {GPT2_EOT}; pass the r50k_base/gpt2 file"
        )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_EOT},
        explicit_n_vocab=GPT2_VOCAB,
    )


def get_tokenizer(name: str, bpe_file: str | os.PathLike | None = None) -> ByteTokenizer | GPT2Tokenizer:
    """``"byte"`` or ``"gpt2"`` (with an optional local BPE file)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer(bpe_file)
    raise ValueError(f"unknown tokenizer {name!r}; choose 'gpt2' or 'byte'")
