"""Builds goodfire's ``spd`` ComponentModel and loss from their package (in ``.peers/spd``) and times
their training step, for the side-by-side in ``benchmarks/spd_step.py``.

Nothing of theirs is copied here: their modules are imported from the checkout. Their package wants
Python 3.13; on older Pythons a small import hook rewrites PEP 695 generics (``def f[T](...)``,
``class C[T]:``) to ``TypeVar`` form while loading, and ``typing.override`` is taken from
``typing_extensions``. ``wandb`` and other logging-only packages they import at module level are
replaced by inert stubs when missing (the training step never calls them). ``pydantic``, ``einops`` and
``jaxtyping`` (with their own dependencies) are needed for real.

Setup (once, where git and pip reach the internet; then carry ``.peers/spd`` and ``.peers/wheels``, about 7 MB):
    git clone https://github.com/goodfire-ai/spd /tmp/spd && git -C /tmp/spd archive HEAD spd pyproject.toml LICENSE \
        | tar -x -C .peers/spd && git -C /tmp/spd rev-parse HEAD > .peers/spd/COMMIT
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .peers/wheels pydantic==2.11.9 pydantic-core==2.33.2 \
        annotated-types==0.7.0 typing-inspection==0.4.1 einops jaxtyping wadler-lindig

Their ``pyproject.toml`` asks for ``pydantic<2.12``, ``einops``, ``jaxtyping`` (and logging / app packages the step
never calls). A GPU image with torch, einops and jaxtyping but no pydantic needs the four pydantic wheels above
(one ``pydantic_core`` wheel per Python version). Missing pure-Python / binary dependencies are unpacked from
``.peers/wheels`` (wheels matching this interpreter) into ``.peers/site-cpXY`` at import time, so a machine without
internet works; when something is still missing, :func:`install` raises and the benchmark records the peer as not
runnable, with the reason.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = ROOT / ".peers" / "spd"
PEER_SITE = ROOT / ".peers" / "site"
PEER_WHEELS = ROOT / ".peers" / "wheels"
# Imported at module level by their package but never used by the training step: stubbed when missing.
_STUB_ROOTS = (
    "wandb", "wandb_workspaces", "dotenv", "fire", "streamlit", "streamlit_antd_components", "scipy", "datasets",
    "zstandard", "openrouter", "httpx", "fastapi", "uvicorn", "sympy", "transformers", "PIL", "matplotlib", "yaml",
    "tqdm",
)
# Needed for real: unpacked from .peers/wheels when missing.
_REAL_DEPS = ("typing_extensions", "annotated_types", "typing_inspection", "pydantic_core", "pydantic", "einops", "wadler_lindig", "jaxtyping")


def _unpack_missing_wheels() -> list[str]:
    """Unpack wheels for missing real dependencies into ``.peers/site-cpXY`` and put it on sys.path."""
    import zipfile

    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    site = ROOT / ".peers" / f"site-{tag}"
    missing = [m for m in _REAL_DEPS if importlib.util.find_spec(m) is None]
    if not missing or not PEER_WHEELS.exists():
        return []
    unpacked = []
    for whl in sorted(PEER_WHEELS.glob("*.whl")):
        dist = whl.name.split("-")[0].lower()
        if dist not in missing:
            continue
        if "-py3-none-any" not in whl.name and f"-{tag}-" not in whl.name:
            continue
        try:
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
        except OSError:  # read-only checkout: unpack into a temporary folder instead
            import tempfile

            site = Path(tempfile.gettempdir()) / f"spd-peer-site-{tag}"
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
        unpacked.append(whl.name)
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return unpacked


_GENERIC = re.compile(r"^(?P<ind>[ \t]*)(?P<kw>def|class)[ \t]+(?P<name>\w+)\[(?P<params>[^\]]*)\]", re.M)


def _rewrite_pep695(src: str) -> str:
    """``def f[T](...)`` -> ``def f(...)`` and ``class C[T]:`` -> ``class C(Generic[T]):`` plus TypeVars."""
    names: dict[str, str] = {}

    def sub(m: re.Match[str]) -> str:
        params = [p.strip() for p in m["params"].split(",") if p.strip()]
        plain = []
        for p in params:
            if p.startswith("**"):
                names[p[2:]] = "ParamSpec"
            else:
                n = p.split(":")[0].strip()
                names[n] = "TypeVar"
                plain.append(n)
        head = f"{m['ind']}{m['kw']} {m['name']}"
        if m["kw"] == "class":
            rest = src[m.end() :]
            if not rest.startswith("(") and plain:
                return f"{head}(_spdcompat_Generic[{', '.join(plain)}])"
        return head

    out = _GENERIC.sub(sub, src)
    if not names:
        return src
    header = "from typing import Generic as _spdcompat_Generic, TypeVar as _spdcompat_TV, ParamSpec as _spdcompat_PS\n"
    header += "".join(f"{n} = _spdcompat_{'PS' if k == 'ParamSpec' else 'TV'}({n!r})\n" for n, k in names.items())
    lines = out.split("\n")
    # after a module docstring / __future__ imports is not needed: their modules have neither first
    return header + "\n".join(lines)


class _CompatLoader(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data: Any, path: Any, *, _optimize: int = -1) -> Any:  # type: ignore[override]
        src = data.decode() if isinstance(data, bytes) else data
        return compile(_rewrite_pep695(src), path, "exec", dont_inherit=True)


class _CompatFinder(importlib.abc.MetaPathFinder):
    """Loads ``spd.*`` from the peer checkout through :class:`_CompatLoader`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "spd" and not fullname.startswith("spd."):
            return None
        rel = Path(*fullname.split("."))
        pkg = PEER_DIR / rel / "__init__.py"
        mod = PEER_DIR / rel.with_suffix(".py")
        if pkg.exists():
            return importlib.util.spec_from_file_location(
                fullname, pkg, loader=_CompatLoader(fullname, str(pkg)), submodule_search_locations=[str(pkg.parent)]
            )
        if mod.exists():
            return importlib.util.spec_from_file_location(fullname, mod, loader=_CompatLoader(fullname, str(mod)))
        return None


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __getitem__(cls, item: Any) -> type:
        return cls


