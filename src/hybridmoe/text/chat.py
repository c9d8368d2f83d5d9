"""Chat templates: render a model's Jinja `tokenizer.chat_template` safely.

Templates come from model files, which are untrusted, so they run in Jinja's
immutable sandbox (no attribute tricks, no mutating calls) with a few extra
limits on memory-hungry operators. The environment mirrors what Hugging Face
`apply_chat_template` offers so existing templates render the same.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..errors import HybridMoeError

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

_MAX_SEQ = 1 << 20      # longest string/list a template may build with '*'
_MAX_POW_BITS = 1 << 16  # biggest integer a template may build with '**'


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
    # '*' and '**' can ask for gigabytes in one expression ('x' * 10**12).
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, k in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(k, int) \
                        and len(seq) * k > _MAX_SEQ:
                    raise SecurityError("'*' would build a sequence that is too long")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) \
                and right > 0 and abs(left) > 1 and abs(left).bit_length() * right > _MAX_POW_BITS:
            raise SecurityError("'**' would build a number that is too large")
        return super().call_binop(context, operator, left, right)


def _make_env() -> jinja2.Environment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise HybridMoeError(f"chat template has a syntax error (line {e.lineno}): "
                             f"{_one_line(e)}") from e
    except Exception as e:
        raise HybridMoeError(f"chat template cannot be compiled: {_one_line(e)}") from e


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
    try:
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           **kwargs)
    except _Raised as e:
        raise HybridMoeError(f"chat template refused the conversation: {_one_line(e)}") from e
    except SecurityError as e:
        raise HybridMoeError(f"chat template blocked by the sandbox (unsafe operation): "
                             f"{_one_line(e)}") from e
    except jinja2.TemplateError as e:
        raise HybridMoeError(f"chat template error: {_one_line(e)}") from e
    except Exception as e:  # template code can fail in any Python way ('a' + 1, ...)
        raise HybridMoeError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from e
