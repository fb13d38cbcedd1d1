"""Regenerate docs/inspect.md from docs/inspect.template.md: each {{posenc ...}} becomes the command and its output.

Run after changing what `posenc inspect` prints: `python docs/build.py`. tests/test_docs.py checks the page
against fresh output, so a stale page fails the suite.
"""

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

from posenc.cli import main

DOCS = Path(__file__).resolve().parent


def run(match: re.Match) -> str:
    command = match.group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(shlex.split(command)[1:])
    if code != 0:
        raise SystemExit(f"{command!r} exited with {code}")
    return f"```console\n$ {command}\n{out.getvalue().rstrip()}\n```"


if __name__ == "__main__":
    os.chdir(DOCS.parent)  # the page's commands use paths relative to the repository root
    template = (DOCS / "inspect.template.md").read_text()
    (DOCS / "inspect.md").write_text(re.sub(r"\{\{(.*?)\}\}", run, template))
    print("wrote", DOCS / "inspect.md")
