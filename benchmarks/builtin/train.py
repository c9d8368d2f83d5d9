"""Train the built-in model (a small qwen3moe) on the corpus make_corpus.py wrote, within a time budget, and export it.

    python benchmarks/builtin/train.py --minutes 6 [--data .carry/builtin] [--out $OUT] [--preset default]

Everything is measured against --minutes, counted from the start of this script: training stops early enough to
leave --reserve seconds for the final evaluation and exports. The best weights so far (by held-out loss) are
exported as OUT/builtin.gguf (Q8_0 matrices, F32 norms and router) every --save-every seconds, atomically, so a
run killed by a time limit (SIGTERM: the loop stops and exports; SIGKILL: the last checkpoint stays) still
leaves a usable file. At the end: OUT/builtin.gguf, OUT/builtin-f16-0000{1,2}-of-00002.gguf (the F16 copy, in
two parts of < 16 MiB, for quality comparisons), OUT/train_meta.json (config, steps, tokens, losses,
perplexities) and OUT/samples.txt (text sampled from the torch model).

Runs on a CUDA GPU (bf16 autocast, fused AdamW, torch.compile when it works) or, slowly, on the CPU for a
dry run (--preset tiny --minutes 1).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import moe

PRESETS = {
    # ~12.7M parameters: Q8_0 ~13.5 MB. Every matrix row is 256 wide (n_embd, n_head*head_dim, n_ff_exp), so
    # every GGUF type, the 256-element K- and I-quants included, applies to every matrix. Context 4096, the
    # default -c of run and serve (as llama.cpp's), so they don't warn that it exceeds the training context.
    "default": dict(n_embd=256, n_layer=6, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=2,
                    n_ff_exp=256, n_ctx=4096),
    # the CPU dry run
    "tiny": dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_expert=4, n_expert_used=2,
                 n_ff_exp=64, n_ctx=128),
}
PROMPTS = ["The", "A function", "The module", "This method returns", "In Python,", "SQLite is",
           "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n"]


class Stop:
    flag = False
    reason = ""


def _on_signal(sig, frame):
    Stop.flag, Stop.reason = True, signal.Signals(sig).name


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def load_tokens(path: Path, device) -> torch.Tensor:
    a = np.fromfile(path, dtype=np.uint16).astype(np.int32)
    return torch.from_numpy(a).to(device)


def batch(data: torch.Tensor, B: int, T: int, gen: torch.Generator, device):
    starts = torch.randint(0, data.numel() - T - 1, (B,), generator=gen, device="cpu").to(device)
    idx = starts[:, None] + torch.arange(T + 1, device=device)[None, :]
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model, data: torch.Tensor, T: int, device, amp, max_tokens: int = 400_000) -> float:
    """Mean next-token loss (nats) over consecutive T-token windows of the held-out tokens."""
    was = model.training
    model.eval()
    n = min(data.numel() - 1, max_tokens) // T
    if n == 0:
        T = data.numel() - 1
        n = 1
    tot, cnt = 0.0, 0
    for i in range(0, n, 16):
        rows = torch.stack([data[j * T:j * T + T + 1] for j in range(i, min(n, i + 16))]).long()
        with amp():
            logits = model(rows[:, :-1])
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum").item()
        cnt += rows[:, 1:].numel()
    model.train(was)
    return tot / max(cnt, 1)


@torch.no_grad()
def sample(model, tok, prompt: str, n: int, device, amp, temperature=0.7, top_k=40, seed=0) -> str:
    was = model.training
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    stops = {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    out = []
    for _ in range(n):
        x = torch.tensor([ids[-model.c.n_ctx:]], device=device)
        with amp():
            logits = model(x)[0, -1].float().cpu()
        v, i = torch.topk(logits / temperature, top_k)
        t = int(i[torch.multinomial(torch.softmax(v, -1), 1, generator=g)])
        if t in stops:
            break
        ids.append(t)
        out.append(t)
    model.train(was)
    return tok.decode(out, skip_special_tokens=False)


def export_all(model_state, cfg, tok_json, out: Path, final: bool, extra_md, log_to=log, f16=True):
    """Q8_0 builtin.gguf (always), and at the end the F16 copy in two parts. CPU copies, atomic writes."""
    m = moe.TinyQwen3Moe(cfg)
    m.load_state_dict({k: v.detach().float().cpu() for k, v in model_state.items()})
    t = time.time()
    moe.export_gguf(m, tok_json, str(out / "builtin.gguf"), qtype="Q8_0", extra_md=extra_md)
    log_to(f"exported builtin.gguf ({(out / 'builtin.gguf').stat().st_size / 2**20:.2f} MiB, "
           f"{time.time() - t:.1f} s){' (final)' if final else ''}")
    if final and f16:
        t = time.time()
        paths = moe.export_gguf(m, tok_json, str(out / "builtin-f16.gguf"), qtype="F16", extra_md=extra_md, split=2)
        log_to(f"exported {', '.join(f'{Path(p).name} ({Path(p).stat().st_size / 2**20:.2f} MiB)' for p in paths)} "
               f"({time.time() - t:.1f} s)")


def main(argv=None) -> int:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="wall-clock budget of the whole script")
    ap.add_argument("--data", default=str(HERE.parents[1] / ".carry" / "builtin"))
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE.parents[1] / "out" / "builtin"))
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences a step (default: 65536 tokens on a GPU, 1024 on a CPU)")
    ap.add_argument("--dropout", type=float, default=None, help="residual dropout (default 0.1 on a GPU, 0 on a CPU)")
    ap.add_argument("--ctx", type=int, default=None, help="training context (default: the preset's)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200, help="steps")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--aux", type=float, default=0.01, help="load-balancing loss coefficient")
    ap.add_argument("--reserve", type=float, default=None, help="seconds kept for the end (default 35 GPU, 20 CPU)")
    ap.add_argument("--save-every", type=float, default=60.0, help="seconds between checkpoints of builtin.gguf")
    ap.add_argument("--eval-every", type=float, default=30.0, help="seconds between held-out evaluations")
    ap.add_argument("--compile", default="auto", choices=["auto", "0", "1"])
    ap.add_argument("--no-f16", action="store_true", help="skip the F16 copy at the end")
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    deadline = t_start + args.minutes * 60
    reserve = args.reserve if args.reserve is not None else (35.0 if cuda else 20.0)
    out, data_dir = Path(args.out), Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = str(data_dir / "tokenizer.json")
    meta = json.loads((data_dir / "meta.json").read_text())
    torch.manual_seed(args.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log("device:", torch.cuda.get_device_name(device), "torch", torch.__version__)
    else:
        torch.set_num_threads(os.cpu_count() or 1)
        log("device: cpu, torch", torch.__version__, "threads", torch.get_num_threads())

    p = dict(PRESETS[args.preset])
    if args.ctx:
        p["n_ctx"] = args.ctx
    cfg = moe.MoEConfig(n_vocab=meta["vocab"], dropout=args.dropout if args.dropout is not None else
                        (0.1 if cuda else 0.0), **p)
    T = cfg.n_ctx
    B = args.batch or max(1, (65536 if cuda else 1024) // T)
    model = moe.TinyQwen3Moe(cfg).to(device)
    log(f"model: {cfg} = {cfg.n_params() / 1e6:.2f}M parameters; batch {B} x {T} tokens")

    train = load_tokens(data_dir / "train.bin", device)
    held = load_tokens(data_dir / "heldout.bin", device)
    log(f"data: {train.numel() / 1e6:.2f}M train tokens, {held.numel() / 1e3:.1f}K held-out tokens")

    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {}))

    def amp():                              # bf16 on a GPU; a CPU without bf16 units is faster in float32
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def loss_fn(x, y):
        logits, aux = model(x, with_aux=True)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), aux

    step_fn = loss_fn
    want_compile = args.compile == "1" or (args.compile == "auto" and cuda)
    if want_compile:
        try:
            step_fn = torch.compile(loss_fn)
        except Exception as e:
            log(f"torch.compile unavailable ({type(e).__name__}: {e}); eager")

    gen = torch.Generator().manual_seed(args.seed)
    extra_md = {"general.description": "hybridmoe's built-in model: a small qwen3moe trained by "
                                       "benchmarks/builtin/train.py on permissively licensed documentation"}
    best = {"loss": float("inf"), "state": None, "step": 0}
    hist = []
    step, tokens_seen = 0, 0
    t_train0 = time.time()
    train_end = deadline - reserve
    last_eval = last_save = t_train0
    losses = []
    log(f"training for {max(0.0, train_end - t_train0):.0f} s (budget {args.minutes * 60:.0f} s, "
        f"reserve {reserve:.0f} s)")

    eval_tokens = 400_000 if cuda else 16_384
    eval_cost = [0.0]

    def do_eval(now):
        t = time.time()
        loss = evaluate(model, held, min(T, 1024), device, amp, eval_tokens)
        eval_cost[0] = time.time() - t
        hist.append(dict(step=step, seconds=round(now - t_start, 1), tokens=tokens_seen,
                         train_loss=round(float(np.mean(losses[-50:])) if losses else float("nan"), 4),
                         heldout_loss=round(loss, 4), heldout_ppl=round(math.exp(loss), 2)))
        if loss < best["loss"]:
            best.update(loss=loss, step=step, state={k: v.detach().clone() for k, v in model.state_dict().items()})
        log(f"eval step {step}: held-out loss {loss:.4f} (ppl {math.exp(loss):.1f}), best {best['loss']:.4f} "
            f"at step {best['step']}")

    while not Stop.flag:
        now = time.time()
        if now >= train_end:
            Stop.reason = Stop.reason or "time budget"
            break
        frac = (now - t_train0) / max(train_end - t_train0, 1e-6)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * \
            (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train, B, T, gen, device)
        try:
            with amp():
                ce, aux = step_fn(x, y)
                loss = ce + args.aux * aux
            loss.backward()
        except Exception as e:
            if step_fn is loss_fn:
                raise
            log(f"compiled step failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); eager from now")
            opt.zero_grad(set_to_none=True)
            step_fn = loss_fn
            continue
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()                          # no per-step check of the norm: it would sync the GPU every step
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += B * T
        if step % 10 == 0 or step <= 3:
            losses.append(ce.item())
            if not math.isfinite(losses[-1]):           # diverged: back to the best weights, fresh moments
                log(f"step {step}: loss {losses[-1]}; back to the weights of step {best['step']}")
                if best["state"] is not None:
                    model.load_state_dict(best["state"])
                opt.state.clear()
                losses.pop()
        if step % 100 == 0 or step in (1, 10):
            el = time.time() - t_train0
            log(f"step {step}: loss {ce.item():.4f} aux {aux.item():.3f} lr {lr:.2e} "
                f"|g| {float(gnorm):.2f} {tokens_seen / max(el, 1e-6) / 1e3:.0f}K tok/s, "
                f"{tokens_seen / train.numel():.2f} epochs, {el:.0f} s")
        now = time.time()
        if now - last_eval >= args.eval_every and now + eval_cost[0] < train_end:
            do_eval(now)
            last_eval = time.time()
        if now - last_save >= args.save_every and best["state"] is not None and now + 10 < train_end:
            export_all(best["state"], cfg, tok_json, out, False, extra_md)
            last_save = time.time()

    log(f"training stopped ({Stop.reason or 'time budget'}) after {step} steps, {tokens_seen / 1e6:.1f}M tokens, "
        f"{time.time() - t_train0:.0f} s")
    Stop.flag = False                       # a second signal during the export stops nothing: the export finishes
    if step and (best["state"] is None or time.time() + eval_cost[0] < deadline - reserve / 2):
        do_eval(time.time())
    state = best["state"] or model.state_dict()
    model.load_state_dict(state)
    export_all(state, cfg, tok_json, out, True, extra_md,
               f16=not args.no_f16 and time.time() < deadline - 10)
    info = dict(config=moe.config_dict(cfg), eval_window=min(T, 1024), preset=args.preset, batch=B, steps=step, tokens=tokens_seen,
                epochs=round(tokens_seen / max(train.numel(), 1), 3), train_tokens=int(train.numel()),
                heldout_tokens=int(held.numel()), best_step=best["step"],
                heldout_loss=round(best["loss"], 4) if best["state"] is not None else None,
                heldout_ppl=round(math.exp(best["loss"]), 2) if best["state"] is not None else None,
                history=hist, seconds=round(time.time() - t_start, 1), stop=Stop.reason or "time budget",
                device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                lr=args.lr, aux=args.aux, n_params=cfg.n_params())
    (out / "train_meta.json").write_text(json.dumps(info, indent=1))
    try:
        import tokenizers
        tok = tokenizers.Tokenizer.from_file(tok_json)
        with open(out / "samples.txt", "w", encoding="utf-8") as f:
            for i, pr in enumerate(PROMPTS):
                if time.time() > deadline:
                    break
                txt = sample(model, tok, pr, 60, device, amp, seed=i)
                f.write(f"--- {pr!r}\n{pr}{txt}\n\n")
        log("samples:\n" + (out / "samples.txt").read_text())
    except Exception as e:
        log(f"no samples ({type(e).__name__}: {e})")
    log(f"done in {time.time() - t_start:.0f} s; best held-out ppl {info['heldout_ppl']}; files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
