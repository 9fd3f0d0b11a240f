import pytest
import torch

from neorec.model.interaction import CrossNetwork, DotInteraction


def test_dot_interaction_matches_loops():
    torch.manual_seed(0)
    b, d, f = 3, 4, 5
    dense, emb = torch.randn(b, d, dtype=torch.float64), torch.randn(b, f * d, dtype=torch.float64)
    out = DotInteraction(f + 1)(dense, emb)
    vecs = [dense] + list(emb.split(d, dim=1))
    expected = [dense]
    for i in range(f + 1):
        for j in range(i):
            expected.append((vecs[i] * vecs[j]).sum(1, keepdim=True))
    assert torch.allclose(out, torch.cat(expected, 1))
    assert DotInteraction(f + 1, self_interaction=True).num_pairs == (f + 1) * (f + 2) // 2


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_interaction_gradient_matches_autograd_of_loops(self_interaction):
    torch.manual_seed(1)
    b, d, f = 4, 3, 6
    dense = torch.randn(b, d, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(b, f * d, dtype=torch.float64, requires_grad=True)
    inter = DotInteraction(f + 1, self_interaction)
    assert torch.autograd.gradcheck(lambda x, e: inter(x, e), (dense, emb))
    upstream = torch.randn(b, d + inter.num_pairs, dtype=torch.float64)
    got = torch.autograd.grad((inter(dense, emb) * upstream).sum(), (dense, emb))
    vecs = [dense] + list(emb.split(d, dim=1))
    loops = [dense] + [(vecs[i] * vecs[j]).sum(1, keepdim=True)
                       for i in range(f + 1) for j in range(i + 1 if self_interaction else i)]  # fmt: skip
    want = torch.autograd.grad((torch.cat(loops, 1) * upstream).sum(), (dense, emb))
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w)


def test_cross_network_formula_and_low_rank():
    torch.manual_seed(0)
    net = CrossNetwork(6, 2).double()
    x0 = torch.randn(4, 6, dtype=torch.float64)
    x = x0
    for lin in net.w:
        x = x0 * (x @ lin.weight.T + lin.bias) + x
    assert torch.allclose(net(x0), x)
    low = CrossNetwork(6, 2, low_rank=2)
    assert low(x0.float()).shape == (4, 6)
