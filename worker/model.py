"""Load a model the normal mlx-lm way (a directory or a hub id), or a GGUF file (:mod:`.gguf`), and
make it CPU-fast."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.utils import dequantize_model

from ..shared.keys import model_name
from ..shared.settings import CPU_WEIGHTS
from ..shared.tools import format_info
from .gguf import GGUFError, GGUFInfo, load_gguf
from .textstream import vocab_size
from .toolprompt import serving_format

# A packed layer's attribute (cpu_weights=int8-dot, set at load): the extension's quantized_linear runs its
# integer dot products on it (worker/engine/kernels/model_ops.py reads it).
INT8_DOT_ATTR = "_mlxq_int8_dot"
# The packed layers the extension's quantized_linear takes: MLX's affine blocks of these bits and group sizes
# (packed_for_extension).
QUANT_BITS, QUANT_GROUPS = (4, 8), (32, 64, 128)


def packed_for_extension(m: nn.Module) -> bool:
    """Whether packed layer ``m`` is MLX's affine 4- or 8-bit blocks in groups the extension's
    quantized_linear takes, with biases, its scales and biases of one type (which types it takes:
    model_ops.quantized_layer_fits; narrow_scales narrows float32 ones)."""
    return (m.bits in QUANT_BITS and m.group_size in QUANT_GROUPS and getattr(m, "mode", "affine") == "affine"
            and "biases" in m and m["scales"].dtype == m["biases"].dtype)

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any  # mlx-lm TokenizerWrapper
    name: str  # the queue this worker serves
    source: str  # the directory or hub id given
    config: dict
    context_length: int
    eos_token_ids: tuple[int, ...]
    max_token_bytes: int  # the longest token's UTF-8 length: bounds prompt tokens from bytes
    num_params: int
    dtype_note: str
    load_s: float
    # the pooling the model directory's sentence-transformers config names (1_Pooling/config.json:
    # "last" or "mean"), None where it names none; an embedding job's default after the worker's setting
    pooling: Optional[str] = None

    @property
    def hidden_size(self) -> Optional[int]:
        """The width of the final hidden states: the longest embedding an embedding job gets."""
        size = getattr(getattr(self.model, "args", None), "hidden_size", None) or self.config.get("hidden_size")
        return int(size) if size else None

    def info(self) -> dict:
        """What producers and gateways may know about this model (kept in Redis)."""
        return {
            "name": self.name,
            "source": self.source,
            "context_length": self.context_length,
            "max_token_bytes": self.max_token_bytes,
            "eos_token_ids": list(self.eos_token_ids),
            "num_params": self.num_params,
            "has_chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
            "vocab_size": vocab_size(self.tokenizer),
            "embedding_size": self.hidden_size,  # an embedding job's `dimensions` may be at most this
            # thinking and tool-call markers, the tool parser's family, mlxq's own call format for a
            # template with no tool slot (mlxq.shared.tools.format_info)
            "chat_format": format_info(serving_format(self.tokenizer)),
        }


def _is_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def to_fp32(model: nn.Module) -> str:
    """Dequantize and cast to float32: on the CPU, fp32 matmul is many times faster.  The cast comes
    first: quantization scales and biases (float16 in a GGUF, often bfloat16 in MLX checkpoints) in
    float32 make the dequantized weights exactly the blocks' values, not those rounded to float16."""
    cast = _cast_to_fp32(model)
    notes = []
    if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
        dequantize_model(model)
        notes.append("dequantized")
    mx.eval(model.parameters())
    return ", ".join(notes + cast) or "already float32"


def _cast_to_fp32(model: nn.Module) -> list[str]:
    """float16/bfloat16 parameters to float32 (floating ones only: packed weights stay uint32); the
    note of what was cast, if anything."""
    cast = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters()) if v.dtype in (mx.float16, mx.bfloat16)})
    if cast:
        model.set_dtype(mx.float32)
    return [f"cast {', '.join(d.removeprefix('mlx.core.') for d in cast)} to float32"] if cast else []


