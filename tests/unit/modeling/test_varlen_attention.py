"""vlm/modeling/varlen.py: per-document attention (DocLayout) == the dense [B, 1, T, T] reference mask.

For every real (valid) query. A padding query sees only itself in the DocLayout, and its earlier
valid keys of the same segment too in the dense mask: its output is unused either way, so the layer
tests weight padding rows by zero, and the full-model test checks that no loss reaches them (every
parameter gradient equal). Forward AND backward (gradients of the inputs and of every weight),
fp32, max |diff| <= 1e-5, for one attention layer, the model's token / concept / joint-decoder
blocks and the whole ConceptMoEModel with packing (several documents per row, length-1 documents)
and left / right padding. On CUDA (``VLM_TEST_DEVICE=cuda``) the bf16 flash kernel (varlen_attn) is checked against
the dense mask too; it skips on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from vlm.modeling.configuration_conceptmoe import AttentionConfig, ConceptMoEConfig
from vlm.modeling import attention, varlen
from vlm.modeling.attention import Attention, attention_mask, causal_mask, rope_cos_sin
from vlm.modeling.varlen import DocLayout

from conftest import randomise_joint, runtime  # noqa: E402
from _device import DEVICE, ON_CUDA, cuda_only, dev, require_test_device, tol  # noqa: E402, F401

# "loop" is the CPU kernel (torch's CPU flash op); on CUDA it is refused (test_loop_kernel_on_cuda_is_refused)
KERNELS_HERE = ["bucketed"] if ON_CUDA else ["loop", "bucketed"]


def with_kernel(attn: Attention, kernel: str) -> Attention:
    """A standalone layer given a model config whose ``runtime.varlen_kernel`` is ``kernel``."""
    attn.model_config = ConceptMoEConfig(runtime={"varlen_kernel": kernel})
    return attn

pytestmark = pytest.mark.device

CFG = AttentionConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
P = -1  # a padding position in the layouts below (valid = False)

# rows of segment ids, P = padding; every case mixes several documents per row, length-1 documents
# and padding somewhere (the last one: segment ids that are not contiguous, padding mid-document)
LAYOUTS = {
    "packed": [[0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 4, 4, 4, 4], [7] * 14],
    "left_pad": [[P] * 4 + [0] * 10, [P] + [0] * 2 + [1] + [2] * 10],
    "right_pad": [[0] * 9 + [P] * 5, [0] + [1] * 6 + [2] * 6 + [P]],
    "packed_left_right": [[P, P, 0, 0, 0, 1, 2, 2, 2, 2, 3, P, P, P], [0] * 5 + [1] * 8 + [P]],
    "noncontiguous": [[0, 0, 1, 1, 0, P, 0, 2, 2, 1, 0, 3, P, 0], [P] * 14],
}


def layout_tensors(name):
    seg = torch.tensor(LAYOUTS[name])
    valid = seg != P
    pos = torch.zeros_like(seg)  # position within the document (padding: 0)
    for r in range(seg.shape[0]):
        for s in seg[r][valid[r]].unique():
            sel = valid[r] & (seg[r] == s)
            pos[r, sel] = torch.arange(int(sel.sum()))
    return dev(valid, seg.clamp(min=0), pos)


def grads(module, *inputs):
    return [t.grad for t in inputs] + [p.grad for p in module.parameters()]


def run_both(module, call, inputs, valid, seg, T, monkeypatch):
    """Forward + backward of ``call(mask)`` with the dense mask and with the DocLayout (via
    ``attention_mask``): outputs of the valid rows, the same random weighting of them (0 on padding)."""
    results = []
    for impl in ("dense", "varlen"):
        module.zero_grad(set_to_none=True)
        for t in inputs:
            t.grad = None
        mask = attention_mask(valid, seg, T, DEVICE, impl=impl)
        assert isinstance(mask, DocLayout) == (impl == "varlen")
        out = call(mask)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE) * valid[..., None]
        (out * w).sum().div(valid.sum()).backward()  # a mean over the tokens, as a loss: O(1) gradients
        results.append((out.detach()[valid], grads(module, *inputs)))
    return results


def assert_same(results):
    (out_d, g_d), (out_v, g_v) = results
    torch.testing.assert_close(out_v, out_d, **tol(1e-5, 1e-5))
    assert len(g_d) == len(g_v)
    for i, (a, b) in enumerate(zip(g_d, g_v)):
        assert (a is None) == (b is None), i
        if a is not None:
            torch.testing.assert_close(b, a, **tol(1e-5, 1e-5), msg=f"gradient {i}")


def test_layout_is_the_dense_mask():
    """Rebuild the allowed (query, key) pairs from the layout: ``causal_mask`` for every valid query;
    a padding query sees itself only."""
    for name in LAYOUTS:
        valid, seg, _ = layout_tensors(name)
        B, T = seg.shape
        lay = DocLayout.build(valid, seg)
        slot_N = lay.inv_N  # document-order slot of each token
        doc_N = torch.searchsorted(lay.cu_seq.long(), slot_N, right=True) - 1
        same = doc_N.view(B, T, 1) == doc_N.view(B, 1, T)
        before = slot_N.view(B, T, 1) >= slot_N.view(B, 1, T)
        allowed = same & before
        dense = causal_mask(valid, seg, T, DEVICE)[:, 0]
        torch.testing.assert_close(allowed[valid], dense[valid], msg=name)
        eye = torch.eye(T, dtype=torch.bool, device=DEVICE).expand(B, T, T)
        torch.testing.assert_close(allowed[~valid], eye[~valid], msg=name)
        # buckets: every token exactly once, padding inside a bucket below 2x its tokens
        flat = torch.cat([f for _, _, f in lay.buckets])
        assert torch.equal(flat[lay.src_N], torch.arange(B * T, device=DEVICE))
        assert sum(n * L for n, L, _ in lay.buckets) < 2 * B * T
        assert lay.max_len == int(lay.cu_seq.diff().max())


def test_attention_mask_choice(monkeypatch):
    valid, seg, _ = layout_tensors("packed")
    assert attention_mask(None, None, 14, DEVICE) is None  # plain causal: no mask at all
    equal = DocLayout.build(None, dev(torch.arange(4).repeat_interleave(4)[None]))  # 4 documents of 4
    assert equal.perm_N is None and equal.src_N is None and equal.buckets[0][:2] == (4, 4)  # no reordering
    assert equal.cu_seq.tolist() == [0, 4, 8, 12, 16] and equal.max_len == 4
    # the loop kernel's pieces (document order): runs of length-1 documents (padding, one-token
    # segments) merged, never across rows
    lay = DocLayout.build(*layout_tensors("packed_left_right")[:2])
    assert lay.pieces == [(0, 3, False), (3, 1, True), (4, 4, False), (8, 6, True),
                          (14, 5, False), (19, 8, False), (27, 1, True)]
    assert isinstance(attention_mask(valid, None, 14, DEVICE), DocLayout)
    assert isinstance(attention_mask(None, seg, 14, DEVICE), DocLayout)
    assert attention_mask(valid, seg, 14, DEVICE, impl="dense").shape == (2, 1, 14, 14)
    with pytest.raises(ValueError, match="runtime.attention='sparse'"):
        attention_mask(valid, seg, 14, DEVICE, impl="sparse")
    with pytest.raises(ValueError, match="runtime.varlen_kernel='fast'"):
        varlen.doc_attention(*(torch.zeros(2, 2, 14, 4, device=DEVICE),) * 3, DocLayout.build(valid, seg), "fast")
    with pytest.raises(ValueError, match="DocLayout is for"):
        varlen.doc_attention(*(torch.zeros(1, 2, 5, 4, device=DEVICE),) * 3, DocLayout.build(valid, seg))


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_attention_layer_matches_dense(name, joint, kernel, monkeypatch):
    torch.manual_seed(0)
    attn = with_kernel(Attention(CFG, CFG.hidden_size, joint=joint), kernel)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    attn = dev(attn)
    valid, seg, pos = layout_tensors(name)
    B, T = seg.shape
    x = dev(torch.randn(B, T, CFG.hidden_size)).requires_grad_()
    c = dev(torch.randn(B, T, CFG.hidden_size)).requires_grad_() if joint else None
    cs = rope_cos_sin(pos, attn.head_dim, CFG.rope_theta, x.dtype)
    inputs = [x] + ([c] if joint else [])
    call = lambda m: attn(x, cs, mask=m, concept_BTD=c)  # noqa: E731
    assert_same(run_both(attn, call, inputs, valid, seg, T, monkeypatch))


@pytest.mark.parametrize("stack", ["encoder", "concept", "decoder"])
@pytest.mark.parametrize("name", ["packed_left_right", "noncontiguous"])
@pytest.mark.parametrize("kernel", ["auto", "bucketed"])
def test_model_blocks_match_dense(tiny_model, stack, name, kernel, monkeypatch):
    """The model's own blocks (MoE FFN, concept width and top-k, joint decoding) on one layout."""
    model = randomise_joint(tiny_model("tiny_concept", concept_hidden_size=48))
    runtime(model).varlen_kernel = kernel
    core = model.model
    block = {"encoder": core.encoder, "concept": core.concept_model, "decoder": core.decoder}[stack][0]
    block = dev(block)
    valid, seg, pos = layout_tensors(name)
    B, T = seg.shape
    d = block.input_norm.weight.shape[0]
    x = dev(torch.randn(B, T, d)).requires_grad_()
    c = dev(torch.randn(B, T, d)).requires_grad_() if block.attn.joint else None
    cs = core.rope(pos, d, x.dtype)
    inputs = [x] + ([c] if c is not None else [])

    def call(mask):
        y, _ = block(x, cs, mask=mask, valid_BT=valid, concept_BTD=c)
        return y

    assert_same(run_both(block, call, inputs, valid, seg, T, monkeypatch))


