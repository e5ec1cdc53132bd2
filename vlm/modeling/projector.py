"""Projector: vision patch features [B, P, D] -> language-model tokens [B, Q, d], optionally 2x2-merged."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from .config_base import Section

PROJECTOR_KINDS = ("linear", "mlp2x_gelu")
PROJECTOR_MERGES = ("none", "pixel_shuffle2x2")


class ProjectorConfig(Section):
    """kind:  "linear" (one Linear) or "mlp2x_gelu" (Linear -> GELU -> Linear, as in LLaVA-1.5).
    merge: "none" keeps one token per patch (Q = P); "pixel_shuffle2x2" concatenates each 2x2
           neighbourhood of the (even) patch grid into one token of 4*D channels, ordered top-left,
           top-right, bottom-left, bottom-right, before the projection (Q = P / 4). A CLS token cannot
           be merged. Tokens stay in raster order over ``Projector.output_grid``.
    """

    kind: Literal[PROJECTOR_KINDS] = "mlp2x_gelu"
    merge: Literal[PROJECTOR_MERGES] = "none"


class Projector(nn.Module):
    def __init__(self, cfg: ProjectorConfig, vision_dim: int, lm_dim: int, patch_grid: tuple[int, int]) -> None:
        super().__init__()
        grid_h, grid_w = patch_grid
        self.cfg = cfg
        self.patch_grid = (grid_h, grid_w)
        if cfg.merge == "pixel_shuffle2x2":
            if grid_h % 2 or grid_w % 2:
                raise ValueError(f"projector.merge='pixel_shuffle2x2' needs an even patch grid, got {grid_h}x{grid_w}")
            self.output_grid = (grid_h // 2, grid_w // 2)
            in_dim = 4 * vision_dim
        else:
            self.output_grid = (grid_h, grid_w)
            in_dim = vision_dim
        if cfg.kind == "linear":
            self.proj = nn.Linear(in_dim, lm_dim)
        else:
            self.proj = nn.Sequential(nn.Linear(in_dim, lm_dim), nn.GELU(), nn.Linear(lm_dim, lm_dim))

    def num_output_tokens(self, num_patches: int) -> int:
        """Image tokens handed to the LM for ``num_patches`` vision tokens per image."""
        if self.cfg.merge == "none":
            return num_patches
        self._check_mergeable(num_patches)
        return num_patches // 4

    def forward(self, features_BPD: torch.Tensor) -> torch.Tensor:
        if self.cfg.merge == "pixel_shuffle2x2":
            features_BPD = self._merge_2x2(features_BPD)
        return self.proj(features_BPD)

    def _check_mergeable(self, num_patches: int) -> None:
        grid_h, grid_w = self.patch_grid
        if num_patches != grid_h * grid_w:
            raise ValueError(
                f"projector.merge='pixel_shuffle2x2' expects {grid_h * grid_w} patch tokens (grid {grid_h}x{grid_w}), "
                f"got {num_patches}; it cannot merge a CLS token, set vision.keep_cls=false"
            )

    def _merge_2x2(self, x_BPD: torch.Tensor) -> torch.Tensor:
        batch, num_patches, dim = x_BPD.shape
        self._check_mergeable(num_patches)
        out_h, out_w = self.output_grid
        # Index names: H, W over the output grid; i, j = row, column inside a 2x2 block.
        x_BHiWjD = x_BPD.reshape(batch, out_h, 2, out_w, 2, dim)
        return x_BHiWjD.permute(0, 1, 3, 2, 4, 5).reshape(batch, out_h * out_w, 4 * dim)


def build_projector(cfg: ProjectorConfig, vision_dim: int, lm_dim: int, patch_grid: tuple[int, int]) -> Projector:
    return Projector(cfg, vision_dim, lm_dim, patch_grid)
