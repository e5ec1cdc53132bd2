"""Pictures of the chunk boundaries: which tokens and which image patches became one concept.

    python -m vlm.visualize --checkpoint runs/train-vlm/hf --image x.png --prompt "What digit is this?" --out b.png

``render_boundaries(...)`` returns the PIL image (for TensorBoard ``add_image`` or a notebook).
"""
from __future__ import annotations

import argparse
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

PALETTE = plt.get_cmap("tab10").colors


def concept_ids(boundary_T) -> list[int]:
    """Concept index of every token (boundary = first token of a concept)."""
    return [int(v) - 1 for v in np.cumsum(np.asarray(boundary_T, dtype=np.int64))]


def draw(tokens: list[str], boundary_T, is_image_T, grid: tuple[int, int], images: list[Image.Image],
         title: str) -> Image.Image:
    """Each image as its patch grid over the picture, patches coloured by concept (raster order, so a
    concept is a run along rows) and outlined where a concept starts; text as coloured spans with a bar
    at each boundary; ``title`` on top."""
    cid = concept_ids(boundary_T)
    img_runs, run, prev = [], [], False  # image token positions, grouped per image
    for t, flag in enumerate(is_image_T):
        if flag:
            run.append(t)
        elif prev:
            img_runs.append(run)
            run = []
        prev = bool(flag)
    if run:
        img_runs.append(run)
    n_img = len(img_runs)
    fig = plt.figure(figsize=(max(8, 3 * n_img + 2), 6 if n_img else 3.5), dpi=110)
    fig.suptitle(title, fontsize=10)
    for i, positions in enumerate(img_runs):
        ax = fig.add_subplot(2 if n_img else 1, max(n_img, 1), i + 1)
        gh, gw = grid
        colours = np.zeros((gh, gw, 3))
        for j, t in enumerate(positions[: gh * gw]):
            colours[j // gw, j % gw] = PALETTE[cid[t] % len(PALETTE)]
        if i < len(images):
            ax.imshow(images[i].convert("RGB").resize((gw * 16, gh * 16), Image.NEAREST),
                      extent=(0, gw, gh, 0))
        ax.imshow(colours, alpha=0.55, extent=(0, gw, gh, 0))
        for j, t in enumerate(positions[: gh * gw]):
            if boundary_T[t]:
                ax.add_patch(plt.Rectangle((j % gw, j // gw), 1, 1, fill=False, lw=1.5, ec="black"))
        n_c = len({cid[t] for t in positions})
        ax.set_title(f"image {i + 1}: {len(positions)} patches -> {n_c} concepts", fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
    ax = fig.add_subplot(2 if n_img else 1, 1, 2 if n_img else 1)
    ax.axis("off")
    x, y, line_h = 0.0, 0.9, 0.14
    for t, tok in enumerate(tokens):
        if is_image_T[t]:
            continue
        text = tok.replace("\n", "\\n") or " "
        w = 0.012 * (len(text) + 1)
        if x + w > 1.0:
            x, y = 0.0, y - line_h
        ax.add_patch(plt.Rectangle((x, y - 0.05), w, 0.1, color=PALETTE[cid[t] % len(PALETTE)], alpha=0.6,
                                   transform=ax.transAxes))
        if boundary_T[t]:
            ax.plot([x, x], [y - 0.06, y + 0.06], color="black", lw=1.5, transform=ax.transAxes)
        ax.text(x + 0.002, y, text, fontsize=7, va="center", family="monospace", transform=ax.transAxes)
        x += w
    fig.canvas.draw()
    out = Image.frombuffer("RGBA", fig.canvas.get_width_height(), fig.canvas.buffer_rgba()).convert("RGB")
    plt.close(fig)
    return out


@torch.no_grad()
def render_boundaries(model, processor, images: list[Image.Image], prompt: str) -> Image.Image:
    """Run the model on one prompt (+ images) in eval mode and draw its concepts (title: the ratios R)."""
    was_training = model.training
    model.eval()
    try:
        batch = processor(text=[prompt], images=images or None)
        device = next(model.parameters()).device
        px = batch["pixel_values"].to(device) if batch["pixel_values"] is not None else None
        out = model(batch["input_ids"].to(device), px, batch["attention_mask"].to(device))
    finally:
        model.train(was_training)
    if out.boundary_mask is None:
        raise ValueError("this model has chunking switched off: there are no concepts to draw")
    ids = batch["input_ids"][0].tolist()
    tokens = processor.tokenizer.convert_ids_to_tokens(ids)
    tokens = [processor.tokenizer.convert_tokens_to_string([t]) for t in tokens]
    is_image = [i == model.config.image_token_id for i in ids]
    comp = out.compression
    parts = [f"R={comp['ratio']:.2f}"] + [f"{k[6:]} R={comp[k]:.2f}" for k in ("ratio_image", "ratio_text") if k in comp]
    return draw(tokens, out.boundary_mask[0].tolist(), is_image, model.projector.output_grid, images,
                "concepts: " + ", ".join(parts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="HF export folder (model + processor)")
    ap.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    ap.add_argument("--prompt", required=True, help="user text; '<image>' placeholders are added if missing")
    ap.add_argument("--out", required=True, help="output PNG")
    args = ap.parse_args(argv)
    from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration
    from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor
    try:
        images = [Image.open(p).convert("RGB") for p in args.image]
    except OSError as err:
        print(f"error: cannot read image: {err}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if images and prompt.count("<image>") < len(images):
        prompt = "<image>\n" * (len(images) - prompt.count("<image>")) + prompt
    model = ConceptMoEVLMForConditionalGeneration.from_pretrained(args.checkpoint)
    processor = ConceptMoEVLMProcessor.from_pretrained(args.checkpoint)
    render_boundaries(model, processor, images, prompt).save(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
