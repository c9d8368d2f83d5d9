"""`hybridmoe run`: generate text from a prompt and print llama.cpp-style timings; `-cnv` chats turn by turn."""
from __future__ import annotations

import sys

from .common import (
    add_model_args,
    add_runtime_args,
    add_template_args,
    add_warmup_arg,
    freeze_heap,
    runtime_kwargs,
    template_setup,
    text_or_file,
    warmup,
)


def setup_arg_parser(p):
    add_model_args(p)
    p.add_argument("-p", "--prompt", default=None,
                   help="prompt text (default: 'Once upon a time'; with -cnv, the first user message)")
    p.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", type=int, default=None,
                   help="tokens to generate (default 64; with -cnv, per turn, default -1: until the model ends "
                        "its turn or the context is full)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="llama.cpp's (1.0: off)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back on (-1: all)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (-1: random)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-display-prompt", dest="display_prompt", action="store_false",
                   help="print only the generated text (by default the prompt comes first, on lines of its own)")
    p.add_argument("-cnv", "--conversation", action="store_true",
                   help="chat turn by turn: read user messages from standard input (/exit or end of input "
                        "ends); each turn runs only its new tokens, the earlier ones stay in the KV cache")
    p.add_argument("-sys", "--system-prompt", default=None, help="with -cnv, the system message")
    p.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="the reply is JSON this schema accepts (a JSON schema as text; '{}': any JSON), as "
                        "llama-cli's; --json-schema-file reads it from a file")
    p.add_argument("--json-schema-file", default=None, metavar="FILE")
    p.add_argument("--grammar", default=None, metavar="GBNF",
                   help="the reply is text this GBNF grammar accepts (llama.cpp's); --grammar-file reads it from a "
                        "file")
    p.add_argument("--grammar-file", default=None, metavar="FILE")
    add_runtime_args(p)
    add_template_args(p)
    add_warmup_arg(p)


def main(args) -> int:
    import hybridmoe

    from ..errors import HybridMoeError
    from ..generate import Timings
    prompt, _ = text_or_file(args.prompt, args.file, "-p")
    schema, gram = json_schema(args), grammar(args)
    model = hybridmoe.load(args.model, **runtime_kwargs(args))
    template_kwargs = template_setup(model, args)
    if gram is not None:
        from ..constrain.grammar import GrammarError
        from ..errors import HybridMoeError
        try:
            gram = gram.bind(model.tokenizer)                             # its <token> references
        except GrammarError as e:
            raise HybridMoeError(f"--grammar: {e}") from None
    gen = dict(json_schema=schema, grammar=gram, **penalties(args))      # what each generation is given
    print(f"loaded {model.cfg.name} ({model.cfg.arch}, {model.file.nbytes / 2**30:.2f} GiB) "
          f"in {model.load_seconds:.2f} s", file=sys.stderr)
    warmup(model, args)
    freeze_heap()
    if args.conversation:
        converse(model, args, prompt, sys.stdin, sys.stdout, sys.stderr, template_kwargs, gen)
        return 0
    prompt = "Once upon a time" if prompt is None else prompt
    timings = Timings()
    if not args.chat and args.display_prompt:
        echo_prompt(prompt, sys.stdout)
    n = 64 if args.n_predict is None else args.n_predict
    last = ""
    try:
        for piece in model.generate(prompt, n, args.temp, args.seed, args.top_k, args.top_p, args.min_p,
                                    chat=args.chat, timings=timings, template_kwargs=template_kwargs, **gen):
            sys.stdout.write(piece)
            sys.stdout.flush()
            last = piece or last
    except (HybridMoeError, KeyboardInterrupt):
        if last and not last.endswith("\n"):             # the error (NaN, a full context) starts on its own line
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    sys.stdout.write("\n")
    print(timings.format(), file=sys.stderr)
    if args.profile:
        from ..perf.calibrate import load_cached
        rates = load_cached(args.threads)
        print(model.stats.format(rates.ram_read_bw if rates else None), file=sys.stderr)
        if rates is None:
            print("  (run `hybridmoe calibrate` once to compare the CPU experts with this machine's read bandwidth)",
                  file=sys.stderr)
    return 0


