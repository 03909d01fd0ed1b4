"""``mlxq make-model DIR``: build a small, briefly trained mlx-lm model with no network.

The directory is an ordinary Hugging Face style checkpoint that ``mlx_lm.load``
reads through its normal path: ``config.json`` (``model_type: llama``),
``model.safetensors`` (fp32), and a byte-level BPE tokenizer trained here with
the ``tokenizers`` library (``tokenizer.json``, ``tokenizer_config.json`` with a
Jinja chat template, ``special_tokens_map.json``).  The template is Hermes / Qwen2.5 style: it renders
``tools`` and tool calls with ``<tool_call>`` markers, so mlx-lm infers its ``json_tools`` parser,
and ``<think>``/``</think>`` are special tokens, so mlx-lm infers thinking markers; the four markers
are single tokens (the model is not trained on them: tests reach them by ``logit_bias``).  The model is trained for a
few hundred steps of next-token prediction on the generated corpus of
:mod:`mlxq.devkit.corpus`, so greedy output is short English-like sentences that
end with ``<|end|>`` (the EOS token); they follow the prompt's topic only weakly.  A build is
deterministic for a given seed on a given machine; the trained weights (and so the generated text)
also follow the BLAS build and the CPU kernels it picks, so they differ between machines.

Presets (parameters counted with tied embeddings):

* ``tiny`` (default, tests and demo): vocab 1024, hidden 64, 2 layers, 4 heads /
  2 KV heads (GQA), intermediate 192: **164,160** parameters, 600 AdamW steps
  of 8x64 tokens (about 30 s on two busy cores; eval loss 6.94 -> ~1.45 nats).
* ``bench`` (benchmarks): vocab 8192, hidden 512, 8 layers, 8 heads / 4 KV
  heads, intermediate 1184: **25,043,456** parameters, 4 steps (throughput
  runs need no quality; greedy output may hit EOS early).

Training runs with one OpenBLAS thread (see :func:`_one_blas_thread`).
A stamp file (:data:`STAMP`) records the preset, seed, steps and a hash of this
code; :func:`ensure_model` rebuilds only when it does not match.  The test suite
trains its model from ``$MLXQ_TEST_MODEL_SEED`` (:func:`seed_from_env`, default 0)
into a directory named after that seed (:func:`seeded_dir`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ..worker import blas, progress

from . import corpus

logger = logging.getLogger(__name__)

STAMP = "mlxq_build.json"
SEED_ENV = "MLXQ_TEST_MODEL_SEED"
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

PAD, BOS, END = "<|pad|>", "<|bos|>", "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Hermes / Qwen2.5 style markers, each one token: mlx-lm infers its "json_tools" tool parser from the
# template (``<tool_call>`` and ``tool_call.name``) and its thinking markers from the vocabulary
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
MARKER_TOKENS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)
SPECIAL_TOKENS = (PAD, BOS, END, *ROLE_TOKENS, *MARKER_TOKENS)  # ids 0..9
# Part of the cached model's directory name (seeded_dir): a change of tokenizer or template gets a
# new directory, so a cache built by older code is never read as this one
FORMAT_VERSION = 2

TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _jinja_str(text: str) -> str:
    """``text`` as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "\\'") + "'"


