"""Options shared by the commands that load a model (run, bench, sweep-bench, serve)."""
from __future__ import annotations

import argparse
import gc


def add_model_args(p: argparse.ArgumentParser, model_default: str | None = None):
    """-m; its default is the built-in trained model (synth:tiny in a checkout that has none)."""
    if model_default is None:
        from ..models.builtin import default_model
        model_default = default_model()
    p.add_argument("-m", "--model", default=model_default,
                   help="GGUF file (first part of a split model), builtin (the small trained model shipped in "
                        "the package) or synth:PRESET (default: %(default)s)")


def add_runtime_args(p: argparse.ArgumentParser):
    from ..placement.core import add_placement_args
    add_placement_args(p)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-op", "--offload-policy", default=None,
                   help="OP,0|1[,OP,0|1...]: force GPU offload of host-weight ops on (1) or off (0); OP is "
                        "mul_mat, mul_mat_id, moe_up_gate, all (or ik_llama.cpp's 26, 27, 29, -1)")
    p.add_argument("-ooae", "--offload-only-active-experts", default="auto", choices=["auto", "0", "1"],
                   help="when offloading, upload only the experts the router picked")
    p.add_argument("-fmoe", "--fused-moe", type=int, nargs="?", const=1, default=1, choices=[0, 1],
                   help="fused up/gate expert op (default 1; a bare -fmoe, as ik_llama.cpp takes it, means 1)")
    p.add_argument("--profile", action="store_true", help="print time per op and device, copies, uploads "
                   "(a captured decode or prompt step is timed as a whole; --no-graphs times every op)")
    p.add_argument("--no-graphs", action="store_true", help="run decode (and prompts with every weight on one GPU) eagerly, "
                   "without the static steps and CUDA graphs")
    add_check_tensors_arg(p)


def add_check_tensors_arg(p: argparse.ArgumentParser):
    p.add_argument("--check-tensors", action="store_true",
                   help="scan every tensor for NaN and inf at load, as llama.cpp's flag (slow: reads the whole file; "
                        "without it only norms, biases and routers are checked)")


def add_warmup_arg(p: argparse.ArgumentParser):
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up run at load (a two-token prompt and one decode step, which compiles "
                        "kernels and captures graphs before the first prompt, as llama.cpp does)")


def freeze_heap():
    """Every object alive now (the loaded model's, its tokenizer's) out of the garbage collector's full passes,
    each of which walked them all: 0.17 s a pass with the 30B shape's objects, 16 of them in a 64-request server
    run on an H100 (benchmarks/serve_steps.py), each a stall of every stream. A process that drops a model to free
    it calls gc.unfreeze() first (frozen objects are never collected)."""
    gc.collect()
    gc.freeze()


def warmup(model, args, prompt_sizes: bool = False):
    """llama.cpp's warm-up, said before its pause (the first run compiles the CPU kernels: seconds) and timed
    after it; prompt_sizes: a prompt of each size whose GPU kernels compile apart too (a server's)."""
    if not args.no_warmup:
        import sys
        prompt_sizes = prompt_sizes and any(d.kind == "cuda" and not d.fake for d in model.devices.values())
        what = "a two-token prompt, one decode step" + (" and a prompt of each GPU kernel size" if prompt_sizes else "")
        print(f"warming up ({what}: compiles kernels, captures graphs; --no-warmup skips it) ...", file=sys.stderr,
              flush=True)
        print(f"warmed up in {model.warmup(prompt_sizes):.2f} s", file=sys.stderr)
        g, k = model.decode_share()
        if g:
            print(f"decode share: the GPU runs {g} of each CPU layer's {k} experts, read over the bus "
                  f"(HYBRIDMOE_DECODE_SHARE=0: the CPU runs all)", file=sys.stderr)


def runtime_kwargs(args) -> dict:
    """The load() options these arguments stand for."""
    import dataclasses

    from ..placement.core import options_from_args
    kw = dataclasses.asdict(options_from_args(args))
    kw.update(threads=args.threads, offload_policy=args.offload_policy,
              offload_only_active_experts=args.offload_only_active_experts, fused_moe=bool(args.fused_moe),
              profile=args.profile, graphs=not args.no_graphs, check_tensors=getattr(args, "check_tensors", False))
    return kw


def add_template_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("chat template (llama-server's flags)")
    g.add_argument("--chat-template", default=None, metavar="JINJA",
                   help="use this chat template instead of the model's: Jinja text, or 'chatml'")
    g.add_argument("--chat-template-file", default=None, metavar="FILE", help="the chat template from a file")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="template variables for every chat, e.g. '{\"reasoning_effort\": \"high\"}' (a request's "
                        "own chat_template_kwargs win)")
    g.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="-1: think as the template does; 0: no thinking (enable_thinking false)")


def template_setup(model, args) -> dict:
    """Applies --chat-template(-file) to the model (checked by rendering one message) and returns the default
    template variables (--chat-template-kwargs, --reasoning-budget)."""
    import json

    from ..errors import HybridMoeError
    from ..text.chat import CHATML_TEMPLATE
    text, _ = text_or_file(args.chat_template, args.chat_template_file, "--chat-template")
    if text is not None:
        model.tokenizer.chat_template = CHATML_TEMPLATE if text.strip().lower() == "chatml" else text
        model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])   # a bad template fails here
    kwargs = {}
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except ValueError as e:
            raise HybridMoeError(f"--chat-template-kwargs is not JSON: {e}") from None
        if not isinstance(kwargs, dict) or {"messages", "add_generation_prompt"} & set(kwargs):
            raise HybridMoeError("--chat-template-kwargs must be a JSON object of template variables (not "
                                 "messages or add_generation_prompt)")
    if args.reasoning_budget not in (-1, 0):
        raise HybridMoeError(f"--reasoning-budget {args.reasoning_budget}: only -1 (no limit) and 0 (no thinking) "
                             f"are supported, as in llama-server")
    if args.reasoning_budget == 0:
        kwargs.setdefault("enable_thinking", False)
    return kwargs


def text_or_file(text: str | None, path: str | None, flag: str) -> tuple[str | None, str]:
    """A flag's text, or its file twin's contents (which win); and what to call it in an error."""
    from ..errors import HybridMoeError
    if not path:
        return text, flag
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    except OSError as e:
        raise HybridMoeError(f"cannot read {path}: {e.strerror}") from None
