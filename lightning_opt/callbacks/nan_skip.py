"""Skip optimizer steps whose loss or gradients are not finite (or spike), instead of aborting the run."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_opt._internals import override_step, restore_class
from lightning_opt.callbacks._flagged_copy import FlaggedCopy
from lightning_opt.callbacks._logging import KeyedStateCallback, log_metrics, log_step
from lightning_opt.callbacks._nonfinite import NonFiniteCheck
from lightning_opt.optim.combined import CombinedOptimizer

_REASONS = ("non-finite loss", "non-finite gradient", "loss spike", "loss clamped by LossClamp")
_WRAP_TAG = "_lightning_opt_nan_skip"


@dataclass
class NaNSkipConfig:
    """Validated settings of :class:`NaNSkip` (see its docstring)."""

    mode: Literal["device", "host"] = "device"
    max_consecutive_skips: int | None = 10
    check_loss: bool = True
    check_grads: bool = True
    spike_zscore: float | None = None
    spike_window: int = 100
    spike_warmup: int = 50
    recent_window: int = 100

    def __post_init__(self) -> None:
        if self.mode not in ("device", "host"):
            raise ValueError(f"NaNSkip: mode={self.mode!r}; use 'device' (no per-step sync) or 'host'.")
        if self.max_consecutive_skips is not None and self.max_consecutive_skips < 1:
            raise ValueError(
                f"NaNSkip: max_consecutive_skips={self.max_consecutive_skips}; use a positive int or None."
            )
        if self.spike_zscore is not None and self.spike_zscore <= 0:
            raise ValueError(f"NaNSkip: spike_zscore={self.spike_zscore}; use a positive number or None.")
        for name in ("spike_window", "spike_warmup", "recent_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"NaNSkip: {name}={getattr(self, name)}; it must be >= 1.")
        if not (self.check_loss or self.check_grads or self.spike_zscore):
            raise ValueError("NaNSkip: nothing to check; enable check_loss, check_grads or spike_zscore.")


@dataclass
class _Pending:
    """One optimizer step whose decision the host has not read yet (device mode)."""

    host: torch.Tensor  # pinned CPU copy of the float32 [len(_REASONS)] flags (filled by a non-blocking copy)
    event: torch.cuda.Event | None
    global_step: int
    batch_idx: int
    scheduler_calls: list[Callable[[], Any]] = field(default_factory=list)
    # host numbers the step changed in param_groups (a step counter, ...): (group, key, before, after)
    group_changes: list[tuple[dict, str, Any, Any]] = field(default_factory=list)


def _inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer] | None:
    """The optimizers a :class:`~lightning_opt.optim.combined.CombinedOptimizer` steps, else None."""
    return list(optimizer.optimizers) if isinstance(optimizer, CombinedOptimizer) else None


def _host_numbers(groups: list[dict]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if type(v) in (int, float)} for g in groups]


def _changed_numbers(groups: list[dict], before: list[dict[str, Any]]) -> list[tuple[dict, str, Any, Any]]:
    return [(g, k, v, g[k]) for g, old in zip(groups, before) for k, v in old.items() if g.get(k, v) != v]


@torch.no_grad()
def flag_nonfinite(parts: list[tuple[list[torch.Tensor], torch.Tensor]], one: torch.Tensor) -> None:
    """For each ``(tensors, flag)`` of ``parts``: set ``flag`` (a float32 element) to 1 when an element of
    ``tensors`` is NaN or infinite. No host sync.

    One fused read of all tensors of one device and dtype, whichever part they belong to:
    ``torch._foreach_norm(ord=inf)``, whose per-tensor max-abs propagates NaN and Inf and cannot overflow for
    finite values (the 2-norm can: a finite gradient of magnitude above ~1e19 has an infinite float32 2-norm).
    Then one kernel per part over its per-tensor norms: ``torch._amp_foreach_non_finite_check_and_unscale_``
    (GradScaler's check, with an inverse scale of ``one``) writes 1 into the flag when a norm is not finite.
    """
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for i, (tensors, _) in enumerate(parts):
        for t in tensors:
            members, owners = groups.setdefault((t.device, t.dtype), ([], []))
            members.append(t)
            owners.append(i)
    for (_, dtype), (members, owners) in groups.items():
        # float32 norms for half types: the check kernel takes float, double and half on CUDA, not bfloat16
        out = None if dtype in (torch.float32, torch.float64) else torch.float32
        norms = torch._foreach_norm(members, float("inf"), dtype=out)
        for i, (_, flag) in enumerate(parts):
            mine = norms if len(parts) == 1 else [n for n, o in zip(norms, owners) if o == i]
            if not mine:
                continue
            if mine[0].device != flag.device:
                mine = [n.to(flag.device) for n in mine]
            torch._amp_foreach_non_finite_check_and_unscale_(mine, flag, one)


class _Leaf:
    """An optimizer that the decision is applied to on the device: the wrapped optimizer itself, or one inner
    optimizer of a :class:`~lightning_opt.optim.combined.CombinedOptimizer` (a fused AdamW beside a Muon)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and any(
            g.get("fused") for g in optimizer.param_groups
        )
        self.snapshot: list[torch.Tensor] = []
        self.copy = FlaggedCopy()
        self.host_fallback_warned = False
        self.params: list[torch.Tensor] = []  # this step's parameters with a gradient
        self._ready: tuple[int, int] | None = None  # (state entries, params) when every param had state
        self._device_ok: tuple[tuple[int, int], bool] | None = None

    def params_with_grad(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def state_ready(self) -> bool:
        """Every parameter of this step has optimizer state (false before the first step: torch optimizers
        create it lazily)."""
        key = (len(self.optimizer.state), len(self.params))
        if self._ready == key:
            return True
        state = self.optimizer.state
        ready = all(state.get(p) for p in self.params)
        self._ready = key if ready else None
        return ready

    def device_path_possible(self) -> bool:
        if self.fused:
            return True
        key = (len(self.optimizer.state), len(self.params))
        if self._device_ok is not None and self._device_ok[0] == key:
            return self._device_ok[1]
        ok = self._check_device_path()
        self._device_ok = (key, ok)
        return ok

    def _check_device_path(self) -> bool:
        device = self.params[0].device if self.params else None
        for p in self.params:
            for v in self.optimizer.state[p].values():
                if isinstance(v, torch.Tensor) and v.device != device:
                    where = f"keeps state on {v.device} while the parameters are on {device}"
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    where = "keeps host numbers (e.g. a Python step count) in its state"
                else:
                    continue
                if not self.host_fallback_warned:
                    warnings.warn(
                        f"NaNSkip: {type(self.optimizer).__name__} {where}, so the skip cannot be applied "
                        "on the device; falling back to mode='host' (one sync per step). With torch's "
                        "Adam/AdamW/SGD, create the optimizer with fused=True (or capturable=True).",
                        stacklevel=4,
                    )
                    self.host_fallback_warned = True
                return False
        return True

    def apply(self, bad: torch.Tensor, step: Callable[[], Any]) -> Any:
        """Run ``step`` so that it takes effect only when ``bad`` (a float32 0/1 on the device) is 0."""
        if self.fused:
            return self._fused_step(bad, step)
        return self._flagged_step(bad, step)

    def _fused_step(self, bad: torch.Tensor, step: Callable[[], Any]) -> Any:
        # Fused torch optimizers accept ``found_inf``: when it is 1 the kernel leaves params and
        # moments untouched and undoes the step-count increment. Combine with a GradScaler's flag.
        opt = self.optimizer
        prior = opt.__dict__.get("found_inf")
        opt.found_inf = bad if prior is None else torch.maximum(prior.reshape(()).float(), bad)  # type: ignore[attr-defined]
        had_scale = "grad_scale" in opt.__dict__
        if not had_scale:
            opt.grad_scale = None  # type: ignore[attr-defined]
        try:
            return step()
        finally:
            if prior is None:
                del opt.found_inf  # type: ignore[attr-defined]
            else:
                opt.found_inf = prior  # type: ignore[attr-defined]
            if not had_scale:
                del opt.grad_scale  # type: ignore[attr-defined]

    def _state_tensors(self) -> list[torch.Tensor]:
        out = list(self.params)
        for p in self.params:
            out.extend(v for v in self.optimizer.state[p].values() if isinstance(v, torch.Tensor))
        return out

    @torch.no_grad()
    def _flagged_step(self, bad: torch.Tensor, step: Callable[[], Any]) -> Any:
        # Any optimizer, no sync: copy params + state aside only when the step is bad (on CUDA a kernel that
        # reads the flag and returns when it is clear), step, copy them back only when the step was bad.
        tensors = self._state_tensors()
        if len(self.snapshot) != len(tensors) or any(
            s.shape != t.shape or s.dtype != t.dtype or s.device != t.device
            for s, t in zip(self.snapshot, tensors)
        ):
            self.snapshot = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        self.copy(bad, self.snapshot, tensors, clear_may_copy=True)
        out = step()
        after = self._state_tensors()
        if len(after) != len(tensors) or any(
            a.shape != t.shape or a.dtype != t.dtype for a, t in zip(after, tensors)
        ):
            raise RuntimeError(
                f"NaNSkip: {type(self.optimizer).__name__} changed its state layout during a step; "
                "use NaNSkip(mode='host') with this optimizer."
            )
        self.copy(bad, after, self.snapshot)
        return out


class _OptimizerGuard:
    """Wraps one optimizer's ``step`` so that it takes effect only when the step is finite."""

    def __init__(self, owner: NaNSkip, optimizer: torch.optim.Optimizer) -> None:
        self.owner = owner
        self.optimizer = optimizer
        self.had_instance_step = "step" in optimizer.__dict__
        self.original_step = optimizer.step
        self.pending: _Pending | None = None
        self.last_skipped = False
        self.host_buf: torch.Tensor | None = None
        self.host_buf_for: torch.device | None = None
        self.event: torch.cuda.Event | None = None
        inner = _inner_optimizers(optimizer)
        self.composite = inner is not None
        self.leaves = [_Leaf(o) for o in inner] if inner is not None else [_Leaf(optimizer)]
        self._applying: torch.Tensor | None = None  # the decision, while the wrapped step runs in device mode
        self._inner: list[tuple[torch.optim.Optimizer, bool, Callable[..., Any]]] = []

        def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            return self.step(closure, **kwargs)

        # Keep markers such as the LR scheduler's ``_wrapped_by_lr_sched`` visible on the wrapper.
        step.__dict__.update(getattr(self.original_step, "__dict__", {}))
        setattr(step, _WRAP_TAG, self)
        optimizer.step = step  # type: ignore[method-assign]
        if self.composite:
            for leaf in self.leaves:
                self._wrap_inner(leaf)

    def _wrap_inner(self, leaf: _Leaf) -> None:
        # The composite's own step calls each inner optimizer's step: each applies the decision its own way
        # (a fused AdamW through found_inf, a Muon through the flagged copy).
        opt = leaf.optimizer
        original = opt.step

        def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            bad = self._applying
            if bad is None or closure is not None:  # not inside a wrapped step: untouched
                return original(**kwargs) if closure is None else original(closure, **kwargs)
            return leaf.apply(bad, lambda: original(**kwargs))

        step.__dict__.update(getattr(original, "__dict__", {}))
        self._inner.append((opt, "step" in opt.__dict__, original))
        opt.step = step  # type: ignore[method-assign]

    def unwrap(self) -> None:
        for opt, had, original in [(self.optimizer, self.had_instance_step, self.original_step), *self._inner]:
            if had:
                opt.step = original  # type: ignore[method-assign]
            else:
                opt.__dict__.pop("step", None)
        self._inner = []

    # -- the step -------------------------------------------------------------------------------
    def params_with_grad(self) -> list[torch.Tensor]:
        return [p for leaf in self.leaves for p in leaf.params_with_grad()]

    def step(self, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        owner = self.owner
        loss = None
        if closure is not None:
            # Automatic optimization runs forward/backward inside ``step`` (the closure).
            with torch.enable_grad():
                loss = closure()
        # The update below needs the previous step's decision (its LR schedule). Read it only
        # now, after this step's forward/backward is queued: waiting for it then leaves the device
        # a whole forward/backward of work. Reading it before the closure would drain the queue
        # every step (a per-step sync in effect).
        self.resolve()
        for leaf in self.leaves:
            leaf.params = leaf.params_with_grad()
        params = [p for leaf in self.leaves for p in leaf.params]
        if not params:  # nothing to update (all grads None): let the optimizer do its no-op
            self.original_step(**kwargs)
            return loss
        device = params[0].device
        code, bad = owner._decision(params, device, self)
        trainer = owner._trainer
        meta = (trainer.global_step if trainer else -1, owner._batch_idx)
        use_host = (
            owner.config.mode == "host"
            # an optimizer's first step creates its state lazily: decided on the host (one sync per run)
            or not all(leaf.state_ready() for leaf in self.leaves if leaf.params)
            or not all(leaf.device_path_possible() for leaf in self.leaves if leaf.params)
        )
        if use_host:
            reasons = [int(r) for r in code.tolist()]
            ok = not any(reasons)
            if ok:
                self.original_step(**kwargs)
            owner._record(ok, reasons, *meta)
            self.last_skipped = not ok
            return loss
        # bad: the maximum of the 0/1 reasons, 1 skips the step
        before = _host_numbers(self.optimizer.param_groups)
        if self.composite:
            self._applying = bad
            try:
                self.original_step(**kwargs)
            finally:
                self._applying = None
        else:
            self.leaves[0].apply(bad, lambda: self.original_step(**kwargs))
        changes = _changed_numbers(self.optimizer.param_groups, before)
        # One pinned buffer and one event, reused: the previous step's copy was read by resolve().
        if self.host_buf is None or self.host_buf_for != device:
            cuda = device.type == "cuda"
            self.host_buf = torch.empty(len(_REASONS), dtype=torch.float32, pin_memory=cuda)
            self.event = torch.cuda.Event() if cuda else None
            self.host_buf_for = device
        self.host_buf.copy_(code, non_blocking=True)
        if self.event is not None:
            self.event.record()
        self.pending = _Pending(self.host_buf, self.event, *meta, group_changes=changes)
        return loss

    # -- deferred decisions -----------------------------------------------------------------------
    def resolve(self) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.event is not None and not pending.event.query():
            # The host is more than one step ahead; this step's forward/backward is queued
            # behind the event, so the device keeps working while the host waits.
            self.owner.host_waits += 1
            pending.event.synchronize()
        reasons = [int(r) for r in pending.host.tolist()]
        ok = not any(reasons)
        self.last_skipped = not ok
        if ok:
            for call in pending.scheduler_calls:
                call()
        else:
            # Host numbers the skipped step changed (Muon's steps_done, which drives its momentum warmup)
            # go back, unless something else changed them since.
            for group, key, old, new in pending.group_changes:
                if group.get(key) == new:
                    group[key] = old
        self.owner._record(ok, reasons, pending.global_step, pending.batch_idx)

    def scheduler_step(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.pending is not None:  # decided later, when the step's flag is read
            self.pending.scheduler_calls.append(lambda: original(*args, **kwargs))
            return None
        if self.last_skipped:
            return None
        return original(*args, **kwargs)


class NaNSkip(KeyedStateCallback):
    """Skips optimizer steps whose loss or gradients are non-finite (or whose loss spikes).

    A skipped step leaves parameters *and* optimizer state (moments, step counts) bit-identical to
    a run that never took it, and the step-interval LR schedulers do not advance. It works by
    wrapping each optimizer's ``step`` at train start, so it needs nothing from the LightningModule
    and covers automatic and manual optimization alike. See ``docs/callbacks/nan_skip.md``.

    The check is one read of every gradient and loss: on CUDA with Triton one kernel per dtype that writes
    the flags and the decision directly, elsewhere ``torch._foreach_norm(ord=inf)`` and a few tiny kernels;
    the decision never goes through the host on the way to the optimizer. The gradients are read in
    ``on_before_optimizer_step``, before Lightning clips them (value clipping would make an Inf finite).

    Args:
        mode: ``"device"`` (default): the decision stays on the device; fused optimizers
            (``fused=True``) skip through their ``found_inf`` input at no cost, other optimizers
            (Muon, foreach AdamW, ...) through a copy of params + state taken and restored only on a bad
            step (on CUDA a kernel that does nothing on a good step; one extra copy of both in memory). The
            inner optimizers of a ``CombinedOptimizer`` (the speedrun's Muon + AdamW) each take their own
            way. ``"host"``: one host-device sync per step, no extra memory, any optimizer.
        max_consecutive_skips: raise after this many skipped steps in a row (``None``: never).
        check_loss: skip when the training loss is not finite.
        check_grads: skip when any gradient is not finite.
        spike_zscore: also skip when the loss exceeds its running mean by this many standard
            deviations (``None``: off).
        spike_window: the running mean/variance is an EMA over about this many steps.
        spike_warmup: steps before spike detection starts.
        recent_window: ``skipped_steps_recent`` counts skips in this many last steps.

    Example::

        trainer = Trainer(callbacks=[NaNSkip(max_consecutive_skips=5)])
    """

    def __init__(
        self,
        mode: Literal["device", "host"] = "device",
        max_consecutive_skips: int | None = 10,
        check_loss: bool = True,
        check_grads: bool = True,
        spike_zscore: float | None = None,
        spike_window: int = 100,
        spike_warmup: int = 50,
        recent_window: int = 100,
    ) -> None:
        self.config = NaNSkipConfig(
            mode,
            max_consecutive_skips,
            check_loss,
            check_grads,
            spike_zscore,
            spike_window,
            spike_warmup,
            recent_window,
        )
        self.skipped_total = 0
        self.steps_seen = 0
        self.host_waits = 0  # decisions the host had to wait for (device mode); see docs
        self.metrics: dict[str, float] = {}
        self._recent: deque[bool] = deque(maxlen=recent_window)
        self._consecutive: list[tuple[int, int, str]] = []
        self._guards: list[_OptimizerGuard] = []
        self._scheduler_wraps: list[tuple[Any, type]] = []
        self._trainer: Trainer | None = None
        self._batch_idx = -1
        # this step's loss values to check (as training_step made them; LossClamp hands in copies from before
        # it clamps), read at the decision: no kernel at backward time
        self._losses: list[torch.Tensor] = []
        self._loss_sum: torch.Tensor | None = None
        self._clamped: torch.Tensor | None = None  # LossClamp(skip_step_when_clamped=True) hit
        # This training step's decision so far: every optimizer stepped in the batch shares it.
        self._step_code: torch.Tensor | None = None
        self._spike_stats: torch.Tensor | None = None  # [mean, var, count] on device
        self._ones: dict[torch.device, torch.Tensor] = {}  # constants, one per device (never written to)
        self._leaves: list[_Leaf] = []  # of this fit (kept after it ends, for ``paths``)
        self._check = NonFiniteCheck()  # one Triton kernel per dtype on CUDA; else flag_nonfinite
        # Gradient flags of the coming optimizer step, read in on_before_optimizer_step, before Lightning clips
        # (value clipping turns an Inf into a finite +-clip_val): (guard, flags, "any" slot written by the kernel)
        self._grad_flags: tuple[_OptimizerGuard, torch.Tensor, bool] | None = None

    # -- hooks ----------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._unwrap()
        self._trainer = trainer
        for opt in trainer.optimizers:
            if isinstance(opt, torch.optim.LBFGS):
                raise ValueError(
                    "NaNSkip: LBFGS re-evaluates its closure inside step(); it is not supported."
                )
            if getattr(opt.step, _WRAP_TAG, None) is not None:
                continue
            self._guards.append(_OptimizerGuard(self, opt))
        self._leaves = [leaf for guard in self._guards for leaf in guard.leaves]
        manual = not pl_module.automatic_optimization
        for config in trainer.lr_scheduler_configs:
            if manual or config.interval == "step":
                self._wrap_scheduler(config.scheduler)

    def _wrap_scheduler(self, scheduler: Any) -> None:
        guard = next((g for g in self._guards if g.optimizer is getattr(scheduler, "optimizer", None)), None)
        if guard is None:
            return
        cls = override_step(scheduler, lambda original, *args, **kwargs: guard.scheduler_step(original, args, kwargs))
        self._scheduler_wraps.append((scheduler, cls))

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_idx = batch_idx
        self._step_code = None
        self._grad_flags = None

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Lightning calls this after the backward(s) of the step and before it clips the gradients (Trainer
        # gradient_clip_val, configure_gradient_clipping): the gradients are checked here, as backward made them.
        self._grad_flags = None
        if not self.config.check_grads:
            return
        guard = next((g for g in self._guards if g.optimizer is optimizer), None)
        if guard is None:
            return
        params = guard.params_with_grad()
        if not params:
            return
        device = params[0].device
        if self._step_code is None and len(self._guards) > 1:  # the step's first decision covers every optimizer
            params = [p for g in self._guards for p in g.params_with_grad()]
        flags = torch.zeros(len(_REASONS) + 1, dtype=torch.float32, device=device)
        self._grad_flags = (guard, flags, self._flag([([p.grad for p in params], 1)], flags, device))

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach()
        if self.config.check_loss:
            self._losses.append(loss)
        if self.config.spike_zscore is not None:  # the loss value is only needed for spikes
            value = loss.float().sum()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    @override
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Automatic optimization zeroes grads at the start of each accumulation window: flags
        # left from a step that never reached our wrapper (a GradScaler skip) must not carry over.
        self._losses = []
        self._loss_sum = None
        self._clamped = None
        self._grad_flags = None

    def _note_loss(self, value: torch.Tensor, clamped: torch.Tensor | None = None) -> None:
        """Adds a loss value of one backward to the checks of the pending decision, and ORs a clamp flag into
        it (no sync).

        ``LossClamp`` calls it with a copy of the loss taken *before* it clamps in place, so an Inf loss that
        it clamps to a finite value is still skipped whichever of the two runs first.
        """
        if self.config.check_loss:
            self._losses.append(value)
        if clamped is not None:
            self._clamped = clamped if self._clamped is None else self._clamped | clamped

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if log_step(trainer, pl_module, batch_idx):
            # Host counters: in device mode they lag the device by at most one step.
            self.metrics = {
                "nan_skip/skipped_steps": float(self.skipped_total),
                "nan_skip/skipped_steps_recent": float(sum(self._recent)),
            }
            log_metrics(pl_module, self.metrics)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.resolve()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.resolve()

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The checkpoint must hold schedulers as of the last *decided* step: resolve (one read at
        # save time) and refresh what Lightning collected before this hook: the scheduler states
        # and the optimizers' param_groups, whose "lr" the deferred scheduler step just changed.
        self.resolve()
        if "lr_schedulers" in checkpoint and trainer.lr_scheduler_configs:
            checkpoint["lr_schedulers"] = [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]
        checkpoint.setdefault("callbacks", {})[self.state_key] = self.state_dict()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        try:
            self.resolve()
        finally:
            self._unwrap()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # The last step's decision (and its deferred scheduler step) belongs to the state that an
        # exception checkpoint saves, whichever callback's on_exception runs first.
        try:
            self.resolve()
        except Exception:  # noqa: BLE001 - the original exception is the one that propagates
            pass
        finally:
            self._unwrap()

    @property
    def skip_streak_start(self) -> int | None:
        """Global step of the first skipped step of the current run of skipped steps (None after a taken
        step). Checkpoint callbacks keep the newest checkpoint from before it out of pruning."""
        return self._consecutive[0][0] if self._consecutive else None

    @property
    def paths(self) -> dict[str, str]:
        """How the last device-mode step was checked and applied (host-side record, no sync): ``"check"`` is
        ``"triton"`` (one kernel per dtype) or ``"foreach_norm"``, ``"check_tables_built"`` how many chunk tables
        the Triton check built and uploaded (again only when gradient or loss addresses change); one entry per
        optimizer names its way of applying the skip: ``"found_inf"`` (fused), ``"flagged_copy_triton"`` or ``"flagged_copy_torch"``."""
        out = {"check": "triton" if self._check.uses_kernel else "foreach_norm",
               "check_tables_built": str(self._check.tables_built)}
        for i, leaf in enumerate(self._leaves):
            way = "found_inf" if leaf.fused else (
                "flagged_copy_triton" if leaf.copy.uses_kernel else "flagged_copy_torch")
            out[f"{i}:{type(leaf.optimizer).__name__}"] = way
        return out

    @override
    def state_key_settings(self) -> dict[str, Any]:
        return asdict(self.config)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_total": self.skipped_total,
            "steps_seen": self.steps_seen,
            "recent": list(self._recent),
            "consecutive": list(self._consecutive),
            "spike_stats": None if self._spike_stats is None else self._spike_stats.cpu().tolist(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_total = int(state_dict["skipped_total"])
        self.steps_seen = int(state_dict["steps_seen"])
        self._recent = deque((bool(x) for x in state_dict["recent"]), maxlen=self.config.recent_window)
        self._consecutive = [tuple(x) for x in state_dict["consecutive"]]  # type: ignore[misc]
        stats = state_dict.get("spike_stats")
        self._spike_stats = None if stats is None else torch.tensor(stats, dtype=torch.float32)

    # -- public helpers -------------------------------------------------------------------------
    def resolve(self) -> None:
        """Reads every pending device decision now (one sync); counters are then exact."""
        for guard in self._guards:
            guard.resolve()

    # -- internals ------------------------------------------------------------------------------
    def _unwrap(self) -> None:
        for guard in self._guards:
            guard.unwrap()
        self._guards = []
        for scheduler, cls in self._scheduler_wraps:
            restore_class(scheduler, cls)
        self._scheduler_wraps = []

    @torch.no_grad()
    def _flag(self, slots: list[tuple[list[torch.Tensor], int]], flags: torch.Tensor, device: torch.device) -> bool:
        """Sets ``flags[slot]`` to 1 for each ``(tensors, slot)`` holding a NaN or Inf (no host sync); True when
        the "any" slot (the last) was written as well (the Triton kernel), so that it is the decision as it is."""
        n = len(_REASONS)
        if self._check(slots, flags, n):
            return True
        if slots:
            one = self._ones.get(device)
            if one is None:
                one = self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
            flag_nonfinite([(tensors, flags[i]) for tensors, i in slots], one)
        return False

    @torch.no_grad()
    def _decision(
        self, params: list[torch.Tensor], device: torch.device, guard: _OptimizerGuard | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [len(_REASONS)] 0/1 flags on ``device``, the same on every rank: (loss not finite, gradient
        not finite, spike, clamped), OR-ed with the earlier decisions of this training step, and the decision
        (their maximum, 0-dim). No host sync.

        The gradients are those :meth:`on_before_optimizer_step` checked for ``guard``'s step before Lightning
        clipped them; without that check (an optimizer stepped outside Lightning's loop) they are checked now.

        One training step has one decision: its first one checks the gradients of *every* wrapped
        optimizer, and each later optimizer step of the same batch (manual optimization) inherits
        it, so all of them are skipped together. Flags that appear only after an earlier optimizer
        of the batch has stepped (a later backward, that optimizer's own new gradients) skip the
        later steps alone: the earlier update is already applied.
        """
        cfg = self.config
        if self._step_code is None and len(self._guards) > 1:
            params = [p for g in self._guards for p in g.params_with_grad()] or params
        n = len(_REASONS)
        early, self._grad_flags = self._grad_flags, None
        slots: list[tuple[list[torch.Tensor], int]] = []
        if cfg.check_loss and self._losses:
            slots.append((self._losses, 0))
        if early is not None and early[0] is guard and early[1].device == device:
            # the reasons and, last, their maximum (the non-finite kernel writes it as it finds a bad value)
            flags, grads_ready = early[1], early[2]
        else:
            flags, grads_ready = torch.zeros(n + 1, dtype=torch.float32, device=device), True
            if cfg.check_grads:
                slots.append(([p.grad for p in params], 1))
        code = flags[:n]
        # one read of every loss (and of the gradients when not read before clipping), flags set on the device
        bad_ready = self._flag(slots, flags, device) and grads_ready
        if self._clamped is not None:
            code[3].copy_(self._clamped.to(device, non_blocking=True))
            bad_ready = False
        if cfg.spike_zscore is not None and self._loss_sum is not None:
            prior_bad = (code[0] + code[1] + code[3]) > 0
            code[2].copy_(self._spike(self._loss_sum.to(device), prior_bad))
            bad_ready = False
        self._losses = []
        self._loss_sum = None
        self._clamped = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # MAX so one rank's NaN skips the step everywhere.
            if dist.get_backend() == "nccl" and code.device.type != "cuda":
                code = code.cuda()
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
            code = code.to(device)
            bad_ready = False
        if self._step_code is not None:
            code = torch.maximum(code, self._step_code.to(device))
            bad_ready = False
        self._step_code = code
        return code, (flags[n] if bad_ready else code.amax())

    def _spike(self, loss: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if self._spike_stats is None or self._spike_stats.device != loss.device:
            stats = self._spike_stats if self._spike_stats is not None else torch.zeros(3)
            self._spike_stats = stats.to(loss.device, torch.float32)
        mean, var, count = self._spike_stats.unbind()
        z = (loss - mean) / torch.sqrt(var + 1e-12)
        spike = (count >= cfg.spike_warmup) & (z > cfg.spike_zscore) & ~bad
        alpha = 2.0 / (cfg.spike_window + 1)
        # First observation seeds the mean; later ones update an EMA of mean and variance.
        delta = loss - mean
        new_mean = torch.where(count == 0, loss, mean + alpha * delta)
        new_var = torch.where(count == 0, torch.zeros_like(var), (1 - alpha) * (var + alpha * delta * delta))
        update = ~(bad | spike)
        new = torch.stack([new_mean, new_var, count + 1])
        self._spike_stats = torch.where(update, new, self._spike_stats)
        return spike

    def _record(self, ok: bool, reasons: list[int], global_step: int, batch_idx: int) -> None:
        self.steps_seen += 1
        self._recent.append(not ok)
        if ok:
            self._consecutive = []
            return
        self.skipped_total += 1
        why = ", ".join(r for r, flag in zip(_REASONS, reasons) if flag)
        self._consecutive.append((global_step, batch_idx, why))
        limit = self.config.max_consecutive_skips
        if limit is not None and len(self._consecutive) >= limit:
            steps = [s for s, _, _ in self._consecutive]
            batches = [b for _, b, _ in self._consecutive]
            raise RuntimeError(
                f"NaNSkip: {len(self._consecutive)} consecutive optimizer steps were skipped "
                f"(global steps {steps}, batch indices {batches}; last reason: {why}). Training is "
                "not recovering: lower the learning rate, check the data at those batches, or raise "
                f"max_consecutive_skips.{self._healthy_checkpoint(steps[0])}"
            )

    def _healthy_checkpoint(self, first_skip: int) -> str:
        """Where the newest checkpoint from before the divergence is, from any checkpoint callback that
        can tell (``AsyncCheckpoint.newest_checkpoint_before``)."""
        for cb in self._trainer.callbacks if self._trainer is not None else []:
            find = getattr(cb, "newest_checkpoint_before", None)
            path = find(first_skip) if callable(find) else None
            if path:
                return (
                    f" The last healthy checkpoint, from before the step that preceded the first skip, is "
                    f"{path} (kept out of pruning): resume from it with ckpt_path={path!r}."
                )
        return ""
