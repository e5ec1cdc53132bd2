"""Activation checkpointing (issue 17, item 4): ``train.activation_checkpointing: none | selective |
full`` and transformers' ``gradient_checkpointing_enable`` recompute parts of every transformer block
in the backward without changing the results.

- ``none`` / ``selective`` / ``full`` give the same loss, aux losses (ratio, load balance, z), expert
  counts, boundaries and parameter gradients (fp32, <= 1e-6; measured: exactly equal) on packed rows
  with padding, for the tiny ConceptMoE and a variant with a narrower, looped concept model and a
  dense first layer; forward-call counts show what is recomputed (and that eval / no-grad runs do
  not checkpoint);
- ``gradient_checkpointing_enable()`` on ``ConceptMoEForCausalLM`` and the VLM is ``full``;
  reentrant checkpointing (which would detach the MoE aux losses) is refused in one line;
- the selective part: the FFN half keeps ~4x the attention half's activation bytes (tiny model,
  T = 4096: 26.3 vs 6.6 MiB) for less recompute (~0.4 vs ~2.2 GFLOP, the attention core is
  quadratic in the document length; measured forward 34-40 vs 74-100 ms on this CPU);
- peak memory of one training step on a 4096-token row (torch.profiler's CPU allocator events,
  exact bytes): full < selective < none, printed;
- with ``train.compile`` (the blocks compiled, aot_eager) the same results, still recomputed;
- 3 trainer steps with ``train.activation_checkpointing: full`` log the losses of ``none`` (ZeRO-2, ZeRO-3).
"""
from __future__ import annotations

import _train_helpers as helpers
import pytest
import torch
from conftest import build_model
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from vlm import ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration
from vlm.modeling.blocks import TransformerBlock
from vlm.modeling.conceptmoe import ConceptMoEModel
from vlm.modeling.modeling_conceptmoe import loss_only
from vlm.training.activation_checkpointing import apply_activation_checkpointing
from vlm.training.compile import compile_blocks

TOL = 1e-6
MODES = ("none", "selective", "full")
KEYS = ("loss", "lm_loss", "ratio_loss", "lb_loss", "z_loss")
VARIANTS = {"tiny_concept": {},
            "narrow_looped_dense": {"concept_hidden_size": 32, "concept_loop_layers": [0], "concept_loop_times": 2,
                                    "first_k_dense": 1}}


def packed_rows(V: int = 2048, T: int = 40):
    """Row 0: documents of 11 + 17 + 12 tokens; row 1: 9 + 21 tokens + 10 right pads (segment 0)."""
    g = torch.Generator().manual_seed(4)
    seg = torch.tensor([[1] * 11 + [2] * 17 + [3] * 12, [1] * 9 + [2] * 21 + [0] * 10])
    am = (seg > 0).long()
    ids = torch.randint(1, V, (2, T), generator=g) * am
    pos = torch.zeros_like(seg)
    for r in range(2):
        for k in range(1, 4):
            pos[r, seg[r] == k] = torch.arange(int((seg[r] == k).sum()))
    return {"input_ids": ids, "attention_mask": am, "position_ids": pos, "segment_ids": seg,
            "labels": ids.masked_fill(am == 0, -100)}


class CallCounts:
    """Forward calls of every block's attention and FFN (a recompute calls them again)."""

    def __init__(self, model):
        self.n = {"attn": 0, "ffn": 0}
        self.handles = []
        for block in model.modules():
            if isinstance(block, TransformerBlock):
                for part in ("attn", "ffn"):
                    self.handles.append(getattr(block, part).register_forward_pre_hook(self._hook(part)))

    def _hook(self, part):
        def hook(module, args):
            self.n[part] += 1
        return hook

    def take(self) -> dict:
        n, self.n = self.n, {"attn": 0, "ffn": 0}
        return n


def step(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the chunker's boundary noise: the same draws for every mode
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want):
    (out, grads), (ref, ref_grads) = got, want
    for key in KEYS:
        assert float((getattr(out, key) - getattr(ref, key)).detach().abs()) <= TOL, key
    assert torch.equal(out.boundary_mask, ref.boundary_mask)
    assert all(torch.equal(a, b) for a, b in zip(out.tokens_per_expert, ref.tokens_per_expert))
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    worst = max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads)
    assert worst <= TOL, worst


