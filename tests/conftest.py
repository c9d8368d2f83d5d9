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


def top1_agreement(got, ref, tol: float = 0.05) -> float:
    """Share of rows whose top-1 token in `got` is also a top-1 of `ref`, up to `tol` x the row's std:
    random tiny models have exact and near ties (margins of 0 and 0.01 std in synth:tiny), where bf16
    rounding decides argmax either way."""
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    picked = ref.gather(-1, got.argmax(-1, keepdim=True))[..., 0]
    return float((picked >= ref.max(-1).values - tol * ref.std(-1)).double().mean())


def has_cuda() -> bool:
    return torch.cuda.is_available()


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
