"""Honest MFU: the attention map is counted per document (causal half), not over the packed row, over the
real (not padded) tokens; training FLOPs count what trains (a frozen LM: forward + input gradient, checked
against FlopCounterMode); the CPU peak is measured; never an MFU above 100%."""
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from vlm.modeling.configuration_conceptmoe import ConceptMoEConfig
from vlm.flops import flops_per_token
from vlm.flops.training import Trains, region_flops
from vlm.flops.training import train_flops_per_token as count_train_flops
from vlm.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from vlm.training.metrics import MfuMeter, WindowStats, doc_tokens_sq, summarize, train_flops_per_token
from vlm.training import peak as peak_mod
from vlm.training.peak import resolve_peak


def test_doc_tokens_sq_counts_each_document_of_a_packed_row():
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2, 0, 0],     # documents of 3 and 5 tokens, 2 pad
                        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])    # one document of 10
    assert doc_tokens_sq(seg) == 3 ** 2 + 5 ** 2 + 10 ** 2


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


def test_samples_per_s_counts_the_packed_documents_not_the_rows():
    """samples/s of packed batches (the packing collator's): 5 documents in 2 rows, then 3 in 1 row,
    over 2 s: 4 samples/s (counting the rows would give 1.5); a batch without ``num_samples`` counts
    its rows, one sample each."""
    from data_pipelines.collate import PackingCollator

    def doc(n, start):
        return {"input_ids": torch.arange(start, start + n), "labels": torch.arange(start, start + n),
                "pixel_values": None}
    collate = PackingCollator(0, 16, 3, 4)
    batches = [collate([doc(6, 10), doc(5, 20), doc(7, 30), doc(4, 40), doc(8, 50)]),
               collate([doc(5, 60), doc(5, 70), doc(6, 80)])]
    assert [tuple(b["input_ids"].shape) for b in batches] == [(2, 15), (1, 16)]  # packed: 2 rows, 1 row
    stats = WindowStats(image_token_id=None)
    for batch in batches:
        stats.add(_Out(), batch)
    rec = summarize(stats.reduce(), elapsed=2.0, world_size=1)
    assert rec["samples_per_s"] == (5 + 3) / 2.0, rec["samples_per_s"]
    stats = WindowStats(image_token_id=None)
    stats.add(_Out(), {k: batches[0][k] for k in ("input_ids", "attention_mask")})
    assert summarize(stats.reduce(), elapsed=2.0, world_size=1)["samples_per_s"] == 2 / 2.0


def test_mean_doc_len_counts_real_tokens_not_padding():
    """A padded batch: the token-weighted document length divides by the real tokens (18), not the
    padded ones (32); packed (segment ids) and unpacked (a padded row is one document) alike."""
    seg = torch.tensor([[1] * 10 + [0] * 6,
                        [1] * 4 + [2] * 4 + [0] * 8])
    for batch in ({"attention_mask": (seg > 0).long(), "segment_ids": seg, "input_ids": seg},
                  {"attention_mask": (seg > 0).long(), "input_ids": seg}):
        stats = WindowStats(image_token_id=None)
        stats.add(_Out(), batch)
        rec = summarize(stats.reduce(), elapsed=1.0, world_size=1)
        docs = [10, 4, 4] if "segment_ids" in batch else [10, 8]
        assert rec["tokens"] == 18 and rec["mean_row_len"] == 16
        assert rec["mean_doc_len"] == sum(n * n for n in docs) / 18


def test_trains_of_the_llava_align_stage():
    from vlm.config.train import REPO_ROOT, load_train_config
    from vlm.training import optim

    cfg = load_train_config(REPO_ROOT / "configs" / "train" / "llava_align.yaml")
    parts = optim.trainable_parts(cfg)
    counts = {p: 10 if p in parts else 0 for p in optim.PARTS}
    assert Trains.of_counts(counts) == Trains(lm=False, chunker=False, grad_at_input=True)
    full = {p: 10 for p in optim.PARTS}
    assert Trains.of_counts(full) == Trains(lm=True, chunker=True, grad_at_input=True)
    assert Trains.of_counts(full, lora=True) == Trains(lm=False, chunker=True, grad_at_input=True)


def _sdpa(q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q, k, v)


def _sdpa_bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, q, k, v)


def _measured_train_flops(model, ids, trains: Trains) -> tuple[float, float | None]:
    """FlopCounterMode over one forward + backward with only ``trains`` requiring gradients (a trained
    projector is stood in for by input embeddings that require a gradient); and the achieved R."""
    for name, p in model.named_parameters():
        p.requires_grad_(trains.chunker if ".chunker." in name else trains.lm)
    emb = model.get_input_embeddings()(ids)
    if not trains.lm:
        emb = emb.detach().requires_grad_(trains.grad_at_input)
    cpu = torch.ops.aten
    with FlopCounterMode(display=False, custom_mapping={
            cpu._scaled_dot_product_flash_attention_for_cpu: _sdpa,
            cpu._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_bwd}) as fc:
        out = model(inputs_embeds=emb, labels=ids)
        out.loss.backward()
    ratio = ids.shape[1] / int(out.num_concepts[0]) if model.config.chunking else None
    return fc.get_total_flops(), ratio


ALIGN = Trains(lm=False, chunker=False, grad_at_input=True)  # LLaVA stage 1: only the projector trains


