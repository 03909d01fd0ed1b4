"""Load a GGUF file (llama.cpp's format) into the mlx-lm model class and tokenizer it stands for.

``mx.load`` reads the tensors and the metadata: Q4_0, Q4_1 and Q8_0 blocks arrive already in MLX's
affine quantized layout (``.weight`` packed uint32, ``.scales``, ``.biases``, groups of 32), most
other block types (K-quants among them) arrive dequantized to float16.  What MLX does not say is
which GGML type each tensor had, so :func:`read_header` reads the tensor table itself (the types
name what was loaded and what it costs; a few lines of ``struct``, so the worker needs no ``gguf``
package).  The model is the mlx-lm class of the architecture (llama, qwen2, qwen3), quantized where
the tensors arrived quantized; the tokenizer is rebuilt from the vocabulary and merges with
``tokenizers`` and then goes through mlx-lm's own tokenizer loader, so the worker sees the same
``TokenizerWrapper`` as from ``mlx_lm.load``.

Every refusal is a :class:`GGUFError` whose message is one line naming what is wrong.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.utils import infer_quant_config

# GGML tensor types by id (ggml.h, enum ggml_type): the names llama.cpp and its users know.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}
# (elements, bytes) of one block of each type (ggml.c, type_traits): a tensor's size in the file
_BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "F64": (1, 8), "I8": (1, 1), "I16": (1, 2), "I32": (1, 4),
    "I64": (1, 8), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q8_1": (32, 36), "IQ4_NL": (32, 18), "MXFP4": (32, 17), "Q2_K": (256, 84), "Q3_K": (256, 110),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292), "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74), "IQ3_XXS": (256, 98), "IQ1_S": (256, 50), "IQ3_S": (256, 110), "IQ2_S": (256, 82),
    "IQ4_XS": (256, 136), "IQ1_M": (256, 56), "TQ1_0": (256, 54), "TQ2_0": (256, 66),
}
# Types MLX keeps as they are (no conversion): anything else that arrives as float16 was converted.
NATIVE_TYPES = {"F32", "F16", "I8", "I16", "I32"}
# What mx.load reads (checked on MLX 0.32, which pyproject pins): the native types; Q4_0, Q4_1 and
# Q8_0 as MLX quantized arrays; BF16, Q2_K, Q4_K and Q6_K converted to float16.  It fails on the
# other block types (Q5_0, Q3_K, Q5_K, the IQ types, ...) and silently skips ids its gguflib does not
# know (MXFP4, TQ1_0), so those are refused here, by name, before it runs.
MLX_READS = NATIVE_TYPES | {"Q4_0", "Q4_1", "Q8_0", "BF16", "Q2_K", "Q4_K", "Q6_K"}

# GGUF metadata value types (gguf.h): struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file this loader cannot use; the message names what is wrong, on one line."""


@dataclass(frozen=True)
class TensorInfo:
    type: str  # the GGML type name (GGML_TYPES), or "type N" for an id this table does not know
    shape: tuple[int, ...]  # in MLX's (row-major) order
    nbytes: int  # its bytes in the file (0 for a type this table does not know)


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensor table of a GGUF file (v2 or v3): name -> type, shape, bytes on disk.  The metadata
    is skipped here (``mx.load`` decodes it); only ``general.alignment`` is read, which places the
    data.  A file that ends before its last tensor does is refused here, before MLX maps it."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise GGUFError("not a GGUF file (it is empty)") from None
    with buf:
        try:
            tensors, data_start, ends = _parse_header(buf)
        except (struct.error, UnicodeDecodeError, IndexError, ZeroDivisionError):  # (0: an alignment of 0)
            raise GGUFError("truncated or corrupt GGUF header (the file ends inside it or holds nonsense)") from None
        size = len(buf)
    for name, end in ends.items():
        if data_start + end > size:
            raise GGUFError(f"truncated: tensor {name!r} ends at byte {data_start + end:,}, "
                            f"the file has {size:,} bytes")
    return tensors


