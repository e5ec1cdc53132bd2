"""Gradient accumulation: grad_accum 2 x micro-batch 1 gives the gradients of grad_accum 1 x micro-batch 2
on the same two samples, and gradient clipping sees the same global norm.

The loss is a per-micro-batch mean over label tokens (``lm_loss_fn``: it is not normalised by the tokens
of the whole accumulation), and DeepSpeed scales each micro-batch's loss by 1/grad_accum. So the two
configurations give the same gradient exactly when every sample has the same number of label tokens
(the samples here are full-length rows, no padding), and when no loss term depends on the batch as a
whole: the load-balancing and ratio losses (functions of batch statistics) and the random boundary
noise are off here; the z-loss (a token mean) is off too, so only the language-model loss is compared.
Under AdamW a constant gradient scale nearly cancels in the update, so the losses cannot show a wrong
scale: the gradients and the norm the clipping sees do."""
from __future__ import annotations

import _train_helpers as helpers
import pytest
import torch

T = 24  # tokens per sample: every row full, 23 label tokens each
OFF = {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0, "ratio_loss_weight": 0.0, "boundary_noise_tau": 0.0}


def samples(n: int = 2) -> list[dict]:
    """``n`` one-row batches of the synthetic kind (arithmetic progressions mod 56, offset 8), no padding."""
    rows = []
    for start, stride in [(3, 1), (17, 3), (40, 2)][:n]:
        ids = (8 + (start + stride * torch.arange(T)) % 56).view(1, T)
        labels = ids.clone()
        labels[:, 0] = -100
        mask = torch.ones(1, T, dtype=torch.long)
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": mask,
                     "position_ids": torch.arange(T).view(1, T), "segment_ids": mask.clone(), "pixel_values": None})
    return rows


def stacked(batches: list[dict]) -> dict:
    return {k: None if batches[0][k] is None else torch.cat([b[k] for b in batches]) for k in batches[0]}


def one_step(tmp_path, name: str, micro: int, accum: int, batches: list[dict]):
    """One optimizer step of a fresh trainer (same seed: same initial weights) on ``batches``: the
    per-parameter gradients summed over the micro-batches' backward passes (as DeepSpeed scaled them),
    the engine's global gradient norm (what clipping sees) and the micro-batch losses."""
    from vlm.config.train import load_train_config
    from vlm.training.callbacks.base import Callback
    from vlm.training.trainer import Trainer

    raw = helpers.config(tmp_path, name=name, model=OFF, data={"max_length": T},
                         train={"micro_batch_size": micro, "grad_accum": accum, "grad_clip": 1e-3},
                         checkpoint={"every_steps": 0})
    cfg = load_train_config(helpers.write_config(tmp_path, raw, f"{name}.yaml"))
    threads = torch.get_num_threads()
    losses = []

    class Losses(Callback):  # records each micro-batch's loss (a callback: train_step calls on_micro_batch)
        def on_micro_batch(self, trainer, out, batch):
            losses.append(out.loss.detach().clone())

    try:
        trainer = Trainer(cfg, callbacks=[Losses()])
        try:
            named = [(n, p) for n, p in trainer.engine.module.named_parameters() if p.requires_grad]
            grads = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named}
            def record(n):
                def hook(g):  # returns None: the gradient itself is left as it is
                    grads[n].add_(g.float())
                return hook
            hooks = [p.register_hook(record(n)) for n, p in named]
            trainer.engine.train()
            step = trainer.train_step(iter(batches))
            for h in hooks:
                h.remove()
            assert not step.skipped
            norm = float(trainer.engine.get_global_grad_norm())
        finally:
            trainer.close()
    finally:
        torch.set_num_threads(threads)
    return grads, norm, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same two samples as grad_accum 2 x micro-batch 1 and as grad_accum 1 x micro-batch 2."""
    tmp = tmp_path_factory.mktemp("accum")
    two = samples(2)
    return {"acc": one_step(tmp, "acc", micro=1, accum=2, batches=two),
            "big": one_step(tmp, "big", micro=2, accum=1, batches=[stacked(two)])}


def total_norm(grads: dict) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))


def test_accumulated_gradients_equal_one_larger_micro_batch(runs):
    (g_acc, norm_acc, loss_acc), (g_big, norm_big, loss_big) = runs["acc"], runs["big"]
    # the same samples: the big batch's loss is the mean of the two micro-batch losses
    assert len(loss_acc) == 2 and len(loss_big) == 1
    assert float(loss_big[0]) == pytest.approx(float(sum(loss_acc)) / 2, rel=1e-6)
    assert g_acc.keys() == g_big.keys() and len(g_acc) > 10
    worst = max((g_acc[n] - g_big[n]).abs().max().item() / g_big[n].abs().max().item()
                for n in g_big if g_big[n].abs().max() > 0)
    assert worst < 1e-4, (worst, total_norm(g_acc), total_norm(g_big))
    # the norm gradient clipping sees (grad_clip far below it: the step is clipped) is the norm of
    # those gradients, in both configurations
    assert norm_big == pytest.approx(total_norm(g_big), rel=1e-5) and norm_big > 1e-3
    assert norm_acc == pytest.approx(norm_big, rel=1e-5), (norm_acc, norm_big)
