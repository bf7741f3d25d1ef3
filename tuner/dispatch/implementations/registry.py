"""The implementations ``tuner.attention`` chooses among, by name."""

from __future__ import annotations

from tuner.dispatch.implementations.base import Implementation

__all__ = ["get_implementation", "implementations", "register_implementation"]

_IMPLEMENTATIONS: dict[str, Implementation] = {}


def register_implementation(impl: Implementation) -> Implementation:
    if not impl.name or not impl.forward:
        raise ValueError(f"an implementation needs a name and a forward template, but "
                         f"{type(impl).__name__} has name={impl.name!r}, "
                         f"forward={impl.forward!r}")
    if impl.name in _IMPLEMENTATIONS:
        raise ValueError(f"an implementation named {impl.name!r} is already registered")
    _IMPLEMENTATIONS[impl.name] = impl
    return impl


def unregister_implementation(name: str) -> None:
    """Forget ``name`` (a test's own implementation, once the test is done)."""
    _IMPLEMENTATIONS.pop(name, None)


def implementations() -> list[Implementation]:
    return list(_IMPLEMENTATIONS.values())


def get_implementation(name: str) -> Implementation:
    try:
        return _IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown implementation {name!r}; known: "
                         f"{sorted(_IMPLEMENTATIONS)}") from None
