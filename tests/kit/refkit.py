"""Expected output computed in the same run: the greedy answers of this run's tiny model, each from the
worker's engine with that sequence alone (``faultkit.reference_tokens``; their agreement with mlx-lm's
own decoding is tested in tests/engine/test_engine.py).

The tiny model is trained at test time (from ``$MLXQ_TEST_MODEL_SEED``) and its weights follow the
BLAS build and CPU kernels of the machine, so no test hard-codes generated text or token ids. A test
compares with these references, and a test that needs a property of the output (a first token that
starts with a space, a non-empty answer) picks a prompt that has it here, from this run's answers."""

from __future__ import annotations

from typing import Callable, Sequence

import pytest

from faultkit import reference_tokens
from mlxq.shared.schemas import SamplingParams
from mlxq.worker.engine.sampler import repetition_penalty


def reference_processors(params: SamplingParams) -> list:
    """mlx-lm's logits processors for these params: the repetition penalty the engine applies to its
    rows in one batched op, as mlx-lm's own decoding applies it (a reference to compare with)."""
    from mlx_lm.sample_utils import make_logits_processors

    if repetition_penalty(params) is None:
        return []
    return make_logits_processors(repetition_penalty=params.repetition_penalty)


def greedy(loaded, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    """The greedy token ids for a text prompt (cut at the first EOS) and their text, which is
    what a job returns: exactly ``decode(ids)``."""
    ids = reference_tokens(loaded, loaded.tokenizer.encode(prompt), max_tokens)
    return ids, loaded.tokenizer.decode(ids)


def pick_prompt(loaded, prompts: Sequence[str], max_tokens: int,
                want: Callable[[list[int], str], bool], what: str) -> tuple[str, list[int], str]:
    """(prompt, ids, text): the first of ``prompts`` whose greedy answer satisfies ``want(ids, text)``."""
    for prompt in prompts:
        ids, text = greedy(loaded, prompt, max_tokens)
        if want(ids, text):
            return prompt, ids, text
    pytest.fail(f"none of {list(prompts)} has a greedy answer of up to {max_tokens} tokens with {what}")
