"""posenc inside other libraries.

- `posenc.integrations.transformers`: `patch(model, policy=...)` puts posenc's rotation, its cache policies
  for length-dependent rules and the official Qwen2-VL positions into one transformers model instance;
  `unpatch(model)` takes them out again.

Nothing here imports transformers until a function that needs it runs.
"""

__all__ = ["transformers"]
