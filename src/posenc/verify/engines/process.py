"""The client side of the engine host: start it, call it with a deadline, contain what goes wrong.

`EngineProcess(python, adapter, load_args)` runs `python host.py adapter` and sends `load(**load_args)`
on first use. `call(method, **args)` returns the decoded answer; a segfault, an abort, a hang past the
deadline, an exception in the engine or an unreadable answer raises `EngineFailure` with the reason
(the signal's name, the timeout, the traceback tail, the last lines the engine wrote to stderr) and
kills the process: the next call starts a fresh one, so one failure costs one row, not the run.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from . import host

__all__ = ["EngineFailure", "EngineProcess", "HOST_SCRIPT"]

HOST_SCRIPT = str(Path(host.__file__).resolve())
STDERR_TAIL = 800


class EngineFailure(RuntimeError):
    """The engine process crashed, hung, raised or answered garbage; `reason` says which.

    `refused` is True when the engine raised while loading (it declined the configuration, e.g. vLLM
    refusing a rule whose derived length is below max_model_len) rather than crashing or hanging."""

    def __init__(self, reason: str, refused: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.refused = reason, refused


def exception_line(trace: str) -> str:
    """The `SomeError: message` line of a traceback tail (the last such; else its last line)."""
    lines = [line.strip() for line in trace.splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", line)]
    if not named:
        return (lines or ["(no traceback)"])[-1][:300]
    i = len(lines) - 1 - lines[::-1].index(named[-1])
    return " ".join(lines[i:i + 3])[:300]  # pydantic and friends put the message on the next lines


def signal_name(returncode: int) -> str:
    """`-11` -> `SIGSEGV`; a plain exit status -> `exit status N`."""
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class EngineProcess:
    """One engine host process, restarted on demand after a failure.

    Args:
        python: the interpreter (a virtual environment's `bin/python`).
        adapter: path of the host-side adapter file (defines `load(**kwargs)`).
        load_args: keyword arguments of `load` (JSON types and numpy arrays).
        timeout: seconds one call may take; `load_timeout` for start-up and `load`.
        env: extra environment variables for the process.
    """

    def __init__(self, python: str, adapter: str, load_args: dict[str, Any], *, timeout: float = 300.0,
                 load_timeout: float = 900.0, env: dict[str, str] | None = None) -> None:
        self.python, self.adapter, self.load_args = python, str(adapter), load_args
        self.timeout, self.load_timeout, self.env = timeout, load_timeout, dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.starts = 0
        self._stderr: Any = None
        self._buffer = b""

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([self.python, HOST_SCRIPT, self.adapter], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr,
                                     env={**os.environ, **self.env}, start_new_session=True)
        self._buffer = b""
        self.starts += 1
        self.info = self._exchange("load", self.load_args, self.load_timeout) or {}

    def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        """`method(**args)` in the engine process; raises EngineFailure (and kills the process) on any fault."""
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self._start()
        return self._exchange(method, args, self.timeout if timeout is None else timeout)

    def _exchange(self, method: str, args: dict[str, Any], timeout: float) -> Any:
        header, payloads = host.encode(args)
        header["method"] = method
        deadline = time.monotonic() + timeout
        try:
            self.proc.stdin.write(json.dumps(header).encode() + b"\n")
            for p in payloads:
                self.proc.stdin.write(p)
            self.proc.stdin.flush()
            answer = json.loads(self._read_line(deadline, method, timeout))
            meta = answer.get("blobs", [])
            arrays = host.to_arrays(meta, [self._read_exact(host.nbytes(m), deadline, method, timeout)
                                           for m in meta])
        except EngineFailure:
            self.close()
            raise
        except (BrokenPipeError, OSError) as exc:
            self._fail(f"{method}: lost the engine process ({exc})")
        except (ValueError, KeyError, TypeError, IndexError) as exc:  # not our wire format
            self._fail(f"{method}: malformed answer from the engine ({type(exc).__name__}: {exc})")
        if not answer.get("ok"):
            error = str(answer.get("error", ""))[-host.TRACEBACK_CHARS:]
            self._fail(f"{method}: the engine raised {exception_line(error)}\n{error}",  # rows keep the head
                       refused=method == "load")
        return host.decode(answer.get("result"), arrays)

    def _fail(self, reason: str, refused: bool = False) -> None:
        tail = self.stderr_tail()
        self.close()
        raise EngineFailure(reason + (f"\nengine stderr: ...{tail}" if tail else ""), refused)

    def _fill(self, deadline: float, method: str, timeout: float) -> None:
        fd = self.proc.stdout.fileno()
        remaining = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(0.0, remaining))[0] if remaining > 0 else []
        if not ready:
            self._fail(f"{method}: no answer within {timeout:g} s (hang or too slow); the engine was killed")
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            code = self.proc.wait(timeout=10)
            self._fail(f"{method}: the engine process {signal_name(code)}")
        self._buffer += chunk

    def _read_line(self, deadline: float, method: str, timeout: float) -> bytes:
        while b"\n" not in self._buffer:
            self._fill(deadline, method, timeout)
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _read_exact(self, n: int, deadline: float, method: str, timeout: float) -> bytes:
        parts, have = [self._buffer], len(self._buffer)
        fd = self.proc.stdout.fileno()
        while have < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self._buffer = b"".join(parts)
                self._fail(f"{method}: no answer within {timeout:g} s (hang or too slow); the engine was killed")
            chunk = os.read(fd, min(1 << 24, n - have + (1 << 16)))
            if not chunk:
                self._buffer = b"".join(parts)
                self._fill(deadline, method, timeout)  # reports the exit
            parts.append(chunk)
            have += len(chunk)
        data = b"".join(parts)
        self._buffer = data[n:]
        return data[:n]

    def stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0, 2)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - STDERR_TAIL))
            return self._stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def close(self) -> None:
        """Stop the process (its whole session: vLLM's worker processes too)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
