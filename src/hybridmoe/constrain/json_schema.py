"""JSON schemas for constrained decoding: which schemas hybridmoe can enforce (`check_schema`, else a
`SchemaError` that names the keyword), and the lookups the incremental parser (json_machine.JsonMachine)
makes in one: $ref, allOf, the kinds a subschema allows, its string patterns and formats.

The schema subset (what `check_schema` lets through):
type (one or a list), properties, required, additionalProperties, items, prefixItems, minItems, maxItems,
enum, const, anyOf / oneOf (alternatives that begin alike, two objects say, are followed side by side until
the bytes tell them apart; oneOf is taken as anyOf), allOf (merged), $ref into the document (#/$defs/..., #/definitions/...), minLength,
maxLength, pattern (with the `regex` module's partial matching), minimum, maximum, exclusiveMinimum,
exclusiveMaximum, and the formats date, time, date-time and uuid. Annotations (title, description, default,
examples, other formats, ...) are accepted and not enforced.

A schema that no value can satisfy is refused too (`_check_satisfiable`, per subschema): the parser would
dead-end in it, or write an enum value its other keywords refuse.
"""
from __future__ import annotations

import decimal
import functools
import json
import math

MAX_DEPTH = 64        # objects and arrays open at once (each check copies the stack)
MAX_NUMBER = 40       # bytes of one number the parser writes
KIND_START = {"object": b"{", "array": b"[", "string": b'"', "number": b"-0123456789",
              "integer": b"-0123456789", "boolean": b"tf", "null": b"n"}
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
                         "readOnly", "writeOnly", "deprecated", "$defs", "definitions", "contentMediaType",
                         "contentEncoding"})
ENFORCED = frozenset({"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
                      "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength",
                      "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern"})
# the string formats enforced (as llama.cpp's JSON grammars do); others are annotations
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?"
_ZONE = r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {"date": f"^{_DATE}$", "time": f"^{_TIME}{_ZONE}?$", "date-time": f"^{_DATE}T{_TIME}{_ZONE}$",
           "uuid": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"}
# hybridmoe's own, for tool calls (tool_call_schema): properties in their order; the schema of "arguments"
# chosen by the value of "name"
ORDERED, BY_NAME = "x-hybridmoe-ordered", "x-hybridmoe-arguments-by-name"


class SchemaError(ValueError):
    """A schema this module cannot enforce, or one that is not a valid JSON schema."""


# ---------------------------------------------------------------------------------------------- schemas

class _Schemas:
    """Lookups in one schema document: $ref, allOf, the kinds a subschema allows."""

    def __init__(self, root):
        self.root = root
        self.literals: dict = {}        # json_machine's cache of enum / const texts

    def resolve(self, s):
        for _ in range(64):
            if not (isinstance(s, dict) and "$ref" in s):
                break
            s = self._ref(s["$ref"])
        else:
            raise SchemaError("'$ref' goes round in a loop")
        if isinstance(s, dict) and "allOf" in s:
            s = self._merge(s)
        return s

    def _ref(self, ref):
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"'$ref' {ref!r}: only references into the schema itself ('#/$defs/name') are supported")
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaError(f"'$ref' {ref!r} points at nothing in the schema")
        return node

    def _merge(self, s):
        parts = s["allOf"]
        if not isinstance(parts, list) or not parts:
            raise SchemaError("'allOf' must be a non-empty array of schemas")
        out = {k: v for k, v in s.items() if k != "allOf"}
        _check_object_keys(out)
        for p in parts:
            p = self.resolve(p)
            if p is True:
                continue
            if not isinstance(p, dict):
                raise SchemaError("'allOf' holds false or a value that is not a schema")
            _check_object_keys(p)
            for k, v in p.items():
                if k == "properties":
                    out["properties"] = {**out.get("properties", {}), **v}
                elif k == "required":
                    out["required"] = list(dict.fromkeys(out.get("required", []) + v))
                elif k in out and out[k] != v and k not in ANNOTATIONS:
                    raise SchemaError(f"'allOf' parts disagree on {k!r}; merge them into one schema")
                else:
                    out[k] = v
        return out

    def kinds(self, s) -> set[str]:
        """The JSON kinds a (resolved) subschema can start."""
        if s is True or s == {}:
            return set(KIND_START)
        if s is False:
            return set()
        if "const" in s or "enum" in s:
            vals = [s["const"]] if "const" in s else s["enum"]
            return {_kind_of(v) for v in vals}
        alts = s.get("anyOf", s.get("oneOf"))
        if alts is not None:
            return set().union(*(self.kinds(self.resolve(a)) for a in alts))
        t = s.get("type")
        if t is not None:
            return set(t) if isinstance(t, list) else {t}
        if {"properties", "required", "additionalProperties"} & set(s):
            return {"object"}
        if {"items", "prefixItems", "minItems", "maxItems"} & set(s):
            return {"array"}
        if {"minLength", "maxLength"} & set(s):
            return {"string"}
        if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(s):
            return {"number"}
        return set(KIND_START)


