"""Download pre-tokenized FineWeb shards (GPT-2 BPE) from the Hugging Face Hub.

``kjj0/fineweb10B-gpt2`` holds ``fineweb_val_000000.bin`` (100M tokens) and ``fineweb_train_000001.bin``
onwards (100M tokens each), the shards the GPT-2 speedrun trains on. Needs ``huggingface_hub`` (the
``hf`` extra) and the internet.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from lightning_opt._optional import require
from lightning_opt.data.shards import PathLike, read_header

FINEWEB_REPO = "kjj0/fineweb10B-gpt2"
FINEWEB_TRAIN_SHARDS = 103  # fineweb_train_000001.bin .. fineweb_train_000103.bin

_OFFLINE_HELP = (
    "Without the internet, get shards another way: copy FineWeb .bin shards made elsewhere into the folder, "
    "or tokenize local text with `lightning-opt-data prepare --input 'texts/*.txt' --out-dir DIR "
    "--bpe-file r50k_base.tiktoken`, or use the built-in offline corpus "
    "(lightning_opt.data.corpus.default_corpus_shards)."
)


class DownloadError(RuntimeError):
    """A download could not be done (no network, missing file, Hub error)."""


def _check_reachable(endpoint: str, timeout: float = 5.0) -> None:
    """Fail in seconds, not after the Hub client's retries, when the endpoint cannot be reached."""
    url = urlparse(endpoint)
    host = url.hostname or endpoint
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as err:
        raise DownloadError(
            f"no network connection to the Hugging Face Hub ({host}:{port}: {err}). {_OFFLINE_HELP}"
        ) from err


def fineweb_filenames(num_train_shards: int, num_val_shards: int = 1) -> list[str]:
    """The Hub file names: val shards first (``fineweb_val_000000.bin``), then train from ``000001``."""
    if not 0 <= num_train_shards <= FINEWEB_TRAIN_SHARDS:
        raise ValueError(f"num_train_shards must be in [0, {FINEWEB_TRAIN_SHARDS}], got {num_train_shards}")
    if num_val_shards not in (0, 1):
        raise ValueError(
            f"{FINEWEB_REPO} has one val shard; num_val_shards must be 0 or 1, got {num_val_shards}"
        )
    names = [f"fineweb_val_{i:06d}.bin" for i in range(num_val_shards)]
    return names + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train_shards + 1)]


def download_fineweb(
    out_dir: PathLike, num_train_shards: int = 1, num_val_shards: int = 1, repo_id: str = FINEWEB_REPO
) -> list[Path]:
    """Download FineWeb shards into ``out_dir`` (skipping valid ones already there) and validate them.

    Args:
        out_dir: destination folder.
        num_train_shards: how many 100M-token train shards (the speedrun's 124M record used 8-9).
        num_val_shards: 1 for the val shard, 0 to skip it.
        repo_id: the Hub dataset repository.

    Returns:
        The local paths, val first.

    Raises:
        ImportError: ``huggingface_hub`` is missing (``pip install 'lightning-opt[hf]'``).
        DownloadError: no network, or the Hub does not have a file.
    """
    hub = require("huggingface_hub", "hf", purpose="download-fineweb")
    try:
        from huggingface_hub import errors
    except ImportError:  # huggingface_hub < 0.24 keeps them in utils
        from huggingface_hub import utils as errors
    from huggingface_hub import constants

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    names = fineweb_filenames(num_train_shards, num_val_shards)
    todo = [n for n in names if not _is_valid(out / n)]
    if todo and not constants.HF_HUB_OFFLINE:  # offline mode reads the Hub cache: no network check
        _check_reachable(constants.ENDPOINT)
    paths = []
    for name in names:
        if name in todo:
            try:
                got = hub.hf_hub_download(repo_id=repo_id, filename=name, repo_type="dataset", local_dir=out)
            except errors.LocalEntryNotFoundError as err:  # offline mode or the connection dropped
                raise DownloadError(
                    f"could not download '{name}' from {repo_id}: no network ({err}). {_OFFLINE_HELP}"
                ) from err
            except (errors.EntryNotFoundError, errors.RepositoryNotFoundError) as err:
                raise DownloadError(
                    f"{repo_id} has no file '{name}' ({err}); check --repo-id and the shard count"
                ) from err
            except errors.HfHubHTTPError as err:
                raise DownloadError(f"the Hub refused '{name}' from {repo_id}: {err}") from err
            path = Path(got)
        else:
            path = out / name
        read_header(path)  # a truncated download fails here with a clear message
        paths.append(path)
    return paths


def _is_valid(path: Path) -> bool:
    try:
        read_header(path)
        return True
    except (OSError, ValueError):
        return False
