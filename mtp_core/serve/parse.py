"""Raw request bytes -> a request model of protocol.py; every problem is one APIError(400) that names the field.

pydantic reports a union field's failure once per member ("str", "list[int]", ...): the message names the
field as the client wrote it and says what the field accepts, not which member failed last.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from mtp_core.serve.protocol import APIError

_TYPE_WORDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
               "string_type": "a string", "list_type": "a list", "dict_type": "an object",
               "model_type": "an object", "literal_error": "one of the allowed values",
               "finite_number": "a finite number"}


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _is_tag(p: Any) -> bool:
    return isinstance(p, str) and (p in _UNION_TAGS or "[" in p or "-" in p)


def _where(loc: tuple) -> str:
    out = ""
    for p in loc:
        if _is_tag(p):
            continue
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Raw JSON bytes -> the request model; every problem is one APIError(400) naming the field."""
    return validate_body(parse_json(raw), model)


def parse_json(raw: bytes) -> dict:
    """Raw bytes -> a JSON object; APIError(400) if they are not one."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)} at position "
                            f"{getattr(e, 'pos', '?')}); send a JSON object", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply; send a flat JSON object",
                       code="invalid_json") from None
    except ValueError as e:             # NaN / Infinity, an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON ({str(e).splitlines()[0][:120]}); send a JSON "
                            "object", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got a JSON {type(data).__name__}",
                       code="invalid_json")
    return data


def validate_body(data: dict, model: type[BaseModel]) -> Any:
    """A JSON object -> the request model; APIError(400) naming the first field that is wrong."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, _first_error(e), param=_where(first["loc"]) or None,
                       code=_CODES.get(first["type"])) from None


_CODES = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter", **{
    k: "invalid_type" for k in ("int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type",
                                "model_type", "int_from_float", "union_tag_invalid")}}


def _first_error(e: ValidationError) -> str:
    # prefer the most specific error of a field (a union reports one error per member)
    errs = e.errors()
    err = errs[0]
    where = _where(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unrecognized request argument: {where}; remove it"
    if kind == "missing":
        return f"missing required argument: {where}"
    if kind == "too_short":
        return f"{where} must not be empty"
    got = err.get("input")
    got_s = json.dumps(got, default=str)[:60]
    if any(_is_tag(p) for p in err["loc"]):          # a union field: say what the field accepts
        last = [p for p in err["loc"] if not _is_tag(p)][-1]
        expected = {"prompt": "a string or a list of token ids", "stop": "a string or a list of strings",
                    "content": "a string or a list of {type: text, text} parts",
                    "tool_choice": "a string or an object", "logit_bias": "a map of token id to number"}
        return f"{where} must be {expected.get(str(last), 'of another type')}, got {got_s}"
    if kind in _TYPE_WORDS:
        return f"{where} must be {_TYPE_WORDS[kind]}, got {got_s}"
    return f"{where}: {err['msg']}"
