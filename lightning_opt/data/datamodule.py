"""A LightningDataModule over memory-mapped token shards: DDP slicing, exact resume, GPU prefetch.

The training stream is the concatenation of the train shards, cut into windows of ``seq_len + 1``
tokens that start every ``seq_len`` tokens (``x = w[:-1]``, ``y = w[1:]``), so every token is a target
exactly once per epoch. See ``docs/data.md`` for the full story.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_opt.data.corpus import default_corpus_shards
from lightning_opt.data.schedule import BatchGeometry, ScheduledBatches
from lightning_opt.data.shards import PathLike, check_vocab, read_header, read_shard, resolve_files

_STATE_VERSION = 1


class _TokenStream:
    """The concatenation of several shards, memory-mapped lazily so that pickling it (DataLoader workers,
    ``ddp_spawn``) sends file names, not the tokens."""

    def __init__(self, files: Sequence[Path]) -> None:
        self.files = [Path(f) for f in files]
        self.lengths = [read_header(f) for f in self.files]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        self.total = int(self.offsets[-1])
        self._maps: list[np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None
        return state

    def _shards(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [read_shard(f) for f in self.files]
        return self._maps

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the concatenated stream (a uint16 copy)."""
        if start < 0 or start + length > self.total:
            raise IndexError(
                f"token range [{start}, {start + length}) outside the stream of {self.total} tokens"
            )
        shards = self._shards()
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        local = start - int(self.offsets[i])
        if local + length <= self.lengths[i]:  # the common case: inside one shard
            return np.array(shards[i][local : local + length])
        out = np.empty(length, dtype=np.uint16)
        filled = 0
        while filled < length:
            while self.lengths[i] == 0:
                i += 1
            take = min(length - filled, self.lengths[i] - local)
            out[filled : filled + take] = shards[i][local : local + take]
            filled += take
            i, local = i + 1, 0
        return out


