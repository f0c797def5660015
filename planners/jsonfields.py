"""Typed readers for JSON fields: each error names the field path and what is wrong."""

from __future__ import annotations

import json
from typing import Any


def load_object(data: str | bytes, what: str) -> dict[str, Any]:
    try:
        d = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(d).__name__}")
    return d


def field_value(d: dict[str, Any], key: str, where: str = "layout") -> Any:
    if key not in d:
        raise ValueError(f"{where}.{key} is missing")
    return d[key]


def as_int(x: Any, where: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{where} must be an integer, got {x!r}")
    return x


def as_float(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise ValueError(f"{where} must be a number, got {x!r}")
    return float(x)


def int_field(d: dict[str, Any], key: str, where: str = "layout") -> int:
    return as_int(field_value(d, key, where), f"{where}.{key}")


def as_list(x: Any, where: str) -> list[Any]:
    if not isinstance(x, list):
        raise ValueError(f"{where} must be a list, got {type(x).__name__}")
    return x


def list_field(d: dict[str, Any], key: str, where: str = "layout") -> list[Any]:
    return as_list(field_value(d, key, where), f"{where}.{key}")


def int_pair(x: Any, where: str) -> tuple[int, int]:
    items = as_list(x, where)
    if len(items) != 2:
        raise ValueError(f"{where} entries must be [a, b] pairs, got {x!r}")
    return as_int(items[0], where), as_int(items[1], where)
