"""A shared invariant of posenc's decoder: cached decode and left padding leave the logits of a full forward."""

import torch
from tests.helpers.tolerances import assert_close


def check_decode_and_padding(model, ids, want, *, prefill, pad, alone, capacity, stores=("rotated",), label=""):
    """Prefill `prefill` tokens then decode one at a time (per key store) == `want` [b, t, vocab]; a batch whose
    row 1 is left-padded by `pad` keeps row 0 and gives row 1 what `alone(ids[1:, pad:])` [1, t - pad, vocab] gives."""
    b, t = ids.shape  # [b, t]
    for store in stores:
        cache = model.new_cache(b, capacity, store=store)
        steps = [model(ids[:, :prefill], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(prefill, t)]
        assert_close(torch.cat(steps, 1), want, msg=f"{label} {store} prefill + decode")
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, :pad] = 0
    padded = model(ids, attention_mask=mask)  # [b, t, vocab]
    assert_close(padded[0], want[0])
    assert_close(padded[1, pad:], alone(ids[1:, pad:])[0], msg=f"{label} left-padded row")