# Roles as role tokens.  With tools, a system block lists them (the first system message's text, then
# each tool's JSON on a line); an assistant turn's tool calls follow its text, one <tool_call> block
# each; a tool result is a user turn holding <tool_response>...</tool_response>.  format_chat renders
# the same without Jinja.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(start=0) %}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% set ns.start = 1 %}"
    "{% endif %}"
    "{{ " + _jinja_str(TOOLS_INTRO) + " }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ " + _jinja_str(TOOLS_OUTRO + END + "\n") + " }}"
    "{% endif %}"
    "{% for message in messages[ns.start:] %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|end|>\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{% for tool_call in message.get('tool_calls') or [] %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def format_chat(messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
    """What :data:`CHAT_TEMPLATE` renders, without Jinja (used to build training text)."""
    text, rest = BOS, list(messages)
    if tools:
        text += "<|system|>\n"
        if rest and rest[0]["role"] == "system":
            text += rest.pop(0)["content"] + "\n\n"
        text += TOOLS_INTRO + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        text += TOOLS_OUTRO + END + "\n"
    text += "".join(_format_message(m) for m in rest)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def _format_message(m: dict) -> str:
    if m["role"] == "tool":
        return "<|user|>\n<tool_response>\n%s\n</tool_response>%s\n" % (m["content"], END)
    calls = "".join(_format_call(c.get("function", c)) for c in m.get("tool_calls") or [])
    return "<|%s|>\n%s%s%s\n" % (m["role"], m.get("content") or "", calls, END)


def _format_call(fn: dict) -> str:
    args = fn["arguments"]
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return '\n%s\n{"name": "%s", "arguments": %s}\n%s' % (TOOL_CALL_START, fn["name"], args, TOOL_CALL_END)


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    train_steps: int
    batch_size: int = 4
    seq_len: int = 128
    learning_rate: float = 1e-2
    max_position_embeddings: int = 4096
    lexicon_lines: int = 0  # extra tokenizer-only text to fill a large vocabulary


PRESETS = {
    "tiny": Preset(1024, 64, 2, 192, 4, 2, train_steps=500),
    "bench": Preset(8192, 512, 8, 1184, 8, 4, train_steps=4, learning_rate=1e-3, lexicon_lines=40000),
}
_EVAL_DOCS = 200


