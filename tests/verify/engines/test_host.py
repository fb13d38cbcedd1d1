"""The engine host contains what a foreign engine does wrong: a segfault, an abort, a hang, an exception
or an unreadable answer becomes an EngineFailure naming the cause, and the next call runs on a fresh process."""

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from posenc.verify.engines.process import EngineFailure, EngineProcess

FAKE = str(Path(__file__).parents[2] / "helpers" / "engine_fakes" / "fake_side.py")


@pytest.fixture
def proc():
    p = EngineProcess(sys.executable, FAKE, {"vocab": 8}, timeout=20, load_timeout=60)
    yield p
    p.close()


def test_calls_round_trip_values_and_arrays(proc):
    assert proc.call("echo", value=[1, "a", None])["value"] == [1, "a", None]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = proc.call("square", x=x)
    assert y.dtype == np.float64 and y.shape == (2, 3)
    np.testing.assert_array_equal(y, (np.arange(6.0) ** 2).reshape(2, 3))
    assert proc.call("noisy") == 7  # prints on fd 1 do not reach the protocol
    assert proc.call("echo", value=0)["calls"] == 2  # same process: state kept
    assert proc.starts == 1


@pytest.mark.parametrize("method, cause", [("segfault", "SIGSEGV"), ("abort", "SIGABRT"),
                                           ("fail", "engine-side exception on purpose"),
                                           ("garbage", "malformed answer"), ("short", "exited with status 3")])
def test_each_failure_is_named_and_the_engine_restarts(proc, method, cause):
    first = proc.call("echo", value=1)["pid"]
    with pytest.raises(EngineFailure) as info:
        proc.call(method)
    assert cause in info.value.reason
    assert proc.proc is None  # killed, whatever state it was in
    again = proc.call("echo", value=2)
    assert again["pid"] != first and again["calls"] == 1 and proc.starts == 2


def test_a_hang_times_out_and_is_killed(proc):
    pid = proc.call("echo", value=1)["pid"]
    start = time.monotonic()
    with pytest.raises(EngineFailure, match="no answer within 1 s"):
        proc.call("hang", timeout=1)
    assert time.monotonic() - start < 10
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(pid, 0)
    assert proc.call("echo", value=3)["value"] == 3


def test_a_crash_during_load_is_reported_with_the_signal():
    p = EngineProcess(sys.executable, FAKE, {"crash_on": "load"}, timeout=20, load_timeout=60)
    with pytest.raises(EngineFailure, match="load: the engine process killed by signal SIGABRT"):
        p.call("echo", value=1)
    p.close()


def test_a_missing_interpreter_or_adapter_is_a_failure_not_a_hang(tmp_path):
    p = EngineProcess(sys.executable, str(tmp_path / "missing.py"), {}, timeout=20, load_timeout=20)
    with pytest.raises(EngineFailure, match="exited with status 1"):
        p.call("echo", value=1)
    p.close()


def test_the_hosts_folder_does_not_shadow_packages(proc):
    # posenc/verify/engines/ holds openai.py and setup.py: an engine importing `openai` must get the real one
    assert proc.call("echo", value=1)["value"] == 1
    p = EngineProcess(sys.executable, str(Path(__file__).parents[2] / "helpers" / "engine_fakes" / "shadow_side.py"), {},
                      timeout=20, load_timeout=60)
    assert p.call("where") is None
    p.close()
