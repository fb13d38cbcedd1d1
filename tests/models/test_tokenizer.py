"""The GGUF tokenizer refuses a lone surrogate by name."""

import pytest

from posenc import PosencError


def test_gguf_tokenizer_refuses_a_lone_surrogate_by_name():
    from posenc.models.tokenizer import GGUFTokenizer

    class Backend:  # the check is posenc's: it must fire before the backend sees the text
        def encode(self, text, add_special_tokens=False):
            raise AssertionError("the backend was given the text")
    tok = GGUFTokenizer(Backend(), {"tokenizer.ggml.tokens": ["a"]})
    for text in ("\ud800", "ok \udfff then"):
        with pytest.raises(PosencError, match=r"text: expected a str of Unicode scalar values .* lone surrogate"):
            tok.encode(text)