def echo_prompt(prompt: str, out):
    """The prompt before the generated text, which starts on the next line (so that the two are never read
    as one); on a terminal the prompt is dimmed (unless NO_COLOR is set), as llama-cli colours it."""
    import os
    dim = out.isatty() and not os.environ.get("NO_COLOR")
    out.write(f"\x1b[2m{prompt}\x1b[0m" if dim else prompt)
    if not prompt.endswith("\n"):
        out.write("\n")
    out.flush()


def json_schema(args):
    """-j / --json-schema-file: the schema (checked), or None."""
    import json

    from ..constrain.json_schema import SchemaError, check_schema
    from ..errors import HybridMoeError
    text, where = text_or_file(args.json_schema, args.json_schema_file, "--json-schema")
    if text is None:
        return None
    try:
        schema = json.loads(text)
        check_schema(schema)
    except ValueError as e:                           # bad JSON, or a SchemaError
        what = "is not JSON" if not isinstance(e, SchemaError) else "cannot be enforced"
        raise HybridMoeError(f"{where} {what}: {e}") from None
    return schema


def grammar(args):
    """--grammar / --grammar-file: the parsed grammar, or None (refused beside a JSON schema)."""
    from ..constrain.grammar import Grammar, GrammarError
    from ..errors import HybridMoeError
    text, where = text_or_file(args.grammar, args.grammar_file, "--grammar")
    if text is None:
        return None
    if args.json_schema or args.json_schema_file:
        raise HybridMoeError("give a grammar or a JSON schema, not both")
    try:
        return Grammar(text)
    except GrammarError as e:
        raise HybridMoeError(f"{where}: {e}") from None


def penalties(args) -> dict:
    return dict(repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)


def converse(model, args, first: str | None, inp, out, err, template_kwargs: dict, gen: dict):
    """llama-cli's conversation mode: each turn sends the whole conversation through the chat template (with
    template_kwargs); the prompt cache runs only what is new since the last turn. `gen`: Model.generate's
    options (constraints, penalties). One line of speeds per turn on stderr."""
    from ..generate import Timings
    tok, n_ctx = model.tokenizer, model.options.ctx_size
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    n_predict = -1 if args.n_predict is None else args.n_predict
    tty = inp.isatty()
    while True:
        if first is not None:
            line, first = first, None
        else:
            if tty:
                out.write("\n> ")
                out.flush()
            try:
                line = inp.readline()
            except KeyboardInterrupt:
                break
            if not line or line.strip() in ("/exit", "/quit"):
                break
            line = line.rstrip("\n")
            if not line.strip():
                continue
        messages.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(messages, **template_kwargs))
        if len(ids) >= n_ctx:
            print(f"the conversation has {len(ids)} tokens and the context is {n_ctx}: it is full; "
                  f"start again with a larger -c", file=err)
            break
        t, reply = Timings(), []
        try:
            for piece in model.generate(ids, n_predict, args.temp, args.seed, args.top_k, args.top_p, args.min_p,
                                        timings=t, **gen):
                out.write(piece)
                out.flush()
                reply.append(piece)
        except KeyboardInterrupt:                       # Ctrl-C ends the reply, not the conversation
            out.write(" [interrupted]")
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        pp = t.n_prompt / t.t_prompt if t.t_prompt > 0 else 0.0
        tg = t.n_eval / t.t_eval if t.t_eval > 0 else 0.0
        print(f"[prompt: {t.n_prompt} new tokens, {t.n_cached} from the cache, {pp:.1f} t/s; "
              f"reply: {t.n_generated} tokens, {tg:.1f} t/s]", file=err, flush=True)
