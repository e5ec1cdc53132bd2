"""Projector: vision patch features [B, P, D] -> language-model tokens [B, Q, d], with the image-token
reductions modern VLMs apply before the LM: pixel shuffle 2x2, average pooling 2x2, top-k pruning."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from .config_base import PosInt, Section, check, fail

PROJECTOR_KINDS = ("linear", "mlp2x_gelu")
PROJECTOR_MERGES = ("none", "pixel_shuffle2x2", "avg_pool2x2", "prune_topk")
GRID_MERGES = ("pixel_shuffle2x2", "avg_pool2x2")  # 2x2 neighbourhoods of an even patch grid -> one token


class ProjectorConfig(Section):
    """kind:  "linear" (one Linear) or "mlp2x_gelu" (Linear -> GELU -> Linear, as in LLaVA-1.5).
    merge: "none" keeps one token per patch (Q = P).
           "pixel_shuffle2x2" (InternVL / nanoVLM pixel shuffle; Qwen2-VL's 2x2 patch merger) concatenates
           each 2x2 neighbourhood of the (even) patch grid into one token of 4*D channels, ordered
           top-left, top-right, bottom-left, bottom-right, before the projection (Q = P / 4).
           "avg_pool2x2" (LLaVA-OneVision's bilinear / average pooling of the patch grid) averages each
           2x2 neighbourhood into one token of D channels (= F.avg_pool2d(kernel 2) on the grid; Q = P / 4).
           "prune_topk" (VisionZip's "dominant tokens"; FastV / PruMerge keep a subset too) keeps the
           ``keep`` patches with the largest feature norm, a score from the vision tower alone, in
           their original raster order, and adds a learned embedding of each kept patch's original grid
           position after the projection (pruned tokens lose their place otherwise; Q = keep).
           A CLS token cannot be merged. Tokens stay in raster order over ``Projector.output_grid``.
    keep:  the number of patch tokens ``prune_topk`` keeps (required for it, refused for the others).
    """

    kind: Literal[PROJECTOR_KINDS] = "mlp2x_gelu"
    merge: Literal[PROJECTOR_MERGES] = "none"
    keep: PosInt | None = None


class Projector(nn.Module):
    def __init__(self, cfg: ProjectorConfig, vision_dim: int, lm_dim: int, patch_grid: tuple[int, int]) -> None:
        super().__init__()
        grid_h, grid_w = patch_grid
        check((cfg.keep is not None) == (cfg.merge == "prune_topk"), "projector.keep",
              f"is required with merge 'prune_topk' and only with it (merge {cfg.merge!r}, keep {cfg.keep})")
        self.cfg = cfg
        self.patch_grid = (grid_h, grid_w)
        in_dim = vision_dim
        if cfg.merge in GRID_MERGES:
            if grid_h % 2 or grid_w % 2:
                raise ValueError(f"projector.merge={cfg.merge!r} needs an even patch grid, got {grid_h}x{grid_w}")
            self.output_grid = (grid_h // 2, grid_w // 2)
            in_dim = 4 * vision_dim if cfg.merge == "pixel_shuffle2x2" else vision_dim
        elif cfg.merge == "prune_topk":
            if cfg.keep > grid_h * grid_w:
                raise fail("projector.keep", f"{cfg.keep} exceeds the {grid_h * grid_w} patches of the "
                                             f"{grid_h}x{grid_w} grid")
            self.output_grid = (1, cfg.keep)  # the kept patches are no grid: one row, in raster order
            self.pos_embed_PD = nn.Parameter(torch.zeros(grid_h * grid_w, lm_dim))
        else:
            self.output_grid = (grid_h, grid_w)
        if cfg.kind == "linear":
            self.proj = nn.Linear(in_dim, lm_dim)
        else:
            self.proj = nn.Sequential(nn.Linear(in_dim, lm_dim), nn.GELU(), nn.Linear(lm_dim, lm_dim))

    def num_output_tokens(self, num_patches: int) -> int:
        """Image tokens handed to the LM for ``num_patches`` vision tokens per image."""
        if self.cfg.merge == "none":
            return num_patches
        self._check_mergeable(num_patches)
        return self.cfg.keep if self.cfg.merge == "prune_topk" else num_patches // 4

    def forward(self, features_BPD: torch.Tensor) -> torch.Tensor:
        if self.cfg.merge == "pixel_shuffle2x2":
            return self.proj(self._merge_2x2(features_BPD))
        if self.cfg.merge == "avg_pool2x2":
            return self.proj(self._avg_pool_2x2(features_BPD))
        if self.cfg.merge == "prune_topk":
            kept_BK = self.keep_indices(features_BPD)
            kept_BKD = features_BPD.gather(1, kept_BK[..., None].expand(-1, -1, features_BPD.shape[-1]))
            return self.proj(kept_BKD) + self.pos_embed_PD[kept_BK]
        return self.proj(features_BPD)

    def keep_indices(self, features_BPD: torch.Tensor) -> torch.Tensor:
        """Long[B, keep]: the patches ``prune_topk`` keeps (largest feature norm), ascending = raster order.
        On the device throughout (topk + sort; no host read)."""
        self._check_mergeable(features_BPD.shape[1])
        score_BP = features_BPD.float().norm(dim=-1)
        return score_BP.topk(self.cfg.keep, dim=1).indices.sort(dim=1).values

    def _check_mergeable(self, num_patches: int) -> None:
        grid_h, grid_w = self.patch_grid
        if num_patches != grid_h * grid_w:
            raise ValueError(
                f"projector.merge={self.cfg.merge!r} expects {grid_h * grid_w} patch tokens (grid {grid_h}x{grid_w}), "
                f"got {num_patches}; it cannot merge a CLS token, set vision.keep_cls=false"
            )

    def _merge_2x2(self, x_BPD: torch.Tensor) -> torch.Tensor:
        batch, num_patches, dim = x_BPD.shape
        self._check_mergeable(num_patches)
        out_h, out_w = self.output_grid
        # Index names: H, W over the output grid; i, j = row, column inside a 2x2 block.
        x_BHiWjD = x_BPD.reshape(batch, out_h, 2, out_w, 2, dim)
        return x_BHiWjD.permute(0, 1, 3, 2, 4, 5).reshape(batch, out_h * out_w, 4 * dim)

    def _avg_pool_2x2(self, x_BPD: torch.Tensor) -> torch.Tensor:
        batch, num_patches, dim = x_BPD.shape
        self._check_mergeable(num_patches)
        out_h, out_w = self.output_grid
        x_BHiWjD = x_BPD.reshape(batch, out_h, 2, out_w, 2, dim)
        return x_BHiWjD.mean(dim=(2, 4)).reshape(batch, out_h * out_w, dim)


def build_projector(cfg: ProjectorConfig, vision_dim: int, lm_dim: int, patch_grid: tuple[int, int]) -> Projector:
    return Projector(cfg, vision_dim, lm_dim, patch_grid)