def _packed_batch(V: int = 2048):
    """Three rows of 24: packed with length-1 documents and right padding, left padding + packing,
    one document. Collate layout: segment ids from 1, 0 = padding, positions restart per segment."""
    seg = torch.tensor([[1] * 6 + [2] + [3] * 9 + [4] + [5] * 4 + [0] * 3,
                        [0] * 5 + [1] * 8 + [2] + [3] * 10,
                        [1] * 24])
    am = (seg > 0).long()
    ids = torch.randint(1, V, seg.shape, generator=torch.Generator().manual_seed(3)) * am
    pos = torch.zeros_like(seg)
    for r in range(seg.shape[0]):
        for s in seg[r].unique().tolist():
            if s:
                sel = seg[r] == s
                pos[r, sel] = torch.arange(int(sel.sum()))
    return dev(ids, am, seg, pos)


@pytest.mark.device
@pytest.mark.skipif(not ON_CUDA, reason="the refusal is of CUDA tensors")
def test_loop_kernel_on_cuda_is_refused(monkeypatch):
    seg = dev(torch.tensor([[1, 1, 2, 2]]))
    q = dev(torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="CPU flash kernel"):
        varlen.doc_attention(q, q, q, DocLayout.build(None, seg), "loop")


@pytest.mark.parametrize("merge, kernel", [("last", "auto"), ("sum", "auto"), ("last", "bucketed")])
def test_full_model_matches_dense(tiny_model, make_decisive, merge, kernel, monkeypatch):
    """ConceptMoEModel with segment_ids + padding: logits, every loss and every parameter gradient
    equal the dense-mask reference (decisive router: a last-bit difference cannot flip a boundary)."""
    model = dev(randomise_joint(make_decisive(tiny_model("tiny_concept", concept_merge=merge), 3)))
    runtime(model).varlen_kernel = kernel
    ids, am, seg, pos = _packed_batch()
    labels = ids.masked_fill(am == 0, -100)
    seen = []
    real = attention.attention_mask
    monkeypatch.setattr(attention, "attention_mask", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    results = []
    for impl in ("dense", "varlen"):
        runtime(model).attention = impl
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=am, position_ids=pos, segment_ids=seg, labels=labels)
        (out.loss + out.lb_loss + out.ratio_loss).backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    # both stacks (tokens, concepts) got a mask of the chosen kind
    assert [type(m).__name__ for m in seen] == ["Tensor", "Tensor", "DocLayout", "DocLayout"]
    (d, gd), (v, gv) = results
    assert torch.equal(v.boundary_mask, d.boundary_mask)
    assert 0 < int(d.boundary_mask[am.bool()].sum()) < int(am.sum())  # really chunked
    torch.testing.assert_close(v.logits, d.logits, **tol(1e-5, 1e-5))
    for key in ("loss", "lb_loss", "z_loss", "ratio_loss"):
        torch.testing.assert_close(getattr(v, key), getattr(d, key), **tol(1e-5, 1e-5), msg=key)
    assert gd.keys() == gv.keys() and len(gd) == len(list(model.parameters()))
    for n in gd:
        torch.testing.assert_close(gv[n], gd[n], **tol(1e-5, 1e-5), msg=n)