@pytest.mark.parametrize("variant", VARIANTS)
def test_modes_give_the_same_losses_and_gradients(variant):
    model = build_model("tiny_concept", **VARIANTS[variant]).train()
    runs = len(model.model.layers) + len(model.model.schedule) - model.model.n_con  # block calls per forward
    n_moe = sum(b.is_moe for b in model.model.encoder) + sum(b.is_moe for b in model.model.decoder) + \
        sum(model.model.concept_model[i].is_moe for i in model.model.schedule)
    batch = packed_rows()
    counts = CallCounts(model)
    results, calls = {}, {}
    for mode in MODES:
        assert apply_activation_checkpointing(model, mode) == (0 if mode == "none" else len(model.model.layers))
        results[mode] = step(model, batch)
        calls[mode] = counts.take()
    assert calls["none"] == {"attn": runs, "ffn": runs}
    assert calls["selective"] == {"attn": runs, "ffn": 2 * runs}  # the FFN half recomputed
    assert calls["full"] == {"attn": 2 * runs, "ffn": 2 * runs}  # every block recomputed
    assert n_moe == len(results["none"][0].tokens_per_expert)
    for mode in ("selective", "full"):
        assert_same(results[mode], results["none"])
    # no backward, no recompute: eval mode and no_grad run each block once
    with torch.no_grad():
        model(**batch)
    model.eval()
    model(**batch)
    assert counts.take() == {"attn": 2 * runs, "ffn": 2 * runs}


def test_unknown_mode_is_one_line():
    with pytest.raises(ValueError, match="^activation checkpointing must be one of none, selective, full, got 'all'$"):
        ConceptMoEModel.set_activation_checkpointing(build_model("tiny_concept").model, "all")


def build_vlm() -> ConceptMoEVLMForConditionalGeneration:
    cfg = ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml", image_token_id=5, im_start_token_id=6,
                                        im_end_token_id=7, vocab_size=64)
    torch.manual_seed(0)
    return ConceptMoEVLMForConditionalGeneration(cfg).train()


def vlm_batch(model):
    """Row 0: text, one image, text; row 1: 3 left pads, text."""
    g = torch.Generator().manual_seed(1)
    txt = lambda n: torch.randint(8, 64, (n,), generator=g).tolist()
    row = txt(3) + [6] + [5] * model.num_image_tokens + [7] + txt(5)
    ids = torch.tensor([row, [0] * 3 + txt(len(row) - 3)])
    am = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": am, "pixel_values": torch.randn(1, 3, 16, 16, generator=g),
            "labels": ids.masked_fill(am == 0, -100)}


@pytest.mark.parametrize("kind", ["lm", "vlm"])
def test_gradient_checkpointing_enable_is_full(kind):
    """transformers' API sets every block's flag (and the non-reentrant checkpoint function)."""
    model = build_model("tiny_concept").train() if kind == "lm" else build_vlm()
    batch = packed_rows() if kind == "lm" else vlm_batch(model)
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    counts = CallCounts(model)
    want = step(model, batch)
    plain = counts.take()
    with pytest.warns(FutureWarning):  # transformers v5: the deprecated alias of activation_checkpointing_enable
        model.gradient_checkpointing_enable()
    assert model.is_activation_checkpointing and all(b.gradient_checkpointing for b in blocks)
    assert_same(step(model, batch), want)
    assert counts.take() == {"attn": 2 * plain["attn"], "ffn": 2 * plain["ffn"]}
    model.activation_checkpointing_disable()
    assert not any(b.gradient_checkpointing for b in blocks)
    assert_same(step(model, batch), want)
    assert counts.take() == plain
    # disable leaves torch's bare checkpoint (reentrant by default) on the blocks: the setter replaces it
    apply_activation_checkpointing(model, "full")
    assert_same(step(model, batch), want)
    assert counts.take() == {"attn": 2 * plain["attn"], "ffn": 2 * plain["ffn"]}


@pytest.mark.parametrize("how", ["use_reentrant=True", "bare checkpoint"])
def test_reentrant_checkpointing_is_refused(how):
    """Reentrant checkpoint (also torch's default when use_reentrant is unset) returns the MoE stats
    without their graph (silently wrong gradients): refused, one line."""
    model = build_model("tiny_concept").train()
    if how == "bare checkpoint":
        model.activation_checkpointing_enable()
        for block in model.model.layers:
            block._gradient_checkpointing_func = checkpoint
    else:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match=r"^TransformerBlock: reentrant checkpointing \(use_reentrant=True or unset\)"):
        model(**packed_rows())


