"""The rows of `posenc verify`, one module per concept: consistency (relativity, prefill-decode,
batch-padding), pairing, length (length-boundaries, short-context), scan (position-scan), multimodal."""