@pytest.mark.parametrize("preset", ["tiny", "tiny_concept"])
def test_frozen_lm_counts_forward_and_input_gradient(preset):
    """A frozen LM under a trained projector skips the weight gradient of every weight matmul (one
    forward's worth each); the attention map has no weights, so its backward (2 x forward) stays. Hence
    full - align = forward FLOPs without the attention map (and the dechunk scan). Checked against
    FlopCounterMode over a real forward + backward, also with only the chunker training."""
    cfg = ConceptMoEConfig.from_yaml(f"configs/model/{preset}.yaml")
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(cfg).float().train()
    seq = 64
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    cases = {"full": Trains(), "align": ALIGN}
    if cfg.chunking:
        cases["chunker"] = Trains(lm=False, chunker=True)
    got = {}
    for name, trains in cases.items():
        measured, ratio = _measured_train_flops(model, ids, trains)
        got[name] = measured
        predicted = count_train_flops(cfg, seq, ratio, trains=trains) * seq
        assert predicted == pytest.approx(measured, rel=0.03), name
    f = flops_per_token(cfg, seq)
    full, align = count_train_flops(cfg, seq), count_train_flops(cfg, seq, trains=ALIGN)
    assert full == pytest.approx(f["train_total"], rel=1e-12)
    dechunk = region_flops(cfg, seq)["dechunk"]["map"]
    assert full - align == pytest.approx(f["total_no_attn_map"] - (dechunk if cfg.chunking else 0), rel=1e-12)
    if not cfg.chunking:  # the same difference, measured (ratio-free)
        assert got["full"] - got["align"] == pytest.approx(f["total_no_attn_map"] * seq, rel=1e-9)


def test_cpu_mfu_is_against_a_measured_peak_and_never_above_100_percent(tmp_path, monkeypatch):
    monkeypatch.setenv(peak_mod.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(peak_mod.REMEASURE_ENV, raising=False)
    peak, source = resolve_peak(None, "cpu", torch.float32)
    assert source.startswith("measured") and peak > 1e8
    cache = tmp_path / "cache" / "cpu_peak.json"
    assert f"cached in {cache}" in source, source  # the cache path is said
    # measured once per machine: a second run divides by the same peak, read back from the cache
    entry = json.loads(cache.read_text())[peak_mod.peak_key(torch.float32)]
    assert entry["flops"] == peak
    monkeypatch.setitem(peak_mod._MEASURED, (torch.float32, torch.get_num_threads(), peak_mod.MATMUL_N), 1.0)
    again, source = resolve_peak(None, "cpu", torch.float32)
    assert again == peak and source.startswith(f"cached (measured {entry['measured']})") and str(cache) in source
    monkeypatch.setenv(peak_mod.REMEASURE_ENV, "1")  # measures again and replaces the cached value
    fresh, source = resolve_peak(None, "cpu", torch.float32)
    assert source.startswith("measured") and fresh > 1e8
    assert json.loads(cache.read_text())[peak_mod.peak_key(torch.float32)]["flops"] == fresh
    assert resolve_peak(5e9, "cpu", torch.float32) == (5e9, "log.peak_flops")
    said = []
    meter = MfuMeter(1e9, 2, "1e+09 FLOP/s/device (test)", said.append)
    assert meter(1e9, 1) == {"mfu": 0.5}
    assert meter(3e9, 2) == {} and meter(4e9, 3) == {}
    assert len(said) == 1 and "no MFU" in said[0] and "1e+09 FLOP/s/device (test)" in said[0]


class _ChunkOut:
    """A chunking model's outputs for the window: losses, boundaries, boundary probabilities, expert loads."""

    def __init__(self, loss: float, b, p):
        self.loss = self.lm_loss = torch.tensor(loss)
        self.ratio_loss, self.lb_loss, self.z_loss = torch.tensor(0.5), None, None
        self.boundary_mask, self.boundary_probs = b, p
        self.tokens_per_expert = [torch.tensor([3, 1]), torch.tensor([2, 2])]


def test_window_counts_host_and_device_parts_of_a_vlm_batch():
    """Host counts (tokens, image / text tokens, rows, documents) from the batch, device counts (boundaries,
    probabilities, losses) from the outputs; a non-finite micro-batch adds no loss and is counted."""
    IMG = 9
    ids = torch.tensor([[IMG, IMG, IMG, IMG, 5, 6, 7, 0], [4, 5, 6, 7, 8, 6, 0, 0]])
    mask = (torch.arange(8)[None] < torch.tensor([[7], [6]])).long()
    b = torch.tensor([[1, 0, 1, 0, 1, 0, 1, 1], [1, 1, 0, 1, 0, 1, 1, 1]], dtype=torch.bool)  # pads: ignored
    p = torch.full((2, 8), 0.25)
    batch = {"input_ids": ids, "attention_mask": mask, "num_samples": 2}
    stats = WindowStats(image_token_id=IMG)
    stats.add(_ChunkOut(2.0, b, p), {**batch, "device": {"input_ids": ids, "attention_mask": mask}})
    stats.add(_ChunkOut(float("nan"), b, p), batch)
    rec = summarize(stats.reduce(), elapsed=1.0, world_size=1)
    assert rec["tokens"] == 2 * 13 and rec["nonfinite_loss"] == 1
    assert rec["loss"] == 2.0 and rec["ratio_loss"] == 0.5  # the finite micro-batch only
    assert rec["ratio"] == pytest.approx(13 / 8)              # 4 + 4 boundaries at real tokens per micro-batch
    assert rec["ratio_image"] == pytest.approx(4 / 2) and rec["ratio_text"] == pytest.approx(9 / 6)
    assert rec["boundary_prob"] == pytest.approx(0.25)
    assert rec["mean_row_len"] == 8 and rec["mean_doc_len"] == pytest.approx((7 ** 2 + 6 ** 2) / 13)
    assert rec["expert_load"] == [[0.75, 0.25], [0.5, 0.5]]
