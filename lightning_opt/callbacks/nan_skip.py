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
from lightning_opt.callbacks._logging import KeyedStateCallback, log_metrics, log_step

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

    code: torch.Tensor  # int32 [len(_REASONS)] on device: reasons, already reduced over ranks
    host: torch.Tensor  # pinned CPU copy of ``code`` (filled by a non-blocking copy)
    event: torch.cuda.Event | None
    global_step: int
    batch_idx: int
    scheduler_calls: list[Callable[[], Any]] = field(default_factory=list)


class _OptimizerGuard:
    """Wraps one optimizer's ``step`` so that it takes effect only when the step is finite."""

    def __init__(self, owner: NaNSkip, optimizer: torch.optim.Optimizer) -> None:
        self.owner = owner
        self.optimizer = optimizer
        self.had_instance_step = "step" in optimizer.__dict__
        self.original_step = optimizer.step
        self.pending: _Pending | None = None
        self.last_skipped = False
        self.snapshot: list[torch.Tensor] = []
        self.host_fallback_warned = False
        self.host_buf: torch.Tensor | None = None
        self.host_buf_for: torch.device | None = None
        self.event: torch.cuda.Event | None = None
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and any(
            g.get("fused") for g in optimizer.param_groups
        )

        def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            return self.step(closure, **kwargs)

        # Keep markers such as the LR scheduler's ``_wrapped_by_lr_sched`` visible on the wrapper.
        step.__dict__.update(getattr(self.original_step, "__dict__", {}))
        setattr(step, _WRAP_TAG, self)
        optimizer.step = step  # type: ignore[method-assign]

    def unwrap(self) -> None:
        if self.had_instance_step:
            self.optimizer.step = self.original_step  # type: ignore[method-assign]
        else:
            self.optimizer.__dict__.pop("step", None)

    # -- the step -------------------------------------------------------------------------------
    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

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
        # every step (a per-step sync in effect: +2.5% on GPT-2 124M).
        self.resolve()
        params = self._params_with_grad()
        if not params:  # nothing to update (all grads None): let the optimizer do its no-op
            self.original_step(**kwargs)
            return loss
        device = params[0].device
        code = owner._decision(params, device)
        trainer = owner._trainer
        meta = (trainer.global_step if trainer else -1, owner._batch_idx)
        state_empty = any(len(self.optimizer.state.get(p, {})) == 0 for p in params)
        use_host = owner.config.mode == "host" or state_empty or not self._device_path_possible(params)
        if use_host:
            # Host mode (or an optimizer's first step, whose state it creates lazily): one sync.
            reasons = code.tolist()
            ok = not any(reasons)
            if ok:
                self.original_step(**kwargs)
            owner._record(ok, reasons, *meta)
            self.last_skipped = not ok
            return loss
        bad = code.amax()  # the reasons are 0/1 flags
        if self.fused:
            self._fused_step(bad, kwargs)
        else:
            self._snapshot_step(params, bad == 0, kwargs)
        # One pinned buffer and one event, reused: the previous step's copy was read by resolve().
        if self.host_buf is None or self.host_buf_for != device:
            cuda = device.type == "cuda"
            self.host_buf = torch.empty(len(_REASONS), dtype=torch.int32, pin_memory=cuda)
            self.event = torch.cuda.Event() if cuda else None
            self.host_buf_for = device
        self.host_buf.copy_(code, non_blocking=True)
        if self.event is not None:
            self.event.record()
        self.pending = _Pending(code, self.host_buf, self.event, *meta)
        return loss

    def _device_path_possible(self, params: list[torch.Tensor]) -> bool:
        if self.fused:
            return True
        device = params[0].device
        for p in params:
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
                        stacklevel=2,
                    )
                    self.host_fallback_warned = True
                return False
        return True

    def _fused_step(self, bad: torch.Tensor, kwargs: dict[str, Any]) -> None:
        # Fused torch optimizers accept ``found_inf``: when it is 1 the kernel leaves params and
        # moments untouched and undoes the step-count increment. Combine with a GradScaler's flag.
        opt = self.optimizer
        prior = opt.__dict__.get("found_inf")
        skip = bad.to(torch.float32)
        opt.found_inf = skip if prior is None else torch.maximum(prior.reshape(()).float(), skip)  # type: ignore[attr-defined]
        had_scale = "grad_scale" in opt.__dict__
        if not had_scale:
            opt.grad_scale = None  # type: ignore[attr-defined]
        try:
            self.original_step(**kwargs)
        finally:
            if prior is None:
                del opt.found_inf  # type: ignore[attr-defined]
            else:
                opt.found_inf = prior  # type: ignore[attr-defined]
            if not had_scale:
                del opt.grad_scale  # type: ignore[attr-defined]

    def _state_tensors(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        out = list(params)
        for p in params:
            out.extend(v for v in self.optimizer.state[p].values() if isinstance(v, torch.Tensor))
        return out

    @torch.no_grad()
    def _snapshot_step(self, params: list[torch.Tensor], ok: torch.Tensor, kwargs: dict[str, Any]) -> None:
        # Generic exact skip without a sync: copy params + state into reused buffers, step, then
        # select old values where the step was bad. Costs one extra copy of params + state.
        tensors = self._state_tensors(params)
        if len(self.snapshot) != len(tensors) or any(
            s.shape != t.shape or s.dtype != t.dtype or s.device != t.device
            for s, t in zip(self.snapshot, tensors)
        ):
            self.snapshot = [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(self.snapshot, tensors)
        self.original_step(**kwargs)
        after = self._state_tensors(params)
        if len(after) != len(tensors):
            raise RuntimeError(
                f"NaNSkip: {type(self.optimizer).__name__} changed its state layout during a step; "
                "use NaNSkip(mode='host') with this optimizer."
            )
        for t, s in zip(after, self.snapshot):
            torch.where(ok, t, s, out=t)

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
        reasons = pending.host.tolist()
        ok = not any(reasons)
        self.last_skipped = not ok
        if ok:
            for call in pending.scheduler_calls:
                call()
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

    Args:
        mode: ``"device"`` (default): the decision stays on the device; fused optimizers
            (``fused=True``) skip through their ``found_inf`` input at no cost, other optimizers
            through a snapshot of params + state (one extra copy of both in memory). ``"host"``:
            one host-device sync per step, no extra memory, any optimizer.
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
        self._loss_bad: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._clamped: torch.Tensor | None = None  # LossClamp(skip_step_when_clamped=True) hit
        # This training step's decision so far: every optimizer stepped in the batch shares it.
        self._step_code: torch.Tensor | None = None
        self._spike_stats: torch.Tensor | None = None  # [mean, var, count] on device
        self._zeros: dict[torch.device, torch.Tensor] = {}

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

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self._note_loss(~torch.isfinite(loss).all())
        if self.config.spike_zscore is not None:  # the loss value is only needed for spikes
            value = loss.float().sum()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    @override
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Automatic optimization zeroes grads at the start of each accumulation window: flags
        # left from a step that never reached our wrapper (a GradScaler skip) must not carry over.
        self._loss_bad = None
        self._loss_sum = None
        self._clamped = None

    def _note_loss(self, nonfinite: torch.Tensor, clamped: torch.Tensor | None = None) -> None:
        """ORs device flags of one backward into the pending decision (no sync).

        ``LossClamp`` calls it with the loss as it was *before* clamping, so an Inf loss that it
        clamps to a finite value is still skipped whichever of the two runs first.
        """
        self._loss_bad = nonfinite if self._loss_bad is None else self._loss_bad | nonfinite
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
    def _decision(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """int32 [len(_REASONS)] on ``device``, the same on every rank: (loss bad, grad bad, spike,
        clamped), OR-ed with the earlier decisions of this training step.

        One training step has one decision: its first one checks the gradients of *every* wrapped
        optimizer, and each later optimizer step of the same batch (manual optimization) inherits
        it, so all of them are skipped together. Flags that appear only after an earlier optimizer
        of the batch has stepped (a later backward, that optimizer's own new gradients) skip the
        later steps alone: the earlier update is already applied.
        """
        cfg = self.config
        if self._step_code is None and len(self._guards) > 1:
            params = [p for guard in self._guards for p in guard._params_with_grad()] or params
        zero = self._zeros.get(device)
        if zero is None:  # a constant, made once per device (never written to)
            zero = self._zeros[device] = torch.zeros((), dtype=torch.bool, device=device)
        loss_bad = zero
        if cfg.check_loss and self._loss_bad is not None:
            loss_bad = self._loss_bad.to(device, non_blocking=True)
        grad_bad = zero
        if cfg.check_grads:
            # inf-norm: propagates NaN/inf and cannot overflow for finite gradients (unlike the 2-norm).
            norms = torch._foreach_norm([p.grad for p in params], float("inf"))
            try:
                stacked = torch.stack(norms)  # promotes mixed grad dtypes
            except RuntimeError:  # grads on several devices
                stacked = torch.stack([n.to(device, torch.float32) for n in norms])
            grad_bad = ~torch.isfinite(stacked.to(device)).all()
        clamped = zero if self._clamped is None else self._clamped.to(device, non_blocking=True)
        spike = zero
        if cfg.spike_zscore is not None and self._loss_sum is not None:
            spike = self._spike(self._loss_sum.to(device), loss_bad | grad_bad | clamped)
        self._loss_bad = None
        self._loss_sum = None
        self._clamped = None
        code = torch.stack([loss_bad, grad_bad, spike, clamped]).to(torch.int32)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # int32 because NCCL cannot reduce bool; MAX so one rank's NaN skips the step everywhere.
            if dist.get_backend() == "nccl" and code.device.type != "cuda":
                code = code.cuda()
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
            code = code.to(device)
        if self._step_code is not None:
            code = torch.maximum(code, self._step_code.to(device))
        self._step_code = code
        return code

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
