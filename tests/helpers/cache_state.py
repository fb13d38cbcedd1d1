"""The whole state of a KV cache as the tests see it, walked independently of `posenc.cache.transaction`.

`dump(cache)`: every tensor reachable from the cache (bookkeeping, block tables, every store and quantized
part: codes, statistics pools, block ids, residuals, scratch slots) as `(dtype, shape, raw bytes)`, and
every int / bool / float / str counter, keyed by attribute path. `held(cache)`: the ids of those tensors.
"""

import torch


def dump(obj, path="cache", out=None, seen=None):
    """`{path: bytes or value}` of every tensor and counter reachable from `obj` (this test's own walk)."""
    out, seen = ({} if out is None else out), (set() if seen is None else seen)
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    for name, value in sorted(vars(obj).items()):
        here = f"{path}.{name}"
        if isinstance(value, torch.Tensor):
            flat = value.detach().contiguous().flatten()
            out[here] = (value.dtype, tuple(value.shape), flat.view(torch.uint8).tolist() if flat.numel() else [])
        elif isinstance(value, (bool, int, float, str)) or value is None:
            out[here] = value
        elif isinstance(value, list):
            for i, item in enumerate(value):
                dump(item, f"{here}[{i}]", out, seen)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("posenc.cache"):
            dump(value, here, out, seen)
    return out


def held(obj, seen=None):
    """Ids of every tensor reachable from `obj` (a refused call must not rebind any of them)."""
    seen = set() if seen is None else seen
    ids = []
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            ids.append(id(value))
        for item in value if isinstance(value, list) else [value]:
            if hasattr(item, "__dict__") and type(item).__module__.startswith("posenc.cache") and id(item) not in seen:
                seen.add(id(item))
                ids += held(item, seen)
    return ids


def changed(before, after):
    """Paths whose dumped value differs (or that appear in only one dump)."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
