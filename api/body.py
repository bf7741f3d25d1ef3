"""JSON request bodies read and validated by the route itself, after its dependencies.

A body parameter is read and parsed by FastAPI before the dependencies that check the token or
the rate run: a refused request would cost its body's parsing (issue 19). Routes that need a
check first take the ``Request``, read the body with ``parsed_body`` once the checks passed,
and document it in OpenAPI with ``request_body``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import HTTPException, Request
from pydantic import BaseModel, ValidationError

__all__ = ["parsed_body", "request_body", "validated_body"]

M = TypeVar("M", bound=BaseModel)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` written in place: a hand-documented request body cannot
    add entries to the OpenAPI components that ``$ref`` would point at."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)  # type: ignore[no-any-return]


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a JSON body validated as ``model``."""
    return {"required": True, "content": {"application/json": {
        "schema": _inlined(model.model_json_schema())}}}


async def parsed_body(request: Request, model: type[M]) -> M:
    """The body validated as ``model``; a 422 naming the first field at fault otherwise."""
    return validated_body(await request.body(), model)


def validated_body(body: bytes, model: type[M]) -> M:
    """``body`` (read already) validated as ``model``; a 422 as ``parsed_body`` answers."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = errors[0]
        where = ".".join(str(p) for p in err["loc"])
        raise HTTPException(422, detail=f"{where + ': ' if where else ''}{err['msg']}"
                                        + (f" (and {len(errors) - 1} more)" if len(errors) > 1
                                           else "")) from None