def _parse_header(buf) -> tuple[dict[str, TensorInfo], int, dict[str, int]]:
    """(tensors, where the data starts, where each tensor ends relative to that)."""
    if buf[:4] != b"GGUF":
        raise GGUFError(f"not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF')")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
    pos, alignment = 24, 32

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        if at + 8 + n > len(buf):
            raise struct.error("string past the end")
        return buf[at + 8: at + 8 + n].decode("utf-8"), at + 8 + n

    def skip(kind: int, at: int) -> int:
        if kind in _SCALARS:
            return at + struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            return string(at)[1]
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALARS:
                return at + count * struct.calcsize(_SCALARS[item])
            for _ in range(count):
                at = skip(item, at)
            return at
        raise struct.error(f"metadata value type {kind}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        if key == "general.alignment" and kind in _SCALARS:
            (alignment,) = struct.unpack_from(_SCALARS[kind], buf, pos + 4)
        pos = skip(kind, pos + 4)
    tensors, ends = {}, {}
    for _ in range(n_tensors):
        name, pos = string(pos)
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        shape = tuple(reversed(dims))  # GGML lists the fastest-varying dimension first
        type_name = GGML_TYPES.get(kind, f"type {kind}")
        per_block, block_bytes = _BLOCKS.get(type_name, (0, 0))
        nbytes = math.prod(shape) // per_block * block_bytes if per_block else 0  # 0: a type not known here
        tensors[name] = TensorInfo(type_name, shape, nbytes)
        ends[name] = offset + nbytes
    return tensors, -(-pos // alignment) * alignment, ends


# -- metadata -> mlx-lm config ------------------------------------------------------------------

# The architectures this loader maps, and whether llama.cpp's converter permuted their q/k rows for
# GGML's interleaved rotation (then mlx-lm runs them with rope_traditional=True; qwen's are NEOX).
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}
MODULES = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3}  # mlx-lm's model file of each


def _value(meta: dict, key: str, default: Any = KeyError) -> Any:
    if key not in meta:
        if default is KeyError:
            raise GGUFError(f"required metadata {key!r} is missing")
        return default
    v = meta[key]
    return v.item() if isinstance(v, mx.array) and v.ndim == 0 else v


def model_config(meta: dict, tensors: dict[str, TensorInfo]) -> dict:
    """The config dict mlx-lm's ``ModelArgs`` of the file's architecture takes."""
    arch = _value(meta, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if _value(meta, f"{arch}.expert_count", 0):
        raise GGUFError(f"{arch} with experts (mixture of experts) is not supported")

    def get(key, default=KeyError):
        return _value(meta, f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFError(f"{arch}.rope.dimension_count={rope_dims} rotates part of a head ({head_dim}): not supported")
    vocab = get("vocab_size", None) or len(_value(meta, "tokenizer.ggml.tokens"))
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 1_000_000.0 if arch.startswith("qwen") else 10_000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if (context := get("context_length", None)) is not None:
        config["max_position_embeddings"] = int(context)
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise GGUFError(f"{arch}.rope.scaling.type={scaling!r} is not supported (none and linear are)")
    if arch != "qwen3":  # qwen3's ModelArgs has no such field: its rope is always NEOX
        config["rope_traditional"] = ARCHITECTURES[arch]
    return config


# GGUF tensor names -> mlx-lm parameter paths (llama.cpp's llama/qwen2/qwen3 naming)
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# the parts of one tensor as mx.load names them: its weight (packed when quantized), the
# quantization's scales and biases, and a layer's own bias (qwen2's attention)
_PARTS = ("weight", "scales", "biases", "bias")


def mlx_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, part = name.rpartition(".")
    if part not in _PARTS:
        raise GGUFError(f"tensor {name!r} is not one this loader handles")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{part}"
    pieces = base.split(".")
    if len(pieces) == 3 and pieces[0] == "blk" and pieces[1].isdigit() and pieces[2] in _BLOCK:
        return f"model.layers.{pieces[1]}.{_BLOCK[pieces[2]]}.{part}"
    raise GGUFError(f"tensor {name!r} is not one this loader handles")


def build_model(config: dict, weights: dict[str, mx.array]) -> nn.Module:
    """The mlx-lm model of ``config`` with ``weights`` (mlx-lm names) loaded strictly; the layers whose
    weights arrived quantized become QuantizedLinear/QuantizedEmbedding with their own bits."""
    arch = MODULES[config["model_type"]]
    model = arch.Model(arch.ModelArgs.from_dict(config))

    def quantized(path: str, module: nn.Module):
        if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, class_predicate=quantized)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:  # a missing, extra or misshapen tensor for this architecture
        raise GGUFError(f"its tensors do not fit mlx-lm's {config['model_type']} model: {exc}") from None
    mx.eval(model.parameters())
    return model


# -- tokenizer ----------------------------------------------------------------------------------

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    """The pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre`` (llama-vocab.cpp's regexes):
    a wrong one would tokenize silently differently, so an unknown name is refused."""
    from tokenizers import Regex, pre_tokenizers as pt

    def split(regex: str):
        return pt.Sequence([pt.Split(Regex(regex), behavior="isolated"), pt.ByteLevel(add_prefix_space=False,
                                                                                        use_regex=False)])

    if pre in ("default", "gpt2", "gpt-2"):
        return pt.ByteLevel(add_prefix_space=False)
    if pre == "smollm":  # every digit alone, then GPT-2's split
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)])
    if pre in ("llama3", "llama-v3", "llama-bpe"):
        return split(_LLAMA3_SPLIT)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return split(_QWEN2_SPLIT)
    raise GGUFError(f"tokenizer.ggml.pre={pre!r} is not supported (gpt2, smollm, llama-bpe and qwen2 are)")


