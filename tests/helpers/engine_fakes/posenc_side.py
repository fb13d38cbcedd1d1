"""Host-side fake: posenc's own decoder behind the engine host, in either protocol, with injected faults.

`fault`: None, "segfault-on-batch" (a real SIGSEGV when a forward has more than one row), "hang-on-batch",
"raise-on-decode" (an exception for one-token forwards after a cache), "garbage-shape" (every answer one
token short) "nan" (NaN logprobs), "refuse-linear" (load raises for the linear rule, as vLLM refuses some
configurations), "positions-ignored" (the scoring position map is dropped), "chunk-restart" (each chunk
prefilled as a new sequence: positions from 0, earlier chunks unseen) or "chunk-skip" (a position skipped
at every chunk boundary). Scoring takes `positions=[offset, gap_at, gap]` (vLLM's
position map) and, with `chunk`, prefills through the cache `chunk` tokens at a time. Runs in the test
interpreter (PYTHONPATH carries posenc).
"""

import ctypes
import time

import numpy as np
import torch

from posenc.verify.engines import posenc_engine


torch.set_grad_enabled(False)


class Fake:
    def __init__(self, model_path, rule, fault, chunk=None):
        self.engine = posenc_engine(model_path, rule, torch.float32)
        self.fault, self.caches, self.handle, self.chunk = fault, {}, 0, chunk
        self.seen = []  # prompts generated from: a prefix cache in blocks of 32 tokens, as vLLM reports it

    def new_cache(self, batch_size):
        self.handle += 1
        self.caches[self.handle] = self.engine.new_cache(batch_size, 8192)
        return self.handle

    def forward(self, ids, mask=None, positions=None, cache=None):
        if ids.shape[0] > 1 and self.fault == "segfault-on-batch":
            ctypes.string_at(0)
        if ids.shape[0] > 1 and self.fault == "hang-on-batch":
            time.sleep(3600)
        if cache is not None and ids.shape[1] == 1 and self.fault == "raise-on-decode":
            raise RuntimeError("decode kernel exploded")
        kw = {"cache": self.caches[cache] if cache is not None else None}
        if mask is not None:
            kw["attention_mask"] = torch.from_numpy(mask.astype(np.int64))
        if positions is not None:
            kw["position_ids"] = torch.from_numpy(positions.astype(np.int64))
        out = self.engine.forward(torch.from_numpy(ids.astype(np.int64)), **kw).numpy()
        return out[:, :-1] if self.fault == "garbage-shape" else out

    def _positions(self, t, positions):
        p = torch.arange(t)
        if positions is None or self.fault == "positions-ignored":
            return p
        offset, gap_at, gap = positions
        return offset + p + (gap * (p >= gap_at) if gap_at is not None else 0)

    def _logits(self, ids, positions=None):
        x, pos = torch.tensor([ids]), self._positions(len(ids), positions)  # [1, t], [t]
        if not self.chunk:
            return self.engine.forward(x, position_ids=pos[None])[0]
        if self.fault == "chunk-restart":  # each chunk prefilled as a new sequence: positions from 0, no context
            return torch.cat([self.engine.forward(x[:, i:i + self.chunk])[0] for i in range(0, len(ids), self.chunk)])
        if self.fault == "chunk-skip":  # a position skipped at every chunk boundary
            pos = pos + torch.arange(len(ids)) // self.chunk
        cache, out = self.engine.new_cache(1, len(ids)), []
        for i in range(0, len(ids), self.chunk):
            out.append(self.engine.forward(x[:, i:i + self.chunk], cache=cache, position_ids=pos[None, i:i + self.chunk])[0])
        return torch.cat(out)  # [t, v]

    def _logprobs(self, ids, positions=None):
        x = torch.tensor([ids])
        logits = self._logits(ids, positions)
        lp = torch.log_softmax(logits.double(), -1)
        out = np.full(len(ids), np.nan)
        out[1:] = lp[:-1].gather(1, x[0, 1:, None])[:, 0].numpy()
        top1 = np.full(len(ids), -1, dtype=np.int64)
        top1[1:] = logits[:-1].argmax(-1).numpy()
        if self.fault == "nan":
            out[:] = np.nan
        return out, top1

    def score(self, batch, top_k=1, positions=None):
        if len(batch) > 1 and self.fault == "segfault-on-batch":
            ctypes.string_at(0)
        res = []
        for ids in batch:
            lp, top1 = self._logprobs(ids, positions)
            res.append({"logprobs": lp[:-1] if self.fault == "garbage-shape" else lp, "top1": top1})
        return res

    def generate(self, ids, n, positions=None):
        ids, lps = list(ids), []
        common = max((next((i for i, (a, b) in enumerate(zip(p, ids)) if a != b), min(len(p), len(ids)))
                      for p in self.seen), default=0)
        cached = 0 if self.fault == "no-prefix-cache" else min(common, len(ids) - 1) // 32 * 32
        self.seen.append(list(ids))
        for _ in range(n):
            logits = self._logits(ids, positions)[-1]
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits.double(), -1)[tok]))
            ids.append(tok)
        return {"tokens": np.array(ids[-n:]), "logprobs": np.array(lps), "cached_tokens": cached}


def load(model_path, rule=None, fault=None, chunk=None):
    if fault == "refuse-linear" and rule and rule.get("rope_type") == "linear":
        raise ValueError("User-specified max_model_len (4096) is greater than the derived max_model_len (128)")
    return Fake(model_path, rule, fault, chunk)
