"""Chat templates: render a model's Jinja `tokenizer.chat_template` safely.

Templates come from model files, which are untrusted, so they run in Jinja's
immutable sandbox (no attribute tricks, no mutating calls) with a budget: every
string or list a template builds (operators, calls, filters, `~`, macro bodies,
the output) is counted, none may exceed _MAX_TEXT and all of them together
_MAX_PRODUCED, numbers that size a result (widths, counts) are bounded, and a
render that runs past RENDER_SECONDS is stopped. A template over its budget is a
clear error. The environment mirrors what Hugging Face `apply_chat_template`
offers so existing templates render the same.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..errors import HybridMoeError, one_line

# Qwen-style ChatML without tools; used for synthetic models and as the fallback.
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "{{- raise_exception('unsupported role: ' + message['role']|string) }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') "
    "+ '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_MAX_SEQ = 1 << 20      # longest string/list a template may build with '*'; largest width, count or indent
_MAX_POW_BITS = 1 << 16  # biggest integer a template may build with '**'
_MAX_TEXT = 1 << 24      # longest string or list a template may build (and its output)
_MAX_PRODUCED = 1 << 28  # characters (or items) all the strings and lists of one render may add up to
RENDER_SECONDS = 5.0     # time budget of one render
_WIDE_FORMAT = re.compile(r"\d{7,}")     # a width or precision of a million or more in a format string
_budget = threading.local()


class _OutOfTime(BaseException):
    """Raised into the rendering thread when its time budget is spent (a BaseException, so that no
    `except Exception` in Jinja or the template's calls swallows it)."""


def _spend(value):
    """Count a string or list the template built against this render's budget; returns it."""
    if isinstance(value, (str, list, tuple)):
        n = len(value)
        if n > _MAX_TEXT:
            raise SecurityError(f"the template built a value of {n} characters or items (limit {_MAX_TEXT})")
        left = getattr(_budget, "left", None)
        if left is not None:
            _budget.left = left - n
            if _budget.left < 0:
                raise SecurityError(f"the template built more than {_MAX_PRODUCED} characters in all")
    return value


def _check_numbers(args, kwargs):
    """Numbers that size a result (a width, a count, an indent) must stay below _MAX_SEQ."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _MAX_SEQ:
            raise SecurityError(f"argument {v} is too large (limit {_MAX_SEQ})")


def _check_format(fmt):
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise SecurityError("a format string asks for a width or precision of a million or more")


def _check_replace(s, old, new, count=-1):
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        hits = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        if len(s) + hits * (len(new) - len(old)) > _MAX_TEXT:
            raise SecurityError(f"replace would build a string longer than {_MAX_TEXT} characters")


def _bounded_join(seq, sep=""):
    """''.join with the result's size counted before it is built (items may come from a lazy generator)."""
    parts, total = [], 0
    for x in seq:
        x = x if isinstance(x, str) else str(x)
        total += len(x) + len(sep)
        if total > _MAX_TEXT:
            raise SecurityError(f"the template built a string of more than {_MAX_TEXT} characters")
        parts.append(x)
    return _spend(sep.join(parts))


def _bounded_markup_join(seq):
    from markupsafe import Markup
    return Markup(_bounded_join(seq))


def _bounded_filter(name, fn):
    """A filter whose size arguments are bounded and whose result is counted."""
    offset = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(fn)
    def run(*args, **kwargs):
        value, rest = (args[offset] if len(args) > offset else None), args[offset + 1:]
        _check_numbers(rest, kwargs)
        if name == "format":
            _check_format(value)
            _check_numbers(rest, {})
        elif name == "replace" and len(rest) >= 2:
            _check_replace(value, *rest[:3])
        elif name == "join" and not kwargs.get("attribute") and len(rest) < 2 and set(kwargs) <= {"d"}:
            sep = rest[0] if rest else kwargs.get("d", "")   # sized first: the items may come from a generator
            return _bounded_join(value, sep if isinstance(sep, str) else str(sep))
        return _spend(fn(*args, **kwargs))
    return run


class _Raised(jinja2.TemplateError):
    """raise_exception() called by the template itself."""


def _raise_exception(message):
    raise _Raised(str(message))


def _strftime_now(fmt):
    return datetime.now().strftime(str(fmt))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes '<' '>' '&' "'"; HF's does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """HF's {% generation %} ... {% endgeneration %} (marks assistant text); rendered as-is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    # '*' and '**' can ask for gigabytes in one expression ('x' * 10**12); '+' and '%' build strings too.
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    concat = staticmethod(_bounded_join)          # macro and block bodies

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, k in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(k, int) \
                        and len(seq) * k > _MAX_SEQ:
                    raise SecurityError("'*' would build a sequence that is too long")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) \
                and right > 0 and abs(left) > 1 and abs(left).bit_length() * right > _MAX_POW_BITS:
            raise SecurityError("'**' would build a number that is too large")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > _MAX_TEXT:
            raise SecurityError(f"'+' would build a value longer than {_MAX_TEXT}")
        elif operator == "%":
            _check_format(left)
            _check_numbers(right if isinstance(right, tuple) else (right,), {})     # '%*s' % (width, s)
        return _spend(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        method = getattr(__obj, "__wrapped__", __obj)    # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):                    # str methods: center, ljust, format, replace, join...
            _check_numbers(args, kwargs)              # (not a macro's: its numbers may be the conversation's)
            name = getattr(method, "__name__", "")
            if name in ("format", "format_map"):
                _check_format(owner)
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, *args[:3])
            elif name == "join" and args:
                return _bounded_join(args[0], owner)
        return _spend(super().call(__context, __obj, *args, **kwargs))


