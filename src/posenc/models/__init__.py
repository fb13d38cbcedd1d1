"""Models built from posenc's parts: a small Llama-family decoder with an explicit KV cache.

    >>> from posenc.models import Decoder
    >>> Decoder.__name__
    'Decoder'
"""

from .decoder import Decoder

__all__ = ["Decoder"]
