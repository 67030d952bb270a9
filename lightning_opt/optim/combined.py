"""Several optimizers behind one ``torch.optim.Optimizer``.

Lightning's automatic optimization takes one optimizer per step; the speedrun needs Muon for the hidden
matrices and AdamW for the rest. Wrapping both keeps gradient clipping, accumulation, schedulers and
callbacks (which see ``param_groups``) working unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch.optim import Optimizer


class CombinedOptimizer(Optimizer):
    """Step, zero and checkpoint several optimizers as one.

    ``param_groups`` is the concatenation of the inner optimizers' groups (the same dict objects), so a
    scheduler that scales ``group["lr"]`` scales the inner optimizers.
    """

    def __init__(self, optimizers: list[Optimizer]) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers = list(optimizers)
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:  # Optimizer internals may assign; the inner lists are the truth
        pass

    @property
    def state(self) -> dict:  # type: ignore[override]
        merged: dict = {}
        for o in self.optimizers:
            merged.update(o.state)
        return merged

    @state.setter
    def state(self, value) -> None:
        pass

    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()  # Lightning's closure runs forward + backward once, for all inner optimizers
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = state_dict.get("optimizers")
        if inner is None or len(inner) != len(self.optimizers):
            raise ValueError(
                f"optimizer checkpoint holds {0 if inner is None else len(inner)} optimizers, this run has "
                f"{len(self.optimizers)}: the checkpoint comes from another optimizer configuration"
            )
        for o, sd in zip(self.optimizers, inner):
            o.load_state_dict(sd)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add the group to one of CombinedOptimizer.optimizers instead")

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"
