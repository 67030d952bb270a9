"""Stochastic parameter decomposition (SPD): components, causal importances, masks, losses.

SPD (Bushnaq et al., 2025) writes each target weight matrix ``W [d_in, d_out]`` as a sum of ``C``
rank-one subcomponents ``V[:, c] U[c, :]`` and learns, per input, a causal importance ``g_c`` in
[0, 1] for each of them. Training asks that the model still works when every subcomponent is scaled
by a random mask ``m_c = g_c + (1 - g_c) r_c`` (``r ~ U(0, 1)``), while as few ``g_c`` as possible are
large. See ``docs/spd.md`` for the long story.

This file is plain torch. :class:`SPDModel` replaces the chosen target modules *once* by
:class:`ComponentLayer` wrappers; what each wrapper computes is driven by a shared
:class:`SPDRunState` that the caller fills before a forward pass, so no hooks are registered per
forward and the whole loss computation traces as one graph under ``torch.compile``.

Two things make a training step cheaper without changing what it computes: :class:`PrefixReplay` (the
repeated blocks of the target that run before the first decomposed layer give the same output in every
masked pass of a step, so the masked passes reuse the target pass' outputs of those blocks) and
:meth:`SPDModel.compile_regions` (regional compilation: one compiled function per repeated block class,
one for the masked linear layers and one for the KL divergence, each compiled once and reused).
"""

from __future__ import annotations

import fnmatch
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CIFnType = Literal["mlp", "vector_mlp", "shared_mlp"]
SigmoidType = Literal["leaky_hard", "hard", "lower_leaky_hard", "upper_leaky_hard", "sigmoid"]
SamplingType = Literal["continuous", "binomial"]
OutputLossType = Literal["mse", "kl"]
_CI_FNS = ("mlp", "vector_mlp", "shared_mlp")
_SIGMOIDS = ("leaky_hard", "hard", "lower_leaky_hard", "upper_leaky_hard", "sigmoid")

# --------------------------------------------------------------------------------------------------
# Leaky hard sigmoids
# --------------------------------------------------------------------------------------------------


