"""The OpenAI adapter's reading of answers: what a server sends wrong is said in its own terms (the field, the
choice, the entry, what was expected), never as a Python error about NoneType or an index."""

import json

import numpy as np
import pytest

from posenc.verify.engines.openai import OpenAIEngine
from posenc.verify.engines.process import EngineFailure
from tests.helpers.engine_fakes.raw_http import RawServer, json_answer

MODELS = json.dumps({"data": [{"id": "m"}]}).encode()


def server_with(completion):
    """A server whose /v1/models names one model and whose /v1/completions answers `completion` (a dict)."""
    def answer(conn, request):
        body = MODELS if request.startswith(b"GET /v1/models") else json.dumps(completion).encode()
        json_answer(body)(conn, request)
    return RawServer(answer)


def choice(values, tokens=None):
    lp = {"token_logprobs": values, "top_logprobs": [None] + [{"token_id:5": v} for v in values[1:]]}
    return {"index": 0, "logprobs": {**lp, **({"tokens": tokens} if tokens is not None else {})}}


@pytest.fixture
def engine_for():
    servers = []

    def make(completion):
        servers.append(server_with(completion))
        return OpenAIEngine(servers[-1].url, timeout=5.0)
    yield make
    for s in servers:
        s.close()


def test_a_well_formed_answer_is_read(engine_for):
    out = engine_for({"choices": [choice([None, -0.5, -1.5])]}).score([[1, 2, 3]])[0]
    assert np.isnan(out["logprobs"][0]) and out["logprobs"][1:].tolist() == [-0.5, -1.5]
    assert out["top1"].tolist() == [-1, 5, 5]


@pytest.mark.parametrize("completion, reason", [
    ({"choices": [{"index": 0, "logprobs": None}]},
     r"choice 0 has `logprobs: null`; expected an object with `token_logprobs` \(the server must honour `logprobs`"),
    ({"choices": [choice([None, -0.5])]}, r"choice 0: `token_logprobs` has 2 entries for a prompt \(echo\) of 3 tokens"),
    ({"choices": [choice([None, -0.5, "x"])]}, r"choice 0: token_logprobs\[2\] is 'x', expected a number or null"),
    ({"choices": [{"index": 0, "logprobs": {"token_logprobs": None}}]}, r"choice 0 has `token_logprobs: null`"),
    ({"choices": []}, r"0 choices for 1 prompts"),
    ({"object": "error", "message": "bad"}, r"the answer has no `choices` list: \{'object': 'error'"),
])
def test_malformed_scores_are_said_in_the_servers_terms(engine_for, completion, reason):
    with pytest.raises(EngineFailure, match=reason):
        engine_for(completion).score([[1, 2, 3]])


def test_a_short_generation_is_said_in_the_servers_terms(engine_for):
    engine = engine_for({"choices": [choice([-0.1], tokens=["token_id:7"])]})
    with pytest.raises(EngineFailure, match=r"choice 0: `tokens` has 1 entries for generated tokens of 4 tokens"):
        engine.generate([1, 2], 4)


def test_a_server_naming_no_model_is_said_so():
    server = RawServer(json_answer(b'{"data": []}'))
    try:
        with pytest.raises(EngineFailure, match=r"/v1/models: expected \{\"data\": \[\{\"id\": MODEL\}"):
            OpenAIEngine(server.url, timeout=5.0)
    finally:
        server.close()
