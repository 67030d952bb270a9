"""Activation sources for transcoders: MLP inputs and outputs of every layer of a target language model.

* :class:`MLPActivationCapture` registers one forward hook per MLP, once, on our ``GPT`` (``model.blocks[i]
  .mlp``) or a ``transformers`` GPT-2 (``model.transformer.h[i].mlp``), and stops the forward after the last
  MLP (the head is never run).
* Online: :func:`iter_activation_batches` runs the target under ``no_grad`` on token windows and yields
  ``(x, y)`` batches of ``tokens_per_batch`` tokens, each ``[tokens, n_layers, d_model]`` (MLP input,
  MLP output), in the storage dtype.
* Cached: :func:`write_activation_cache` writes the same stream once to memory-mapped shards (bf16 stored as
  its 16-bit pattern) plus ``meta.json`` with shapes and normalisation statistics;
  :class:`CachedActivations` reads batch ``i`` back with one slice per shard. For the same tokens, online and
  cached batches are bitwise identical.
* :class:`CLTDataModule` wires it for Lightning: cached or online training batches, online validation
  batches that also carry their tokens (for the replacement-model KL), and the target model itself.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_opt._optional import require
from lightning_opt.data.corpus import cache_root, default_corpus_shards
from lightning_opt.data.shards import check_vocab, read_shard, resolve_files
from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.models.targets import load_gpt_checkpoint, train_language_model

__all__ = [
    "MLPActivationCapture",
    "iter_activation_batches",
    "write_activation_cache",
    "CachedActivations",
    "ActivationStats",
    "CLTDataModule",
    "load_target_model",
    "token_windows",
    "train_demo_target",
    "find_mlps",
]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# numpy has no bfloat16: 16-bit types are stored as their bit pattern (int16) and viewed back in torch
_NP_STORAGE = {"bfloat16": np.int16, "float16": np.int16, "float32": np.float32}


class _StopForward(Exception):
    """Raised by the last MLP hook: nothing after the last MLP is needed."""


def find_mlps(model: nn.Module) -> list[nn.Module]:
    """The MLP module of every block of a GPT-style model (ours or ``transformers`` GPT-2)."""
    if hasattr(model, "blocks"):
        return [b.mlp for b in model.blocks]
    body = getattr(model, "transformer", model)
    if hasattr(body, "h"):
        return [b.mlp for b in body.h]
    raise ValueError(
        f"cannot find the MLPs of {type(model).__name__}: expected `.blocks[i].mlp` (lightning_opt GPT) or "
        "`.transformer.h[i].mlp` (transformers GPT-2)"
    )


def model_width(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for name in ("n_embd", "hidden_size", "d_model"):
        if cfg is not None and hasattr(cfg, name):
            return int(getattr(cfg, name))
    raise ValueError(f"cannot read the residual width of {type(model).__name__} from its config")


class MLPActivationCapture:
    """Capture every layer's MLP input and output with hooks registered once.

    Args:
        model: the target model (kept in eval mode by :meth:`run`).
        dtype: storage dtype of the captured activations.

    Example:
        >>> cap = MLPActivationCapture(gpt)                  # doctest: +SKIP
        >>> x, y = cap.run(tokens)                           # [B*T, L, d] each
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = model
        self.dtype = dtype
        self.mlps = find_mlps(model)
        self.n_layers = len(self.mlps)
        self.d_model = model_width(model)
        self._inputs: list[torch.Tensor | None] = [None] * self.n_layers
        self._outputs: list[torch.Tensor | None] = [None] * self.n_layers
        self.active = False
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.mlps)]

    def _hook(self, layer: int):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if not self.active:
                return
            self._inputs[layer] = inputs[0].detach()
            self._outputs[layer] = output.detach()
            if layer == self.n_layers - 1:
                raise _StopForward

        return hook

    @torch.no_grad()
    def run(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLP inputs and outputs ``[B*T, L, d]`` (storage dtype) for token ids ``[B, T]``."""
        was_training = self.model.training
        self.model.eval()
        self.active = True
        try:
            self.model(tokens)
        except _StopForward:
            pass
        finally:
            self.active = False
            self.model.train(was_training)
        x = torch.stack([t.reshape(-1, self.d_model) for t in self._inputs], dim=1).to(self.dtype)
        y = torch.stack([t.reshape(-1, self.d_model) for t in self._outputs], dim=1).to(self.dtype)
        self._inputs = [None] * self.n_layers
        self._outputs = [None] * self.n_layers
        return x, y

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def token_windows(
    files: str | os.PathLike | Sequence[str | os.PathLike], seq_len: int, batch_size: int, max_tokens: int | None
) -> Iterator[torch.Tensor]:
    """Consecutive, non-overlapping ``[batch_size, seq_len]`` int64 windows from token shards, in order."""
    paths = resolve_files(files)
    budget = math.inf if max_tokens is None else max_tokens
    per_batch = seq_len * batch_size
    used = 0
    for path in paths:
        toks = read_shard(path)
        for start in range(0, len(toks) - per_batch + 1, per_batch):
            if used + per_batch > budget:
                return
            arr = np.asarray(toks[start : start + per_batch], dtype=np.int64)
            yield torch.from_numpy(arr).view(batch_size, seq_len)
            used += per_batch


def iter_activation_batches(
    capture: MLPActivationCapture,
    token_batches: Iterable[torch.Tensor],
    tokens_per_batch: int,
    device: torch.device | str | None = None,
    with_tokens: bool = False,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Online activations: ``(x, y)`` batches of exactly ``tokens_per_batch`` tokens, in token order.

    A trailing remainder shorter than ``tokens_per_batch`` is dropped. With ``with_tokens`` each batch is
    ``(x, y, tokens)`` and must align with whole windows (``tokens_per_batch`` a multiple of the window).
    """
    device = torch.device(device) if device is not None else next(capture.model.parameters()).device
    seq_len = 0
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    ts: list[torch.Tensor] = []
    have = 0
    for tok in token_batches:
        tok = tok.to(device, non_blocking=True)
        x, y = capture.run(tok)
        if with_tokens:
            seq_len = tok.shape[1]
            if tokens_per_batch % seq_len:
                raise ValueError(f"tokens_per_batch={tokens_per_batch} must be a multiple of seq_len={seq_len}")
            ts.append(tok)
        xs.append(x)
        ys.append(y)
        have += x.shape[0]
        while have >= tokens_per_batch:
            X, Y = torch.cat(xs), torch.cat(ys)
            batch: tuple[torch.Tensor, ...] = (X[:tokens_per_batch], Y[:tokens_per_batch])
            xs, ys = [X[tokens_per_batch:]], [Y[tokens_per_batch:]]
            if with_tokens:
                W = torch.cat(ts)  # whole windows: every forward adds whole windows
                n_windows = tokens_per_batch // seq_len
                batch = (*batch, W[:n_windows])
                ts = [W[n_windows:]]
            have -= tokens_per_batch
            yield batch


class ActivationStats:
    """Running sums (float64) over tokens for the normalisation statistics of ``x`` and ``y``."""

    def __init__(self, n_layers: int, d_model: int) -> None:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.n = 0
        self.sums = {k: z(n_layers, d_model) for k in ("in_sum", "in_sq", "out_sum", "out_sq")}
        self.norms = {k: z(n_layers) for k in ("in_norm", "out_norm")}

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for side, t in (("in", x), ("out", y)):
            t = t.double()
            self.sums[f"{side}_sum"] += t.sum(0).cpu()
            self.sums[f"{side}_sq"] += t.square().sum(0).cpu()
            self.norms[f"{side}_norm"] += t.norm(dim=-1).sum(0).cpu()
        self.n += x.shape[0]

    def result(self) -> dict[str, list]:
        n = max(self.n, 1)
        out: dict[str, Any] = {"tokens": self.n}
        for side in ("in", "out"):
            mean = self.sums[f"{side}_sum"] / n
            var = (self.sums[f"{side}_sq"] / n - mean.square()).clamp_min(0) * n / max(n - 1, 1)
            out[f"{side}_mean"] = mean.float().tolist()
            out[f"{side}_std"] = var.sqrt().float().tolist()
            out[f"{side}_norm"] = (self.norms[f"{side}_norm"] / n).float().tolist()
        return out


def write_activation_cache(
    capture: MLPActivationCapture,
    token_batches: Iterable[torch.Tensor],
    directory: str | os.PathLike,
    tokens_per_batch: int,
    tokens_per_shard: int = 1 << 16,
    source: dict[str, Any] | None = None,
) -> Path:
    """Write the online stream once to memory-mapped shards + ``meta.json`` (with statistics).

    Shards hold ``[tokens, 2, L, d]`` (MLP input, MLP output) in the capture's dtype (16-bit floats as their
    bit pattern). ``meta.json`` is written last, so a cache without it is incomplete and gets rewritten.

    Args:
        capture: hooks on the target model.
        token_batches: token windows ``[B, T]``, in order.
        directory: cache folder (created).
        tokens_per_batch: the batch size the cache will be read with (the stream is cut the same way).
        tokens_per_shard: tokens per shard file (rounded down to whole batches, at least one batch).
        source: free-form description stored in ``meta.json`` (target model, token files...).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta_path.unlink()
    dtype_name = next(k for k, v in _DTYPES.items() if v == capture.dtype)
    L, d = capture.n_layers, capture.d_model
    per_shard = max(1, tokens_per_shard // tokens_per_batch) * tokens_per_batch
    stats = ActivationStats(L, d)
    shards: list[dict[str, Any]] = []
    mm: np.memmap | None = None
    filled = 0

    def close() -> None:
        if mm is not None:
            mm.flush()
            shards[-1]["n_tokens"] = filled

    for x, y in iter_activation_batches(capture, token_batches, tokens_per_batch):
        stats.update(x, y)
        if mm is None or filled == per_shard:
            close()
            name = f"acts_{len(shards):05d}.bin"
            mm = np.memmap(out / name, dtype=_NP_STORAGE[dtype_name], mode="w+", shape=(per_shard, 2, L, d))
            shards.append({"file": name, "n_tokens": 0})
            filled = 0
        pair = torch.stack([x, y], dim=1).cpu()
        arr = pair.view(torch.int16).numpy() if pair.element_size() == 2 else pair.numpy()
        mm[filled : filled + x.shape[0]] = arr
        filled += x.shape[0]
    close()
    if not shards:
        raise ValueError("write_activation_cache got fewer tokens than one batch; give it more tokens")
    meta = {
        "format": "lightning_opt.activations/1",
        "n_layers": L,
        "d_model": d,
        "dtype": dtype_name,
        "tokens_per_batch": tokens_per_batch,
        "n_tokens": sum(s["n_tokens"] for s in shards),
        "shard_capacity": per_shard,
        "shards": shards,
        "source": source or {},
        "stats": stats.result(),
    }
    tmp = meta_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, meta_path)
    return out


def read_cache_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """``meta.json`` of an activation cache, checked: known dtype, positive sizes, and shard files that are plain
    names inside the cache folder (a ``"file": "../secret.bin"`` or an absolute path is refused)."""
    path = Path(directory) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the activation cache is missing or was not completed")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete the cache folder to rewrite it") from None
    _check_cache_meta(meta, Path(directory), path)
    return meta


def _check_cache_meta(meta: Any, directory: Path, path: Path) -> None:
    def bad(what: str) -> ValueError:
        return ValueError(f"activation cache {path}: {what}; it was not written by write_activation_cache or was "
                          "altered. Delete the cache folder to rewrite it")

    if not isinstance(meta, dict):
        raise bad("meta.json does not hold an object")
    if meta.get("dtype") not in _DTYPES:
        raise bad(f"dtype={meta.get('dtype')!r} is not one of {sorted(_DTYPES)}")
    for key in ("n_layers", "d_model", "shard_capacity", "tokens_per_batch"):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise bad(f"{key}={v!r} is not a positive integer")
    shards = meta.get("shards")
    if not isinstance(shards, list) or not shards:
        raise bad("it lists no shards")
    for shard in shards:
        if not isinstance(shard, dict):
            raise bad(f"shard entry {shard!r} is not an object")
        n = shard.get("n_tokens")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= meta["shard_capacity"]:
            raise bad(f"shard {shard.get('file')!r} has n_tokens={n!r} (capacity {meta['shard_capacity']})")
        _check_shard_size(cache_file(directory, shard.get("file"), path), meta)


def _check_shard_size(file: Path, meta: dict[str, Any]) -> None:
    """Refuse a shard file that is missing or not the size ``meta.json`` gives it (a copy or a write cut short):
    memory-mapping it would fail, or read the wrong bytes, at the first batch."""
    itemsize = np.dtype(_NP_STORAGE[meta["dtype"]]).itemsize
    expected = meta["shard_capacity"] * 2 * meta["n_layers"] * meta["d_model"] * itemsize
    actual = file.stat().st_size if file.is_file() else None
    if actual != expected:
        found = "is missing" if actual is None else f"is {actual} bytes"
        raise ValueError(
            f"activation cache {file.parent}: shard {file.name} {found}, expected {expected} bytes "
            f"({meta['shard_capacity']} tokens x 2 x {meta['n_layers']} layers x {meta['d_model']} x {itemsize} "
            f"bytes); the cache is truncated or damaged. Delete the cache folder {file.parent} to rebuild it"
        )


def cache_file(directory: str | os.PathLike, name: Any, meta_path: str | os.PathLike | None = None) -> Path:
    """The path of shard ``name`` of the cache in ``directory``: refused unless it is a plain file name that
    stays inside the folder (no ``..``, no absolute path, no link leading out)."""
    folder = Path(directory)
    where = meta_path or folder / "meta.json"
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(
            f"activation cache {where}: shard file {name!r} is not a plain file name inside the cache folder "
            f"{folder}; refusing to read it (paths outside the cache entry are not allowed). Delete the cache "
            "folder to rewrite it"
        )
    path = folder / name
    root = folder.resolve()
    if path.resolve().parent != root:
        raise ValueError(
            f"activation cache {where}: shard file {name!r} resolves to {path.resolve()}, outside the cache "
            f"folder {root}; refusing to read it. Delete the cache folder to rewrite it"
        )
    return path


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of a model's ``state_dict``: every entry's name, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _config_dict(model: nn.Module) -> Any:
    """The model's config as plain JSON data (``config.to_dict()`` of ours or a ``transformers`` model)."""
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    value = to_dict() if callable(to_dict) else ({} if cfg is None else repr(cfg))
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def check_cache_key(directory: str | os.PathLike, meta: dict[str, Any], key: dict[str, Any]) -> None:
    """Refuse an activation cache built from other inputs than ``key`` (see :meth:`CLTDataModule.cache_key`),
    naming every setting that differs: its activations are not this run's. A cache is never overwritten here
    (another run may be reading it)."""
    source = meta.get("source")
    saved = source.get("key") if isinstance(source, dict) else None
    fix = (f"Use another cache_dir for this run (the cache is built there on first use), or delete {directory} "
           "to rebuild it in place")
    if not isinstance(saved, dict):
        raise ValueError(
            f"activation cache {directory} does not record what it was built from (no source.key in meta.json: "
            f"written by write_activation_cache directly or by an older version), so it cannot be matched to this "
            f"run's target and data. {fix}"
        )
    saved = json.loads(json.dumps(saved))
    ours = json.loads(json.dumps(key))

    def show(v: Any) -> str:
        text = json.dumps(v)
        return text if len(text) <= 160 else text[:157] + "..."

    diffs = [f"{k}: {show(saved.get(k))} (cache) vs {show(ours.get(k))} (this run)"
             for k in sorted(set(saved) | set(ours)) if saved.get(k) != ours.get(k)]
    if diffs:
        raise ValueError(
            f"activation cache {directory} was built from other inputs than this run's, so its activations would "
            f"not be this run's; differing: {'; '.join(diffs)}. {fix}"
        )


class CachedActivations(Dataset):
    """Batch ``i`` of an activation cache: ``(x, y)`` ``[tokens_per_batch, L, d]`` from memory-mapped shards.

    Use with ``DataLoader(ds, batch_size=None, shuffle=..., num_workers=..., pin_memory=True,
    persistent_workers=True, prefetch_factor=...)`` to stream with prefetch.
    """

    def __init__(self, directory: str | os.PathLike, tokens_per_batch: int | None = None) -> None:
        self.dir = Path(directory)
        self.meta = read_cache_meta(self.dir)
        self.tokens_per_batch = int(tokens_per_batch or self.meta["tokens_per_batch"])
        if self.tokens_per_batch <= 0:
            raise ValueError(f"tokens_per_batch must be positive, got {self.tokens_per_batch}")
        self.dtype = _DTYPES[self.meta["dtype"]]
        self._bounds = np.cumsum([0] + [s["n_tokens"] for s in self.meta["shards"]])
        self._maps: list[np.memmap] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = None  # each worker maps the files itself
        return state

    def _open(self) -> list[np.memmap]:
        if self._maps is None:
            L, d = self.meta["n_layers"], self.meta["d_model"]
            np_dtype = _NP_STORAGE[self.meta["dtype"]]
            self._maps = [
                np.memmap(cache_file(self.dir, s["file"]), dtype=np_dtype, mode="r",
                          shape=(self.meta["shard_capacity"], 2, L, d))
                for s in self.meta["shards"]
            ]
        return self._maps

    def __len__(self) -> int:
        return int(self._bounds[-1]) // self.tokens_per_batch

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range ({len(self)} batches)")
        maps = self._open()
        start, stop = i * self.tokens_per_batch, (i + 1) * self.tokens_per_batch
        parts = []
        s = int(np.searchsorted(self._bounds, start, side="right") - 1)
        while start < stop:
            lo = start - self._bounds[s]
            take = min(stop - start, int(self._bounds[s + 1] - start))
            parts.append(np.array(maps[s][lo : lo + take]))  # a private, writable copy
            start += take
            s += 1
        arr = torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else parts[0])
        pair = arr.view(self.dtype) if self.dtype != torch.float32 else arr
        return pair[:, 0], pair[:, 1]

    @property
    def stats(self) -> dict[str, Any]:
        return self.meta["stats"]