_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)


def build_tokenizer(meta: dict, context_length: int | None):
    """mlx-lm's ``TokenizerWrapper`` for the file's byte-level BPE vocabulary: a ``tokenizers``
    tokenizer and a tokenizer_config.json written to a scratch directory and read back by mlx-lm's
    own loader, so its choices (streaming detokenizer, tool parser, thinking markers) are the ones a
    model directory gets."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _value(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model={kind!r} is not supported: only byte-level BPE ('gpt2') "
                        f"vocabularies are (SentencePiece 'llama' ones are not)")
    tokens = list(_value(meta, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _value(meta, "tokenizer.ggml.merges")]
    types = _value(meta, "tokenizer.ggml.token_type", None)
    types = types.tolist() if types is not None else [1] * len(tokens)
    pre = _value(meta, "tokenizer.ggml.pre", "default")
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama3", "llama-v3", "llama-bpe")))
    if pre in ("qwen2", "deepseek-r1-qwen"):  # as their tokenizer.json: text NFC-normalized first
        from tokenizers import normalizers

        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, k in zip(tokens, types) if k == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = _value(meta, f"tokenizer.ggml.{key}_token_id", None)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    if eos is None:
        raise GGUFError("required metadata 'tokenizer.ggml.eos_token_id' is missing")
    if _value(meta, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    named = {bos, eos, token("padding"), token("unknown")}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "pad_token": token("padding"), "unk_token": token("unknown"),
        "additional_special_tokens": [t for t in special if t not in named],
        "clean_up_tokenization_spaces": False,
        "chat_template": _value(meta, "tokenizer.chat_template", None),
    }
    if context_length:
        config["model_max_length"] = context_length
    # end-of-turn and end-of-message tokens end generation too (llama 3's <|eot_id|>, ...)
    eos_ids = sorted({vocab[eos]} | {int(_value(meta, f"tokenizer.ggml.{k}_token_id")) for k in ("eot", "eom")
                                     if f"tokenizer.ggml.{k}_token_id" in meta})
    with tempfile.TemporaryDirectory(prefix="mlxq-gguf-tokenizer-") as scratch:
        tok.save(str(Path(scratch) / "tokenizer.json"))
        (Path(scratch) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        return load_tokenizer(Path(scratch), eos_token_ids=eos_ids)


# -- the whole file -----------------------------------------------------------------------------

@dataclass
class GGUFInfo:
    """What was in the file, for the log: tensor types, bytes on disk, which arrived as float16."""
    architecture: str
    type_counts: Counter
    file_bytes: int
    widened: Counter  # GGML types MLX read as float16 (not kept in their blocks): tensor counts
    widened_disk_bytes: int  # their bytes in the file
    widened_mem_bytes: int  # their bytes as float16

    def types(self) -> str:
        return _counts(self.type_counts)

    def widened_types(self) -> str:
        return _counts(self.widened)


def _counts(types: Counter) -> str:
    return ", ".join(f"{t} x {n}" for t, n in types.most_common())


def load_gguf(path: str | Path) -> tuple[nn.Module, Any, dict, GGUFInfo]:
    """(model, TokenizerWrapper, config, info) of a GGUF file; :class:`GGUFError` when it cannot be used."""
    path = Path(path)
    tensors = read_header(path)
    type_counts = Counter(t.type for t in tensors.values())
    unreadable = Counter(t.type for t in tensors.values() if t.type not in MLX_READS)
    if unreadable:
        name, info = next((n, t) for n, t in tensors.items() if t.type not in MLX_READS)
        raise GGUFError(f"tensor {name!r} is {info.type}, a type MLX does not read (it reads F32, F16, BF16, "
                        f"Q4_0, Q4_1, Q8_0, Q2_K, Q4_K, Q6_K); unreadable here: {_counts(unreadable)}")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise GGUFError(f"MLX could not read it ({exc}): corrupt?") from None
    for name in tensors:
        if name not in arrays:
            raise GGUFError(f"MLX read no tensor {name!r} ({tensors[name].type}) from it: corrupt?")
    config = model_config(meta, tensors)
    widened = Counter()
    widened_disk = widened_mem = 0
    for name, info in tensors.items():
        if info.type not in NATIVE_TYPES and f"{name.removesuffix('.weight')}.scales" not in arrays:
            widened[info.type] += 1
            widened_disk += info.nbytes
            widened_mem += arrays[name].nbytes
    weights = {mlx_name(name): a for name, a in arrays.items()}
    model = build_model(config, weights)
    tokenizer = build_tokenizer(meta, config.get("max_position_embeddings"))
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    return model, tokenizer, config, GGUFInfo(
        architecture=config["model_type"], type_counts=type_counts, file_bytes=path.stat().st_size,
        widened=widened, widened_disk_bytes=widened_disk, widened_mem_bytes=widened_mem,
    )
