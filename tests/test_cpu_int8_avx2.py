"""The AVX2 integer path without AVX-VNNI (kernels 'avx2-int8'): vpdpbusd's int32 sums by vpmaddubsw +
vpmaddwd. vpmaddubsw saturates each pair's sum to int16, so the form is exact only while u.s pairs stay in
range; these check it bit for bit against plain integer sums at the extremes the kernels can meet (weights'
u up to 128, or up to 255 on the split form; activations in [-127, 127])."""
import pytest
import torch

from hybridmoe.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.dp256_test(torch.zeros(32, dtype=torch.uint8), torch.zeros(32, dtype=torch.int8),
                                               False) is None, reason="no AVX2 kernel")


def _ref(u, s):
    return (u.to(torch.int64) * s.to(torch.int64)).view(-1, 4).sum(1).to(torch.int32)


@pytest.mark.parametrize("big, umax", [(False, 128), (True, 255)])
def test_dp256_is_exact(big, umax):
    g = torch.Generator().manual_seed(umax)
    n = 32 * 256
    u = torch.randint(0, umax + 1, (n,), generator=g, dtype=torch.int32).to(torch.uint8)
    s = torch.randint(-127, 128, (n,), generator=g, dtype=torch.int32).to(torch.int8)
    # the extremes: every pair at the largest magnitude of either sign
    u[:1024] = umax
    s[:512], s[512:1024] = 127, -127
    assert torch.equal(cpu.dp256_test(u, s, big), _ref(u, s))


def test_dp256_needs_the_split_above_128():
    """The plain form does saturate past its bound (the split is needed, not decoration)."""
    u = torch.full((32,), 255, dtype=torch.uint8)
    s = torch.full((32,), 127, dtype=torch.int8)
    assert not torch.equal(cpu.dp256_test(u, s, False), _ref(u, s))
    assert torch.equal(cpu.dp256_test(u, s, True), _ref(u, s))
