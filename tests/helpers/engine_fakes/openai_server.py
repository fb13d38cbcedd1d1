"""A real local OpenAI-compatible completions server (stdlib http.server) backed by posenc's decoder.

Implements what `--engine openai:URL` uses: GET /v1/models, POST /v1/completions with token-id prompts,
`echo`, `logprobs`, `max_tokens`, greedy decoding and `return_tokens_as_token_ids`. `mode` "http-500" and
"not-json" make every completion fail the way broken servers do.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from posenc.verify.engines import posenc_engine


def _choice(engine, prompt, echo, k, max_tokens):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(engine.forward(torch.tensor([ids]))[0, -1].argmax()))
        lp = torch.log_softmax(engine.forward(torch.tensor([ids]))[0].double(), -1)  # [t, v]
    start = 0 if echo else len(prompt)
    tokens, values, tops = [], [], []
    for i in range(start, len(ids)):
        tokens.append(f"token_id:{ids[i]}")
        values.append(None if i == 0 else float(lp[i - 1, ids[i]]))
        if i == 0:
            tops.append(None)
        else:
            best = lp[i - 1].topk(k)
            tops.append({f"token_id:{int(j)}": float(v) for v, j in zip(best.values, best.indices)})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}


def serve(model_path, mode=None):
    """Start the server on a free port; returns (server, url). Stop with server.shutdown()."""
    engine = posenc_engine(model_path, None, torch.float32)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(200, json.dumps({"data": [{"id": "tiny"}]}).encode())

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if mode == "http-500":
                return self._send(500, b'{"error": "engine core died"}')
            if mode == "not-json":
                return self._send(200, b"<html>proxy error</html>")
            prompts = req["prompt"] if isinstance(req["prompt"][0], list) else [req["prompt"]]
            choices = [{"index": i, "logprobs": _choice(engine, p, req.get("echo", False), req.get("logprobs", 1),
                                                        req.get("max_tokens", 16))} for i, p in enumerate(prompts)]
            self._send(200, json.dumps({"choices": choices, "usage": {}}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
