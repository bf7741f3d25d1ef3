"""Autotuned FlashAttention: the one public import surface of the project."""

from __future__ import annotations

__all__: list[str] = []
