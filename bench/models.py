"""The benchmark's models and sizes: ``test_models`` from a source checkout.

``default_sizes(quick)`` gives, per model, the sizes of the default sweep;
``specs(...)`` turns command-line choices into :class:`ModelSpec` s.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .core import ModelSpec, spec_from_module

#: Sizes of the default sweep (CPU, 2 cores: well under 15 minutes together).
DEFAULT_SIZES: Dict[str, List[dict]] = {
    "resnet": [dict(depth=d, batch=32) for d in (20, 56, 110, 164)],
    "transformer": [dict(layers=12, d_model=128, heads=4, seq_len=128, batch=8)],
    "unet": [dict(levels=4, base=32, image_size=64, batch=8)],
    "mlp": [dict(depth=64, width=256, batch=1024)],
    "chain": [dict(n=100, size=262144, kind="tanh")],
}

#: Tiny sizes for ``--quick`` (a smoke test of the whole pipeline, seconds per model).
QUICK_SIZES: Dict[str, List[dict]] = {
    "resnet": [dict(depth=d, batch=2, width=4) for d in (8, 14)],
    "transformer": [dict(layers=2, d_model=16, heads=2, seq_len=8, batch=2, vocab=32)],
    "unet": [dict(levels=2, base=4, image_size=8, batch=2)],
    "mlp": [dict(depth=6, width=16, batch=8)],
    "chain": [dict(n=12, size=1024, kind="tanh")],
}

DEFAULT_MODELS = ("resnet", "transformer", "unet", "mlp", "chain")


def test_models_package():
    """``test_models`` (in a source checkout), with advice when it is missing."""
    try:
        import test_models
    except ImportError as error:  # pragma: no cover - only outside a checkout
        raise ImportError(
            "The default sweep uses the models in test_models/, which a source checkout "
            "of memory_saving_gradients has. Run from the repository root, or measure "
            "your own model with bench.measure(build_fn, variant)."
        ) from error
    return test_models


def default_sizes(quick: bool = False) -> Dict[str, List[dict]]:
    source = QUICK_SIZES if quick else DEFAULT_SIZES
    return {name: [dict(s) for s in sizes] for name, sizes in source.items()}


def parse_overrides(items: Sequence[str]) -> Dict[str, dict]:
    """``['transformer.layers=24', 'unet.base=16']`` -> ``{'transformer': {'layers': 24}, ...}``.

    Values are parsed as int, float or bool when they look like one.
    """
    out: Dict[str, dict] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        model, dot, field = key.partition(".")
        if not sep or not dot or not model or not field:
            raise ValueError(f"--size expects MODEL.KEY=VALUE (e.g. transformer.layers=24), got {item!r}")
        out.setdefault(model, {})[field] = _parse_value(raw)
    return out


def _parse_value(raw: str):
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return raw


def specs(
    models: Sequence[str],
    quick: bool = False,
    depths: Optional[Sequence[int]] = None,
    batch: Optional[int] = None,
    overrides: Optional[Dict[str, dict]] = None,
    seed: int = 0,
) -> List[ModelSpec]:
    """ModelSpecs for the sweep: default (or quick) sizes, then the options.

    ``depths`` replaces the ResNet depths; ``batch`` sets every model's batch;
    ``overrides`` (from :func:`parse_overrides`) sets other size keywords.
    """
    tm = test_models_package()
    sizes = default_sizes(quick)
    out = []
    for name in models:
        if name not in tm.MODELS:
            raise ValueError(f"unknown model {name!r}; known: {sorted(tm.MODELS)}")
        model_sizes = sizes.get(name) or [dict()]
        if name == "resnet" and depths:
            template = dict(model_sizes[0])
            model_sizes = [dict(template, depth=int(d)) for d in depths]
        for size in model_sizes:
            if batch is not None:
                size["batch"] = int(batch)
            size.update((overrides or {}).get(name, {}))
            out.append(spec_from_module(tm.MODELS[name], seed=seed, name=name, **size))
    return out


def resnet_spec(depth: int, batch: int, seed: int = 0, **extra) -> ModelSpec:
    """A CIFAR ResNet v2 spec (used by the fits-in-N-MB search and the GPU check)."""
    tm = test_models_package()
    return spec_from_module(tm.resnet, seed=seed, name="resnet", depth=depth, batch=batch, **extra)
