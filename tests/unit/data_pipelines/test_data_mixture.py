"""Mixtures: deterministic order from the seed, worker-count independence, exact resume, ranks."""

from collections import Counter

import numpy as np
import pytest
import torch
import yaml

from vlm.modeling.chat_template import ChatTokenizer
from vlm.modeling.image_transform import ImageTransform
from data_pipelines.mixture import MixtureSchedule, RankBatchSampler, block_quotas, build_loader
from _data_helpers import digit_record, session_default_data, tiny_tokenizer, write_image, write_llava


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    chat = ChatTokenizer(tiny_tokenizer(str(root / "tok")), num_image_tokens=2)
    for i in range(5):
        write_image(str(root / f"{i}.png"), "L", value=40 * i)
    write_llava(str(root / "vqa.json"), [digit_record(i, f"{i % 5}.png", answer=str(i)) for i in range(23)])
    (root / "text.txt").write_text("".join(f"line {i} to be or not to be\n" for i in range(300)))
    cfg = {"root": str(root), "max_length": 48, "packing": True, "datasets": [
        {"name": "vqa", "type": "llava_json", "path": "vqa.json", "weight": 0.7},
        {"name": "text", "type": "text", "path": "text.txt", "weight": 0.3}]}
    return cfg, chat


def batches(cfg, chat, n, state=None, **kwargs):
    loader = build_loader(cfg, chat, ImageTransform(8), batch_size=kwargs.pop("batch_size", 6), **kwargs)
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out, loader


def same(a, b) -> bool:
    keys = ["input_ids", "labels", "attention_mask", "position_ids", "segment_ids"]
    return all(torch.equal(a[k], b[k]) for k in keys) and (
        (a["pixel_values"] is None and b["pixel_values"] is None) or torch.equal(a["pixel_values"], b["pixel_values"]))