class _Anything(metaclass=_AnyMeta):
    """Inert stand-in: any attribute, call, subscript or subclassing works and does nothing."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __call__(self, *a: Any, **k: Any) -> _Anything:
        return _Anything()

    def __getattr__(self, name: str) -> Any:
        return _Anything()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] in _STUB_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        m = _StubModule(spec.name)
        m.__path__ = []  # type: ignore[attr-defined]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> list[str]:
    """Make ``import spd`` work; returns the names that were stubbed."""
    if not (PEER_DIR / "spd" / "__init__.py").exists():
        raise FileNotFoundError(f"goodfire spd checkout not found at {PEER_DIR} (git clone https://github.com/goodfire-ai/spd {PEER_DIR})")
    if PEER_SITE.exists() and str(PEER_SITE) not in sys.path:
        sys.path.append(str(PEER_SITE))
    _unpack_missing_wheels()
    still_missing = [m for m in _REAL_DEPS if importlib.util.find_spec(m) is None]
    if still_missing:
        raise ImportError(f"goodfire spd needs {still_missing}, neither installed nor in {PEER_WHEELS} as wheels for "
                          f"this Python ({sys.version_info.major}.{sys.version_info.minor}); see this file's setup")
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    stubbed = [n for n in _STUB_ROOTS if importlib.util.find_spec(n) is None]
    global _STUB_ROOTS_ACTIVE
    _STUB_ROOTS_ACTIVE = tuple(stubbed)
    if stubbed:
        finder = _StubFinder()
        finder_roots = set(stubbed)
        finder.find_spec = lambda fullname, path=None, target=None: (  # type: ignore[method-assign]
            importlib.machinery.ModuleSpec(fullname, finder, is_package=True) if fullname.split(".")[0] in finder_roots else None
        )
        sys.meta_path.insert(0, finder)
    if sys.version_info < (3, 12):
        sys.meta_path.insert(0, _CompatFinder())
    else:
        sys.path.insert(0, str(PEER_DIR))
    return stubbed


_STUB_ROOTS_ACTIVE: tuple[str, ...] = ()


def build_step(target: Any, module_info: list[tuple[str, int]], config: dict[str, Any], device: str) -> Any:
    """Their ComponentModel around ``target`` and a closure running one of their training steps.

    ``config`` keys mirror their Config: ci_fn_type, ci_fn_hidden_dims, sigmoid_type, lr,
    use_delta_component, n_mask_samples, output_loss_type, autocast_bf16, loss_metric_configs (list of
    dicts with ``classname``), pretrained_model_output_attr, steps.
    """
    import torch

    install()
    from typing import Annotated

    from pydantic import Field, TypeAdapter
    from spd.configs import LossMetricConfigType, ModulePatternInfoConfig
    from spd.losses import compute_total_loss
    from spd.models.component_model import ComponentModel
    from spd.utils.component_utils import calc_ci_l_zero
    from spd.utils.module_utils import expand_module_patterns

    target.requires_grad_(False)
    infos = [ModulePatternInfoConfig(module_pattern=p, C=c) for p, c in module_info]
    model = ComponentModel(
        target_model=target,
        module_path_info=expand_module_patterns(target, infos),
        ci_fn_type=config["ci_fn_type"],
        ci_fn_hidden_dims=config["ci_fn_hidden_dims"],
        sigmoid_type=config.get("sigmoid_type", "leaky_hard"),
        pretrained_model_output_attr=config.get("pretrained_model_output_attr"),
    ).to(device)
    adapter = TypeAdapter(Annotated[LossMetricConfigType, Field(discriminator="classname")])
    loss_cfgs = [adapter.validate_python(dict(c)) for c in config["loss_metric_configs"]]
    active = {"loss_cfgs": loss_cfgs}
    params = []
    for name in model.target_module_paths:
        params += list(model.components[name].parameters()) + list(model.ci_fns[name].parameters())
    opt = torch.optim.AdamW(params, lr=config["lr"], weight_decay=0)
    steps = int(config.get("steps", 1000))
    state = {"step": 0}
    bf16 = bool(config.get("autocast_bf16", False))

    def step(batch: Any) -> Any:
        # The body of their optimize() loop for one step, minus periodic eval / logging / saving.
        opt.zero_grad()
        weight_deltas = model.calc_weight_deltas()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
            out = model(batch, cache_type="input")
            ci = model.calc_causal_importances(pre_weight_acts=out.cache, detach_inputs=False, sampling="continuous")
            total, _terms = compute_total_loss(
                loss_metric_configs=active["loss_cfgs"],
                model=model,
                batch=batch,
                ci=ci,
                target_out=out.output,
                weight_deltas=weight_deltas,
                pre_weight_acts=out.cache,
                current_frac_of_training=state["step"] / steps,
                sampling="continuous",
                use_delta_component=config.get("use_delta_component", True),
                n_mask_samples=config.get("n_mask_samples", 1),
                output_loss_type=config["output_loss_type"],
            )
        total.backward()
        for layer_ci in ci.lower_leaky.values():  # their loop computes CI-L0 every step
            calc_ci_l_zero(layer_ci, 0.1)
        opt.step()
        state["step"] += 1
        return total.detach()  # their compute_total_loss and calc_ci_l_zero already read values back (.item())

    def set_pgd(on: bool) -> None:
        """Their loss list with (``on``) or without the PGD terms: the same model and optimizer."""
        active["loss_cfgs"] = loss_cfgs if on else [c for c in loss_cfgs if not c.classname.startswith("PGD")]

    step.model = model  # type: ignore[attr-defined]
    step.set_pgd = set_pgd  # type: ignore[attr-defined]
    return step


def time_steps(step: Any, batches: list[Any], warmup: int, iters: int, sync: Any) -> float:
    """Mean seconds per step after ``warmup`` steps."""
    for i in range(warmup):
        step(batches[i % len(batches)])
    sync()
    t0 = time.perf_counter()
    for i in range(iters):
        step(batches[i % len(batches)])
    sync()
    return (time.perf_counter() - t0) / iters