class _OnlineStream(IterableDataset):
    """The target's activations of ``files``, one batch per group of ``windows_per_forward`` windows. The training
    stream (``train``) starts each pass at the data position (:meth:`CLTDataModule.state_dict`): the windows of
    the batches a resumed run already trained on are skipped before the target sees them."""

    def __init__(self, dm: CLTDataModule, files: Any, max_tokens: int | None, with_tokens: bool,
                 train: bool = False) -> None:
        self.dm, self.files, self.max_tokens, self.with_tokens, self.train = dm, files, max_tokens, with_tokens, train

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        dm = self.dm
        rank, world = dm.data_rank_world()
        windows: Iterator[torch.Tensor] = token_windows(self.files, dm.seq_len, dm.windows_per_forward,
                                                        self.max_tokens)
        if world > 1:
            # data-parallel ranks take every world-th batch of windows (ranks of one decoder group share it)
            windows = (w for i, w in enumerate(windows) if i % world == rank)
        if self.train:
            _, skip = dm._start_pass()
            windows = itertools.islice(windows, skip, None)  # one group of windows per batch
        yield from iter_activation_batches(dm.capture, windows, dm.tokens_per_batch, dm.target_device,
                                           with_tokens=self.with_tokens)


class _PassSampler(DistributedSampler):
    """This data rank's batches of an activation cache for one pass: every pass in its own order (seeded by the
    data module's ``seed`` and the pass), split over the data ranks, from the data position on. A
    ``DistributedSampler``, so Lightning uses it as it is on several ranks."""

    def __init__(self, dm: CLTDataModule, n_batches: int) -> None:
        rank, world = dm.data_rank_world()
        super().__init__(range(n_batches), num_replicas=world, rank=rank, shuffle=dm.shuffle, seed=dm.seed,
                         drop_last=True)
        self.dm = dm

    def __iter__(self) -> Iterator[int]:
        pass_index, skip = self.dm._start_pass()
        self.set_epoch(pass_index)  # DistributedSampler's order for this pass (Lightning's own epoch is not used)
        return itertools.islice(super().__iter__(), skip, None)