def to_fp32_packed(model: nn.Module, int8_dot: bool = False) -> str:
    """Cast the floating parameters to float32 (the scales and biases of quantized layers too) and keep
    the quantized layers' blocks packed, for the extension's quantized_linear (cpu_weights=quantized);
    ``int8_dot`` marks them for its integer dot products (cpu_weights=int8-dot), which read each layer's
    scales and biases in 16 bits where they fit exactly (:func:`narrow_scales`; a model for the engine,
    whose quantized embedding widens them for its lookup: MLX's own lookup would give 16-bit rows). The
    note counts the layers kept, by bits, and by the scales' type where int8_dot narrowed some."""
    cast = _cast_to_fp32(model)
    packed = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    for m in packed:
        object.__setattr__(m, INT8_DOT_ATTR, int8_dot)
    kept = Counter(m.bits for m in packed)
    scales = Counter(narrow_scales(m) for m in packed) if int8_dot else Counter()
    mx.eval(model.parameters())
    by_type = ", ".join(f"{d} scales x {n}" for d, n in sorted(scales.items()) if d in ("float16", "bfloat16"))
    note = (f"quantized layers kept packed ({', '.join(f'{b}-bit x {n}' for b, n in sorted(kept.items()))}"
            f"{', int8 dot products' if int8_dot else ''}{', ' + by_type if by_type else ''})"
            if kept else "no quantized layers")
    return ", ".join([note] + cast)


def narrow_scales(m: nn.Module) -> str:
    """Store packed layer ``m``'s float32 scales and biases as float16, else bfloat16, where that type
    holds every one of them exactly (a GGUF's blocks carry float16 ones, mlx-lm checkpoints mostly
    bfloat16), else leave them float32; returns the type's name ("unchanged": a layer the extension does
    not take). int8_dot's kernels widen them back to the same float32s as they read them, so its results
    do not change; what does is the bytes a decode step reads (a 4-bit block of 32: 20 against 24)."""
    if not (packed_for_extension(m) and m["scales"].dtype == mx.float32):
        return "unchanged"
    s, b = m["scales"], m["biases"]
    for dtype in (mx.float16, mx.bfloat16):
        ns, nb = s.astype(dtype), b.astype(dtype)
        if mx.array_equal(ns.astype(mx.float32), s).item() and mx.array_equal(nb.astype(mx.float32), b).item():
            m.update({"scales": ns, "biases": nb})
            return str(dtype).removeprefix("mlx.core.")
    return "float32"


def _context_length(config: dict) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "max_sequence_length"):
        value = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def _max_token_bytes(tokenizer) -> int:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    size = len(hf)
    texts = hf.batch_decode([[i] for i in range(size)])
    return max(1, max(len(t.encode("utf-8", "replace")) for t in texts))


class ModelNotFound(FileNotFoundError):
    """The model to load is not there: the message says what was looked for, where, and what to pass."""


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or os.sep != "/" and os.sep in source


def missing_model(source: str, exc: BaseException) -> ModelNotFound:
    """One line for a model that is not where ``source`` says: no directory, a directory that is not
    a model, or a hub id that is neither in the local Hugging Face cache nor downloadable."""
    path = Path(source).expanduser().resolve()
    make = "`mlxq make-model DIR` builds a small one"
    if path.is_dir():
        return ModelNotFound(f"{path} is not an mlx-lm model directory ({exc}); pass a directory with config.json, "
                             f"the tokenizer and *.safetensors weights ({make})")
    if _looks_like_path(source):
        return ModelNotFound(f"no model directory at {path}: it does not exist; pass an mlx-lm model directory "
                             f"({make}) or a Hugging Face hub id (org/name)")
    return ModelNotFound(f"model {source!r}: no directory {path}, and hub id {source!r} is not in the local "
                         f"Hugging Face cache ({_hub_cache()}) and could not be downloaded ({type(exc).__name__}); download it "
                         f"first (`hf download {source}`) or pass a model directory ({make})")


def _not_found_errors() -> tuple:
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError, OfflineModeIsEnabled

    return (FileNotFoundError, HFValidationError, HfHubHTTPError, OfflineModeIsEnabled)


