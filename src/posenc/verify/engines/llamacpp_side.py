"""Host-side adapter for llama.cpp (llama-cpp-python's low-level API); runs inside the engine host.

Imports only numpy and (when loading) llama_cpp. One context holds `2 * max_batch` sequences in a unified F32 KV cache:
sequences `0..max_batch-1` belong to the current cache (a new cache clears them), the others to
stateless forwards (cleared after each). Every token is sent with its own position and sequence id
through `llama_batch`, so explicit positions and batches of rows of different lengths are llama.cpp's own.
"""

import ctypes

import numpy as np


class LlamaCpp:
    def __init__(self, model_path, ctx_params, n_ctx=16384, n_batch=2048, max_batch=4, threads=1):
        import llama_cpp

        self.L = llama_cpp
        self.L.llama_backend_init()
        mparams = self.L.llama_model_default_params()
        self.model = self.L.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.n_vocab = self.L.llama_vocab_n_tokens(self.L.llama_model_get_vocab(self.model))
        cp = self.L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, min(512, n_batch)
        cp.n_seq_max, cp.kv_unified = 2 * max_batch, True
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
        cp.flash_attn_type = 0  # disabled: its F16 accumulation costs 1e-2 of logit
        for key, value in ctx_params.items():
            setattr(cp, key, value)
        self.ctx = self.L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.mem = self.L.llama_get_memory(self.ctx)
        self.n_batch, self.max_batch = n_batch, max_batch
        self.batch = self.L.llama_batch_init(n_batch, 0, 1)
        self.handle, self.kept = 0, []

    def info(self):
        return {"vocab": self.n_vocab, "max_batch": self.max_batch, "system": self.L.llama_print_system_info().decode()}

    def new_cache(self, batch_size):
        if batch_size > self.max_batch:
            raise ValueError(f"batch_size {batch_size} > {self.max_batch}")
        for s in range(self.max_batch):
            self.L.llama_memory_seq_rm(self.mem, s, -1, -1)
        self.handle += 1
        self.kept = [0] * batch_size
        return self.handle

    def _decode(self, tokens, positions, seqs, out):
        """Send (token, position, sequence) triples in n_batch chunks; logits of every token into `out`."""
        for start in range(0, len(tokens), self.n_batch):
            n = min(self.n_batch, len(tokens) - start)
            b = self.batch
            for i in range(n):
                b.token[i] = int(tokens[start + i])
                b.pos[i] = int(positions[start + i])
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = int(seqs[start + i])
                b.logits[i] = 1
            b.n_tokens = n
            code = self.L.llama_decode(self.ctx, b)
            if code != 0:
                raise RuntimeError(f"llama_decode returned {code}")
            for i in range(n):
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                out[start + i] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                       shape=(self.n_vocab,))

    def forward(self, ids, mask=None, positions=None, cache=None):
        b, t = ids.shape
        if b > self.max_batch:
            raise ValueError(f"{b} rows > {self.max_batch}")
        if cache is not None and (cache != self.handle or b != len(self.kept)):
            raise ValueError("stale or mismatched cache handle")
        keep = np.ones((b, t), dtype=bool) if mask is None else mask.astype(bool)
        base = 0 if cache is not None else self.max_batch
        tokens, pos, seqs, where = [], [], [], []
        for r in range(b):
            start = self.kept[r] if cache is not None else 0
            derived = start + np.cumsum(keep[r]) - 1
            for j in np.nonzero(keep[r])[0]:
                tokens.append(ids[r, j])
                pos.append(positions[r, j] if positions is not None else derived[j])
                seqs.append(base + r)
                where.append((r, j))
        out = np.zeros((len(tokens), self.n_vocab), dtype=np.float32)
        try:
            self._decode(tokens, pos, seqs, out)
        finally:
            if cache is None:
                for s in range(self.max_batch, 2 * self.max_batch):
                    self.L.llama_memory_seq_rm(self.mem, s, -1, -1)
        logits = np.zeros((b, t, self.n_vocab), dtype=np.float32)
        for k, (r, j) in enumerate(where):
            logits[r, j] = out[k]
        if cache is not None:
            for r in range(b):
                self.kept[r] += int(keep[r].sum())
        return logits


def load(model_path, ctx_params, **kwargs):
    return LlamaCpp(model_path, ctx_params, **kwargs)
