"""``/docs``: the API reference as plain HTML, built from the app's own OpenAPI schema.

FastAPI's default ``/docs`` page loads Swagger UI from a CDN, so it is blank on a machine
without internet access, where a service like this one often runs. This page needs no script
or asset from anywhere; Swagger UI stays at ``/docs/swagger`` for those who can load it.
"""

from __future__ import annotations

from html import escape
from typing import Any

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)

_METHODS = ("get", "post", "put", "patch", "delete")


@router.get("/docs", response_class=HTMLResponse)
def reference(request: Request) -> HTMLResponse:
    schema = request.app.openapi()
    return HTMLResponse(reference_html(schema))


@router.get("/docs/swagger", response_class=HTMLResponse)
def swagger(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=request.app.openapi_url,
                               title=f"{request.app.title} (Swagger UI)")


def reference_html(schema: dict[str, Any]) -> str:
    """Every operation of ``schema``: method, path, summary, description, parameters."""
    info = schema.get("info", {})
    rows = []
    for path, item in schema.get("paths", {}).items():
        for method in _METHODS:
            op = item.get(method)
            if op is None:
                continue
            params = "".join(
                f"<li><code>{escape(p.get('name', ''))}</code> ({escape(p.get('in', ''))}"
                f"{', required' if p.get('required') else ''})"
                f"{': ' + escape(p['description']) if p.get('description') else ''}</li>"
                for p in op.get("parameters", []))
            body = " (JSON body)" if "requestBody" in op else ""
            rows.append(
                f"<h3><code>{method.upper()} {escape(path)}</code>{body}</h3>"
                f"<p>{escape(op.get('summary', ''))}</p>"
                f"<pre>{escape(op.get('description', ''))}</pre>"
                + (f"<ul>{params}</ul>" if params else ""))
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>{escape(info.get('title', 'API'))} reference</title></head><body>"
            f"<h1>{escape(info.get('title', 'API'))} {escape(str(info.get('version', '')))}</h1>"
            f"<p>{escape(info.get('description', ''))} The schema: "
            "<a href='/openapi.json'>/openapi.json</a>; Swagger UI (loads from a CDN): "
            "<a href='/docs/swagger'>/docs/swagger</a>.</p>"
            + "".join(rows) + "</body></html>")