def _mlx_load(source: str):
    """``mlx_lm.load``; ``ModelNotFound`` (one clear line) when there is no model at ``source``."""
    try:
        return mlx_load(source, return_config=True)
    except _not_found_errors() as exc:
        raise missing_model(source, exc) from None


class BadModelFile(ModelNotFound):
    """The model file is there but cannot be used (a corrupt GGUF, an architecture or tensor type
    not handled): the message says which file and what is wrong.  A ``ModelNotFound``, so every
    caller that reports one reports this too."""


def is_gguf(source: str) -> bool:
    return source.lower().endswith(".gguf")


def _gguf_load(source: str):
    path = Path(source).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"no GGUF file at {path.resolve()}: it does not exist")
    try:
        return load_gguf(path)
    except GGUFError as exc:
        raise BadModelFile(f"{path}: {exc}") from None


def _mb(nbytes: int) -> str:
    mb = nbytes / 1e6
    return f"{mb:,.0f} MB" if mb >= 100 else f"{mb:.3g} MB"


def _log_gguf(source: str, info: GGUFInfo) -> None:
    log.info("GGUF %s: %s, tensors %s", source, info.architecture, info.types())
    if info.widened:
        log.warning(
            "GGUF %s: the %s tensors arrived as float16, because MLX reads these types unquantized: "
            "%s in the file -> %s as float16",
            source, info.widened_types(),
            _mb(info.widened_disk_bytes), _mb(info.widened_mem_bytes),
        )


def load_model(source: str, *, name: str | None = None, keep_dtype: bool = False,
               cpu_weights: str = "fp32") -> LoadedModel:
    """``mlx_lm.load`` of a directory or hub id, or a GGUF file, then fp32 on the CPU unless ``keep_dtype``:
    ``cpu_weights`` "fp32" dequantizes quantized layers, "quantized" keeps their blocks packed (the rest
    float32) for the CPU extension's quantized_linear."""
    if cpu_weights not in CPU_WEIGHTS:
        raise ValueError(f"cpu_weights must be one of {', '.join(CPU_WEIGHTS)} (got {cpu_weights!r})")
    t0 = time.perf_counter()
    gguf_info = None
    if is_gguf(source):
        model, tokenizer, config, gguf_info = _gguf_load(source)
        _log_gguf(source, gguf_info)
    else:
        model, tokenizer, config = _mlx_load(source)
    if keep_dtype or not _is_cpu():
        note = "dtype kept" + ("" if keep_dtype else " (not on the CPU)")
    elif cpu_weights in ("quantized", "int8-dot"):
        note = to_fp32_packed(model, int8_dot=cpu_weights == "int8-dot")
    else:
        note = to_fp32(model)
    if gguf_info is not None:  # what the policy costs: a quantized file may grow many times in fp32
        in_memory = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        note += f": {_mb(gguf_info.file_bytes)} on disk -> {_mb(in_memory)} in memory"
    num_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name or model_name(source),
        source=source,
        config=config,
        context_length=_context_length(config),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        max_token_bytes=_max_token_bytes(tokenizer),
        num_params=num_params,
        dtype_note=note,
        load_s=time.perf_counter() - t0,
        pooling=None if gguf_info is not None else sentence_pooling(Path(source)),
    )
    log.info(
        "loaded model %s from %s: %.1fM params, context %d, %s, %.1fs",
        loaded.name, source, num_params / 1e6, loaded.context_length, note, loaded.load_s,
    )
    return loaded


def sentence_pooling(model_dir: Path) -> Optional[str]:
    """The pooling a sentence-transformers model directory names (``1_Pooling/config.json``): "last"
    or "mean"; None where there is no such file, or it names another (cls, max: the worker's rule then)."""
    path = model_dir / "1_Pooling" / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    for key, pooling in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean")):
        if cfg.get(key) is True:
            return pooling
    log.warning("%s names a pooling mlxq does not do (only last-token and mean): the worker's rule applies", path)
    return None
