"""Host-side fake engine for the engine-host tests: answers, crashes, hangs and corrupts on request.

Loaded by posenc's engine host from its file path (stdlib + numpy only, like a real adapter).
"""

import ctypes
import os
import signal
import time

import numpy as np

# PROTOCOL_FD is set by the host before this file runs



class Fake:
    def __init__(self, vocab, crash_on):
        self.vocab, self.crash_on, self.calls = vocab, crash_on, 0

    def info(self):
        return {"pid": os.getpid(), "vocab": self.vocab}

    def echo(self, value):
        self.calls += 1
        return {"value": value, "calls": self.calls, "pid": os.getpid()}

    def square(self, x):
        return x.astype(np.float64) ** 2

    def abort(self):
        os.abort()

    def segfault(self):
        ctypes.string_at(0)  # a real read of address 0: SIGSEGV inside C code
        os.kill(os.getpid(), signal.SIGSEGV)

    def hang(self):
        time.sleep(3600)

    def fail(self):
        raise RuntimeError("engine-side exception on purpose")

    def garbage(self):
        os.write(PROTOCOL_FD, b"this is not json\n")
        time.sleep(3600)

    def short(self):  # announces 4000 bytes, sends 10 and dies
        os.write(PROTOCOL_FD, b'{"ok": true, "result": {"__blob__": 0}, "blobs": [["<f4", [1000]]]}\n' + b"x" * 10)
        os._exit(3)

    def noisy(self):
        print("engine log line on stdout")  # must not corrupt the protocol
        os.write(1, b"raw write to fd 1\n")
        return 7


def load(vocab=8, crash_on=None):
    if crash_on == "load":
        os.abort()
    return Fake(vocab, crash_on)
