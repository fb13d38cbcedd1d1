"""The `posenc` command line, run in-process through `posenc.cli.main` (and once as `python -m posenc`)."""

import json
import re
import subprocess
import sys

import pytest

from posenc import inspection as ins
from posenc.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out, title_start):
    """Rows of the plain table whose title starts with `title_start`, split on 2+ spaces."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title_start))
    rows = []
    for line in lines[start + 1:]:
        if not line or line.startswith("  "):
            break
        rows.append([cell.strip() for cell in line.split("  ") if cell.strip()])
    return rows


def test_readme_command_prints_the_seed_table(capsys):
    code, out, err = run(capsys, "inspect", "llama-2-7b", "--lengths", "4k,32k,128k", "--batch", "16")
    assert code == 0 and err == ""
    header, *rows = table_rows(out, "KV cache")
    fp16 = header.index("fp16")
    assert [(r[0], r[fp16]) for r in rows] == [
        ("4k", "2 GB / 32 GB"), ("32k*", "16 GB / 256 GB"), ("128k*", "64 GB / 1024 GB")]
    assert "* beyond the model's declared maximum of 4096 positions" in out
    assert "GB = 2**30 bytes, i.e. GiB" in out and "per batch of 16" in out
    assert "512 KiB" in out


def test_bands_table(capsys):
    code, out, _ = run(capsys, "inspect", "llama-3.1-8b", "--bands", "4")
    assert code == 0
    header, *rows = table_rows(out, "Frequency bands")
    assert header[0] == "pairs" and [r[0] for r in rows] == ["0-15", "16-31", "32-47", "48-63"]
    assert rows[0][-1] == "1" and rows[-1][-1] == "8"  # fast pairs kept, slow pairs divided by the factor
    assert "scaling llama3: factor=8.0" in out and "L0 = 8192 (original), L1 = 131072 (target)" in out
    assert "29 of 64 pairs (35-63) have wavelengths beyond L0 = 8192" in out


def test_json_has_the_same_facts(capsys):
    code, out, _ = run(capsys, "inspect", "deepseek-v3", "--json", "--lengths", "4k,128k", "--batch", "2",
                       "--memory", "80")
    assert code == 0
    data = json.loads(out)
    cfg, source = ins.load_config("deepseek-v3")
    expected = ins.inspect_model(cfg, lengths=[4096, 131072], batch=2, source=source, memory_gib=80.0)
    assert data == json.loads(json.dumps(expected))
    assert data["kv_cache"]["kind"] == "mla"


@pytest.mark.parametrize("name", ins.preset_names())
def test_every_preset_prints(capsys, name):
    code, out, err = run(capsys, "inspect", name, "--format", "plain")
    assert code == 0 and err == "", err
    assert out.startswith(name) and "KV cache" in out


def test_rich_tables(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # rich sizes tables to the terminal; captured output has none
    code, out, _ = run(capsys, "inspect", "llama-2-7b", "--lengths", "4k", "--batch", "16", "--format", "rich")
    assert code == 0
    assert "2 GB / 32 GB" in out and "Frequency bands" in out


def test_config_path_and_unsupported_config(capsys, tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 120, "num_attention_heads": 5, "num_key_value_heads": 1,
           "num_hidden_layers": 3, "max_position_embeddings": 1000, "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "inspect", str(tmp_path), "--lengths", "1000", "--dtypes", "fp32")
    assert code == 0
    # 2 x 3 layers x 1 KV head x 24 dims x 4 bytes x 1000 tokens
    assert f"{2 * 3 * 24 * 4 * 1000 / 2**30:.3g} GB" in out
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2 and out == ""
    assert err.startswith(f"posenc inspect: error: {tmp_path / 'config.json'}['model_type']: expected a model whose")
    assert "got 'mamba', which applies no positional encoding" in err
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    code, out, err = run(capsys, "inspect", str(tmp_path / "config.json"))
    assert code == 2 and out == ""
    assert err == f"posenc inspect: error: {tmp_path / 'config.json'}['num_hidden_layers']: expected a positive integer, got 0\n"
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "linear", "factor": -2.0}}))
    code, out, err = run(capsys, "plot", "wavelengths", str(tmp_path), "-o", str(tmp_path / "w.png"))
    assert code == 2 and out == "" and not (tmp_path / "w.png").exists()
    assert err.startswith(f"posenc plot: error: {tmp_path / 'config.json'}['rope_scaling']['factor']: expected"), err


@pytest.mark.parametrize("argv, message", [
    (["inspect", "no-such-model"], "MODEL_OR_CONFIG: expected"),
    (["inspect", "llama-2-7b", "--lengths", "4x"], "--lengths"),
    (["inspect", "llama-2-7b", "--batch", "0"], "--batch"),
    (["inspect", "llama-2-7b", "--dtypes", "fp16,fp6"], "--dtypes"),
    (["inspect", "llama-2-7b", "--memory", "-1"], "--memory"),
])
def test_bad_input_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and message in err


@pytest.mark.parametrize("command, words", [("inspect", ["MODEL_OR_CONFIG", "GB = 2**30 bytes", "llama-2-7b", "--lengths"]),
                                            ("plot", ["wavelengths", "alibi", "--output"])])
def test_help(capsys, command, words):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in words:
        assert word in out


def test_python_dash_m(tmp_path):
    done = subprocess.run([sys.executable, "-m", "posenc", "inspect", "llama-2-7b", "--lengths", "4k", "--batch", "16"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2 GB / 32 GB" in done.stdout


def test_version(capsys):
    import posenc

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    from posenc.kernels import build

    version, kernel = capsys.readouterr().out.splitlines()
    assert version == f"posenc {posenc.__version__}"
    assert kernel == build.describe() and kernel.startswith(("cpu kernel: ", "reference ("))
    # which library runs and where it was loaded from: the install-time build or the first-use cache
    assert re.fullmatch(r"cpu kernel: (installed build \S+|(installed build .+; )?first-use build \S+)|reference \(.+\)",
                        kernel), kernel


@pytest.mark.parametrize("argv, module, extra", [
    (["inspect", "llama-2-7b", "--format", "rich"], "rich", "rich"),
    (["plot", "alibi", "-o", "x.png"], "matplotlib", "plot"),
])
def test_missing_optional_package_is_one_line(capsys, monkeypatch, tmp_path, argv, module, extra):
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError, as when not installed
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err == f"posenc {argv[0]}: error: {module} is not installed: pip install 'posenc[{extra}]'\n"
    assert not (tmp_path / "x.png").exists()


def test_missing_rich_is_fine_for_auto_and_json(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    assert run(capsys, "inspect", "llama-2-7b", "--format", "auto")[0] == 0
    assert run(capsys, "inspect", "llama-2-7b", "--format", "rich", "--json")[0] == 0


@pytest.mark.parametrize("argv, message", [
    (["inspect", "llama-2-7b", "--dtypes", ""], "--dtypes: expected at least one name from ('fp32'"),
    (["inspect", "llama-2-7b", "--dtypes", " , "], "--dtypes: expected at least one name"),
    (["inspect", "llama-2-7b", "--lengths", ""], "--lengths: expected comma-separated token counts"),
    (["inspect", "llama-2-7b", "--lengths", "4k,8000000m"], "--lengths: expected whole numbers of tokens in [1, 4294967296]"),
    (["inspect", "llama-2-7b", "--bands", "0"], "--bands: expected a positive integer, got 0"),
    (["inspect", "llama-2-7b", "--bands", "-3"], "--bands: expected a positive integer, got -3"),
    (["inspect", "llama-2-7b", "--bands", "65"], "--bands: expected at most the 64 rotation pairs of all layers, got 65"),
    (["inspect", "missing/config.json"], "MODEL_OR_CONFIG: expected an existing config.json or directory,"
                                         " got 'missing/config.json' (file not found)"),
])
def test_bad_options_are_named(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"posenc inspect: error: {message}"), err
    assert err.count("\n") == 1  # one line


def test_memory_beyond_the_maximum_is_starred(capsys):
    code, out, _ = run(capsys, "inspect", "llama-3.1-8b", "--memory", "80", "--dtypes", "fp16,int4", "--format", "plain")
    assert code == 0
    assert "80 GB holds, in fp16 at batch 1: 655360* tokens (640k) per request" in out
    assert "* beyond the model's declared maximum of 131072 positions" in out
    code, out, _ = run(capsys, "inspect", "llama-3.1-8b", "--memory", "1", "--dtypes", "fp16", "--format", "plain")
    assert "1 GB holds, in fp16 at batch 1: 8192 tokens (8k) per request" in out and "declared maximum" not in out


@pytest.mark.parametrize("name", ins.preset_names())
def test_default_plain_output_fits_80_columns(capsys, name):
    code, out, _ = run(capsys, "inspect", name, "--format", "plain")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80, max(out.splitlines(), key=len)


@pytest.mark.parametrize("columns", [80, 100])
def test_rich_never_crops_a_table(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, _ = run(capsys, "inspect", "llama-3.1-8b", "--format", "rich", "--lengths", "4k,128k", "--batch", "16")
    assert code == 0
    assert "\u2026" not in out  # rich's ellipsis: a cell cut short
    assert max(len(line) for line in out.splitlines()) <= columns
    assert "16 GB / 256 GB" in out and "609226..2.56e6" in out


@pytest.mark.parametrize("argv", [["verify", "--quick"], ["bench", "--quick", "--shapes", "decode", "--rounds", "1"],
                                  ["lab", "--quick"]])
def test_an_output_folder_that_is_a_file_is_one_error_line(capsys, tmp_path, argv):
    # verify says so before minutes of checks; the others at their first write: never a traceback
    target = tmp_path / "a-file"
    target.write_text("")
    assert main([*argv, "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"posenc {argv[0]}: error: ") and "a-file" in err and "Traceback" not in err
