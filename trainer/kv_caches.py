"""The key/value caches decoding writes: transformers' own, with each key stored in its value's dtype.

Why: under bf16 autocast over float32 weights (the GPU's default sampling), keys leave the rotary embedding in
float32 (it takes the residual stream's dtype) and values leave their projection in bf16. transformers 5.17 and
earlier, the lent GPUs' version among them, size a layer's tensors by the first keys' dtype, so a static layer
refuses the first bf16 value (`index_copy_` will not mix dtypes) and a dynamic layer concatenates the values up to
float32; 5.24 keeps the keys in float32. Either way a cache held twice the memory its bf16 contents need (4 GB
against 2 at 512 rows of 320 tokens of Qwen2.5-0.5B) or failed. Attention casts keys and values to bf16 under
autocast at every step anyway, so casting the keys once on the way in changes no result. Without autocast both
are in the weights' dtype and nothing changes.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import transformers
from packaging.version import Version
from torch import Tensor

# transformers 5.24 renamed generate's and the model outputs' `past_key_values` to `cache` (the old name warns).
CACHE_ARGUMENT = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"

CacheT = TypeVar("CacheT", bound=transformers.Cache)


def static_cache(model: transformers.PreTrainedModel, length: int) -> transformers.StaticCache:
    """transformers' `StaticCache` of `length` slots for `model`, keys stored in the values' dtype."""
    return _keys_as_values(transformers.StaticCache(config=model.config, max_cache_len=length))


def dynamic_cache(model: transformers.PreTrainedModel) -> transformers.DynamicCache | None:
    """An empty `DynamicCache` for `model` (its layers made from the config), keys stored in the values' dtype;
    None for a model that keeps a cache of its own kind (transformers' `_supports_default_dynamic_cache`: a few
    recurrent or linear-attention architectures), whose forward then makes it."""
    if not getattr(type(model), "_supports_default_dynamic_cache", lambda: True)():
        return None
    return _keys_as_values(transformers.DynamicCache(config=model.config))


def _keys_as_values(cache: CacheT) -> CacheT:
    layers: list[Any] = list(cache.layers)  # typed Any, as mypy sees the union of every layer kind transformers has
    for layer in layers:
        if hasattr(layer, "update"):  # a key/value layer (a linear-attention layer keeps states, no keys)
            layer.update = _cast_keys(layer.update)  # this instance's only
    return cache


def _cast_keys(update: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
    def cast_update(key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return update(key_states.to(value_states.dtype), value_states, *args, **kwargs)

    return cast_update
