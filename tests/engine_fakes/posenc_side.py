"""Host-side fake: posenc's own decoder behind the engine host, in either protocol, with injected faults.

`fault`: None, "segfault-on-batch" (a real SIGSEGV when a forward has more than one row), "hang-on-batch",
"raise-on-decode" (an exception for one-token forwards after a cache), "garbage-shape" (every answer one
token short) "nan" (NaN logprobs) or "refuse-linear" (load raises for the linear rule, as vLLM refuses some configurations). Runs in the test interpreter (PYTHONPATH carries posenc).
"""

import ctypes
import time

import numpy as np
import torch

from posenc.verify.engines import posenc_engine


torch.set_grad_enabled(False)


class Fake:
    def __init__(self, model_path, rule, fault):
        self.engine = posenc_engine(model_path, rule, torch.float32)
        self.fault, self.caches, self.handle = fault, {}, 0

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

    def _logprobs(self, ids):
        x = torch.tensor([ids])
        logits = self.engine.forward(x)[0]
        lp = torch.log_softmax(logits.double(), -1)
        out = np.full(len(ids), np.nan)
        out[1:] = lp[:-1].gather(1, x[0, 1:, None])[:, 0].numpy()
        top1 = np.full(len(ids), -1, dtype=np.int64)
        top1[1:] = logits[:-1].argmax(-1).numpy()
        if self.fault == "nan":
            out[:] = np.nan
        return out, top1

    def score(self, batch, top_k=1):
        if len(batch) > 1 and self.fault == "segfault-on-batch":
            ctypes.string_at(0)
        res = []
        for ids in batch:
            lp, top1 = self._logprobs(ids)
            res.append({"logprobs": lp[:-1] if self.fault == "garbage-shape" else lp, "top1": top1})
        return res

    def generate(self, ids, n):
        ids, lps = list(ids), []
        for _ in range(n):
            logits = self.engine.forward(torch.tensor([ids]))[0, -1]
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits.double(), -1)[tok]))
            ids.append(tok)
        return {"tokens": np.array(ids[-n:]), "logprobs": np.array(lps), "cached_tokens": 0}


def load(model_path, rule=None, fault=None):
    if fault == "refuse-linear" and rule and rule.get("rope_type") == "linear":
        raise ValueError("User-specified max_model_len (4096) is greater than the derived max_model_len (128)")
    return Fake(model_path, rule, fault)
