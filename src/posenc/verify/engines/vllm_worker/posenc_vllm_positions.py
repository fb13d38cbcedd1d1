"""A position map for vLLM's rotary embedding: the hook behind the vLLM adapter's `positions` capability.

vLLM derives every position itself (it counts the tokens a request has computed) and has no public way
to pass position ids. Each function here runs inside vLLM's worker through `LLM.apply_model(fn)`
(`VLLM_ALLOW_INSECURE_SERIALIZATION=1`; the worker imports this module by name). It wraps the forward of
every rotary-embedding module of the model so that the position p vLLM derived becomes

    offset + p + gap * (p >= gap_at)

before vLLM's own rotary code runs: a shift of the whole sequence, and a gap in the middle of it. The map
is an attribute of the module, set per call; the identity map (0, None, 0) leaves vLLM untouched.
Imports nothing at module level (the host's test suite imports it without vLLM).
"""

ATTR = "_posenc_position_map"


def remap(positions, offset=0, gap_at=None, gap=0):
    """`offset + p + gap * (p >= gap_at)` for a tensor of positions `[t]` (same dtype and device)."""
    out = positions + offset if offset else positions
    if gap_at is not None and gap:
        out = out + gap * (positions >= gap_at).to(positions.dtype)
    return out


def rotary_modules(model):
    """The distinct rotary-embedding modules of `model` (vLLM shares one instance between layers)."""
    found, seen = [], set()
    for module in model.modules():
        if hasattr(module, "cos_sin_cache") and callable(getattr(module, "forward", None)) and id(module) not in seen:
            seen.add(id(module))
            found.append(module)
    return found


def _wrap(module):
    """Route `module.forward(positions, *args)` through the module's position map (once)."""
    if hasattr(module, ATTR):
        return
    inner = module.forward

    def forward(positions, *args, **kwargs):
        return inner(remap(positions, *getattr(module, ATTR)), *args, **kwargs)

    module.forward = forward
    setattr(module, ATTR, (0, None, 0))


def set_position_map(model, offset=0, gap_at=None, gap=0):
    """Install the map on every rotary module of `model`; returns how many modules carry it (0: none found)."""
    modules = rotary_modules(model)
    for module in modules:
        _wrap(module)
        setattr(module, ATTR, (int(offset), None if gap_at is None else int(gap_at), int(gap)))
    return len(modules)


def position_map_setter(offset=0, gap_at=None, gap=0):
    """`fn(model)` for `LLM.apply_model` that installs this map (a picklable callable, by reference)."""
    import functools

    return functools.partial(set_position_map, offset=offset, gap_at=gap_at, gap=gap)