class _LowerLeakyHardSigmoid(torch.autograd.Function):
    """clamp(x, 0, 1) whose gradient below 0 leaks (times alpha) only when it would push x up."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, alpha: float) -> Tensor:
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return x.clamp(0.0, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        # A dead component (x <= 0) may be revived by a loss that wants it larger (grad < 0 under
        # gradient descent), but is never pushed further down.
        below = torch.where(grad < 0, grad * ctx.alpha, torch.zeros_like(grad))
        inside = torch.where(x <= 1, grad, torch.zeros_like(grad))
        return torch.where(x <= 0, below, inside), None


def lower_leaky_hard_sigmoid(x: Tensor, alpha: float = 0.01) -> Tensor:
    """Values in [0, 1] (used for masks); the gradient leaks below 0 only upwards."""
    return _LowerLeakyHardSigmoid.apply(x, alpha)


def upper_leaky_hard_sigmoid(x: Tensor, alpha: float = 0.01) -> Tensor:
    """0 below 0, identity on [0, 1], slope ``alpha`` above 1 (used for the importance loss)."""
    return torch.where(x > 1, 1 + alpha * (x - 1), x.clamp(0.0, 1.0))


def hard_sigmoid(x: Tensor, alpha: float = 0.0) -> Tensor:
    return x.clamp(0.0, 1.0)


def _sigmoid(x: Tensor, alpha: float = 0.0) -> Tensor:
    return torch.sigmoid(x)


def _sigmoid_pair(kind: str) -> tuple[Any, Any]:
    """(function for the masks, function for the importance-minimality loss)."""
    if kind == "leaky_hard":
        return lower_leaky_hard_sigmoid, upper_leaky_hard_sigmoid
    fn = {
        "hard": hard_sigmoid,
        "lower_leaky_hard": lower_leaky_hard_sigmoid,
        "upper_leaky_hard": upper_leaky_hard_sigmoid,
        "sigmoid": _sigmoid,
    }[kind]
    return fn, fn


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclass
class ComponentPattern:
    """Which modules to decompose (an ``fnmatch`` pattern on module names) and with how many
    subcomponents."""

    pattern: str
    C: int

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ValueError("ComponentPattern.pattern is empty; give an fnmatch pattern like 'layers.*.mlp_in'")
        if self.C <= 0:
            raise ValueError(f"ComponentPattern {self.pattern!r}: C={self.C} must be a positive integer")


@dataclass
class SPDConfig:
    """How to decompose a target model.

    Args:
        components: patterns and their C, e.g. ``[{"pattern": "linear1", "C": 20}]``.
        ci_fn: ``mlp`` (the paper's: a small MLP per subcomponent on its scalar activation
            ``x . V[:, c]``), ``vector_mlp`` (an MLP per subcomponent on the layer input) or
            ``shared_mlp`` (one MLP from the layer input to all C importances).
        ci_hidden: hidden widths of the causal-importance MLPs.
        sigmoid: ``leaky_hard`` uses the lower-leaky hard sigmoid for masks and the upper-leaky one
            for the importance loss; other values use one function for both.
        use_delta: add the residual ``W - V U`` as one more subcomponent with its own random mask.
        sampling: ``continuous`` (r ~ U(0, 1)) or ``binomial`` (r in {0, 1}).
        output_attr: attribute to read from the target's output (``"logits"`` for HF models).
        leak: slope of the leaky parts of the sigmoids.
    """

    components: list[ComponentPattern] = field(default_factory=list)
    ci_fn: str = "mlp"
    ci_hidden: list[int] = field(default_factory=lambda: [16])
    sigmoid: str = "leaky_hard"
    use_delta: bool = True
    sampling: str = "continuous"
    output_attr: str | None = None
    leak: float = 0.01

    def __post_init__(self) -> None:
        self.components = [c if isinstance(c, ComponentPattern) else ComponentPattern(**c) for c in self.components]
        if not self.components:
            raise ValueError("SPDConfig.components is empty; give at least one {'pattern': ..., 'C': ...}")
        if self.ci_fn not in _CI_FNS:
            raise ValueError(f"SPDConfig.ci_fn={self.ci_fn!r} is unknown; choose one of {_CI_FNS}")
        if self.sigmoid not in _SIGMOIDS:
            raise ValueError(f"SPDConfig.sigmoid={self.sigmoid!r} is unknown; choose one of {_SIGMOIDS}")
        if self.sampling not in ("continuous", "binomial"):
            raise ValueError(f"SPDConfig.sampling={self.sampling!r}; choose 'continuous' or 'binomial'")
        if any(h <= 0 for h in self.ci_hidden):
            raise ValueError(f"SPDConfig.ci_hidden={self.ci_hidden} must hold positive widths")
        if self.ci_fn == "mlp" and not self.ci_hidden:
            raise ValueError("ci_fn='mlp' needs at least one hidden width in ci_hidden")


# --------------------------------------------------------------------------------------------------
# Causal-importance functions
# --------------------------------------------------------------------------------------------------


def _kaiming_(t: Tensor, fan_in: int, gain: float) -> Tensor:
    with torch.no_grad():
        return t.normal_(0.0, gain / math.sqrt(fan_in))


_RELU_GAIN = math.sqrt(2.0)


class ParallelMLP(nn.Module):
    """``C`` independent MLPs evaluated at once: ``[..., C, d_in] -> [..., C]`` (GELU hidden)."""

    def __init__(self, C: int, d_in: int, hidden: Sequence[int]) -> None:
        super().__init__()
        dims = [d_in, *hidden, 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            gain = 1.0 if i == len(dims) - 2 else _RELU_GAIN
            self.weights.append(nn.Parameter(_kaiming_(torch.empty(C, a, b), a, gain)))
            self.biases.append(nn.Parameter(torch.zeros(C, b)))

    def forward(self, x: Tensor) -> Tensor:
        n = len(self.weights)
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            if x.shape[-1] == 1 and i == 0:
                x = x * w[:, 0, :] + b  # scalar input: an outer product, no matmul needed
            else:
                x = torch.einsum("...ci,cio->...co", x, w) + b
            if i < n - 1:
                x = F.gelu(x)
        return x[..., 0]


class ScalarMLPCI(nn.Module):
    """The paper's CI function: a small MLP per subcomponent on its activation ``x . V[:, c]``."""

    uses_component_acts = True

    def __init__(self, C: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.mlp = ParallelMLP(C, 1, hidden)

    def forward(self, acts: Tensor) -> Tensor:
        return self.mlp(acts.unsqueeze(-1))


class VectorMLPCI(nn.Module):
    """A small MLP per subcomponent on the whole layer input."""

    uses_component_acts = False

    def __init__(self, C: int, d_in: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.C = C
        self.mlp = ParallelMLP(C, d_in, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x.unsqueeze(-2))


class SharedMLPCI(nn.Module):
    """One MLP from the layer input to all ``C`` importances."""

    uses_component_acts = False

    def __init__(self, C: int, d_in: int, hidden: Sequence[int]) -> None:
        super().__init__()
        dims = [d_in, *hidden, C]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            lin = nn.Linear(a, b)
            last = i == len(dims) - 2
            _kaiming_(lin.weight, a, 1.0 if last else _RELU_GAIN)
            nn.init.zeros_(lin.bias)
            layers.append(lin)
            if not last:
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x)


# --------------------------------------------------------------------------------------------------
# Run state and component layers
# --------------------------------------------------------------------------------------------------


def masked_linear(
    x: Tensor, V: Tensor, U: Tensor, mask: Tensor | None, delta_mask: Tensor | None, delta_w: Tensor | None,
    bias: Tensor | None,
) -> Tensor:
    """What a linear :class:`ComponentLayer` computes on its components: ``((x V) * mask) U``, plus the delta
    component ``delta_mask * (x delta_w)`` and the target's bias.

    A pure function of its tensors, so that regional compilation (:meth:`SPDModel.compile_regions`) compiles it
    once per layer shape and every decomposed linear layer of that shape reuses it.
    """
    acts = x.to(V.dtype) @ V
    if mask is not None:
        acts = acts * mask
    out = acts @ U
    if delta_mask is not None and delta_w is not None:
        out = out + delta_mask.unsqueeze(-1) * (x @ delta_w.to(x.dtype))
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


class _KLSum(torch.autograd.Function):
    """``sum over positions of KL(softmax(t) || softmax(s))``, float32, with its gradient in ``s`` written out."""

    @staticmethod
    def forward(ctx: Any, pred: Tensor, target: Tensor, target_lse: Tensor) -> Tensor:
        s = pred.float()
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        log_p = target.float() - target_lse
        ctx.save_for_backward(pred, target, target_lse, lse)
        return (log_p.exp() * (log_p - (s - lse))).sum()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        pred, target, target_lse, lse = ctx.saved_tensors
        g = (torch.exp(pred.float() - lse) - torch.exp(target.float() - target_lse)) * grad
        return g.to(pred.dtype), None, None


def kl_sum(pred: Tensor, target: Tensor, target_lse: Tensor) -> Tensor:
    """``sum over positions of KL(softmax(target) || softmax(pred))`` in float32; ``target_lse`` is the target's
    logsumexp over the last dimension (``[..., 1]``, computed once per step by :func:`recon_target`).

    The gradient (in ``pred`` only: the target is a constant) is ``softmax(pred) - softmax(target)`` per position,
    from the saved logits and logsumexps: no float32 log-probabilities are kept for the backward pass, and it
    reads the logits once (autograd's log-softmax backward would sum the target's probabilities again).
    """
    return _KLSum.apply(pred, target, target_lse)


def compile_region(fn: Callable[..., Any], backend: str = "inductor", fullgraph: bool = False,
                   recompile_limit: int = 64, options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """``torch.compile(fn)`` for one region: static shapes (each shape compiles once, none turns dynamic), and
    room for ``recompile_limit`` variants (shapes, grad modes) of it, above dynamo's default of 8. ``options``
    are the backend's (inductor's) options."""
    kw: dict[str, Any] = {"dynamic": False, "backend": backend, "fullgraph": fullgraph}
    if options:
        kw["options"] = dict(options)
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, recompile_limit=recompile_limit, **kw)
    import torch._dynamo.config as dynamo_config

    compiled = torch.compile(fn, **kw)
    key = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"

    def call(*args: Any, **kwargs: Any) -> Any:
        with dynamo_config.patch(**{key: max(getattr(dynamo_config, key), recompile_limit)}):
            return compiled(*args, **kwargs)

    return call


@dataclass
class PrefixReplay:
    """Outputs of the target's repeated blocks that ran before the first decomposed layer of a target pass.

    Such a block's input cannot depend on any mask, so a masked pass on the same input gets the same output from
    it: :meth:`SPDModel.masked_forward` hands back the recorded tensor instead of running the block again (for a
    GPT-2 layer in the middle of the network, half of the blocks of every masked pass). Only calls whose
    arguments are tensors, ``None`` or numbers and whose output is one tensor are recorded: a block handed
    another object (a key/value cache, say) may change it as a side effect. A masked pass replays only when its
    arguments are the very objects the target pass was given.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: dict[tuple[str, int], Tensor] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # calls of each block in the pass under way
    mode: str = "record"  # "record" (target pass), "replay" (a masked pass on the same input) or "off"
    component_seen: bool = False  # a decomposed layer ran in the recording pass: nothing after it is recorded

    def same_input(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        return (len(args) == len(self.args) and all(a is b for a, b in zip(args, self.args))
                and kwargs.keys() == self.kwargs.keys() and all(kwargs[k] is self.kwargs[k] for k in kwargs))


def _plain_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    return all(a is None or isinstance(a, (Tensor, bool, int, float)) for a in (*args, *kwargs.values()))


@dataclass
class SPDRunState:
    """What the component layers do in the next forward pass (filled by :class:`SPDModel`).

    A layer whose name is not in ``masks`` runs the frozen target weights. ``routes[name]`` (bool,
    leading dims of the input) picks components where True and the target elsewhere. ``masked_linear`` and
    ``kl`` are the functions the layers and the KL loss run (compiled ones under regional compilation).
    ``frozen_components`` runs the layers on ``V``, ``U`` and the weight deltas detached (a pass whose gradient
    is wanted only in its masks).
    """

    masks: dict[str, Tensor] = field(default_factory=dict)
    delta_masks: dict[str, Tensor] = field(default_factory=dict)
    delta_weights: dict[str, Tensor] = field(default_factory=dict)
    routes: dict[str, Tensor] = field(default_factory=dict)
    frozen_components: bool = False
    inputs: dict[str, Tensor] | None = None
    replay: PrefixReplay | None = None
    masked_linear: Callable[..., Tensor] = masked_linear
    kl: Callable[..., Tensor] = kl_sum

    def clear(self) -> None:
        self.masks = {}
        self.delta_masks = {}
        self.routes = {}
        self.inputs = None
        self.replay = None


class _BlockRunner:
    """The ``forward`` of one repeated block of the target (set on the instance, so the module tree and its
    state dict stay as they are): hands back the :class:`PrefixReplay` output when a masked pass replays, and
    otherwise runs ``fn`` (the block class' ``forward``; its compiled version under regional compilation)."""

    def __init__(self, block: nn.Module, name: str, state: SPDRunState) -> None:
        self.block, self.name, self.state = block, name, state
        self.fn: Callable[..., Any] = type(block).forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rp = self.state.replay
        if rp is None or rp.mode == "off":
            return self.fn(self.block, *args, **kwargs)
        i = rp.calls.get(self.name, 0)
        rp.calls[self.name] = i + 1
        if rp.mode == "replay":
            out = rp.outputs.get((self.name, i))
            return self.fn(self.block, *args, **kwargs) if out is None else out
        out = self.fn(self.block, *args, **kwargs)
        if not rp.component_seen and isinstance(out, Tensor) and _plain_call(args, kwargs):
            rp.outputs[(self.name, i)] = out
        return out


def _is_hf_conv1d(module: nn.Module) -> bool:
    # Duck typing so that transformers is never imported just to check a type.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


class ComponentLayer(nn.Module):
    """Stands in for a target ``nn.Linear``, ``nn.Embedding`` or HF ``Conv1D``.

    Holds the frozen target weight in ``[d_in, d_out]`` layout (transposed once at construction, so
    no per-step transpose), the frozen bias, ``V [d_in, C]`` and ``U [C, d_out]``.
    """

    def __init__(self, name: str, target: nn.Module, C: int, state: SPDRunState) -> None:
        super().__init__()
        self.name = name
        self.C = C
        self._state = state
        if isinstance(target, nn.Embedding):
            self.kind = "embedding"
            w = target.weight.detach()  # [vocab, d]
            self.padding_idx = target.padding_idx
        elif isinstance(target, nn.Linear):
            self.kind = "linear"
            w = target.weight.detach().t()
        elif _is_hf_conv1d(target):
            self.kind = "linear"
            w = target.weight.detach()  # Conv1D already stores [d_in, d_out]
        else:
            raise TypeError(
                f"module {name!r} is a {type(target).__name__}; SPD decomposes nn.Linear, nn.Embedding and "
                "transformers' Conv1D. Choose a pattern that matches only those."
            )
        self.d_in, self.d_out = w.shape
        self.register_buffer("weight", w.clone().contiguous())
        bias = getattr(target, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.V = nn.Parameter(_kaiming_(torch.empty(self.d_in, C, dtype=w.dtype, device=w.device), self.d_in, 1.0))
        self.U = nn.Parameter(_kaiming_(torch.empty(C, self.d_out, dtype=w.dtype, device=w.device), C, 1.0))

    def extra_repr(self) -> str:
        return f"{self.name!r}, kind={self.kind}, d_in={self.d_in}, d_out={self.d_out}, C={self.C}"

    # -- pieces ---------------------------------------------------------------------------------
    def component_weight(self) -> Tensor:
        """``V @ U`` in ``[d_in, d_out]`` layout."""
        return self.V @ self.U

    def component_acts(self, x: Tensor) -> Tensor:
        """``x . V[:, c]`` for every subcomponent: ``[..., C]``."""
        if self.kind == "embedding":
            return F.embedding(x, self.V)
        return x.to(self.V.dtype) @ self.V

    def target_forward(self, x: Tensor) -> Tensor:
        if self.kind == "embedding":
            return F.embedding(x, self.weight, self.padding_idx)
        out = x @ self.weight.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def masked_forward(self, x: Tensor, mask: Tensor | None, delta_mask: Tensor | None, delta_w: Tensor | None) -> Tensor:
        V, U = self.V, self.U
        if self._state.frozen_components:
            V, U = V.detach(), U.detach()
            delta_w = None if delta_w is None else delta_w.detach()
        if self.kind == "linear":
            return self._state.masked_linear(x, V, U, mask, delta_mask, delta_w, self.bias)
        acts = F.embedding(x, V)
        if mask is not None:
            acts = acts * mask
        out = acts @ U
        if delta_mask is not None and delta_w is not None:
            out = out + delta_mask.unsqueeze(-1) * F.embedding(x, delta_w)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def forward(self, x: Tensor) -> Tensor:
        st = self._state
        if st.replay is not None and st.replay.mode == "record":
            st.replay.component_seen = True
        if st.inputs is not None:
            st.inputs[self.name] = x
        mask = st.masks.get(self.name)
        if mask is None:
            return self.target_forward(x)
        out = self.masked_forward(x, mask, st.delta_masks.get(self.name), st.delta_weights.get(self.name))
        route = st.routes.get(self.name)
        if route is not None:
            with torch.no_grad():
                tgt = self.target_forward(x)
            out = torch.where(route.unsqueeze(-1), out, tgt.to(out.dtype))
        return out


def repeated_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The children of every ``nn.ModuleList`` in ``model`` that holds two or more modules of one class (the
    transformer blocks of a language model), by name: the outermost such lists only, and no list of component
    layers."""
    out: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 2 or len({type(c) for c in m}) != 1:
            continue
        if isinstance(m[0], ComponentLayer) or any(name.startswith(b + ".") for b in out):
            continue
        for i, c in enumerate(m):
            out[f"{name}.{i}" if name else str(i)] = c
    return out


def match_modules(model: nn.Module, patterns: Sequence[ComponentPattern]) -> dict[str, int]:
    """Module name -> C for every module matched by a pattern.

    Raises:
        ValueError: a pattern matches nothing, or a module is matched by two patterns.
    """
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, int] = {}
    owner: dict[str, str] = {}
    for p in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, p.pattern)]
        if not hits:
            sample = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"pattern {p.pattern!r} matches no module of the target; module names are: {sample}")
        for n in hits:
            if n in owner:
                raise ValueError(
                    f"module {n!r} is matched by both {owner[n]!r} and {p.pattern!r}; make the patterns disjoint"
                )
            owner[n] = p.pattern
            out[n] = p.C
    return out


@dataclass
class CIOutput:
    """Causal importances per layer: ``lower`` (for masks) and ``upper`` (for the importance loss)."""

    lower: dict[str, Tensor]
    upper: dict[str, Tensor]
    pre: dict[str, Tensor]


class SPDModel(nn.Module):
    """A target model with chosen modules replaced by :class:`ComponentLayer`.

    The target is modified in place (its modules are swapped) and frozen.

    Example:
        >>> spd = SPDModel(tms, SPDConfig(components=[ComponentPattern("linear*", 20)]))
        >>> out, inputs = spd.target_forward(x)  # frozen target, layer inputs cached
        >>> ci = spd.causal_importances(inputs)
        >>> masks = spd.stochastic_masks(ci.lower)
        >>> spd.refresh_delta_weights()  # W - V U, once per optimizer step
        >>> y = spd.masked_forward(x, masks=masks, delta_masks=spd.delta_masks(ci.lower))

    ``target_forward(x, keep_prefix=True)`` also records the outputs of the repeated blocks that run before the
    first decomposed layer (:class:`PrefixReplay`); masked passes on the same ``x`` then reuse them, until
    :meth:`forget_prefix`.
    """

    def __init__(self, target: nn.Module, config: SPDConfig) -> None:
        super().__init__()
        self.config = config
        target.requires_grad_(False)
        target.eval()
        self.target = target
        self.state = SPDRunState()
        self.module_to_c = match_modules(target, config.components)
        self.layer_names: list[str] = list(self.module_to_c)
        layers: dict[str, ComponentLayer] = {}
        for name, C in self.module_to_c.items():
            parent_name, _, child = name.rpartition(".")
            parent = target.get_submodule(parent_name) if parent_name else target
            layer = ComponentLayer(name, getattr(parent, child), C, self.state)
            setattr(parent, child, layer)
            layers[name] = layer
        self._layers = layers  # plain dict: the layers are registered once, under target
        self.ci_fns = nn.ModuleDict({n.replace(".", "-"): self._make_ci(layers[n]) for n in self.layer_names})
        self._lower, self._upper = _sigmoid_pair(config.sigmoid)
        self._runners: dict[str, _BlockRunner] = {}
        for name, block in repeated_blocks(target).items():
            if "forward" in vars(block):  # already wrapped by someone else (accelerate's hooks, say): left alone
                continue
            runner = _BlockRunner(block, name, self.state)
            block.forward = runner  # an instance attribute: no new module, same state dict keys
            self._runners[name] = runner
        self.compiled_regions: list[str] = []

    def _make_ci(self, layer: ComponentLayer) -> nn.Module:
        cfg = self.config
        if cfg.ci_fn == "mlp":
            return ScalarMLPCI(layer.C, cfg.ci_hidden)
        if layer.kind == "embedding":
            raise ValueError(f"{layer.name!r} is an embedding: only ci_fn='mlp' works there (token ids are not vectors)")
        if cfg.ci_fn == "vector_mlp":
            return VectorMLPCI(layer.C, layer.d_in, cfg.ci_hidden)
        return SharedMLPCI(layer.C, layer.d_in, cfg.ci_hidden)

    # -- parameters -----------------------------------------------------------------------------
    @property
    def layers(self) -> dict[str, ComponentLayer]:
        return self._layers

    def component_parameters(self) -> list[nn.Parameter]:
        return [p for n in self.layer_names for p in (self._layers[n].V, self._layers[n].U)]

    def ci_parameters(self) -> list[nn.Parameter]:
        return list(self.ci_fns.parameters())

    # -- forward passes -------------------------------------------------------------------------
    def _output(self, raw: Any) -> Tensor:
        attr = self.config.output_attr
        if attr is None:
            return raw
        if attr.startswith("idx_"):
            return raw[int(attr[4:])]
        return getattr(raw, attr)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        """The frozen target's output (all layers on the target path)."""
        self.state.clear()
        return self._output(self.target(*args, **kwargs))

    def target_forward(self, *args: Any, keep_prefix: bool = False, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Target output and the input of every decomposed layer (no grad: the target is frozen).

        ``keep_prefix`` records the outputs of the blocks before the first decomposed layer for the masked passes
        on the same arguments (:class:`PrefixReplay`); :meth:`forget_prefix` drops them.
        """
        st = self.state
        st.clear()
        st.inputs = {}
        st.replay = PrefixReplay(args, dict(kwargs)) if keep_prefix else None
        try:
            with torch.no_grad():
                out = self._output(self.target(*args, **kwargs))
            inputs = st.inputs
        finally:
            st.inputs = None
            if st.replay is not None:
                st.replay.mode = "off"
        return out, inputs

    def forget_prefix(self) -> None:
        """Drop the block outputs :meth:`target_forward` kept (``keep_prefix=True``)."""
        self.state.replay = None

    def masked_forward(
        self,
        *args: Any,
        masks: Mapping[str, Tensor],
        delta_masks: Mapping[str, Tensor] | None = None,
        routes: Mapping[str, Tensor] | None = None,
        frozen_components: bool = False,
        **kwargs: Any,
    ) -> Tensor:
        """Output with the layers in ``masks`` on their (masked) components, the rest on the target.

        ``delta_masks`` needs :meth:`refresh_delta_weights` called first (once per optimizer step).
        ``frozen_components``: the components (``V``, ``U``, the weight deltas) enter detached, so a backward
        pass of this output computes no gradient for them (the same values; PGD's ascent wants only the masks').
        """
        st = self.state
        st.frozen_components = frozen_components
        st.masks = dict(masks)
        st.delta_masks = dict(delta_masks) if delta_masks else {}
        st.routes = dict(routes) if routes else {}
        rp = st.replay
        if rp is not None:
            rp.mode = "replay" if rp.same_input(args, kwargs) else "off"
            rp.calls = {}
        try:
            return self._output(self.target(*args, **kwargs))
        finally:
            st.masks, st.delta_masks, st.routes = {}, {}, {}
            st.frozen_components = False
            if rp is not None:
                rp.mode = "off"

    def weight_deltas(self) -> dict[str, Tensor]:
        """``W - V U`` per layer, ``[d_in, d_out]`` (differentiable in V, U), in the parameters' dtype also
        under autocast: ``V U`` close to ``W`` leaves a small difference that bf16 rounding of ``V U`` would
        swamp."""
        device = self._layers[self.layer_names[0]].V.device.type
        with torch.autocast(device, enabled=False):
            return {n: self._layers[n].weight - self._layers[n].component_weight() for n in self.layer_names}

    def refresh_delta_weights(self, deltas: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Compute the weight deltas once and hand them to the layers for the delta component."""
        deltas = self.weight_deltas() if deltas is None else deltas
        self.state.delta_weights = deltas
        return deltas

    # -- causal importances and masks -----------------------------------------------------------
    def causal_importances(self, inputs: Mapping[str, Tensor], detach_inputs: bool = False) -> CIOutput:
        lower, upper, pre = {}, {}, {}
        for name in self.layer_names:
            x = inputs[name]
            fn = self.ci_fns[name.replace(".", "-")]
            z = self._layers[name].component_acts(x) if fn.uses_component_acts else x.to(self._layers[name].V.dtype)
            if detach_inputs:
                z = z.detach()
            g = fn(z)
            pre[name] = g
            lower[name] = self._lower(g, self.config.leak)
            upper[name] = self._upper(g, self.config.leak)
        return CIOutput(lower=lower, upper=upper, pre=pre)

    def stochastic_masks(self, ci: Mapping[str, Tensor], sampling: str | None = None) -> dict[str, Tensor]:
        """``m = g + (1 - g) r`` per layer with ``r ~ U(0, 1)`` (or {0, 1} when binomial)."""
        return {n: stochastic_mask(g, sampling or self.config.sampling) for n, g in ci.items()}

    def delta_masks(self, ci: Mapping[str, Tensor]) -> dict[str, Tensor] | None:
        """Random masks for the delta component (its importance is 0, so the mask is just ``r``)."""
        if not self.config.use_delta:
            return None
        return {n: torch.rand(g.shape[:-1], device=g.device, dtype=g.dtype) for n, g in ci.items()}

    # -- losses and compilation -------------------------------------------------------------------
    def recon_loss(self, pred: Tensor, target: ReconTarget) -> Tensor:
        """:func:`recon_loss` with this model's KL function (the compiled one under regional compilation)."""
        s, n = recon_loss_sum(pred, target, kl=self.state.kl)
        return s / n

    def compile_regions(self, backend: str = "inductor", options: Mapping[str, Any] | None = None) -> list[str]:
        """Regional compilation: compile the repeated pieces of a step once and reuse them.

        * each repeated block class of the target without a decomposed layer (the transformer blocks around a
          decomposed one): one compiled ``forward`` for all its instances;
        * :func:`masked_linear` for every linear component layer (one graph per layer shape);
        * :func:`kl_sum` for the KL reconstruction losses.

        The rest (the block holding the decomposed layers, causal importances, masks, the importance loss) runs
        eagerly between them. Compiling a handful of small graphs takes a fraction of the time of the whole step
        as one graph. ``options`` go to the backend (inductor's options). Returns what was compiled, by name;
        calling it again changes nothing.
        """
        if self.compiled_regions:
            return self.compiled_regions
        done: dict[type, Callable[..., Any]] = {}
        for name, runner in self._runners.items():
            if any(isinstance(m, ComponentLayer) for m in runner.block.modules()):
                continue
            cls = type(runner.block)
            if cls not in done:
                done[cls] = compile_region(cls.forward, backend, options=options)
            runner.fn = done[cls]
            self.compiled_regions.append(name)
        if any(layer.kind == "linear" for layer in self._layers.values()):
            self.state.masked_linear = compile_region(masked_linear, backend, fullgraph=True, options=options)
            self.compiled_regions.append("masked_linear")
        self.state.kl = compile_region(kl_sum, backend, fullgraph=True, options=options)
        self.compiled_regions.append("kl")
        return self.compiled_regions


def stochastic_mask(ci: Tensor, sampling: str = "continuous") -> Tensor:
    """``ci + (1 - ci) * r``: every value lies in [ci, 1]."""
    if sampling == "binomial":
        r = torch.randint(0, 2, ci.shape, device=ci.device).to(ci.dtype)
    else:
        r = torch.rand_like(ci)
    return ci + (1 - ci) * r


def uniform_k_subset_routes(names: Sequence[str], shape: Sequence[int], device: torch.device) -> dict[str, Tensor]:
    """For each position draw k ~ U{1..L}; route k of the L layers (a random subset) to components."""
    n = len(names)
    k = torch.randint(1, n + 1, tuple(shape), device=device)
    ranks = torch.rand((n, *shape), device=device).argsort(0).argsort(0)
    return {name: ranks[i] < k for i, name in enumerate(names)}


# --------------------------------------------------------------------------------------------------
# Losses (pure functions; the LightningModule combines them)
# --------------------------------------------------------------------------------------------------


def faithfulness_loss(deltas: Mapping[str, Tensor]) -> Tensor:
    """Mean squared entry of ``W - V U`` over all decomposed weights."""
    total = sum((d.float() ** 2).sum() for d in deltas.values())
    n = sum(d.numel() for d in deltas.values())
    return total / n


@dataclass
class ReconTarget:
    """The target's output, prepared once per step for every reconstruction loss against it: for ``kl``, the
    logsumexp of its logits (``lse``, float32 ``[..., 1]``), so no loss term normalises the target again."""

    kind: str
    out: Tensor
    lse: Tensor | None = None


def recon_target(target: Tensor, kind: str) -> ReconTarget:
    if kind == "kl":
        return ReconTarget(kind, target, torch.logsumexp(target.float(), dim=-1, keepdim=True))
    return ReconTarget(kind, target)


def recon_loss_sum(pred: Tensor, target: Tensor | ReconTarget, kind: str | None = None,
                   kl: Callable[..., Tensor] = kl_sum) -> tuple[Tensor, int]:
    """(summed loss, count) for ``mse`` (count = elements) or ``kl`` (KL(target || pred) per position).

    ``target`` is the target's output with its ``kind``, or a :class:`ReconTarget` (prepared once for several
    losses). ``kl`` computes the summed KL (:func:`kl_sum` or a compiled version of it).
    """
    if not isinstance(target, ReconTarget) and kind is None:
        raise ValueError("recon_loss_sum: give the loss kind ('mse' or 'kl') with a target tensor")
    tgt = target if isinstance(target, ReconTarget) else recon_target(target, kind)
    if tgt.kind == "mse":
        return ((pred.float() - tgt.out.float()) ** 2).sum(), pred.numel()
    return kl(pred, tgt.out, tgt.lse), pred.shape[:-1].numel()


def recon_loss(pred: Tensor, target: Tensor | ReconTarget, kind: str | None = None) -> Tensor:
    s, n = recon_loss_sum(pred, target, kind)
    return s / n


def annealed_p(p: float, frac: Tensor | float, start_frac: float = 1.0, final_p: float | None = None, end_frac: float = 1.0) -> Tensor | float:
    """Linear anneal of p from ``p`` to ``final_p`` between ``start_frac`` and ``end_frac`` of training."""
    if final_p is None or start_frac >= 1.0:
        return p
    span = max(end_frac - start_frac, 1e-12)
    if isinstance(frac, Tensor):
        t = ((frac - start_frac) / span).clamp(0.0, 1.0)
    else:
        t = min(max((frac - start_frac) / span, 0.0), 1.0)
    return p + (final_p - p) * t


def importance_sums(ci_upper: Mapping[str, Tensor], p: Tensor | float, eps: float = 1e-12) -> tuple[dict[str, Tensor], int]:
    """Per layer, ``sum over positions of (ci + eps) ** p`` (shape ``[C]``), and the number of positions."""
    sums = {n: ((g.float() + eps) ** p).flatten(0, -2).sum(0) for n, g in ci_upper.items()}
    return sums, next(iter(ci_upper.values())).shape[:-1].numel()


def importance_minimality_from_sums(sums: Mapping[str, Tensor], n: Tensor | int, beta: float = 0.0) -> Tensor:
    """``sum_layers sum_c [mean_c + beta * mean_c * log2(1 + sum_c)]`` with ``mean_c = sum_c / n``.

    Pass *global* sums and counts (all-reduced) so the value and the log term are right under DDP.
    """
    total = None
    for s in sums.values():
        mean = s / n
        term = mean + beta * mean * torch.log2(1 + s) if beta else mean
        total = term.sum() if total is None else total + term.sum()
    return total


def importance_minimality_loss(
    ci_upper: Mapping[str, Tensor], p: Tensor | float, beta: float = 0.0, eps: float = 1e-12, reduce_sums: Any = None
) -> Tensor:
    """Importance minimality; ``reduce_sums`` (e.g. a differentiable all-reduce) makes it global."""
    sums, n = importance_sums(ci_upper, p, eps)
    if reduce_sums is not None:
        sums, n = reduce_sums(sums, n)
    return importance_minimality_from_sums(sums, n, beta)


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def ci_l0(ci: Tensor, threshold: float = 0.1) -> Tensor:
    """Mean number of subcomponents per position with importance above ``threshold``."""
    return (ci > threshold).float().sum(-1).mean()


def mmcs_ml2r(target_rows: Tensor, V: Tensor, U: Tensor, min_norm: float = 0.0) -> tuple[Tensor, Tensor]:
    """Mean max cosine similarity and mean L2 ratio of a decomposition against target rows.

    ``target_rows [n, d_out]``: row ``j`` is the weight feature ``j`` writes (for TMS ``linear1`` this
    is ``W^T``). Subcomponent ``c`` writes ``V[j, c] U[c, :]`` for feature ``j``; for each ``j`` take the
    ``c`` with the highest cosine similarity, and the ratio of its norm to the target row's norm.
    """
    sub = V.unsqueeze(-1) * U.unsqueeze(0)  # [n, C, d_out]
    sub_norm = sub.norm(dim=-1)
    tgt_norm = target_rows.norm(dim=-1, keepdim=True)
    cos = (sub * target_rows.unsqueeze(1)).sum(-1) / (sub_norm * tgt_norm).clamp_min(1e-12)
    if min_norm > 0:
        cos = cos.masked_fill(sub_norm < min_norm, -1.0)
    best, idx = cos.max(dim=1)
    ratio = sub_norm.gather(1, idx.unsqueeze(1)).squeeze(1) / tgt_norm.squeeze(1)
    return best.mean(), ratio.mean()


def greedy_identity_permutation(ci: Tensor) -> Tensor:
    """Column order that puts a large entry on each diagonal place: repeatedly take the largest
    remaining entry of the matrix and pair its row and column (rows without any mass go last)."""
    n, C = ci.shape
    work = ci.detach().float().clone()
    col_of_row = [-1] * n
    for _ in range(min(n, C)):
        flat = int(work.argmax())
        i, j = divmod(flat, C)
        col_of_row[i] = j
        work[i, :] = -math.inf
        work[:, j] = -math.inf
    used = [j for j in col_of_row if j >= 0]
    order = [col_of_row[i] for i in range(min(n, C))]
    return torch.tensor(order + [j for j in range(C) if j not in used], device=ci.device)


def identity_ci_breakdown(ci: Tensor, tolerance: float = 0.1) -> dict[str, float]:
    """The parts of :func:`identity_ci_error` after the greedy column matching.

    Returns ``off_diagonal`` (entries off the matched diagonal ``> tol``), ``diagonal_misses`` (matched
    entries ``< 1 - tol``), ``off_diagonal_max`` and ``off_diagonal_mean_active`` (mean of the
    off-diagonal entries ``> tol``): whether an error count comes from a few strong extra
    subcomponents or from many weak ones.
    """
    ci = ci.detach().float()
    ci = ci[:, greedy_identity_permutation(ci)]
    k = min(ci.shape)
    diag = torch.diagonal(ci[:k, :k])
    off = ci.clone()
    off[:k, :k].fill_diagonal_(0.0)
    active = off[off > tolerance]
    return {
        "off_diagonal": int((off > tolerance).sum().item()),
        "diagonal_misses": int((diag < 1 - tolerance).sum().item()),
        "off_diagonal_max": float(off.max().item()) if off.numel() else 0.0,
        "off_diagonal_mean_active": float(active.mean().item()) if active.numel() else 0.0,
    }


def identity_ci_error(ci: Tensor, tolerance: float = 0.1) -> int:
    """Entries off the (best-permuted) identity pattern: off-diagonal ``> tol`` or diagonal ``< 1 - tol``.

    ``ci [n_features, C]`` holds the importances for inputs with one active feature each; 0 means
    each feature uses exactly one subcomponent of its own.
    """
    parts = identity_ci_breakdown(ci, tolerance)
    return int(parts["off_diagonal"] + parts["diagonal_misses"])
