"""docs/inspect.md: every `$ posenc ...` command in it runs and prints exactly what the page shows."""

import re
import shlex
from pathlib import Path

import pytest

from posenc.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "inspect.md"
BLOCK = re.compile(r"```console\n\$ (posenc [^\n]*)\n(.*?)```", re.S)


def blocks():
    return BLOCK.findall(DOC.read_text())


def test_page_has_inspect_and_plot_commands():
    commands = [cmd for cmd, _ in blocks()]
    assert any(c.startswith("posenc inspect llama-2-7b --lengths 4k,32k,128k --batch 16") for c in commands)
    assert sum(c.startswith("posenc plot") for c in commands) >= 2
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", DOC.read_text()):
        assert (DOC.parent / image).is_file(), image


@pytest.mark.parametrize("command, shown", [b for b in blocks() if b[0].startswith("posenc inspect")])
def test_inspect_output_matches_page(capsys, command, shown):
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out == shown


@pytest.mark.parametrize("command, shown", [b for b in blocks() if b[0].startswith("posenc plot")])
def test_plot_commands_run(tmp_path, capsys, command, shown):
    from matplotlib.image import imread

    argv = shlex.split(command)[1:]
    documented = argv[argv.index("-o") + 1]
    assert shown == f"wrote {documented}\n"
    argv[argv.index("-o") + 1] = str(tmp_path / Path(documented).name)  # never overwrite the committed figure
    assert main(argv) == 0
    pixels = imread(tmp_path / Path(documented).name)
    assert pixels.shape[0] >= 250 and pixels[..., :3].std() > 0.05
    assert (DOC.parents[1] / documented).is_file()
