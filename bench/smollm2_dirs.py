"""SmolLM2-135M-Instruct as mlx-lm directories, for mlx-lm's side of the bench: mlx-lm cannot read
the GGUF file the mlxq worker serves, so the same weights are written out once through mlxq's GGUF
loader, twice:

* ``fp32``: dequantized, as the worker runs them on the CPU (the fair anchor: the same arithmetic);
* ``4-bit``: the Q4_1 blocks as they are stored (MLX's affine 4-bit layout, group 32), which is what
  a user who ran mlx-lm on a 4-bit model would get.

    python bench/smollm2_dirs.py      # prints the two directories (built on the first call)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mlxq.worker import blas

blas.setup()

import mlx.nn as nn  # noqa: E402
from mlx_lm.utils import save_config, save_model  # noqa: E402

from mlxq.devkit.smollm2 import INSTALL, smollm2_gguf  # noqa: E402
from mlxq.shared.settings import cache_dir  # noqa: E402
from mlxq.worker.model import load_model  # noqa: E402

STAMP = "source.json"


def _quantization(model) -> dict | None:
    """mlx-lm's ``quantization`` config for the modules that are quantized: the commonest
    (bits, group) for all, each other one named by its path."""
    found = {p: (m.bits, m.group_size) for p, m in model.named_modules()
             if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if not found:
        return None
    (bits, group), _ = Counter(found.values()).most_common(1)[0]
    out: dict = {"group_size": group, "bits": bits}
    out.update({p: {"group_size": g, "bits": b} for p, (b, g) in found.items() if (b, g) != (bits, group)})
    return out


def _write(gguf: Path, out: Path, keep_dtype: bool) -> None:
    loaded = load_model(str(gguf), name="smollm2", keep_dtype=keep_dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, loaded.model)
    config = dict(loaded.config)
    quant = _quantization(loaded.model)
    if quant:
        config["quantization"] = config["quantization_config"] = quant
    save_config(config, out / "config.json")
    hf = getattr(loaded.tokenizer, "_tokenizer", loaded.tokenizer)
    hf.save_pretrained(str(out))


def mlx_lm_dirs() -> tuple[Path, dict[str, Path]]:
    """(the GGUF file, {"fp32": dir, "4-bit": dir}), writing the directories when the file changed."""
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not installed: {INSTALL}")
    source = {"path": str(gguf), "size": gguf.stat().st_size, "mtime": gguf.stat().st_mtime}
    dirs = {"fp32": cache_dir() / "smollm2-mlx-fp32", "4-bit": cache_dir() / "smollm2-mlx-4bit"}
    for label, out in dirs.items():
        stamp = out / STAMP
        if stamp.exists() and json.loads(stamp.read_text()) == source:
            continue
        _write(gguf, out, keep_dtype=label == "4-bit")
        stamp.write_text(json.dumps(source))
    return gguf, dirs


if __name__ == "__main__":
    gguf, dirs = mlx_lm_dirs()
    print(gguf)
    for label, d in dirs.items():
        print(f"{label}: {d}")
    sys.exit(0)
