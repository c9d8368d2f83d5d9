"""llama-server's slot persistence (`--slot-save-path`, POST /slots/ID?action=save|restore|erase): the KV
cache of what a slot last ran, saved to a safetensors file and put back later, so a long prompt (an
agent's system prompt, a document) is not prefilled again after a restart or another conversation. The file
records the tokens the cache holds, the cache's layout, the model and a SHA-256 of each tensor's bytes; a file
that does not match them, or whose keys and values are not finite numbers, is refused before anything is
copied, and the cache keeps what it held."""
from __future__ import annotations

import hashlib
import json
import os
import re
import time

import torch

from ..errors import HybridMoeError
from .requests import ApiError, _bad

FORMAT = "hybridmoe-kv-2"          # 2: with the SHA-256 of each tensor's bytes
OLD_FORMATS = ("hybridmoe-kv-1",)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def _path(folder: str, body) -> tuple[str, str]:
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise _bad("'filename' must be a plain file name (letters, digits, '.', '_', '-'; no folders)", "filename")
    return name, os.path.join(folder, name)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def _finite(t: torch.Tensor) -> bool:
    """No NaN or infinity among the keys or values (for q8_0 blocks, in their f16 scales)."""
    if t.dtype == torch.uint8:                       # q8_0: 34-byte blocks, an f16 scale then 32 int8
        t = t.reshape(-1, 34)[:, :2].contiguous().view(torch.float16)
    return bool(torch.isfinite(t).all())


def _model_id(model) -> dict:
    return {"file": os.path.basename(model.path), "bytes": model.file.nbytes, "arch": model.cfg.arch,
            "n_layer": model.cfg.n_layer}


def _take(model, slot):
    """The cache to save, restore or erase: the slot's (a batching.Slot), else the model's own."""
    return slot.cache(model) if slot is not None else model.take_cache()


def _give(model, slot, kv):
    if slot is None:
        model.return_cache(kv)


def save(model, folder: str, body, slot=None) -> dict:
    """Runs on the generation thread while the slot is idle: its cache (the model's, without a slot) to a file."""
    from safetensors.torch import save_file
    name, path = _path(folder, body)
    t0 = time.perf_counter()
    kv = _take(model, slot)
    try:
        if not kv.tokens:
            raise _bad("the cache is empty: run a prompt first", "filename")
        tensors, tokens, hi = kv.save_state()
        meta = {"format": FORMAT, "tokens": json.dumps(tokens), "hi": str(hi), "layout": json.dumps(kv.layout()),
                "model": json.dumps(_model_id(model)),
                "sha256": json.dumps({k: _digest(t) for k, t in tensors.items()})}
    finally:
        _give(model, slot, kv)
    tmp = path + ".tmp"
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except OSError as e:
        raise ApiError(500, f"cannot write {name}: {e.strerror}", "slot_save_failed", type_="server_error") from None
    return {"id_slot": slot.id if slot is not None else 0, "filename": name, "n_saved": len(tokens),
            "n_written": os.path.getsize(path),
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def restore(model, folder: str, body, slot=None) -> dict:
    """Runs on the generation thread while the slot is idle: a saved file back into its cache."""
    from safetensors import SafetensorError, safe_open
    name, path = _path(folder, body)
    if not os.path.isfile(path):
        raise ApiError(404, f"no saved slot {name!r}", "not_found", type_="not_found_error")
    t0 = time.perf_counter()
    kv = _take(model, slot)
    held = list(kv.tokens), kv.hi
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") in OLD_FORMATS:
                raise _bad(f"{name} was saved by an older hybridmoe, without a checksum of its keys and values; "
                           f"save it again", "filename")
            if meta.get("format") != FORMAT:
                raise _bad(f"{name} is not a slot saved by hybridmoe", "filename")
            if json.loads(meta.get("model", "{}")) != _model_id(model):
                raise _bad(f"{name} was saved with another model ({json.loads(meta.get('model', '{}'))})", "filename")
            if json.loads(meta.get("layout", "{}")) != kv.layout():
                raise _bad(f"{name} was saved with another cache layout (context size, -ctk/-ctv or placement); "
                           f"start the server as it was then", "filename")
            tokens = json.loads(meta["tokens"])
            if not (isinstance(tokens, list) and all(isinstance(t, int) and 0 <= t < model.tokenizer.n_vocab
                                                     for t in tokens)):
                raise _bad(f"{name} holds a bad token record", "filename")

            digests = json.loads(meta["sha256"])
            if not isinstance(digests, dict):
                raise _bad(f"{name} holds a bad checksum record", "filename")

            def get(tensor: str, shape):
                if tensor not in f.keys() or tuple(f.get_slice(tensor).get_shape()) != tuple(shape):
                    raise _bad(f"{name}: tensor {tensor} is missing or not {tuple(shape)}", "filename")
                t = f.get_tensor(tensor)
                if digests.get(tensor) != _digest(t):
                    raise _bad(f"{name}: the bytes of {tensor} do not match their checksum (the file was changed or "
                               f"damaged since it was saved); nothing was restored", "filename")
                if not _finite(t):
                    raise _bad(f"{name}: {tensor} holds NaN or infinite values; nothing was restored", "filename")
                return t
            kv.restore_state(get, tokens, int(meta["hi"]))
    except BaseException as e:
        kv.tokens, kv.hi = held                     # nothing was copied: the cache holds what it held
        if isinstance(e, (SafetensorError, ValueError, KeyError, OSError, HybridMoeError)):
            raise _bad(f"{name} is not a restorable saved slot: {e}", "filename") from None
        raise
    finally:
        _give(model, slot, kv)
    return {"id_slot": slot.id if slot is not None else 0, "filename": name, "n_restored": len(tokens),
            "n_read": os.path.getsize(path),
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def erase(model, slot=None) -> dict:
    kv = _take(model, slot)
    try:
        n = len(kv.tokens)
        kv.tokens.clear()
    finally:
        _give(model, slot, kv)
    return {"id_slot": slot.id if slot is not None else 0, "n_erased": n}
