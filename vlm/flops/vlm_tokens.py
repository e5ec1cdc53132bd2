"""The VLM side of the accountant: image tokens per image after the projector's merge, the projector's
parameters, and the language model's FLOPs per sample of image + text tokens at per-modality ratios."""
from __future__ import annotations

from vlm.flops.accountant import flops_per_token


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def image_tokens_per_image(projector, patch_grid: tuple[int, int]) -> int:
    """LM tokens of one image (one view) for a projector config (dict or ``ProjectorConfig``): P for
    "none", P / 4 for the 2x2 merges (pixel_shuffle2x2, avg_pool2x2), ``keep`` for prune_topk."""
    grid_h, grid_w = patch_grid
    merge = _get(projector, "merge", "none") or "none"
    if merge == "none":
        return grid_h * grid_w
    if merge in ("pixel_shuffle2x2", "avg_pool2x2"):
        if grid_h % 2 or grid_w % 2:
            raise ValueError(f"projector.merge={merge!r} needs an even patch grid, got {grid_h}x{grid_w}")
        return grid_h * grid_w // 4
    if merge == "prune_topk":
        return int(_get(projector, "keep"))
    raise ValueError(f"projector.merge={merge!r} is unknown to the accountant")


def projector_params(projector, vision_dim: int, lm_dim: int, patch_grid: tuple[int, int]) -> int:
    """Parameters of the projector (the merge changes the first layer's input width; prune_topk adds
    one learned position embedding per patch of the grid)."""
    merge = _get(projector, "merge", "none") or "none"
    in_dim = 4 * vision_dim if merge == "pixel_shuffle2x2" else vision_dim
    n = in_dim * lm_dim + lm_dim
    if (_get(projector, "kind", "mlp2x_gelu") or "mlp2x_gelu") == "mlp2x_gelu":
        n += lm_dim * lm_dim + lm_dim
    if merge == "prune_topk":
        n += patch_grid[0] * patch_grid[1] * lm_dim
    return n


def pooled_ratio(image_tokens: float, text_tokens: float, image_ratio: float, text_ratio: float) -> float:
    """R over a sample's tokens given per-modality R: tokens / (image concepts + text concepts)."""
    return (image_tokens + text_tokens) / (image_tokens / image_ratio + text_tokens / text_ratio)


def llm_flops_per_sample(text_cfg, image_tokens: int, text_tokens: int, seq_len: int,
                         image_ratio: float | None = None, text_ratio: float | None = None) -> dict:
    """Forward / training LLM FLOPs (attention map excluded) of one sample of ``image_tokens`` +
    ``text_tokens``; with chunking, at the per-modality ratios (default: the config's targets)."""
    n = image_tokens + text_tokens
    ratio = None
    if text_cfg.chunking:
        r_img = image_ratio or text_cfg.image_target_ratio or text_cfg.target_ratio
        r_txt = text_ratio or text_cfg.text_target_ratio or text_cfg.target_ratio
        ratio = pooled_ratio(image_tokens, text_tokens, float(r_img), float(r_txt))
    f = flops_per_token(text_cfg, seq_len, ratio=ratio)
    return {"tokens": n, "ratio": ratio or 1.0, "forward": n * f["total_no_attn_map"],
            "train": n * f["train_total_no_attn_map"]}