def _make_env() -> jinja2.Environment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters.update({name: _bounded_filter(name, fn) for name, fn in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()


def _one_line(e: BaseException) -> str:
    return one_line(str(e), 200) or type(e).__name__


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        tmpl = _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise HybridMoeError(f"chat template has a syntax error (line {e.lineno}): "
                             f"{_one_line(e)}") from e
    except Exception as e:
        raise HybridMoeError(f"chat template cannot be compiled: {_one_line(e)}") from e
    # '~' compiles to the runtime's str_join / markup_join, looked up in the template's module globals
    module = tmpl.root_render_func.__globals__
    module["str_join"], module["markup_join"] = _bounded_join, _bounded_markup_join
    return tmpl


class _Deadline:
    """Raises _OutOfTime in this thread once `seconds` have passed (Python's asynchronous exception, so a
    loop in template code stops at its next bytecode); leaving the block cancels it, and clears one that
    fired but was not raised yet."""

    def __init__(self, seconds: float):
        self.tid, self.lock, self.active = threading.get_ident(), threading.Lock(), True
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def _fire(self):
        with self.lock:
            if self.active:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.tid), ctypes.py_object(_OutOfTime))

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        with self.lock:
            self.active = False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.tid), ctypes.c_void_p(None))
        return False


def _render(tmpl: jinja2.Template, variables: dict) -> str:
    """The template's output, within the budget (counted per chunk as it comes)."""
    out, total = [], 0
    for chunk in tmpl.generate(**variables):
        total += len(chunk)
        if total > _MAX_TEXT:
            raise SecurityError(f"the output is longer than {_MAX_TEXT} characters")
        out.append(chunk)
    return "".join(out)


def render_chat_template(template: str | None, messages: list[dict],
                         add_generation_prompt: bool = True, **kwargs) -> str:
    """Render `messages` with `template` (ChatML when the model has none).

    Extra keyword arguments (bos_token, eos_token, tools, enable_thinking, ...)
    become template variables, as with HF `apply_chat_template`.
    """
    if not template:
        template = CHATML_TEMPLATE
    if not isinstance(template, str):
        raise HybridMoeError("chat template must be a string")
    tmpl = _compile(template)
    _budget.left = _MAX_PRODUCED
    try:
        try:
            with _Deadline(RENDER_SECONDS):
                return _render(tmpl, dict(kwargs, messages=messages, add_generation_prompt=add_generation_prompt))
        except _OutOfTime:
            raise HybridMoeError(f"chat template ran past its time budget ({RENDER_SECONDS:g} s) and was "
                                 "stopped") from None
    except _Raised as e:
        raise HybridMoeError(f"chat template refused the conversation: {_one_line(e)}") from e
    except SecurityError as e:
        raise HybridMoeError(f"chat template blocked by the sandbox (unsafe operation): "
                             f"{_one_line(e)}") from e
    except jinja2.TemplateError as e:
        raise HybridMoeError(f"chat template error: {_one_line(e)}") from e
    except HybridMoeError:
        raise
    except (MemoryError, RecursionError) as e:
        raise HybridMoeError(f"chat template exceeded its budget: {type(e).__name__}") from None
    except Exception as e:  # template code can fail in any Python way ('a' + 1, ...)
        raise HybridMoeError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from e
    finally:
        _budget.left = None