def _windows_to_batch(
    stream: _TokenStream, window_ids: np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather windows ``k`` (tokens ``[k*T, k*T + T + 1)``) into int64 ``(x, y)`` of shape ``[B, T]``."""
    b = len(window_ids)
    if b > 1 and np.all(np.diff(window_ids) == 1):  # contiguous: one read, as the speedrun does
        buf = stream.read(int(window_ids[0]) * seq_len, b * seq_len + 1).astype(np.int64)
        x = torch.from_numpy(buf[:-1].reshape(b, seq_len))
        y = torch.from_numpy(buf[1:].reshape(b, seq_len))
        return x, y
    rows = np.stack([stream.read(int(k) * seq_len, seq_len + 1) for k in window_ids]).astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(
        np.ascontiguousarray(rows[:, 1:])
    )


class _TrainBatches(IterableDataset):
    """Yields this rank's batches from stream position ``start`` to the end of that epoch.

    Position ``p`` (per rank, counted across epochs) is step ``s = p % steps_per_epoch`` of epoch
    ``e = p // steps_per_epoch``; it holds windows ``order_e[(s*world + rank)*B : +B]``, so ranks read
    disjoint windows. With DataLoader workers, worker ``w`` of ``n`` makes every ``n``-th batch; the
    DataLoader's round-robin keeps the order.
    """

    def __init__(
        self,
        stream: _TokenStream,
        seq_len: int,
        batch_size: int,
        rank: int,
        world: int,
        seed: int,
        shuffle: bool,
    ) -> None:
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.rank, self.world, self.seed, self.shuffle = rank, world, seed, shuffle
        self.num_windows = (stream.total - 1) // seq_len
        self.steps_per_epoch = self.num_windows // (batch_size * world)
        self.start = 0

    def __len__(self) -> int:
        return self.steps_per_epoch

    def window_order(self, epoch: int) -> np.ndarray | None:
        """The epoch's window permutation, or ``None`` for the natural order."""
        if not self.shuffle:
            return None
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def window_ids(self, position: int, order: np.ndarray | None) -> np.ndarray:
        step = position % self.steps_per_epoch
        first = (step * self.world + self.rank) * self.batch_size
        if order is None:
            return np.arange(first, first + self.batch_size)
        return order[first : first + self.batch_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.start // self.steps_per_epoch
        order = self.window_order(epoch)
        end = (epoch + 1) * self.steps_per_epoch
        for i, position in enumerate(range(self.start, end)):
            if i % n_workers == worker:
                yield _windows_to_batch(self.stream, self.window_ids(position, order), self.seq_len)


class _ValBatches(IterableDataset):
    """This rank's contiguous slice of the fixed validation windows, in batches."""

    def __init__(self, stream: _TokenStream, seq_len: int, batch_size: int, first: int, count: int) -> None:
        self.stream, self.seq_len, self.batch_size, self.first, self.count = (
            stream,
            seq_len,
            batch_size,
            first,
            count,
        )

    def __len__(self) -> int:
        return -(-self.count // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for j in range(worker, len(self), n_workers):
            lo = self.first + j * self.batch_size
            hi = min(lo + self.batch_size, self.first + self.count)
            yield _windows_to_batch(self.stream, np.arange(lo, hi), self.seq_len)


class _ValLoader:
    """A sized iterable over the val DataLoader (not a DataLoader itself, so Lightning does not warn that
    an ``IterableDataset`` with ``__len__`` may duplicate data across workers: ours shards by worker)."""

    def __init__(self, loader: DataLoader, length: int) -> None:
        self.loader, self.length = loader, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.loader)


class _TrainLoader:
    """Wraps the train DataLoader: starts each pass at the DataModule's position and, on CUDA, copies the
    next batch to the GPU on a side stream while the current step runs.

    It has ``state_dict``/``load_state_dict`` (the DataModule's), so Lightning also treats it as a
    resumable loader when it is passed to ``fit`` directly.
    """

    def __init__(self, dm: TokenShardDataModule, loader: DataLoader, dataset: _TrainBatches) -> None:
        self._dm, self._loader, self._dataset = dm, loader, dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def state_dict(self) -> dict[str, Any]:
        return self._dm.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._dm.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        dm = self._dm
        # Set before iter(): DataLoader workers get a pickled copy of the dataset at this moment.
        self._dataset.start = dm._resolve_position(self._dataset)
        dm._pending.clear()
        device = dm._prefetch_device()
        stream = torch.cuda.Stream(device) if device is not None else None
        count_here = dm._attached_trainer() is None
        for x, y in self._loader:
            if stream is not None:
                # Issued when Lightning prefetches this batch, i.e. while the previous step runs.
                with torch.cuda.stream(stream):
                    x = x.to(device, non_blocking=True)
                    y = y.to(device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                dm._pending[id(x)] = event
                dm._prefetched += 1
            if count_here:  # without a Trainer, a batch handed out is a batch consumed
                dm._position += 1
            dm._yielded += 1
            yield x, y


BUILTIN = "builtin"


def _builtin_corpus(train_files: Any, val_files: Any, val_tokens: int | None) -> tuple[Any, Any, int | None]:
    """Replace ``"builtin"`` by the offline corpus's train/val shard (built and cached on first use).

    A ``val_tokens`` larger than the built-in val shard is lowered to all of it, with a note.
    """
    if BUILTIN not in (train_files, val_files):
        return train_files, val_files, val_tokens
    train, val = default_corpus_shards()
    if val_files == BUILTIN:
        if train_files != BUILTIN:
            warnings.warn(
                f"TokenShardDataModule: val_files is 'builtin' (the offline byte-level corpus, vocab 256) "
                f"while train_files are {train_files!r}; the val loss is measured on the built-in corpus, "
                f"which is only meaningful if your shards are byte-level too; pass val_files= (or "
                f"--data.val_files) with your own validation shards",
                stacklevel=3,
            )
        available = read_header(val) - 1
        if val_tokens is not None and val_tokens > available:
            warnings.warn(
                f"TokenShardDataModule: the built-in corpus has {available} val tokens; val_tokens={val_tokens} "
                f"is lowered to all of them. Point val_files at your shards for a larger val set.",
                stacklevel=3,
            )
            val_tokens = None
        val_files = os.fspath(val)
    if train_files == BUILTIN:
        train_files = os.fspath(train)
    return train_files, val_files, val_tokens


def _plain_paths(files: Any) -> Any:
    if files is None or isinstance(files, str):
        return files
    if isinstance(files, os.PathLike):
        return os.fspath(files)
    return [os.fspath(f) for f in files]


class TokenShardDataModule(pl.LightningDataModule):
    """Next-token batches from memory-mapped FineWeb-format token shards.

    Batches are ``(x, y)``, int64 ``[batch_size, seq_len]`` with ``y`` = ``x`` shifted by one token.

    - **DDP**: rank ``r`` of ``world`` takes global batch ``s*world + r`` at step ``s``, so no window is
      read twice per epoch across ranks. Rank and world come from the attached Trainer, else from
      ``torch.distributed`` when initialised, else 0/1 (or from the ``rank``/``world_size`` arguments).
    - **Resume**: ``state_dict()`` holds the number of batches the training loop has consumed (counted
      in ``transfer_batch_to_device``, so batches prefetched by workers or by Lightning are not
      counted); Lightning saves it in checkpoints and ``load_state_dict`` makes the next batch the one
      an uninterrupted run would have seen.
    - **Epochs**: one Lightning epoch is one pass over the train windows; each epoch reshuffles the
      window order with ``(seed, epoch)`` when ``shuffle`` is on.
    - **Validation**: the first ``val_tokens`` tokens of the val shards in ``seq_len`` windows, the same
      on every run; under DDP each rank takes a disjoint contiguous slice (the remainder of
      ``n_windows % world`` windows is dropped so that every rank runs the same number of batches).
    - **Transfer**: pinned host memory and non-blocking copies; on CUDA the next training batch is
      copied on a side stream while the current step runs (no-op on CPU).

    Args:
        train_files: shard path(s) or glob(s) for training, or ``"builtin"`` for the offline demo corpus
            (Python's own docs, byte-level tokens; built and cached on first use). A file named twice is
            read once (with a warning).
        val_files: shard path(s) or glob(s) for validation, ``"builtin"`` for the offline corpus's val
            shard (a ``val_tokens`` larger than it is lowered to all of it), or ``None`` for no
            validation. Val shards that are also train shards give a warning.
        seq_len: tokens per sequence (``T``).
        batch_size: sequences per batch per rank (``B``).
        val_tokens: how many leading val tokens form the fixed val set; ``None`` uses all of them.
        vocab_size: if given, every token of the shards is checked for ids ``>= vocab_size`` at
            construction (a chunked scan of the memory maps; the error names the shard, offset and id).
        seed: seed of the per-epoch shuffle.
        shuffle: shuffle the window order each epoch (the speedrun reads in order: off).
        num_workers: DataLoader workers (0 reads in the main process; memory-mapped reads are cheap).
        pin_memory: pin host batches when CUDA is available.
        val_batch_size: validation batch size (defaults to ``batch_size``).
        gpu_prefetch: copy the next training batch to the GPU on a side CUDA stream.
        prefetch_factor: batches each worker prepares ahead (only with ``num_workers > 0``).
        rank: override the rank (for use without a Trainer or ``torch.distributed``).
        world_size: override the world size (with ``rank``).
        seq_len_schedule: a sequence-length curriculum, ``[(from_batch, seq_len), ...]`` over the training
            batches this rank has consumed (micro-batches: with ``accumulate_grad_batches=k``, use multiples
            of ``k``); ``seq_len`` applies before the first entry and is the longest an entry may set.
        batch_size_schedule: ``[(from_batch, batch_size), ...]`` likewise; ``batch_size`` applies before the
            first entry.
        schedule_keeps_tokens: with ``seq_len_schedule``, keep the tokens per batch: a batch holds
            ``scheduled batch_size x seq_len`` tokens in sequences of the scheduled length (so a curriculum
            leaves tokens per step unchanged). ``False``: the batch size is the scheduled one.

    With either schedule (see :class:`~lightning_opt.data.schedule.BatchGeometry`) the train shards are read
    in order (no ``shuffle``), each global batch right after the previous one, as one endless Lightning
    epoch (bound the run with ``max_steps``); a checkpoint's data position restores the schedule's stage and
    the next batch exactly. Validation keeps ``seq_len`` windows.

    Example::

        dm = TokenShardDataModule("data/fineweb_train_*.bin", "data/fineweb_val_*.bin",
                                  seq_len=1024, batch_size=16, val_tokens=10_485_760, vocab_size=50257)
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        train_files: PathLike | Sequence[PathLike] = BUILTIN,
        val_files: PathLike | Sequence[PathLike] | None = None,
        seq_len: int = 1024,
        batch_size: int = 8,
        val_tokens: int | None = None,
        vocab_size: int | None = None,
        seed: int = 0,
        shuffle: bool = False,
        num_workers: int = 0,
        pin_memory: bool = True,
        val_batch_size: int | None = None,
        gpu_prefetch: bool = True,
        prefetch_factor: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        seq_len_schedule: list[tuple[int, int]] | None = None,
        batch_size_schedule: list[tuple[int, int]] | None = None,
        schedule_keeps_tokens: bool = True,
    ) -> None:
        super().__init__()
        # Plain strings: Lightning loads checkpoints with torch.load(weights_only=True), which rejects Paths.
        train_files = _plain_paths(train_files)
        val_files = _plain_paths(val_files)
        self.save_hyperparameters()  # recorded in checkpoints next to the data position
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TokenShardDataModule: {name} must be a positive integer, got {value!r}")
        if val_batch_size is not None and (not isinstance(val_batch_size, int) or val_batch_size <= 0):
            raise ValueError(
                f"TokenShardDataModule: val_batch_size must be a positive integer, got {val_batch_size!r}"
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"TokenShardDataModule: num_workers must be an integer >= 0, got {num_workers!r}"
            )
        if (rank is None) != (world_size is None):
            raise ValueError("TokenShardDataModule: pass both rank and world_size, or neither")
        if world_size is not None and (world_size <= 0 or not 0 <= rank < world_size):  # type: ignore[operator]
            raise ValueError(
                f"TokenShardDataModule: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if vocab_size is not None and vocab_size <= 0:
            raise ValueError(f"TokenShardDataModule: vocab_size must be positive, got {vocab_size}")

        if train_files is None:
            raise ValueError(
                "TokenShardDataModule: train_files is None; pass shard paths or globs, or 'builtin' for the "
                "offline demo corpus"
            )
        train_files, val_files, val_tokens = _builtin_corpus(train_files, val_files, val_tokens)
        self.train_files = resolve_files(train_files)
        self.val_files = resolve_files(val_files) if val_files is not None else []
        shared = {f.resolve() for f in self.train_files} & {f.resolve() for f in self.val_files}
        if shared:
            what = "are the train shards" if len(shared) == len(self.val_files) else "include train shards"
            warnings.warn(
                f"TokenShardDataModule: the val shards {what} ({', '.join(sorted(map(str, shared))[:3])}); "
                f"the val loss would be measured on training data; pass separate val_files (e.g. the "
                f"'*_val_*.bin' shards made by `lightning-opt-data prepare`)",
                stacklevel=2,
            )
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.seed, self.shuffle = seed, shuffle
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self.gpu_prefetch = gpu_prefetch
        self.geometry = BatchGeometry.build(seq_len, batch_size, seq_len_schedule, batch_size_schedule,
                                            schedule_keeps_tokens)
        if self.geometry.scheduled and shuffle:
            raise ValueError("TokenShardDataModule: seq_len_schedule / batch_size_schedule read the shards in order; "
                             "set shuffle=False")
        self._explicit = (rank, world_size) if rank is not None else None

        self._train = _TokenStream(self.train_files)
        num_windows = (self._train.total - 1) // seq_len
        if num_windows < batch_size:
            raise ValueError(
                f"TokenShardDataModule: the train shards hold {self._train.total} tokens = {num_windows} windows "
                f"of seq_len+1={seq_len + 1}, fewer than one batch of batch_size={batch_size}; use more data "
                f"or a smaller seq_len/batch_size"
            )
        self._val: _TokenStream | None = None
        self.num_val_windows = 0
        if self.val_files:
            self._val = _TokenStream(self.val_files)
            available = self._val.total
            if val_tokens is None:
                val_tokens = max(available - 1, 0)
                if val_tokens < seq_len:
                    raise ValueError(
                        f"TokenShardDataModule: the val shards hold only {available} tokens, less than one "
                        f"window of seq_len+1={seq_len + 1}; use more validation data or a smaller seq_len"
                    )
            if available < seq_len + 1:
                raise ValueError(
                    f"TokenShardDataModule: the val shards hold {available} tokens; one validation window needs "
                    f"seq_len+1={seq_len + 1} tokens (the targets are the inputs shifted by one); use more "
                    f"validation data, a smaller seq_len, or val_files=None for no validation"
                )
            if val_tokens < seq_len:
                raise ValueError(
                    f"TokenShardDataModule: val_tokens={val_tokens} is smaller than one window of seq_len={seq_len}; "
                    f"raise val_tokens (or pass val_files=None for no validation)"
                )
            if val_tokens > available:  # a config's val set larger than a small split: validate on all of it
                warnings.warn(
                    f"TokenShardDataModule: val_tokens={val_tokens} but the val shards hold only {available} tokens; "
                    f"validating on all {available - 1} (set data.val_tokens to silence this)",
                    stacklevel=2,
                )
                val_tokens = available - 1
            self.num_val_windows = min(val_tokens, available - 1) // seq_len
        self.val_tokens = val_tokens
        if vocab_size is not None:
            check_vocab(self.train_files + self.val_files, vocab_size)
        self.vocab_size = vocab_size

        self._position = 0  # training batches consumed on this rank, across epochs
        self._loaded_state: dict[str, Any] | None = None
        self._yielded = 0
        self._hook_calls = 0
        self._pending: dict[int, Any] = {}
        self._prefetched = 0  # batches copied on the side stream (for tests and benchmarks)
        self._train_world: int | None = None

    def __repr__(self) -> str:
        # Lightning's default __str__ builds and iterates the loaders, which would move the position.
        return (
            f"{type(self).__name__}(train={len(self.train_files)} shards/{self._train.total} tokens, "
            f"val={self.num_val_windows} windows, seq_len={self.seq_len}, batch_size={self.batch_size}, "
            f"position={self._position})"
        )

    __str__ = __repr__

    # -- rank, world, device -------------------------------------------------------------------

    def _attached_trainer(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)

    def rank_and_world(self) -> tuple[int, int]:
        """``(rank, world_size)`` from the explicit arguments, the Trainer, ``torch.distributed`` or 0/1."""
        if self._explicit is not None:
            return self._explicit  # type: ignore[return-value]
        trainer = self._attached_trainer()
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _prefetch_device(self) -> torch.device | None:
        trainer = self._attached_trainer()
        if not self.gpu_prefetch or trainer is None:
            return None
        device = trainer.strategy.root_device
        return device if device.type == "cuda" else None

    def steps_per_epoch(self) -> int:
        """Training batches per rank per epoch for the current world size."""
        _, world = self.rank_and_world()
        return ((self._train.total - 1) // self.seq_len) // (self.batch_size * world)

    # -- loaders -------------------------------------------------------------------------------

    def _loader(self, dataset: IterableDataset) -> DataLoader:
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return DataLoader(
            dataset,
            batch_size=None,  # the dataset yields whole batches: one contiguous read each, no collate
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            # its own generator: creating an iterator must not draw from the global RNG, or a resumed
            # run's dropout masks shift by one draw (the datasets never use the base seed)
            generator=torch.Generator().manual_seed(self.seed),
            **kwargs,
        )

    def train_dataloader(self) -> _TrainLoader:
        rank, world = self.rank_and_world()
        if self.geometry.scheduled:
            scheduled = ScheduledBatches(self._train, self.geometry, rank, world)
            self._train_world = world
            return _TrainLoader(self, self._loader(scheduled), scheduled)  # type: ignore[arg-type]
        dataset = _TrainBatches(
            self._train, self.seq_len, self.batch_size, rank, world, self.seed, self.shuffle
        )
        if dataset.steps_per_epoch < 1:
            raise ValueError(
                f"TokenShardDataModule: {dataset.num_windows} train windows cannot fill one batch on each of "
                f"{world} ranks (batch_size={self.batch_size}); use more data or a smaller batch_size/seq_len"
            )
        self._train_world = world
        return _TrainLoader(self, self._loader(dataset), dataset)

    def val_dataloader(self) -> _ValLoader | list:
        if self._val is None:
            return []
        rank, world = self.rank_and_world()
        per_rank = self.num_val_windows // world
        if per_rank < 1:
            need = world * self.seq_len
            if self._val.total < need + 1:
                fix = (f"the val shards hold {self._val.total} tokens, {world} windows need {need + 1} "
                       f"(seq_len per window, plus one for the shifted targets); use more validation data")
            else:
                fix = f"raise val_tokens (now {self.val_tokens}) to at least {need}"
            raise ValueError(
                f"TokenShardDataModule: {self.num_val_windows} validation windows cannot be split over {world} "
                f"ranks; {fix}, lower seq_len, or pass val_files=None for no validation"
            )
        dataset = _ValBatches(self._val, self.seq_len, self.val_batch_size, rank * per_rank, per_rank)
        return _ValLoader(self._loader(dataset), len(dataset))

    # -- transfer and position tracking --------------------------------------------------------

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Count consumed training batches; finish a side-stream prefetch or copy non-blocking."""
        trainer = self._attached_trainer()
        if trainer is not None and trainer.training:
            # Called by the training loop for each batch it actually runs (after Lightning's own
            # one-batch prefetch), so the position never counts prefetched batches.
            self._position += 1
            self._hook_calls += 1
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
            event = self._pending.pop(id(batch[0]), None)
            if event is not None:
                current = torch.cuda.current_stream(batch[0].device)
                current.wait_event(event)  # GPU-side wait; the host does not block
                for t in batch:
                    t.record_stream(current)  # memory was allocated on the side stream
                return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    # -- state ---------------------------------------------------------------------------------

    def _resolve_position(self, dataset: _TrainBatches) -> int:
        """Apply a loaded state (converting across a changed layout) and return the start position."""
        if self._loaded_state is not None:
            state, self._loaded_state = self._loaded_state, None
            same = (
                state["seq_len"] == self.seq_len
                and state["batch_size"] == self.batch_size
                and state["world_size"] == dataset.world
                and state["train_tokens"] == self._train.total
                and state["shuffle"] == self.shuffle
                and (not self.shuffle or state["seed"] == self.seed)
                and _schedule_key(state.get("schedule")) == _schedule_key(self._schedule_state())
            )
            if not same and (self.geometry.scheduled or state.get("schedule")):
                raise ValueError(
                    f"TokenShardDataModule: the checkpoint's batch schedule {state.get('schedule')} or data layout "
                    f"differs from this run's ({self._schedule_state()}); a scheduled run resumes only with the "
                    f"same seq_len, batch_size, schedules, world size and shards"
                )
            if same:
                self._position = int(state["position"])
            else:
                tokens = int(state["position"]) * state["batch_size"] * state["seq_len"] * state["world_size"]
                self._position = tokens // (self.batch_size * self.seq_len * dataset.world)
                warnings.warn(
                    f"TokenShardDataModule: the checkpoint's data layout (seq_len={state['seq_len']}, "
                    f"batch_size={state['batch_size']}, world_size={state['world_size']}, "
                    f"train_tokens={state['train_tokens']}, shuffle={state['shuffle']}) differs from this run's; "
                    f"resuming at the same token count ({tokens}), which is not an exact resume",
                    stacklevel=2,
                )
        return self._position

    def state_dict(self) -> dict[str, Any]:
        """The data position: batches consumed on this rank, plus the layout needed to interpret it."""
        if self._loaded_state is not None:  # loaded but not yet applied by a train loader
            return dict(self._loaded_state)
        position = self._position
        trainer = self._attached_trainer()
        if trainer is not None and self._hook_calls == 0 and self._yielded > 0:
            # The LightningModule overrides transfer_batch_to_device, so ours never ran: estimate
            # from batches handed to Lightning minus its one-batch prefetch.
            warnings.warn(
                "TokenShardDataModule: transfer_batch_to_device was not called (does the LightningModule "
                "override it?); the saved data position is estimated and resume may be off by a batch",
                stacklevel=2,
            )
            position = max(self._yielded - 1, 0)
        _, world = self.rank_and_world()
        return {
            "version": _STATE_VERSION,
            "position": position,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "world_size": self._train_world or world,
            "train_tokens": self._train.total,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "schedule": self._schedule_state(),
            "stage": self.geometry.stage(position),
        }

    def _schedule_state(self) -> dict[str, Any] | None:
        g = self.geometry
        if not g.scheduled:
            return None
        return {"seq_len": [list(p) for p in g.seq_len_schedule],
                "batch_size": [list(p) for p in g.batch_size_schedule], "keep_tokens": g.keep_tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the data position saved by :meth:`state_dict` (applied when the train loader starts)."""
        missing = {
            "position",
            "seq_len",
            "batch_size",
            "world_size",
            "train_tokens",
            "shuffle",
            "seed",
        } - set(state_dict)
        if missing:
            raise ValueError(
                f"TokenShardDataModule.load_state_dict: the state has no {sorted(missing)}; it was not written by "
                f"TokenShardDataModule.state_dict"
            )
        self._loaded_state = dict(state_dict)
        self._position = int(state_dict["position"])


def _schedule_key(schedule: dict[str, Any] | None) -> Any:
    """A saved schedule in one comparable form (checkpoints may hold tuples or lists)."""
    if schedule is None:
        return None
    return (tuple(map(tuple, schedule["seq_len"])), tuple(map(tuple, schedule["batch_size"])),
            bool(schedule["keep_tokens"]))
