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


README = DOC.parents[1] / "README.md"


def readme_example():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    runnable = [b for b in blocks if "load_preset(" in b]
    assert len(runnable) == 1, "README needs one runnable example that loads a bundled preset"
    return runnable[0]


def test_readme_example_runs(capsys):
    code = readme_example()
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out.splitlines()
    claimed = re.findall(r"print\(.*\)\s+# (tensor\(True\))", code)
    assert len(claimed) == 2 and printed == claimed  # each print shows what its comment says


def test_readme_install_names_every_extra_and_the_size_warning():
    import tomllib

    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = README.read_text()
    install = text[text.index("## Install"):text.index("## A first run")]
    for extra in extras:
        assert extra in install, extra
    for extra in ("plot", "rich", "hf", "test"):
        assert f"pip install 'posenc[{extra}]'" in install
    assert "torch==2.13.0" in install and "CUDA" in install and "whl/cpu" in install
    assert "60 GiB" in text and "`Decoder.from_hf_config` builds the config's full size" in text


def test_readme_decoder_size_claim():
    """The README's 60 GiB: llama-3.1-8b's parameter count, counted on the meta device (nothing allocated)."""
    import torch

    from posenc.inspection import load_preset
    from posenc.models import Decoder

    with torch.device("meta"):
        model = Decoder.from_hf_config(load_preset("llama-3.1-8b"))
    params = sum(p.numel() for p in model.parameters())
    assert 8.0e9 <= params <= 8.1e9
    assert round(params * 8 / 2**30) == 60 and round(params * 4 / 2**30) == 30
