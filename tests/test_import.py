"""`import posenc` imports torch and nothing optional."""

import subprocess
import sys

OPTIONAL = ("transformers", "matplotlib", "rich", "triton", "gguf", "mpmath", "hypothesis")


def test_import_posenc_pulls_no_optional_dependency():
    code = (
        "import sys, posenc\n"
        f"print(','.join(m for m in {OPTIONAL!r} if m in sys.modules))\n"
        "print(posenc.Rope, posenc.apply_rope, posenc.PosencError)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.splitlines()[0]
    assert loaded == "", f"import posenc loaded optional modules: {loaded}"


def test_public_names_exported():
    import posenc

    for name in posenc.__all__:
        assert hasattr(posenc, name), name
    for name in ("Rope", "apply_rope", "PosencError", "YaRN", "LongRoPE", "Llama3", "DynamicNTK", "Linear"):
        assert name in posenc.__all__
