"""Client JSON in, server JSON out: the one parser every door uses for what a client sends, and the one encoder
for what the server sends.

`parse_object` refuses, with a `WireError` whose message never quotes the input: text that is not JSON, values
nested deeper than `MAX_DEPTH` (a 2 KB event nested 1000 levels deep must not reach the interpreter's recursion
limit), the non-standard constants `NaN`/`Infinity` and numbers that overflow to infinity (`1e400`), and anything
but an object at the top. `dumps` is strict JSON (`allow_nan=False`): what the server sends parses anywhere.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 32          # client events nest 4-5 levels; 32 leaves room and keeps the walk cheap


class WireError(ValueError):
    """The text is not a usable JSON object; the message says why, without quoting it."""


def _refuse_constant(name: str) -> Any:
    raise WireError(f"{name} is not a JSON number: numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise WireError(f"a number of {len(text)} characters overflows to infinity: numbers must be finite")
    return value


def _depth_ok(value: object) -> bool:
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_DEPTH:
            return False
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return True


def parse_value(text: str | bytes) -> Any:
    """Any JSON value, under the rules above (the top level need not be an object)."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except WireError:
        raise
    except RecursionError:
        raise WireError(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise WireError(f"not JSON: {_first_line(e)}") from None
    if not _depth_ok(value):
        raise WireError(f"nested deeper than {MAX_DEPTH} levels")
    return value


def parse_object(text: str | bytes) -> dict[str, Any]:
    """One client event or request body: a JSON object."""
    value = parse_value(text)
    if not isinstance(value, dict):
        raise WireError("an event must be a JSON object")
    return value


def dumps(value: object) -> str:
    """Compact, strict JSON: a non-finite number here is a server bug and raises ValueError."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:120] if str(e) else type(e).__name__
