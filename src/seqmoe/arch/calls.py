"""How to hand a transformers v5 causal LM its KV cache: the argument was renamed during v5.

    model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    cache = output_cache(out)

transformers 5.0 takes and returns `past_key_values`; later 5.x releases take `cache` and warn
that `past_key_values` goes away in 5.40. Asking the forward's signature keeps both working.
"""

from __future__ import annotations

import inspect


def cache_kwarg(model) -> str:
    """The keyword `model.forward` takes its KV cache by: "cache", or "past_key_values" on older v5."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(out):
    """The KV cache in a model output (`cache`, or `past_key_values` on older v5)."""
    return out["cache"] if "cache" in out else out["past_key_values"]
