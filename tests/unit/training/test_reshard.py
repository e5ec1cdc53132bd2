"""Resume at another world size without training (``vlm/training/reshard.py``): the data position maps
with fewer than W' repeated positions and none skipped, and new ranks get a derived RNG state. The
resumed runs themselves are in tests/integration/training/test_resume_world_size.py."""
from __future__ import annotations

import json

import pytest
import torch

from vlm.training import checkpoint as ckpt
from vlm.training import reshard


def _collate(items):
    return {"num_samples": len(items), "skipped": {}, "positions": list(items)}


def _loader(rank, world, batch=4):
    """The real MixtureLoader over one map-style source whose record j is j (no shuffle): a sample is
    its own global position."""
    from data_pipelines.mixture import MixtureDataset, MixtureLoader

    dataset = MixtureDataset([list(range(10_000))], [1.0], lambda x: x, seed=0, shuffle=False)
    return MixtureLoader(dataset, _collate, batch, rank=rank, world_size=world)


@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (2, 3), (3, 2), (4, 3), (3, 4), (2, 4)])
def test_data_position_maps_with_fewer_than_new_world_repeats(tmp_path, old, new):
    """W ranks read 5 batches of 5 each, save; W' ranks resume from the mapped states: positions
    [W' * (c // W'), c) are read twice (c = samples_consumed; fewer than W', none if W' divides c)
    and no position is skipped. c = 25 W is not a multiple of W' > 1 here, so a position rounded up
    (skipping samples) fails. Per-rank counters (``seen``, ``bad_counts``) are summed into new rank 0."""
    batch, before = 5, 5
    consumed = set()
    for r in range(old):
        loader = _loader(r, old, batch)
        it = iter(loader)
        for _ in range(before):
            consumed.update(next(it)["positions"])
        state = {"rank": r, "step": before, "rng": ckpt.rng_state(), "data": loader.state_dict()}
        assert state["data"]["seen"] == batch * before
        state["data"]["bad_counts"] = {"corrupt_image": r + 1}
        ckpt.write_json(tmp_path / ckpt.rank_file(r), state)
    c = len(consumed)
    assert consumed == set(range(c)) and c == batch * before * old
    assert new == 1 or c % new  # the case this test is for: W' does not divide the position
    after: list[int] = []
    for r in range(new):
        st = reshard.rank_state(tmp_path, r, old, seed=0, step=before)
        assert st["data"]["bad_counts"] == ({"corrupt_image": sum(range(1, old + 1))} if r == 0 else {})
        loader = _loader(r, new, batch)
        loader.load_state_dict(st["data"])
        assert loader.seen == (c if r == 0 else 0)  # every old rank's count, once
        it = iter(loader)
        for _ in range(3):
            after += next(it)["positions"]
    repeated = consumed & set(after)
    assert len(after) == len(set(after))  # the new ranks read disjoint positions
    assert repeated == set(range(new * (c // new), c)) and len(repeated) == c % new < new
    seen = consumed | set(after)
    assert seen == set(range(max(seen) + 1))  # nothing skipped


def test_new_ranks_get_a_derived_rng_state(tmp_path):
    """Ranks that existed keep their saved RNG state; a new rank's is a pure function of
    (seed, rank, step), differs per rank, and deriving it leaves this process's generators alone."""
    for r in range(2):
        ckpt.write_json(tmp_path / ckpt.rank_file(r), {"rank": r, "rng": ckpt.rng_state(),
                                                        "data": {"index": 5, "seed": 0, "world_size": 2}})
    torch.manual_seed(123)
    probe = torch.get_rng_state()
    states = [reshard.rank_state(tmp_path, r, 2, seed=7, step=10) for r in range(4)]
    assert torch.equal(torch.get_rng_state(), probe)
    saved = [json.loads((tmp_path / ckpt.rank_file(r)).read_text())["rng"] for r in range(2)]
    assert states[0]["rng"] == saved[0] and states[1]["rng"] == saved[1]
    assert states[2]["rng"] != states[3]["rng"] and states[2]["rng"] != saved[1]
    assert reshard.rank_state(tmp_path, 3, 2, seed=7, step=10)["rng"] == states[3]["rng"]
    assert all(s["data"]["index"] == 5 for s in states)  # the synthetic loader keeps its batch index