@cuda_only
@pytest.mark.parametrize("name", ["packed_left_right", "noncontiguous"])
def test_cuda_bf16_flash_matches_dense(name, monkeypatch):
    """bf16 on CUDA: the varlen_attn (flash) kernel == dense mask == the bucketed SDPA, forward and
    backward, to the bf16 tolerance."""
    cfg = AttentionConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32
    torch.manual_seed(0)
    attn = dev(Attention(cfg, cfg.hidden_size)).to(torch.bfloat16)
    valid, seg, pos = layout_tensors(name)
    B, T = seg.shape
    x = dev(torch.randn(B, T, cfg.hidden_size)).to(torch.bfloat16).requires_grad_()
    cs = rope_cos_sin(pos, attn.head_dim, cfg.rope_theta, x.dtype)
    lay = DocLayout.build(valid, seg)
    assert varlen.flash_applies(torch.zeros(1, 1, 1, attn.head_dim, device=DEVICE, dtype=torch.bfloat16))
    ref = run_both(attn, lambda m: attn(x, cs, mask=m), [x], valid, seg, T, monkeypatch)
    assert_bf16 = dict(tol(0, dtype=torch.bfloat16))
    with_kernel(attn, "bucketed")
    attn.zero_grad(set_to_none=True)
    x.grad = None
    out = attn(x, cs, mask=lay)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE) * valid[..., None]
    (out * w).sum().div(valid.sum()).backward()
    for (o, g) in ref[1:] + [(out.detach()[valid], grads(attn, x))]:
        torch.testing.assert_close(o.float(), ref[0][0].float(), **assert_bf16)
        for a, b in zip(ref[0][1], g):
            torch.testing.assert_close(b.float(), a.float(), **assert_bf16)


@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_one_token_documents_keep_q_and_k_in_the_graph(kernel, monkeypatch):
    """Every document one token long (a concept stack whose rows each collapsed into one concept):
    q and k still get a (zero) gradient, not None, so that data-parallel ranks whose batches differ
    here reduce the same set of gradients (a None on one rank desynchronised ZeRO's reduction)."""
    seg = dev(torch.arange(3)[None].repeat(2, 1))  # 2 rows x 3 one-token documents
    q, k, v = (dev(torch.randn(2, 4, 3, 8)).requires_grad_() for _ in range(3))
    kv = (k[:, :2], v[:, :2])  # grouped-query: 2 kv heads
    out = varlen.doc_attention(q, *kv, DocLayout.build(None, seg), kernel)
    torch.testing.assert_close(out, v[:, :2].repeat_interleave(2, dim=1).transpose(1, 2))
    out.square().sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    # zero up to rounding: the softmax over one key has no gradient (SDPA's backward leaves ~1e-6)
    assert q.grad.abs().max() <= 1e-5 and k.grad.abs().max() <= 1e-5
