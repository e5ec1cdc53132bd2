"""vlm.compare.image_use: the spread of the image tokens a VLM's language model receives and how far its
answer moves when the image is swapped, on a tiny VLM of the project's classes: a projector made constant
gives 0 for both, the random-init model more than 0; the batched measures equal plain loops."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, processor, records, image_root): a random tiny VLM and 6 records over 5 noise images
    (records 0 and 1 share one image: the swap must pick another)."""
    from PIL import Image
    from transformers import AutoTokenizer

    from _data_helpers import tiny_tokenizer
    from _eval_helpers import build_tiny_vlm

    root = tmp_path_factory.mktemp("image_use")
    tiny_tokenizer(str(root / "tok"))
    model, processor = build_tiny_vlm(AutoTokenizer.from_pretrained(str(root / "tok")), seed=0)
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / f"{i}.png")
    records = [{"image": f"{max(i - 1, 0)}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat digit is this?" if i % 2 else "<image>\nIs it odd?"},
        {"from": "gpt", "value": "3"}]} for i in range(6)]
    return model, processor, records, str(root)


def test_random_init_model_reads_its_image(tiny):
    from vlm.compare.image_use import image_use

    model, processor, records, root = tiny
    res = image_use(model, processor, records, root, batch_size=4)  # two batches, the last one short
    assert res["records"] == res["images"] == 6 and res["tokens_per_image"] == model.num_image_tokens
    assert res["patch_spread"] > 0.05 and res["image_spread"] > 0.05 and res["patch_std"] > 0.05, res
    assert res["tv"] > 1e-4 and res["max_logit_change"] > 1e-3, res
    assert 0 <= res["flip_rate"] <= 1


def test_constant_projector_gives_zero_spread_and_zero_sensitivity(tiny):
    """The collapse seen in the VLM study: every image token the same vector. Both measures are 0."""
    from vlm.compare.image_use import image_use

    model, processor, records, root = tiny
    last = model.projector.proj[-1]
    saved = last.weight.detach().clone(), last.bias.detach().clone()
    with torch.no_grad():
        last.weight.zero_()
        last.bias.normal_(0.0, 1.0)
    try:
        res = image_use(model, processor, records, root, batch_size=4)
    finally:
        with torch.no_grad():
            last.weight.copy_(saved[0])
            last.bias.copy_(saved[1])
    assert res["token_abs_mean"] > 0.1  # a constant, not zero: the spread is relative to it
    assert res["patch_spread"] == res["image_spread"] == res["patch_std"] == 0.0, res
    assert res["tv"] < 1e-6 and res["flip_rate"] == 0.0 and res["max_logit_change"] < 1e-4, res


def test_token_spread_equals_plain_loops():
    from vlm.compare.image_use import token_spread

    x_NQD = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))
    scale = x_NQD.abs().mean().item()
    pairs = [(x_NQD[n, i] - x_NQD[n, j]).abs().mean().item() for n in range(3) for i in range(5) for j in range(5)
             if i != j]
    across = [(x_NQD[a, q] - x_NQD[b, q]).abs().mean().item() for q in range(5) for a in range(3) for b in range(3)
              if a != b]
    res = token_spread(x_NQD)
    assert res["patch_spread"] == pytest.approx(np.mean(pairs) / scale, rel=1e-5)
    assert res["image_spread"] == pytest.approx(np.mean(across) / scale, rel=1e-5)
    assert res["patch_std"] == pytest.approx(x_NQD.std(dim=1).mean().item() / scale, rel=1e-5)


def test_answer_shift_equals_plain_formulas():
    from vlm.compare.image_use import answer_shift

    g = torch.Generator().manual_seed(2)
    own_BV, swap_BV = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    swap_BV[0] = own_BV[0] + 3.0  # a shift of every logit: the same distribution, the same greedy token
    res = answer_shift(own_BV, swap_BV)
    for b in range(4):
        p, q = own_BV[b].softmax(-1).tolist(), swap_BV[b].softmax(-1).tolist()
        assert res["tv"][b].item() == pytest.approx(0.5 * sum(abs(x - y) for x, y in zip(p, q)), abs=1e-6)
        assert res["flip"][b].item() == float(int(own_BV[b].argmax()) != int(swap_BV[b].argmax()))
    assert res["tv"][0].item() < 1e-6 and res["flip"][0].item() == 0.0
    assert res["max_logit_change"][0].item() == pytest.approx(3.0)


def test_swap_partner_shows_another_image():
    from vlm.compare.image_use import swap_partners

    recs = [{"image": n} for n in ("a", "a", "b", "a")]
    assert swap_partners(recs) == [2, 2, 3, 2]
    with pytest.raises(ValueError, match="one image file"):
        swap_partners([{"image": "a"}, {"image": "a"}])


def test_job_key_ignores_the_report_only_image_use_knob(tmp_path):
    """eval.image_use is read by the report alone: changing it must not retrain the finished runs."""
    from vlm.compare.config import load_compare, train_raw
    from vlm.compare.jobs import make_jobs
    from vlm.compare.presets import build_presets

    def keys(*overrides):
        cfg = load_compare(ROOT / "configs" / "compare" / "vlm_smoke.yaml", list(overrides))
        raw = train_raw(cfg)
        return [j["key"] for j in make_jobs(cfg, raw, build_presets(cfg, raw, mode="check"), tmp_path, [0])]

    base = keys()
    assert keys("eval.image_use=3") == base
    assert keys("eval.prefill_batch=3") != base  # the key does see the other eval knobs


def test_cli_prints_the_measures_of_an_export(tiny, tmp_path, capsys):
    """The export loaded back gives the in-memory model's numbers, on the first n records WITH an image."""
    from vlm.compare.image_use import image_use, main

    model, processor, records, root = tiny
    model.save_pretrained(str(tmp_path / "hf"))
    processor.save_pretrained(str(tmp_path / "hf"))
    text_only = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "3"}]}
    (tmp_path / "recs.json").write_text(json.dumps([text_only] + records))
    assert main(["--model", str(tmp_path / "hf"), "--data", str(tmp_path / "recs.json"), "--image-root", root,
                 "-n", "5"]) == 0
    printed = json.loads(capsys.readouterr().out)
    direct = image_use(model, processor, records[:5], root)
    assert printed["records"] == 5
    for k in ("patch_spread", "image_spread", "tv", "flip_rate"):
        assert printed[k] == pytest.approx(direct[k], rel=1e-4, abs=1e-7), k
