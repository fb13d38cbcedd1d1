"""verify's HTTP client against hostile loopback servers: one deadline for the whole request, redirects
refused with their target, a size cap; each failure says what happened. Each test takes about a second."""

import json
import time

import pytest

from posenc.verify.engines.httpclient import request_json
from posenc.verify.engines.process import EngineFailure
from tests.helpers.engine_fakes.raw_http import RawServer, json_answer


@pytest.fixture
def serve():
    servers = []

    def start(answer, host="127.0.0.1"):
        servers.append(RawServer(answer, host))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def trickle_body(conn, request):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(100):
        conn.sendall(b" ")
        time.sleep(0.1)


def trickle_headers(conn, request):
    for byte in b"HTTP/1.1 200 OK\r\nX-Padding: " + b"a" * 1000:
        conn.sendall(bytes([byte]))
        time.sleep(0.05)


@pytest.mark.parametrize("answer", [trickle_body, trickle_headers], ids=["body", "headers"])
def test_one_deadline_covers_a_server_that_keeps_trickling(serve, answer):
    server = serve(answer)
    start = time.monotonic()
    with pytest.raises(EngineFailure, match=r"/v1/x: no complete answer from .* within 1 s"):
        request_json(server.url + "/v1/x", timeout=1.0)
    assert time.monotonic() - start < 3.0  # each byte arrives well within 1 s; the whole never does


def test_a_redirect_is_refused_naming_where_it_pointed(serve):
    other = serve(json_answer(b'{"data": [{"id": "elsewhere"}]}'), host="127.0.0.2")
    server = serve(json_answer(b"", "302 Found", f"Location: {other.url}/v1/completions\r\n"))
    with pytest.raises(EngineFailure, match=r"HTTP 302, a redirect to http://127\.0\.0\.2:\d+/v1/completions; "
                                            r"verify does not follow redirects"):
        request_json(server.url + "/v1/completions", "POST", {"prompt": [1, 2]}, timeout=5.0)
    assert len(server.requests) == 1 and other.requests == []


def test_answers_past_the_size_cap_are_refused(serve):
    announced = serve(json_answer(b"[" + b"0," * 5000 + b"0]"))
    with pytest.raises(EngineFailure, match=r"announces 10003 bytes, more than the cap of 1000 \(--engine-max-bytes\)"):
        request_json(announced.url + "/v1/x", timeout=5.0, max_bytes=1000)

    def unannounced(conn, request):  # no Content-Length: the body runs until the connection closes
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b" " * 50000)
    with pytest.raises(EngineFailure, match=r"passed the cap of 1000 bytes"):
        request_json(serve(unannounced).url + "/v1/x", timeout=5.0, max_bytes=1000)
    assert request_json(announced.url + "/v1/x", timeout=5.0) == [0] * 5001  # under the default cap


@pytest.mark.parametrize("answer, reason", [
    (json_answer(b'{"error": "engine core died"}', "500 Internal Server Error"), r"HTTP 500: \{\"error\""),
    (json_answer(b"<html>proxy error</html>"), r"malformed answer \(not JSON\): b'<html>"),
    (lambda conn, request: None, r"no answer from http://127.0.0.1:\d+/v1/x \(RemoteDisconnected")])
def test_http_errors_say_which(serve, answer, reason):
    with pytest.raises(EngineFailure, match=reason):
        request_json(serve(answer).url + "/v1/x", timeout=5.0)


def test_a_good_answer_is_its_json(serve):
    server = serve(json_answer(json.dumps({"ok": [1, 2]}).encode()))
    assert request_json(server.url + "/v1/x", "POST", {"a": 1}, timeout=5.0) == {"ok": [1, 2]}
    assert server.requests[0].startswith(b"POST /v1/x HTTP/1.1") and server.requests[0].endswith(b'{"a": 1}')