def load_target_model(target: str | nn.Module, cache_dir: str | os.PathLike | None = None) -> nn.Module:
    """The target language model.

    Args:
        target: an ``nn.Module``; ``"demo"`` (a tiny byte-level GPT trained on the offline corpus once and
            cached); ``"gpt2-random"`` (GPT-2 small's shape, random weights); ``"hf:<name>"`` (a ``transformers`` GPT-2, needs the ``hf`` extra); or the path of a
            ``GPT`` checkpoint (a Lightning checkpoint of ``GPT2SpeedrunModule`` or a ``{"config", "model"}``
            file written by :func:`train_demo_target`).
    """
    if isinstance(target, nn.Module):
        return target
    if target == "demo":
        return train_demo_target(cache_dir=cache_dir)
    if target == "gpt2-random":
        # GPT-2 small's shape with random weights: end-to-end timing and memory checks without a download
        torch.manual_seed(0)
        return GPT(GPTConfig())
    if target.startswith("hf:"):
        transformers = require("transformers", purpose="a transformers GPT-2 target model")
        return transformers.GPT2LMHeadModel.from_pretrained(target[3:])
    return load_gpt_checkpoint(target)


def demo_target_path(
    steps: int = 300,
    n_layer: int = 4,
    n_embd: int = 64,
    seq_len: int = 64,
    batch_size: int = 16,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Where :func:`train_demo_target` caches the target trained with these settings."""
    cfg = GPTConfig(vocab_size=256, n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=seq_len)
    key = hashlib.sha256(json.dumps([cfg.to_dict(), steps, batch_size]).encode()).hexdigest()[:12]
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "clt_demo"
    return folder / f"demo_gpt_{key}.pt"


def _endless_windows(files: Any, seq_len: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` next-token batches of consecutive windows of ``files``, from the start again at their end."""
    while True:
        for w in token_windows(files, seq_len + 1, batch_size, None):
            yield w[:, :-1], w[:, 1:]


def train_demo_target(
    steps: int = 300,
    n_layer: int = 4,
    n_embd: int = 64,
    seq_len: int = 64,
    batch_size: int = 16,
    cache_dir: str | os.PathLike | None = None,
) -> nn.Module:
    """A tiny byte-level GPT trained on :func:`~lightning_opt.data.corpus.default_corpus_shards` (CPU, a few
    seconds), cached on disk by its settings so later runs reuse it."""
    cfg = GPTConfig(vocab_size=256, n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=seq_len)
    path = demo_target_path(steps, n_layer, n_embd, seq_len, batch_size, cache_dir=cache_dir)
    folder = path.parent
    if path.exists():
        return load_gpt_checkpoint(path)  # weights_only: a file planted in the cache cannot run code
    train, _ = default_corpus_shards()
    torch.manual_seed(0)
    model = GPT(cfg)
    final_loss = train_language_model(model, _endless_windows(train, seq_len, batch_size), steps, lr=3e-3,
                                      lr_at=lambda step: 3e-3 * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * (1 - step / steps)))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"config": cfg.to_dict(), "model": model.state_dict(), "final_loss": final_loss}, tmp)
    os.replace(tmp, path)
    return model


