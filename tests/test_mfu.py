"""Honest MFU: the attention map is counted per document (causal half), not over the packed row."""
import torch

from vlm.config import ConceptMoEConfig
from vlm.flops import flops_per_token
from vlm.training.metrics import WindowStats, doc_tokens_sq, summarize, train_flops_per_token


def test_doc_tokens_sq_counts_each_document_of_a_packed_row():
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2, 0, 0],     # documents of 3 and 5 tokens, 2 pad
                        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])    # one document of 10
    assert doc_tokens_sq(seg, "cpu").item() == 3 ** 2 + 5 ** 2 + 10 ** 2


class _Out:
    loss = lm_loss = torch.tensor(1.0)
    ratio_loss = lb_loss = z_loss = None


def test_mfu_uses_the_documents_not_the_packed_row():
    seg = torch.tensor([[1] * 16 + [2] * 16 + [3] * 16 + [4] * 16])  # 4 documents packed in a row of 64
    stats = WindowStats(image_token_id=None)
    stats.add(_Out(), {"attention_mask": (seg > 0).long(), "segment_ids": seg, "input_ids": seg})
    rec = summarize(stats.reduce(), elapsed=1.0, world_size=1)
    assert rec["mean_row_len"] == 64 and rec["mean_doc_len"] == 16
    cfg = ConceptMoEConfig.from_yaml("configs/model/tiny.yaml")
    honest = train_flops_per_token(cfg, rec["mean_doc_len"], None)
    assert honest == flops_per_token(cfg, seq_len=16, causal_half=True)["train_total"]
    packed_full = flops_per_token(cfg, seq_len=64)["train_total"]  # what was counted before
    attn_full = flops_per_token(cfg, seq_len=64)["attn_map"]
    # the attention map: 4 documents of 16, causal half, vs the full 64 x 64 row: 8x smaller (x3 for training)
    assert abs((packed_full - honest) - 3 * attn_full * (1 - 1 / 8)) < 1e-6 * packed_full