def code_version() -> str:
    """A hash of the code and corpus that determine the built files."""
    h = hashlib.sha256()
    for path in (Path(__file__), Path(corpus.__file__)):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def read_stamp(out_dir) -> dict | None:
    """The build record of ``out_dir``, or None when it has none (or an unreadable one)."""
    try:
        return json.loads((Path(out_dir) / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(out_dir: Path, preset: str, train_steps: int, seed: int) -> bool:
    stamp = read_stamp(out_dir)
    return (
        stamp is not None
        and stamp.get("preset") == preset
        and stamp.get("code_version") == code_version()
        and stamp.get("train_steps") == train_steps
        and stamp.get("seed") == seed
        and all((out_dir / name).is_file() for name in FILES)
    )


def make_model(out_dir, preset: str = "tiny", *, train_steps: int | None = None, seed: int = 0) -> Path:
    """Build the ``preset`` model into ``out_dir`` (created if needed), replacing its
    model files; other files in ``out_dir`` are left alone.  Returns ``out_dir``."""
    out_dir = Path(out_dir)
    cfg = PRESETS[preset]
    steps = cfg.train_steps if train_steps is None else train_steps
    with _locked(out_dir):
        _build_and_install(out_dir, preset, steps, seed)
    return out_dir


def ensure_model(out_dir, preset: str = "tiny", *, seed: int = 0) -> Path:
    """``out_dir`` holding a complete ``preset`` model built by this code version
    (default steps, ``seed``), building it only when needed.  Concurrent callers
    wait for one build (a file lock) and never see half-written files."""
    out_dir = Path(out_dir)
    steps = PRESETS[preset].train_steps
    if _is_complete(out_dir, preset, steps, seed):
        return out_dir
    with _locked(out_dir):
        if not _is_complete(out_dir, preset, steps, seed):
            _build_and_install(out_dir, preset, steps, seed)
    return out_dir


def seed_from_env() -> int:
    """The seed the test suite's tiny model is trained from: ``$MLXQ_TEST_MODEL_SEED``
    (default 0).  Another seed gives other weights (and another tokenizer); the
    suite's verdict must not change with it.  A knob of a test or bench run, read here and not in
    ``Settings``: no producer, worker or gateway uses it (Settings only knows its name, so as not to
    report it as a misspelt setting)."""
    raw = os.environ.get(SEED_ENV, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"{SEED_ENV} must be an integer, got {raw!r}") from None


def seeded_dir(cache_dir, preset: str, seed: int) -> Path:
    """Where a cached ``preset`` model trained from ``seed`` lives: the seed and the
    :data:`FORMAT_VERSION` are part of the name, so a build from another seed, or with
    another tokenizer or chat template, is never picked up by mistake."""
    return Path(cache_dir) / f"{preset}-model-v{FORMAT_VERSION}-seed{seed}"


@contextlib.contextmanager
def _locked(out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".mlxq_build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_and_install(out_dir: Path, preset: str, steps: int, seed: int) -> None:
    blas.setup()  # the fast BLAS under MLX, as in the worker: before the build imports mlx
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))
    try:
        _build(tmp, preset, steps, seed)
        # The stamp goes first and comes back last: a reader that sees a valid
        # stamp sees complete files.
        (out_dir / STAMP).unlink(missing_ok=True)
        for name in FILES:
            os.replace(tmp / name, out_dir / name)
        os.replace(tmp / STAMP, out_dir / STAMP)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build(out: Path, preset: str, steps: int, seed: int) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    cfg = PRESETS[preset]
    t0, cpu0 = time.perf_counter(), time.process_time()
    n_docs = max(2000, 10 * steps)  # fewer repeats of a document than of a window
    docs = corpus.documents(seed, n_docs)
    eval_docs = corpus.documents(seed + 10_000, _EVAL_DOCS)

    tokenizer = _train_tokenizer(docs, cfg, seed)
    vocab_size = tokenizer.get_vocab_size()
    if vocab_size != cfg.vocab_size:
        logger.warning("tokenizer has %d tokens, preset asks for %d", vocab_size, cfg.vocab_size)
    bos_id, end_id, pad_id = (tokenizer.token_to_id(t) for t in (BOS, END, PAD))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": end_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    embed = model.model.embed_tokens
    embed.weight = mx.random.normal(embed.weight.shape) * config["initializer_range"]
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))

    train = _token_stream(tokenizer, docs)
    evals = _token_stream(tokenizer, eval_docs)
    with _one_blas_thread():
        loss_before, loss_after = _train(model, cfg, steps, seed, train, evals)

    mx.save_safetensors(
        str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    _write_json(out / "config.json", config)
    _save_tokenizer(out, tokenizer, cfg)
    info = {
        "preset": preset,
        "code_version": code_version(),
        "seed": seed,
        "train_steps": steps,
        "params": n_params,
        "vocab_size": vocab_size,
        "loss_before": round(loss_before, 4),
        "loss_after": round(loss_after, 4),
        "seconds": round(time.perf_counter() - t0, 2),
        "cpu_seconds": round(time.process_time() - cpu0, 2),
    }
    _write_json(out / STAMP, info)
    logger.debug(  # `mlxq make-model` prints the result; the training step logged its time
        "built %s model: %d params, vocab %d, eval loss %.3f -> %.3f after %d steps, %.1f s",
        preset, n_params, vocab_size, loss_before, loss_after, steps, info["seconds"],
    )
    return info


def _doc_texts(docs) -> list[str]:
    """Plain text of the documents (conversations as their message contents)."""
    return [d if isinstance(d, str) else "\n".join(m["content"] for m in d) for d in docs]


def _train_tokenizer(docs, cfg: Preset, seed: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _doc_texts(docs) + corpus.lexicon(seed, cfg.lexicon_lines)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _token_stream(tokenizer: Tokenizer, docs) -> tuple[np.ndarray, np.ndarray]:
    """All documents as one token stream, and the offsets where documents start.
    A chat is rendered as the chat template does (``<|bos|>`` first); plain text
    is ``text<|end|>`` with no ``<|bos|>``, like a raw prompt that mlx-lm encodes."""
    texts = [format_chat(d) if isinstance(d, list) else d + END for d in docs]
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    starts = np.cumsum([0] + [len(doc) for doc in ids[:-1]])
    return np.fromiter((t for doc in ids for t in doc), dtype=np.int32), starts


@contextlib.contextmanager
def _one_blas_thread():
    """Run with one OpenBLAS thread: for these small matmuls a second thread only
    spins and takes the core MLX's own thread needs (3-5x slower on 2 busy cores)."""
    loaded = ctypes.CDLL(None)  # the process's symbols: the OpenBLAS blas.setup() loaded, if any
    get = getattr(loaded, "openblas_get_num_threads", None)
    set_ = getattr(loaded, "openblas_set_num_threads", None)
    if get is None or set_ is None:
        yield
        return
    before = get()
    set_(1)
    try:
        yield
    finally:
        set_(before)


def _train(model, cfg: Preset, steps: int, seed: int, train, evals) -> tuple[float, float]:
    """AdamW with warmup and cosine decay on windows that begin at a document start
    (as prompts do); returns the eval loss before and after."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    rng = np.random.default_rng(seed)
    L = cfg.seq_len

    def batch(stream_starts, idx: np.ndarray):
        stream, starts = stream_starts
        windows = np.stack([stream[s : s + L + 1] for s in starts[idx]])
        return mx.array(windows[:, :-1]), mx.array(windows[:, 1:])

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    eval_x, eval_y = batch(evals, np.arange(16))
    n_train = int(np.searchsorted(train[1], len(train[0]) - L - 1))  # windows that fit

    def eval_loss() -> float:
        return loss_fn(model, eval_x, eval_y).item()

    loss_before = eval_loss()
    if steps <= 0:
        return loss_before, loss_before
    warmup = min(20, max(1, steps // 10))
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(cfg.learning_rate / warmup, cfg.learning_rate, warmup),
            optim.cosine_decay(cfg.learning_rate, max(1, steps - warmup), cfg.learning_rate * 0.1),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=0.01)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    with progress.step(logger, f"training the small model ({steps} steps)", total=steps, unit="step",
                       expect="once per machine; tiny takes ~20 s on 2 cores") as bar:
        for i in range(steps):
            x, y = batch(train, rng.integers(0, n_train, size=cfg.batch_size))
            loss, grads = loss_and_grad(model, x, y)
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            optimizer.update(model, grads)
            mx.eval(model.state, optimizer.state, loss)
            bar.update()
            if (i + 1) % 100 == 0 or i + 1 == steps:
                logger.debug("step %d/%d: train loss %.3f", i + 1, steps, loss.item())
    return loss_before, eval_loss()


def _save_tokenizer(out: Path, tokenizer: Tokenizer, cfg: Preset) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": END,
            "pad_token": PAD,
            "unk_token": None,
            "additional_special_tokens": [*ROLE_TOKENS, *MARKER_TOKENS],
            "added_tokens_decoder": added,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS,
            "eos_token": END,
            "pad_token": PAD,
            "additional_special_tokens": [*ROLE_TOKENS, *MARKER_TOKENS],
        },
    )


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxq make-model",
        description="Build a small, briefly trained mlx-lm model directory (no network).",
    )
    parser.add_argument("dir", type=Path, help="output directory (created if needed)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    before = read_stamp(args.dir)
    if args.force or args.steps is not None:
        make_model(args.dir, args.preset, train_steps=args.steps, seed=args.seed)
    else:
        ensure_model(args.dir, args.preset, seed=args.seed)
    info = read_stamp(args.dir) or {}
    print(
        "%s %s: preset %s, %s parameters, vocab %d, eval loss %.3f -> %.3f (log vocab %.3f) "
        "after %d training steps; build took %.1f s (%.1f s CPU)"
        % (
            "up to date" if info == before else "built", args.dir, info["preset"],
            format(info["params"], ","), info["vocab_size"], info["loss_before"], info["loss_after"],
            math.log(info["vocab_size"]), info["train_steps"], info["seconds"], info["cpu_seconds"],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
