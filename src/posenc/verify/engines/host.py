"""The engine host: one foreign engine in its own process (and interpreter), driven over pipes.

Run as a script by any Python that has the engine installed (`VENV/bin/python host.py ADAPTER.py`); it
imports nothing from posenc, only the standard library, numpy and the adapter file. The adapter defines
`load(**kwargs) -> object`; every later request calls a method of that object.

Wire format, both ways: one JSON header line, then the raw bytes of the arrays it announces.
- request: `{"method": NAME, "args": {...}, "blobs": [[dtype, shape], ...]}`; an argument
  `{"__blob__": i}` is array i.
- answer: `{"ok": true, "result": ..., "blobs": [...]}` or `{"ok": false, "error": TRACEBACK TAIL}`.
The protocol uses a private copy of the original stdout; file descriptor 1 is pointed at stderr so an
engine that prints (vLLM logs, llama.cpp) cannot corrupt it.

    >>> header, blobs = encode({"x": [1, 2]})
    >>> decode(header["args"], [])
    {'x': [1, 2]}
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from typing import Any

TRACEBACK_CHARS = 1500


def _is_array(obj: Any) -> bool:
    return hasattr(obj, "__array_interface__") and hasattr(obj, "tobytes")


def encode(obj: Any) -> tuple[dict, list]:
    """`({"args": obj with arrays replaced by {"__blob__": i}, "blobs": [[dtype, shape]]}, [array bytes])`."""
    blobs: list = []

    def walk(o: Any) -> Any:
        if _is_array(o):
            blobs.append(o)
            return {"__blob__": len(blobs) - 1}
        if isinstance(o, dict):
            return {str(k): walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v) for v in o]
        return o

    tree = walk(obj)
    meta = [[b.dtype.str, list(b.shape)] for b in blobs]
    return {"args": tree, "blobs": meta}, [b.tobytes() for b in blobs]


def decode(tree: Any, arrays: list) -> Any:
    """The inverse of `encode`: `{"__blob__": i}` -> `arrays[i]`."""
    if isinstance(tree, dict):
        if set(tree) == {"__blob__"}:
            return arrays[tree["__blob__"]]
        return {k: decode(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [decode(v, arrays) for v in tree]
    return tree


def nbytes(meta: list) -> int:
    """Bytes of one announced array `[dtype, shape]`."""
    import numpy as np

    n = np.dtype(meta[0]).itemsize
    for s in meta[1]:
        n *= int(s)
    return n


def to_arrays(meta: list, payloads: list) -> list:
    import numpy as np

    return [np.frombuffer(p, dtype=np.dtype(m[0])).reshape(m[1]) for m, p in zip(meta, payloads)]


def _read_message(stream: Any) -> tuple[dict, list] | None:
    line = stream.readline()
    if not line:
        return None
    header = json.loads(line)
    payloads = [stream.read(nbytes(m)) for m in header.get("blobs", [])]
    return header, to_arrays(header.get("blobs", []), payloads)


def _write(stream: Any, header: dict, payloads: list) -> None:
    stream.write(json.dumps(header).encode() + b"\n")
    for p in payloads:
        stream.write(p)
    stream.flush()


def serve(adapter_path: str) -> None:
    """Answer requests on stdin until it closes."""
    proto = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # engine output goes to stderr
    sys.stdout = sys.stderr
    spec = importlib.util.spec_from_file_location("posenc_engine_adapter", adapter_path)
    adapter = importlib.util.module_from_spec(spec)
    adapter.PROTOCOL_FD = proto.fileno()  # only tests that corrupt the wire on purpose use it
    spec.loader.exec_module(adapter)
    stdin = sys.stdin.buffer
    engine = None
    while True:
        message = _read_message(stdin)
        if message is None:
            return
        header, arrays = message
        try:
            args = decode(header.get("args", {}), arrays)
            if header["method"] == "load":
                engine = adapter.load(**args)
                result: Any = getattr(engine, "info", lambda: {})()
            else:
                result = getattr(engine, header["method"])(**args)
            answer, payloads = encode(result)
            _write(proto, {"ok": True, "result": answer["args"], "blobs": answer["blobs"]}, payloads)
        except BaseException:  # noqa: BLE001 - every engine error goes back as text
            _write(proto, {"ok": False, "error": traceback.format_exc()[-TRACEBACK_CHARS:]}, [])


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))  # its siblings (openai.py, setup.py) must not shadow packages
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    serve(sys.argv[1])
