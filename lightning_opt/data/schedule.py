"""Batch geometry that changes during training: a sequence-length curriculum and a batch-size schedule.

Both are lists of ``(from_batch, value)`` pairs over the training batches a rank has consumed (the data
position that checkpoints hold). The stream is read in order, each global batch right after the previous
one whatever its shape, so a resumed run continues token for token.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

Schedule = Sequence[Sequence[int]]


def _pairs(name: str, schedule: Schedule | None) -> tuple[tuple[int, int], ...]:
    pairs = tuple((int(a), int(b)) for a, b in (schedule or ()))
    starts = [a for a, _ in pairs]
    if starts and (starts[0] < 0 or any(b <= a for a, b in zip(starts, starts[1:]))):
        raise ValueError(f"{name}={list(map(list, pairs))}: the from_batch values must be >= 0 and increasing")
    if any(v <= 0 for _, v in pairs):
        raise ValueError(f"{name}={list(map(list, pairs))}: every value must be a positive integer")
    return pairs


def _value_at(pairs: tuple[tuple[int, int], ...], position: int, default: int) -> int:
    value = default
    for start, v in pairs:
        if position < start:
            break
        value = v
    return value


@dataclass(frozen=True)
class BatchGeometry:
    """The ``(batch_size, seq_len)`` of every training batch.

    Args:
        seq_len: the base sequence length: before the first ``seq_len_schedule`` entry, and the longest any
            entry may set (the model's context is checked against it).
        batch_size: the base batch size per rank: before the first ``batch_size_schedule`` entry.
        seq_len_schedule: ``[(from_batch, seq_len), ...]``.
        batch_size_schedule: ``[(from_batch, batch_size), ...]``.
        keep_tokens: ``True``: a shorter sequence length raises the batch size so that a batch holds the
            tokens of ``batch_size x seq_len`` (the scheduled batch size at the base ``seq_len``); the
            sequence-length curriculum then leaves tokens per step, and so the learning-rate schedule's
            meaning, unchanged. ``False``: the batch size is the scheduled one and shorter sequences mean
            fewer tokens per batch.
    """

    seq_len: int
    batch_size: int
    seq_len_schedule: tuple[tuple[int, int], ...] = ()
    batch_size_schedule: tuple[tuple[int, int], ...] = ()
    keep_tokens: bool = True

    @classmethod
    def build(cls, seq_len: int, batch_size: int, seq_len_schedule: Schedule | None = None,
              batch_size_schedule: Schedule | None = None, keep_tokens: bool = True) -> BatchGeometry:
        geometry = cls(seq_len, batch_size, _pairs("seq_len_schedule", seq_len_schedule),
                       _pairs("batch_size_schedule", batch_size_schedule), keep_tokens)
        too_long = [t for _, t in geometry.seq_len_schedule if t > seq_len]
        if too_long:
            raise ValueError(f"seq_len_schedule sets {too_long} above seq_len={seq_len}; seq_len is the longest "
                             "sequence the schedule may use (raise it)")
        if keep_tokens:
            for start in geometry.boundaries():
                b, t = _value_at(geometry.batch_size_schedule, start, batch_size), geometry.seq_len_at(start)
                if (b * seq_len) % t:
                    raise ValueError(f"keep_tokens: from batch {start}, {b} x {seq_len} tokens do not split into "
                                     f"sequences of {t}; use sequence lengths that divide batch_size x seq_len")
        return geometry

    @property
    def scheduled(self) -> bool:
        return bool(self.seq_len_schedule or self.batch_size_schedule)

    def boundaries(self) -> list[int]:
        """The batches where the geometry may change (0 included), in order."""
        return sorted({0, *(a for a, _ in self.seq_len_schedule), *(a for a, _ in self.batch_size_schedule)})

    def stage(self, position: int) -> int:
        """The index in :meth:`boundaries` of the stage that batch ``position`` belongs to."""
        return int(np.searchsorted(self.boundaries(), position, side="right")) - 1

    def seq_len_at(self, position: int) -> int:
        return _value_at(self.seq_len_schedule, position, self.seq_len)

    def batch_size_at(self, position: int) -> int:
        b = _value_at(self.batch_size_schedule, position, self.batch_size)
        return b * self.seq_len // self.seq_len_at(position) if self.keep_tokens else b

    def at(self, position: int) -> tuple[int, int]:
        """``(batch_size, seq_len)`` of batch ``position`` (counted from 0 over the run, per rank)."""
        return self.batch_size_at(position), self.seq_len_at(position)

    def max_batch_tokens(self) -> int:
        return max(b * t for b, t in map(self.at, self.boundaries()))

    def token_offset(self, position: int, world: int, total: int) -> int:
        """Where in a stream of ``total`` tokens global batch ``position`` starts.

        Global batches follow each other (``world x batch_size x seq_len`` tokens each); one that would not
        fit before the end of the stream (it reads one token more, the last target) starts again at 0.
        """
        bounds = [start for start in self.boundaries() if start < position] + [position]
        offset = 0
        for lo, hi in zip(bounds, bounds[1:]):
            b, t = self.at(lo)
            step = world * b * t
            per_pass = (total - 1) // step
            fits = (total - 1 - offset) // step  # batches of this shape that fit from offset on
            n = hi - lo
            if n <= fits:
                offset += n * step
            else:
                offset = ((n - fits - 1) % per_pass + 1) * step  # after wrapping to 0: the last pass's batches
        b, t = self.at(position)
        if offset + world * b * t + 1 > total:  # this batch does not fit: it starts a new pass
            offset = 0
        return offset


class ScheduledBatches(IterableDataset):
    """This rank's batches from position ``start`` on, endlessly, read in order with :class:`BatchGeometry`.

    Batch ``p`` on rank ``r`` is ``batch_size`` rows of ``seq_len + 1`` tokens starting every ``seq_len``
    tokens at ``token_offset(p) + r x batch_size x seq_len``. With DataLoader workers, worker ``w`` of ``n``
    makes every ``n``-th batch; the DataLoader's round-robin keeps the order.
    """

    def __init__(self, stream, geometry: BatchGeometry, rank: int, world: int) -> None:
        self.stream, self.geometry, self.rank, self.world = stream, geometry, rank, world
        self.start = 0
        if geometry.max_batch_tokens() * world + 1 > stream.total:
            raise ValueError(f"the train shards hold {stream.total} tokens, fewer than the largest global batch "
                             f"of the schedule ({world} x {geometry.max_batch_tokens()} + 1)")

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = self.geometry.at(position)
        start = self.geometry.token_offset(position, self.world, self.stream.total) + self.rank * b * t
        buf = self.stream.read(start, b * t + 1).astype(np.int64)
        return torch.from_numpy(buf[:-1].reshape(b, t)), torch.from_numpy(buf[1:].reshape(b, t))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i, position in enumerate(itertools.count(self.start)):
            if i % n_workers == worker:
                yield self.batch(position)
