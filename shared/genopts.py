"""Checks shared by the bulk paths (``mlxq batch``, ``Client.map``) and the CLI: the options every item
gets, validated once, and a validation error said in one line for a person."""

from __future__ import annotations

from typing import Any


def error_text(exc: BaseException) -> str:
    """A ValueError in one line for a person: a pydantic ValidationError as ``field: why`` (without the
    input echoed back, which may be a whole prompt), any other error as it is."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for err in exc.errors(include_url=False, include_input=False)[:5]:
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or str(exc)


def check_defaults(defaults: dict[str, Any]) -> None:
    """Validate the options a bulk run gives every item (``mlxq batch``'s flags, ``Client.map``'s
    keyword arguments: constraint, tools, penalties, sampling) once, before anything is queued:
    ValueError saying that nothing was queued.  A pydantic class given as ``response_format`` is the
    client's to convert; it is checked with the first item."""
    from .schemas import GenerateRequest

    fields = {k: v for k, v in defaults.items() if not isinstance(v, type)}
    if not any(k in fields for k in ("prompt", "messages", "prompt_tokens")):
        fields["messages"] = [{"role": "user", "content": "-"}]  # a stand-in input: only the options are checked
    fields["model"] = fields.get("model") or "-"
    try:
        GenerateRequest.model_validate(fields)
    except ValueError as exc:
        raise ValueError(f"the options for every item are invalid (nothing was queued): {error_text(exc)}") from None