@functools.lru_cache(maxsize=256)
def _regex(pattern: str):
    """A string schema's pattern, compiled with the `regex` module, whose partial matches tell whether a
    prefix can still become a match (Python's syntax, which agrees with ECMA-262's for common patterns)."""
    import regex
    out, i, cls = [], 0, False                 # ECMA-262's $ ends the string only; Python's also before a "\n"
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        cls = (cls and ch != "]") or ch == "["
        out.append("\\Z" if ch == "$" and not cls else ch)
        i += 1
    try:
        return regex.compile("".join(out))
    except (regex.error, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise SchemaError(f"'pattern' {pattern!r} is not a regular expression: {e}") from None


def _patterns(s: dict) -> tuple:
    """The compiled patterns a string of schema s must match: its pattern, and its format if enforced."""
    pats = [s["pattern"]] if isinstance(s.get("pattern"), str) else []
    if s.get("format") in FORMATS:
        pats.append(FORMATS[s["format"]])
    return tuple(_regex(p) for p in pats)


def _check_object_keys(s: dict):
    if not isinstance(s.get("properties", {}), dict):
        raise SchemaError("'properties' must be an object of property schemas")
    req = s.get("required", [])
    if not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        raise SchemaError("'required' must be an array of property names")


def _kind_of(v) -> str:
    return ("null" if v is None else "boolean" if isinstance(v, bool) else "number" if isinstance(v, (int, float))
            else "string" if isinstance(v, str) else "array" if isinstance(v, list) else "object")

def _number_text(s: dict, integer: bool) -> str | None:
    """The shortest text (no exponent: bounded numbers have none) of at most MAX_NUMBER bytes that a number
    between s's bounds can be written as, or None when the bounds leave none."""
    inf = float("inf")
    lo, lo_x = s.get("minimum", -inf), s.get("exclusiveMinimum", -inf)
    hi, hi_x = s.get("maximum", inf), s.get("exclusiveMaximum", inf)

    def fits(t: str) -> bool:
        v = float(t)
        return len(t) <= MAX_NUMBER and lo <= v <= hi and v > lo_x and v < hi_x
    if fits("0"):
        return "0"
    low, high = max(lo, lo_x), min(hi, hi_x)
    with decimal.localcontext() as ctx:
        ctx.prec = 2000                              # exact for any float or JSON integer that fits a number
        for k in range(1 if integer else MAX_NUMBER):
            for side, edge in ((1, low), (-1, high)):
                if not (math.isfinite(edge) and side * edge >= 0 and -side * (high if side > 0 else low) < 0):
                    continue                         # that side of 0 is empty, or its edge is not a number
                c = decimal.Decimal(edge).scaleb(k).to_integral_value(
                    decimal.ROUND_CEILING if side > 0 else decimal.ROUND_FLOOR).scaleb(-k)
                for cand in (c, c + side * decimal.Decimal(1).scaleb(-k)):
                    t = format(cand, "f")
                    if len(t) <= MAX_NUMBER and fits(t):
                        return t
    return None


def _mismatch(v, s: dict) -> str | None:
    """Why the value v of an enum or const breaks the other keywords of s (the parser writes such values as
    they are), or None. Checks v itself, not what it holds."""
    t = s.get("type")
    kinds = set(t) if isinstance(t, list) else {t} if t is not None else None
    kind = _kind_of(v)
    is_int = kind == "number" and (isinstance(v, int) or float(v).is_integer())
    if kinds is not None and kind not in kinds and not (is_int and "integer" in kinds):
        return f"is {'an integer' if is_int else 'a ' + kind}, not {' or '.join(sorted(kinds))}"
    if kind == "string":
        if len(v) < s.get("minLength", 0) or len(v) > s.get("maxLength", len(v)):
            return "has a length outside minLength..maxLength"
        for p in _patterns(s):
            if not p.search(v):
                return "does not match the pattern or format"
    elif kind == "number":
        inf = float("inf")
        if not (s.get("minimum", -inf) <= v <= s.get("maximum", inf) and v > s.get("exclusiveMinimum", -inf)
                and v < s.get("exclusiveMaximum", inf)):
            return "is outside the bounds"
    elif kind == "array":
        if len(v) < s.get("minItems", 0) or len(v) > s.get("maxItems", len(v)):
            return "has a length outside minItems..maxItems"
    elif kind == "object":
        missing = [r for r in s.get("required", []) if r not in v]
        if missing:
            return f"lacks the required {missing[0]!r}"
        if s.get("additionalProperties", True) is False and not set(v) <= set(s.get("properties", {})):
            return "has properties that additionalProperties: false forbids"
    return None


def _check_satisfiable(S: _Schemas, s: dict, where: str):
    """Refuse a subschema whose keywords contradict each other for a kind it allows (minLength > maxLength,
    bounds that leave no number, minItems > maxItems, an enum value of another type, ...): the parser would
    either dead-end or write a value the schema does not accept."""
    def show(v):
        text = json.dumps(v, ensure_ascii=False)
        return text if len(text) <= 60 else text[:57] + "..."
    if "const" in s or "enum" in s:
        values = [s["const"]] if "const" in s else s["enum"]
        if "const" in s and "enum" in s and show(s["const"]) not in {show(e) for e in s["enum"]}:
            raise SchemaError(f"{where}: 'const' {show(s['const'])} is not one of its 'enum'; nothing can match")
        bad = [(v, why) for v in values for why in [_mismatch(v, s)] if why]
        if bad:
            key = "const" if "const" in s else "enum"
            v, why = bad[0]
            raise SchemaError(f"{where}: the {key} value {show(v)} {why}, so the schema refuses it; "
                              f"{'nothing can match' if len(bad) == len(values) else 'remove it'}")
        return
    kinds = S.kinds(s)
    if "string" in kinds and s.get("minLength", 0) > s.get("maxLength", float("inf")):
        raise SchemaError(f"{where}: minLength {s['minLength']} is more than maxLength {s['maxLength']}: no string "
                          f"can match")
    if "array" in kinds:
        lo, hi = s.get("minItems", 0), s.get("maxItems", float("inf"))
        if s.get("items", True) is False:
            hi = min(hi, len(s.get("prefixItems", [])))
        if lo > hi:
            raise SchemaError(f"{where}: minItems {lo} is more than the {hi} items that maxItems (or items: false "
                              f"after prefixItems) allows: no array can match")
    if kinds & {"number", "integer"} and {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(s):
        integer = "number" not in kinds
        if _number_text(s, integer) is None:
            bounds = ", ".join(f"{k} {s[k]}" for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
                               if k in s)
            inf = float("inf")
            lo, hi = max(s.get("minimum", -inf), s.get("exclusiveMinimum", -inf)), \
                min(s.get("maximum", inf), s.get("exclusiveMaximum", inf))
            why = "" if lo > hi or (lo == hi and ("exclusiveMinimum" in s or "exclusiveMaximum" in s)) else \
                f" that can be written without an exponent in at most {MAX_NUMBER} characters"
            raise SchemaError(f"{where}: the bounds ({bounds}) leave no {'integer' if integer else 'number'}{why}")
    if "object" in kinds:
        props = s.get("properties", {})
        for r in s.get("required", []):
            sub = props.get(r, s.get("additionalProperties", True))
            if S.resolve(sub) is False:
                raise SchemaError(f"{where} requires {r!r}, which its schema forbids (false): no object can match")


def check_schema(schema) -> None:
    """Raise SchemaError unless every part of `schema` is in the supported subset (module docstring)."""
    S = _Schemas(schema)
    seen: set[int] = set()

    def walk(s, where, depth=0):
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema is nested more than {MAX_DEPTH} levels deep")
        s = S.resolve(s)
        if isinstance(s, bool):
            return
        if not isinstance(s, dict):
            raise SchemaError(f"{where} is {type(s).__name__}, not a schema (an object or true/false)")
        if id(s) in seen:
            return
        seen.add(id(s))
        bad = sorted(k for k in s if k not in ENFORCED and k not in ANNOTATIONS and k not in (ORDERED, BY_NAME))
        if bad:
            raise SchemaError(f"{where} uses {', '.join(repr(b) for b in bad)}, which hybridmoe cannot enforce; "
                              f"supported: {', '.join(sorted(ENFORCED))}")
        t = s.get("type")
        if t == []:
            raise SchemaError(f"{where}: 'type' is an empty list")
        for name in (t if isinstance(t, list) else [t] if t is not None else []):
            if not isinstance(name, str) or name not in KIND_START:
                raise SchemaError(f"{where}: unknown type {name!r}")
        if "enum" in s and not (isinstance(s["enum"], list) and s["enum"]):
            raise SchemaError(f"{where}: 'enum' must be a non-empty array")
        for k in ("properties", "$defs", "definitions"):
            v = s.get(k, {})
            if not isinstance(v, dict):
                raise SchemaError(f"{where}.{k} must be an object")
        for name, sub in s.get("properties", {}).items():
            walk(sub, f"{where}.properties.{name}", depth + 1)
        req = s.get("required", [])
        if not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
            raise SchemaError(f"{where}.required must be an array of property names")
        ap = s.get("additionalProperties", True)
        if ap is False and not set(req) <= set(s.get("properties", {})):
            raise SchemaError(f"{where} requires properties it does not allow (additionalProperties is false)")
        if not isinstance(ap, bool):
            walk(ap, f"{where}.additionalProperties", depth + 1)
        for name, sub in s.get(BY_NAME, {}).items():        # each its own document
            try:
                check_schema(sub)
            except SchemaError as e:
                raise SchemaError(f"the parameters of {name!r}: {e}") from None
        if "items" in s and not isinstance(s["items"], bool):
            walk(s["items"], f"{where}.items", depth + 1)
        if not isinstance(s.get("prefixItems", []), list):
            raise SchemaError(f"{where}.prefixItems must be an array of schemas")
        for i, sub in enumerate(s.get("prefixItems", [])):
            walk(sub, f"{where}.prefixItems[{i}]", depth + 1)
        if "pattern" in s and not isinstance(s["pattern"], str):
            raise SchemaError(f"{where}.pattern must be a string")
        _patterns(s)                                   # compiles them: a bad regular expression is refused here
        for k in ("minItems", "maxItems", "minLength", "maxLength"):
            if k in s and not (isinstance(s[k], int) and not isinstance(s[k], bool) and s[k] >= 0):
                raise SchemaError(f"{where}.{k} must be a non-negative integer")
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if k in s and not (isinstance(s[k], (int, float)) and not isinstance(s[k], bool)):
                raise SchemaError(f"{where}.{k} must be a number")
        for key in ("anyOf", "oneOf"):
            if key not in s:
                continue
            alts = s[key]
            if not isinstance(alts, list) or not alts:
                raise SchemaError(f"{where}.{key} must be a non-empty array of schemas")
            for i, a in enumerate(alts):
                walk(a, f"{where}.{key}[{i}]", depth + 1)
        _check_satisfiable(S, s, where)
    try:
        walk(schema, "schema")
    except RecursionError:              # allOf / $ref chains resolve recursively
        raise SchemaError("the schema is nested too deeply") from None