def test_schedule_is_a_function_of_seed_and_position():
    s1, s2 = MixtureSchedule([30, 7], [0.7, 0.3], seed=1), MixtureSchedule([30, 7], [0.7, 0.3], seed=1)
    order = [s1(p) for p in range(3000)]
    assert order == [s2(p) for p in reversed(range(3000))][::-1]  # any access order, same answer
    other = MixtureSchedule([30, 7], [0.7, 0.3], seed=2)
    assert order != [other(p) for p in range(3000)]
    counts = Counter(k for k, _ in order)
    assert counts == {0: 2100, 1: 900}  # exact per-block quotas
    draws = [j for k, j in order if k == 1]
    for epoch in range(len(draws) // 7):  # each element exactly once per (dataset) epoch
        assert sorted(draws[epoch * 7:(epoch + 1) * 7]) == list(range(7))
    assert MixtureSchedule([30, 7], [0.7, 0.3], seed=1)(10 ** 12)[0] in (0, 1)  # O(1) far ahead


def test_block_quotas_and_no_shuffle():
    assert block_quotas([1, 1, 1], 1000) == [334, 333, 333]
    plain = MixtureSchedule([5], [1.0], shuffle=False)
    assert [plain(p) for p in range(12)] == [(0, p % 5) for p in range(12)]


@pytest.mark.parametrize("weights, slots, expected", [
    ([0.5, 0.3, 0.2], 7, [4, 2, 1]),        # exact 3.5 / 2.1 / 1.4: the one spare slot to the 0.5 remainder
    ([0.2, 0.3, 0.5], 7, [1, 2, 4]),        # the same, largest last (the order is not what decides)
    ([0.15, 0.6, 0.25], 4, [1, 2, 1]),      # exact 0.6 / 2.4 / 1.0: the spare to 0.6, never to the exact 1.0
    ([1, 2, 4], 10, [1, 3, 6]),             # exact 1.43 / 2.86 / 5.71: two spares to .86 and .71
    ([0.45, 0.35, 0.2], 9, [4, 3, 2]),      # exact 4.05 / 3.15 / 1.8: one spare, to .8
])
def test_block_quotas_give_spare_slots_to_the_largest_remainders(weights, slots, expected):
    assert block_quotas(weights, slots) == expected


def test_block_quotas_are_within_one_of_the_exact_share_and_favour_larger_remainders():
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = rng.random(int(rng.integers(2, 6))) + 1e-3
        slots = int(rng.integers(1, 50))
        quotas = np.asarray(block_quotas(w.tolist(), slots))
        exact = w / w.sum() * slots
        extra, remainder = quotas - np.floor(exact), exact - np.floor(exact)
        assert quotas.sum() == slots and (np.abs(quotas - exact) < 1).all(), (w, slots, quotas)
        # a larger remainder never gets fewer extra slots than a smaller one
        assert all(extra[i] >= extra[j] for i in range(len(w)) for j in range(len(w))
                   if remainder[i] > remainder[j]), (w, slots, quotas)


def test_rank_slices_are_disjoint():
    flat = [p for r in range(3) for _, batch in zip(range(4), RankBatchSampler(5, r, 3)) for p in batch]
    assert sorted(flat) == list(range(60))  # 3 ranks x 4 batches x 5 positions, no overlap


def test_same_batches_with_and_without_workers(setup):
    cfg, chat = setup
    plain, _ = batches(cfg, chat, 6, num_workers=0, seed=4)
    workers, _ = batches(cfg, chat, 6, num_workers=2, seed=4)
    assert all(same(a, b) for a, b in zip(plain, workers))
    other, _ = batches(cfg, chat, 6, num_workers=0, seed=5)
    assert not all(same(a, b) for a, b in zip(plain, other))


def test_resume_continues_at_the_exact_next_sample(setup):
    cfg, chat = setup
    reference, _ = batches(cfg, chat, 9, seed=7)
    first, loader = batches(cfg, chat, 4, seed=7)
    state = loader.state_dict()
    assert state == {"seed": 7, "samples_consumed": 24, "world_size": 1, "seen": 24, "bad_counts": {}}
    resumed, _ = batches(cfg, chat, 5, state=state, seed=999)  # the state's seed wins
    assert all(same(a, b) for a, b in zip(first + resumed, reference))


def test_resume_with_two_ranks(setup):
    cfg, chat = setup
    for rank in range(2):
        reference, _ = batches(cfg, chat, 5, rank=rank, world_size=2, seed=1)
        _, loader = batches(cfg, chat, 2, rank=rank, world_size=2, seed=1)
        assert loader.state_dict()["samples_consumed"] == 2 * 6 * 2
        resumed, _ = batches(cfg, chat, 3, state=loader.state_dict(), rank=rank, world_size=2, seed=1)
        assert all(same(a, b) for a, b in zip(resumed, reference[2:]))
    r0, _ = batches(cfg, chat, 1, rank=0, world_size=2, seed=1)
    r1, _ = batches(cfg, chat, 1, rank=1, world_size=2, seed=1)
    assert not same(r0[0], r1[0])


def test_default_config_resume_on_default_data(tmp_path_factory):
    from transformers import AutoTokenizer
    root = session_default_data(tmp_path_factory)
    with open("configs/data/default.yaml") as f:
        cfg = yaml.safe_load(f)
    cfg["root"] = root
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(f"{root}/tokenizer"), num_image_tokens=4)
    reference, _ = batches(cfg, chat, 5, batch_size=16, seed=0)
    _, loader = batches(cfg, chat, 2, batch_size=16, seed=0)
    resumed, _ = batches(cfg, chat, 3, state=loader.state_dict(), batch_size=16, seed=0)
    assert all(same(a, b) for a, b in zip(resumed, reference[2:]))
    batch = reference[0]
    assert batch["input_ids"].shape[1] <= 128 and batch["pixel_values"].shape[1:] == (3, 8, 8)
    assert int((batch["input_ids"] == chat.image_id).sum()) == 4 * batch["pixel_values"].shape[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterating_leaves_the_global_rngs_alone(setup, num_workers):
    """A checkpoint restores the global RNG states and the resumed run then starts a new loader
    iterator: a draw from them there (a DataLoader's base seed without a generator of its own) would
    shift the model's random numbers (the chunker's boundary noise) against an uninterrupted run."""
    import random

    import numpy as np

    cfg, chat = setup
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    batches(cfg, chat, 3, num_workers=num_workers, seed=4)
    assert torch.equal(torch.get_rng_state(), before[0]), "iterating the loader drew from the global torch RNG"
    assert random.getstate() == before[1] and (np.random.get_state()[1] == before[2]).all()
