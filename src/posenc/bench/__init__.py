"""`posenc bench`: RoPE on q and k timed side by side with the peers and the memory floors.

- `harness.py`: the shapes, the interleaved timing rounds, the floors (`copy`, `clone`), CSV / Markdown / plot.
- `providers.py`: who is timed (posenc's implementations, transformers, vLLM, flash-attn, ...), skipped when absent.
"""

from .harness import SHAPES, add_parser, plot, run, summary, write_csv

__all__ = ["SHAPES", "run", "write_csv", "summary", "plot", "add_parser"]
