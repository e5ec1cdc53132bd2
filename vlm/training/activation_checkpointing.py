"""``train.activation_checkpointing``: which activations the training backward recomputes instead of
keeping (the model's ``ConceptMoEModel.set_activation_checkpointing``, blocks.py):

- ``none``: every activation is kept (the default);
- ``selective``: each transformer block's FFN half (post-attention norm + MoE / dense FFN) is
  recomputed: the MoE keeps the most bytes per unit of recompute (its K-fold gathered tokens and
  [N*K, I] expert activations: 26 MiB per block of the tiny model at T = 4096, ~0.4 GFLOP to
  redo; the attention half keeps 6.6 MiB for ~2.2 GFLOP, its core quadratic in the document length);
- ``full``: every block (token and concept layers) is recomputed; only its input is kept.

Applied by the trainer after the model is built. The checkpoint call is inside the block's
``forward``, so ``train.compile`` traces it with the block (same results, aot_eager and inductor);
ZeRO-3 gathers the parameters again for the recompute. The chunker, dechunk and the loss run
outside the blocks, so boundary decisions and the chunker's noise are drawn once; losses and
gradients are those of ``none`` (tests/unit/training/test_activation_checkpointing.py).
"""
from __future__ import annotations

import torch.nn as nn

from vlm.modeling.conceptmoe import ConceptMoEModel


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """``mode`` on every ConceptMoE backbone in ``model`` (a VLM's language model too); returns the
    number of transformer blocks it applies to (0 for ``none``)."""
    backbones = [m for m in model.modules() if isinstance(m, ConceptMoEModel)]
    n = sum(b.set_activation_checkpointing(mode) for b in backbones)
    return 0 if mode == "none" else n