class CLTDataModule(pl.LightningDataModule):
    """Activations of a target model for CLT training.

    Training batches are ``(x, y)`` ``[tokens_per_batch, L, d]``; validation batches are ``(x, y, tokens)``
    with the ``[B, seq_len]`` windows that produced them (the module splices the CLT into the target on
    them). The target runs on the training device (online) or once, when the cache is written.

    Args:
        target: see :func:`load_target_model` (``"demo"``, ``"hf:gpt2"``, a checkpoint path).
        train_files, val_files: token shards (``"builtin"`` = the offline demo corpus).
        seq_len: window length fed to the target.
        tokens_per_batch: tokens per CLT step (a multiple of ``seq_len``).
        train_tokens: tokens of training activations (``None``: all train windows; online only).
        val_tokens: tokens of validation activations.
        cache_dir: write/read a cache here (``None`` = online training batches). A cache built from other
            inputs (another target or target weights, other train files, ``seq_len``, ``tokens_per_batch``,
            ``train_tokens`` or ``dtype``; see :meth:`cache_key`) or with a shard cut short is refused at
            ``setup``, naming what differs: use another folder, or delete this one to rebuild it.
        dtype: storage dtype of activations (``bfloat16``, ``float16``, ``float32``).
        shuffle: shuffle cached batches each pass (each pass in its own order, seeded by ``seed``).
        seed: the seed of the cached batches' order.
        num_workers, prefetch_factor: DataLoader settings for the cache.
        stats_tokens: tokens used for normalisation statistics in online mode.
        rank, world_size: data-parallel rank and size of the online stream (default: the strategy's
            ``distributed_sampler_kwargs``, so decoder-sharding ranks share batches; else 0 and 1).
    """

    def __init__(
        self,
        target: str = "demo",
        train_files: str | list[str] = "builtin",
        val_files: str | list[str] | None = "builtin",
        seq_len: int = 64,
        tokens_per_batch: int = 1024,
        train_tokens: int | None = None,
        val_tokens: int = 4096,
        cache_dir: str | None = None,
        dtype: str = "bfloat16",
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        stats_tokens: int = 65536,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        if tokens_per_batch <= 0 or tokens_per_batch % seq_len:
            raise ValueError(f"tokens_per_batch={tokens_per_batch} must be a positive multiple of seq_len={seq_len}")
        self.target_spec = target
        self.train_files, self.val_files = train_files, val_files
        self.seq_len, self.tokens_per_batch = seq_len, tokens_per_batch
        self.windows_per_forward = tokens_per_batch // seq_len
        self.train_tokens, self.val_tokens = train_tokens, val_tokens
        self.cache_dir = cache_dir
        self.dtype = _DTYPES[dtype]
        self.shuffle, self.num_workers, self.prefetch_factor = shuffle, num_workers, prefetch_factor
        self.seed = seed
        self.stats_tokens = stats_tokens
        # the data position: the training pass and the batches of it this rank has trained on
        self._pass, self._consumed = -1, 0
        self._resume_at: tuple[int, int] | None = None
        if (rank is None) != (world_size is None) or (world_size is not None and not 0 <= rank < world_size):
            raise ValueError(f"pass both rank and world_size with 0 <= rank < world_size, got {rank}, {world_size}")
        self._rank_world = None if rank is None else (rank, world_size)
        self.target_model: nn.Module | None = None
        self.capture: MLPActivationCapture | None = None
        self.stats: dict[str, Any] | None = None
        self._cached: CachedActivations | None = None
        self._cache_key: dict[str, Any] | None = None
        self.target_device = torch.device("cpu")

    def data_rank_world(self) -> tuple[int, int]:
        """Data-parallel rank and size from the strategy's ``distributed_sampler_kwargs`` (else 0, 1)."""
        if self._rank_world is not None:
            return self._rank_world
        trainer = getattr(self, "trainer", None)
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not kwargs:
            return 0, 1
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    # shapes the CLT must match, known after prepare()
    @property
    def n_layers(self) -> int:
        return self.prepare().n_layers

    @property
    def d_model(self) -> int:
        return self.prepare().d_model

    def _files(self, which: str) -> Any:
        files = self.train_files if which == "train" else self.val_files
        if files in (None, "builtin"):
            if files is None:
                return None
            train, val = default_corpus_shards()
            return train if which == "train" else val
        return files

    def prepare(self) -> MLPActivationCapture:
        """Load the target, register the hooks, build the cache (once) and the statistics."""
        if self.capture is not None:
            return self.capture
        self.target_model = load_target_model(self.target_spec)
        self.target_model.requires_grad_(False).eval()
        self.capture = MLPActivationCapture(self.target_model, self.dtype)
        return self.capture

    def _check_token_ids(self, with_train: bool) -> None:
        """Refuse shards holding token ids the target's input embedding has no row for (every token is
        checked), naming the shard and the target, before the target sees a batch."""
        get = getattr(self.target_model, "get_input_embeddings", None)
        emb = get() if callable(get) else getattr(self.target_model, "wte", None)
        if not isinstance(emb, nn.Embedding):
            return
        for which in ("train", "val") if with_train else ("val",):
            files = self._files(which)
            if files is None:
                continue
            try:
                check_vocab(resolve_files(files), emb.num_embeddings)
            except ValueError as err:
                raise ValueError(f"CLTDataModule ({which} files, target {self.target_spec!r} with "
                                 f"{emb.num_embeddings} token ids): {err}") from None

    def _target_name(self) -> str:
        spec = self.target_spec
        return type(spec).__name__ if isinstance(spec, nn.Module) else str(spec)

    def cache_key(self) -> dict[str, Any]:
        """What the cached training activations depend on, stored in the cache's ``meta.json`` and compared when
        the cache is reused (:func:`check_cache_key`): the target (its class, config and a SHA-256 of its
        weights), the train token files (resolved path, size, modification time), ``seq_len``,
        ``tokens_per_batch`` (the target's batch of windows), ``train_tokens`` and the storage ``dtype``.
        The weights are hashed once per data module."""
        if self._cache_key is None:
            cap = self.prepare()
            train = self._files("train")
            files = [] if train is None else [
                [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in resolve_files(train)]
            self._cache_key = {
                "target_class": f"{type(cap.model).__module__}.{type(cap.model).__qualname__}",
                "target_config": _config_dict(cap.model),
                "target_weights_sha256": weights_digest(cap.model),
                "n_layers": cap.n_layers,
                "d_model": cap.d_model,
                "train_files": files,
                "seq_len": self.seq_len,
                "tokens_per_batch": self.tokens_per_batch,
                "train_tokens": self.train_tokens,
                "dtype": next(k for k, v in _DTYPES.items() if v == self.dtype),
            }
        return self._cache_key

    def setup(self, stage: str | None = None) -> None:
        cap = self.prepare()
        if self.cache_dir is not None:
            self.cache_key()  # hashes the target's weights while they are still on the CPU
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            self.target_device = trainer.strategy.root_device
        self.target_model.to(self.target_device)
        if not getattr(self, "_ids_checked", False):
            cached = self.cache_dir is not None and (Path(self.cache_dir) / "meta.json").exists()
            self._check_token_ids(with_train=not cached)  # a complete cache is not re-read from the shards
            self._ids_checked = True
        if self.cache_dir is not None and self._cached is None:
            key = self.cache_key()
            meta = Path(self.cache_dir) / "meta.json"
            if not meta.exists():
                windows = token_windows(self._files("train"), self.seq_len, self.windows_per_forward, self.train_tokens)
                write_activation_cache(cap, windows, self.cache_dir, self.tokens_per_batch,
                                       source={"target": self._target_name(), "key": key})
            cached = CachedActivations(self.cache_dir, self.tokens_per_batch)  # checks meta.json and shard sizes
            check_cache_key(self.cache_dir, cached.meta, key)
            self._cached = cached
            self.stats = self._cached.stats
        elif self.stats is None:
            stats = ActivationStats(cap.n_layers, cap.d_model)
            windows = token_windows(self._files("train"), self.seq_len, self.windows_per_forward, self.stats_tokens)
            for x, y in iter_activation_batches(cap, windows, self.tokens_per_batch, self.target_device):
                stats.update(x, y)
            self.stats = stats.result()

    def train_dataloader(self) -> DataLoader:
        if self._cached is not None:
            workers = self.num_workers
            return DataLoader(
                self._cached, batch_size=None, sampler=_PassSampler(self, len(self._cached)), num_workers=workers,
                pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
                prefetch_factor=self.prefetch_factor if workers > 0 else None,
            )
        return DataLoader(_OnlineStream(self, self._files("train"), self.train_tokens, False, train=True),
                          batch_size=None)

    # -- the data position ------------------------------------------------------------------------
    def _start_pass(self) -> tuple[int, int]:
        """The pass a training iterator starts and the batches of it to skip (a resumed run's position)."""
        if self._resume_at is not None:
            (self._pass, self._consumed), self._resume_at = self._resume_at, None
        else:
            self._pass, self._consumed = self._pass + 1, 0
        return self._pass, self._consumed

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            self._consumed += 1  # a training batch handed to the step: trained on once this step ends
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The data position, saved in checkpoints: the training pass and the batches of it this rank has
        trained on. A resumed run skips those batches (online: before the target runs on them), so it sees
        the batches the uninterrupted run would have seen."""
        if self._resume_at is not None:  # loaded, not yet applied by a training iterator
            return {"pass": self._resume_at[0], "consumed": self._resume_at[1]}
        return {"pass": max(self._pass, 0), "consumed": self._consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s position (applied when the next training pass starts)."""
        if not {"pass", "consumed"} <= set(state_dict):
            raise ValueError(f"CLTDataModule.load_state_dict: the state {sorted(state_dict)} has no pass and consumed; "
                             "it was not written by CLTDataModule.state_dict")
        self._resume_at = (int(state_dict["pass"]), int(state_dict["consumed"]))

    def val_dataloader(self) -> DataLoader | list:
        files = self._files("val")
        if files is None or self.val_tokens <= 0:
            return []
        return DataLoader(_OnlineStream(self, files, self.val_tokens, True), batch_size=None)

    def test_dataloader(self) -> DataLoader | list:
        """The validation stream (``val_files``, ``val_tokens``): ``(x, y, tokens)`` batches."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader | list:
        """The validation stream's batches (``CLTModule.predict_step`` reads their ``x``)."""
        return self.val_dataloader()
