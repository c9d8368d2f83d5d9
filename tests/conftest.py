import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Synthetic models go to a per-run cache unless HYBRIDMOE_CACHE is set (then they are reused)."""
    if not os.environ.get("HYBRIDMOE_CACHE"):
        os.environ["HYBRIDMOE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def qwen235():
    """Tensor records of Qwen3-235B-A22B (no file): discussion 532's model."""
    from hybridmoe.models.catalog import catalog_model
    return catalog_model("qwen3-235b-a22b")


@pytest.fixture(scope="module")
def dsr1():
    """Tensor records of DeepSeek-R1 (no file): issue 521's model."""
    from hybridmoe.models.catalog import catalog_model
    return catalog_model("deepseek-r1")


def rel_l2(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm())


def moe_ref_f64(x, ids, wts, graw, uraw, draw, gq, dq):
    """Routed experts from GGUF bytes in float64: the sum over slots of wts * down(SiLU(gate x) * up x), each
    matrix from the reference dequantizer (the GPU MoE kernels' tests compare with it)."""
    import torch.nn.functional as F

    from hybridmoe.quant.dequant import dequantize
    H, Fd = x.shape[1], graw.shape[1]
    wg, wu = dequantize(graw, gq, H).double(), dequantize(uraw, gq, H).double()
    wd = dequantize(draw, dq, Fd).double()
    ref = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            hh = F.silu(wg[e] @ x[t].double()) * (wu[e] @ x[t].double())
            ref[t] += wts[t, j].double() * (wd[e] @ hh)
    return ref


def top1_agreement(got, ref, tol: float = 0.05) -> float:
    """Share of rows whose top-1 token in `got` is also a top-1 of `ref`, up to `tol` x the row's std:
    random tiny models have exact and near ties (margins of 0 and 0.01 std in synth:tiny), where bf16
    rounding decides argmax either way."""
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    picked = ref.gather(-1, got.argmax(-1, keepdim=True))[..., 0]
    return float((picked >= ref.max(-1).values - tol * ref.std(-1)).double().mean())


def has_cuda() -> bool:
    return torch.cuda.is_available()


def triton_test_device() -> str:
    """Where tests of Triton kernels run: "cuda" with a GPU, "cpu" in Triton's interpreter (TRITON_INTERPRET=1);
    otherwise the calling test module is skipped."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def byte_verdict(machine, text) -> str:
    """A constraint machine (constrain.JsonMachine, grammar.GrammarMachine) fed `text` byte by byte: 'ok' (it
    may end here), 'prefix' (it can still get there) or 'refused'."""
    data = text.encode() if isinstance(text, str) else text
    for i in range(len(data)):
        if not machine.feed(data[i:i + 1]):
            return "refused"
    return "ok" if machine.can_end() else "prefix"


def random_json(rng, depth=0):
    """A random JSON value (nested up to 3 levels; strings with escapes and non-ASCII)."""
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.choice([0.5, -1e-7, 3.25e12, 1.0])
    if kind in (3, 4):
        return "".join(rng.choice('ab "\\/\n\té€😀x') for _ in range(rng.randrange(6)))
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}{rng.choice('xyé')}": random_json(rng, depth + 1) for i in range(rng.randrange(4))}
