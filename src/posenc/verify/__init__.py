"""`posenc verify`: the validation table (relativity, prefill-decode, batch-padding, pairing,
length-boundaries, position-scan, short-context, multimodal, rules-vs-reference, prefix-caching,
chunked-prefill) on a real model and any engine (foreign ones out of process: `posenc.verify.engines`).

Rows are `Row` values with measured numbers, thresholds and pass/fail; `run_checks` runs them on a
`Subject` (an engine factory, a checkpoint and text); `self_test` injects each failure mode of the seed
into posenc's engine (`faults`) and shows its row catching it. Imported lazily by the CLI.

    >>> from posenc.verify import CHECKS
    >>> len(CHECKS)
    11
"""

from .checks.common import BUDGETS, Budget, Row, Subject
from .faults import FAULTS, faulty_factory
from .runner import CHECKS, run_checks, self_test

__all__ = ["BUDGETS", "Budget", "Row", "Subject", "CHECKS", "run_checks", "self_test", "FAULTS", "faulty_factory"]
