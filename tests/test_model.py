import pytest
import torch

from neorec.model.interaction import CrossNetwork, DotInteraction


def test_dot_interaction_matches_loops():
    torch.manual_seed(0)
    b, d, f = 3, 4, 5
    dense, emb = torch.randn(b, d, dtype=torch.float64), torch.randn(b, f * d, dtype=torch.float64)
    out = DotInteraction(f + 1)(torch.cat([dense, emb], 1))
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
    assert torch.autograd.gradcheck(lambda x, e: inter(torch.cat([x, e], 1)), (dense, emb))
    upstream = torch.randn(b, d + inter.num_pairs, dtype=torch.float64)
    got = torch.autograd.grad((inter(torch.cat([dense, emb], 1)) * upstream).sum(), (dense, emb))
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


def test_dot_interaction_under_bf16_autocast_matches_the_reference_in_bf16_precision():
    torch.manual_seed(2)
    b, d, f = 64, 16, 9
    dense = torch.randn(b, d, requires_grad=True)
    emb = torch.randn(b, f * d, requires_grad=True)
    inter = DotInteraction(f + 1)
    upstream = torch.randn(b, d + inter.num_pairs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = inter(torch.cat([dense, emb], 1))
    got = torch.autograd.grad((out.float() * upstream).sum(), (dense, emb))
    assert got[0].dtype == got[1].dtype == torch.float32  # gradients keep the inputs' dtype
    d64, e64 = dense.detach().double().requires_grad_(), emb.detach().double().requires_grad_()
    want_out = inter(torch.cat([d64, e64], 1))
    want = torch.autograd.grad((want_out * upstream.double()).sum(), (d64, e64))
    # bf16 keeps 8 bits of mantissa: products of O(1) inputs summed over d=16 carry ~1% error.
    scale = want_out.abs().max()
    assert (out.double() - want_out).abs().max() <= 0.02 * scale
    for g, w in zip(got, want, strict=True):
        assert (g.double() - w).abs().max() <= 0.02 * w.abs().max()


def _tiny_model(arch: str, precision: str):
    from neorec.config.load import load_config
    from neorec.train.build import build_model, build_source, build_tables
    from neorec.train.embeddings import build_embeddings

    sets = ["data.synthetic.train_samples=512", "data.synthetic.eval_samples=256", "data.batch_size=128",
            f"model.arch={arch}", f"model.precision={precision}", "model.bottom_mlp=[32,16]",
            "model.top_mlp=[32,16]"] + (["model.low_rank=8"] if arch == "dcnv2" else [])  # fmt: skip
    cfg = load_config("default", sets)
    source = build_source(cfg)
    torch.manual_seed(0)
    embeddings = build_embeddings(cfg, build_tables(cfg, source.info))
    return build_model(cfg, source.info, embeddings), next(iter(source.train_batches(128, 0)))


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
def test_bf16_models_stay_close_to_fp32_keep_fp32_gradients_and_are_deterministic(arch):
    fp32, batch = _tiny_model(arch, "fp32")
    start = {k: v.clone() for k, v in fp32.state_dict().items()}  # backward updates the tables in place
    bf16, _ = _tiny_model(arch, "bf16")
    bf16.load_state_dict(start)
    dense_params = lambda m: [(n, p) for n, p in m.named_parameters() if "embeddings" not in n]  # noqa: E731

    def run(model):
        logits = model(batch)
        assert logits.dtype == torch.float32  # the last layer runs outside autocast
        torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
        grads = {n: p.grad.clone() for n, p in dense_params(model)}
        model.zero_grad(set_to_none=True)
        return logits.detach(), grads

    want_logits, want_grads = run(fp32)
    logits, grads = run(bf16)
    assert (logits - want_logits).abs().max() <= 0.05 * want_logits.abs().max()
    for n, g in grads.items():
        assert g.dtype == torch.float32, n
        w = want_grads[n]
        assert torch.cosine_similarity(g.flatten(), w.flatten(), dim=0) > 0.98, n
    again, _ = _tiny_model(arch, "bf16")
    again.load_state_dict(start)
    assert torch.equal(run(again)[0], logits)
