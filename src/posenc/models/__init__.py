"""Models built from posenc's parts: a small Llama-family decoder with an explicit KV cache, and its loaders.

    >>> from posenc.models import Decoder, embedded_model_path, load_tokenizer
    >>> Decoder.__name__
    'Decoder'
"""

from .decoder import Decoder
from .loading import embedded_model_path, to_transformers
from .tokenizer import load_tokenizer

__all__ = ["Decoder", "embedded_model_path", "load_tokenizer", "to_transformers"]
