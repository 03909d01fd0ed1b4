"""OpenAI's embeddings request and response, without HTTP: the gateway's room (``gateway/embeddings.py``)
and the Batch API's ``/v1/embeddings`` lines (``bulk.py``, which runs without the gateway extra) share them."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..shared import codec
from ..shared.schemas import MAX_EMBED_DIMENSIONS, Result

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request (``pooling``: mlxq's, "last" or "mean"; default the worker's rule)."""

    model_config = ConfigDict(extra="forbid")
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    model: Optional[StrictStr] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = Field(None, ge=1, le=MAX_EMBED_DIMENSIONS)
    user: Optional[StrictStr] = None  # OpenAI's end-user id: accepted, unused
    pooling: Optional[Literal["last", "mean"]] = None

    def count(self) -> int:
        one = isinstance(self.input, str) or (self.input and isinstance(self.input[0], int))
        return 1 if one else len(self.input)


def embeddings_body(encoding_format: str, model: str, results: list[Result]) -> dict:
    """OpenAI's response: one embedding per input, in order, and the prompt tokens they took."""
    data = [{"object": "embedding", "index": i,
             "embedding": r.embedding if encoding_format == "base64" else codec.unpack_vector(r.embedding)}
            for i, r in enumerate(results)]
    tokens = sum(r.stats.prompt_tokens for r in results)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