def saved_bytes(fn) -> tuple[int, object]:
    """Bytes of the distinct storages autograd keeps for the backward of ``fn()``."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_selective_recomputes_the_part_that_keeps_the_most_bytes():
    """Per block (tiny model, one 4096-token document): the FFN half keeps > 2x the attention half's
    bytes (measured 13.4 vs 5.6 MiB with the expert MLP and RMSNorm functions that recompute their
    activation products and the routing weights folded into the expert MLP) while its recompute costs fewer FLOPs (the attention core alone is
    2 T^2 D for a causal T-token document: 2.1 GFLOP; the whole FFN half, counted, ~0.4)."""
    model = build_model("tiny_concept").train()
    block, T, D = model.model.layers[0], 4096, model.config.hidden_size
    x = torch.randn(1, T, D, requires_grad=True)
    cos_sin = model.model.rope(torch.arange(T)[None], D, x.dtype)
    attn_bytes, h = saved_bytes(lambda: x + block.attn(block.input_norm(x), cos_sin))
    ffn_bytes, _ = saved_bytes(lambda: block._ffn_half(h, None))
    print(f"\nsaved per block at T={T}: attention half {attn_bytes / 2**20:.1f} MiB, "
          f"FFN half {ffn_bytes / 2**20:.1f} MiB")
    assert ffn_bytes > 2 * attn_bytes
    with torch.no_grad(), torch.utils.flop_counter.FlopCounterMode(display=False) as fc:
        block._ffn_half(h, None)
    assert fc.get_total_flops() < 2 * T * T * D  # < the causal attention core's FLOPs


def peak_bytes(fn) -> int:
    """Peak of the CPU allocator's live bytes during ``fn()`` over those at its start (the profiler's
    allocation / free events, in order; exact, not RSS)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_peak_memory_full_below_selective_below_none():
    model = build_model("tiny_concept").train()
    ids = torch.randint(1, model.config.vocab_size, (1, 4096), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    loss_only(model)  # the trainer's loss: chunked CE, no [B, T, V] logits
    step(model, batch)  # warm-up: gradients allocated, lazy state built
    peaks = {}
    for mode in MODES:
        apply_activation_checkpointing(model, mode)
        peaks[mode] = peak_bytes(lambda: step(model, batch))
    print("\npeak memory of one training step, T=4096 (tiny ConceptMoE, fp32): " +
          ", ".join(f"{m} {b / 2**20:.1f} MiB" for m, b in peaks.items()))
    assert peaks["full"] < peaks["selective"] < peaks["none"]


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.integration  # in-process, but torch.compile of every block takes 15-30 s
def test_with_compiled_blocks(mode):
    """``train.compile`` + checkpointing: Dynamo traces the checkpoint inside the block's forward
    (aot_eager here, inductor checked by hand: the same); results equal (each block one graph), and
    still recomputed (counted by Python hooks, side effects a graph cannot hold: counted with the
    blocks compiled with graph breaks allowed, where the hooks run eager)."""
    torch._dynamo.reset()
    batch = packed_rows()
    want = step(build_model("tiny_concept").train(), batch)
    for fullgraph in (True, False):
        model = build_model("tiny_concept").train()
        apply_activation_checkpointing(model, mode)
        compile_blocks(model, backend="aot_eager", fullgraph=fullgraph)
        counts = None if fullgraph else CallCounts(model)
        for _ in range(2):
            assert_same(step(model, batch), want)
        if counts is not None:
            assert counts.take()["ffn"] == 2 * 2 * 4  # two steps, 4 blocks, each FFN run twice
        torch._dynamo.reset()


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_trainer_full_steps_equal_none(tmp_path, zero):
    """3 steps of the tiny ConceptMoE LM (fp32, one process; ZeRO-3 gathers the parameters again for
    the recompute): the trainer sets the blocks' flags from the config, and the logged losses equal
    those of ``none``."""
    runs = {}
    for mode in ("none", "full"):
        raw = helpers.config(tmp_path, name=mode, deepspeed=zero,
                             train={"max_steps": 3, "activation_checkpointing": mode},
                             checkpoint={"every_steps": 0, "save_final": False})
        trainer = helpers.run_inprocess(raw, tmp_path)
        blocks = [m for m in trainer.engine.module.modules() if isinstance(m, TransformerBlock)]
        assert blocks and all(b.gradient_checkpointing == (mode == "full") for b in blocks)
        runs[mode] = helpers.records(tmp_path / mode)
    for key in ("loss", "lm_loss", "ratio_loss", "lb_loss"):
        want, got = [r[key] for r in runs["none"]], [r[key] for r in runs["full"]]
        assert len(want) == 3 and max(abs(a - b) for a, b in zip(want, got)) <= TOL, (key, want, got)
