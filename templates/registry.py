"""Name -> template. A new template registers itself here with one line."""

from __future__ import annotations

from typing import TypeVar

from templates.base import Template

T = TypeVar("T", bound=Template)

_TEMPLATES: dict[str, Template] = {}


def register(template: T) -> T:
    if template.name in _TEMPLATES:
        raise ValueError(f"a template named {template.name!r} is already registered")
    _TEMPLATES[template.name] = template
    return template


def get_template(name: str) -> Template:
    try:
        return _TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown template {name!r}; known: {sorted(_TEMPLATES)}") from None


def all_templates() -> list[Template]:
    return [_TEMPLATES[n] for n in sorted(_TEMPLATES)]
