"""The token stack's document layout built on the host (the packing collator's ``doc_layout``): the model
takes it instead of reading the device to build one, with the same outputs and gradients, and a layout for
other rows is refused."""
from __future__ import annotations

import pytest
import torch

from vlm.modeling import syncs
from vlm.modeling.varlen import LAYOUT_SYNC, LOOP_SYNC, DocLayout

from conftest import build_model


def _packed(B=2, T=24, vocab=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, T), generator=g)
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[0, :10], seg[0, 10:17], seg[0, 17:] = 1, 2, 3
    seg[1, :20] = 1  # then 4 padding positions
    mask = (seg > 0).long()
    pos = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for s in seg[b].unique():
            if s > 0:
                idx = (seg[b] == s).nonzero().flatten()
                pos[b, idx] = torch.arange(idx.numel())
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "segment_ids": seg, "labels": labels}


@pytest.mark.parametrize("chunking", [True, False])
def test_host_layout_gives_the_same_loss_and_gradients_without_the_token_layout_read(chunking, monkeypatch):
    # both runs read the concept count M (a host layout otherwise also switches the concept sequence to
    # its capacity T: equal up to the summation order of padded slots, test_concept_capacity.py)
    torch.manual_seed(0)
    model = build_model(chunking=chunking, **{"runtime.capacity": "exact"})
    batch = _packed()
    layout = DocLayout.on_host(batch["attention_mask"].bool(), batch["segment_ids"])  # as the collator does
    runs = []
    for extra in ({}, {"doc_layout": layout}):
        model.zero_grad()
        with syncs.counting() as named:
            out = model(**batch, **extra)
        out.loss.backward()
        runs.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                     named[LAYOUT_SYNC] + named[LOOP_SYNC]))
    (loss_a, grads_a, reads_a), (loss_b, grads_b, reads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    # the token stack's layout is no longer built (or read) in the forward; the concept stack's still is
    assert reads_b == reads_a - 2, (reads_a, reads_b)  # its build and its document runs


def test_a_layout_for_other_rows_is_refused():
    model = build_model(chunking=False)
    batch = _packed()
    other = DocLayout.build(batch["attention_mask"][:1].bool(), batch["segment_ids"][:1])
    with pytest.raises(ValueError, match="doc_layout is for 1 x 24 positions"):
        model(**batch, doc_layout=other)


def test_the_packing_collator_ships_the_layout_of_its_batch():
    from data_pipelines.collate import PackingCollator

    def sample(n, i):
        ids = torch.arange(4, 4 + n)
        return {"id": str(i), "input_ids": ids, "labels": ids.clone(), "pixel_values": None}
    coll = PackingCollator(pad_id=0, max_length=16)
    batch = coll([sample(n, i) for i, n in enumerate((5, 7, 9, 3))])
    layout = batch["doc_layout"]
    ref = DocLayout.build(batch["attention_mask"].bool(), batch["segment_ids"])
    assert (layout.B, layout.T, layout.max_len) == (ref.B, ref.T, ref.max_len)
    assert "pieces" in layout.__dict__  # computed in the collator, not in the training step (read before below)
    assert torch.equal(layout.cu_seq, ref.cu_seq) and layout.pieces == ref.pieces


@pytest.mark.parametrize("chunking", [True, False])
def test_a_host_layout_without_padding_spares_the_moe_masks(chunking, monkeypatch):
    # rows packed to the last position: the host layout says so, and the token stacks' MoE layers get no
    # padding mask (nothing to mask: no masked sort, output or loss sums), with the same loss and gradients
    from vlm.modeling.moe import MoEFeedForward

    torch.manual_seed(0)
    model = build_model(chunking=chunking, **{"runtime.capacity": "exact"})
    batch = _packed()
    batch["segment_ids"][1, 20:] = 2  # row 1's last 4 positions: a second document instead of padding
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    batch["position_ids"][1, 20:] = torch.arange(4)
    batch["labels"] = batch["input_ids"].clone()
    layout = DocLayout.build(batch["attention_mask"].bool(), batch["segment_ids"])
    assert layout.padded is False and DocLayout.build(_packed()["attention_mask"].bool(), _packed()["segment_ids"]).padded
    seen = []
    forward = MoEFeedForward.forward

    def spy(self, x_BTD, valid_BT=None, stats=True):
        seen[-1].append(valid_BT is None)
        return forward(self, x_BTD, valid_BT, stats)
    monkeypatch.setattr(MoEFeedForward, "forward", spy)
    runs = []
    for extra in ({}, {"doc_layout": layout}):
        seen.append([])
        model.zero_grad()
        out = model(**batch, **extra)
        out.loss.backward()
        runs.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    token_stacks = [*model.model.encoder, *(model.model.decoder if chunking else [])]
    n_tok = sum(layer.is_moe for layer in token_stacks)
    assert n_tok > 0 and not any(seen[0]) and seen[1].count(True) == n_tok, seen  # the concept stack keeps its mask
