"""The boundary visualiser: the drawn patch colours follow concepts; the CLI writes a PNG."""
import numpy as np
import torch
from PIL import Image

from _data_helpers import tiny_tokenizer, write_image
from vlm import ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration
from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor
from vlm.visualize import PALETTE, concept_ids, draw, main


def test_concept_ids_follow_boundaries():
    assert concept_ids([1, 0, 0, 1, 1, 0]) == [0, 0, 0, 1, 2, 2]


def _blend(colour, under=255.0, alpha=0.55):
    """RGB of a palette colour drawn with ``alpha`` (as draw() does) over a pixel value ``under``."""
    return alpha * np.asarray(colour) * 255 + (1 - alpha) * under


def _patch_cells(arr, colours, tol=3.0):
    """(x0, y0, cell width, cell height) of the 4x4 patch grid: the box of pixels of the given colours."""
    near = np.zeros(arr.shape[:2], dtype=bool)
    for colour in colours:
        near |= np.abs(arr - colour).max(axis=-1) <= tol
    ys, xs = np.nonzero(near)
    return xs.min(), ys.min(), (xs.max() - xs.min() + 1) / 4, (ys.max() - ys.min() + 1) / 4


def test_rendered_patches_follow_concepts(tmp_path):
    """Read the PNG back: patches of one concept share a colour, the next concept changes it mid-row,
    boundary patches get a dark outline, and the picture shows under the colours."""
    grid = (4, 4)
    # text "a" | patches 0-5 = concept 1 | patches 6-15 = concept 2 | text "b"
    boundary = [1] + [1, 0, 0, 0, 0, 0] + [1] + [0] * 9 + [1]
    is_image = [0] + [1] * 16 + [0]
    picture = np.full((8, 8, 3), 255, dtype=np.uint8)
    picture[6:, 6:] = 0  # the last patch of the 4x4 grid (2x2 source pixels each) is black
    out = tmp_path / "concepts.png"
    draw(["a"] + [""] * 16 + ["b"], boundary, is_image, grid, [Image.fromarray(picture)], "t").save(out)
    arr = np.asarray(Image.open(out).convert("RGB")).astype(np.float64)

    first, second = _blend(PALETTE[1]), _blend(PALETTE[2])
    x0, y0, cell_w, cell_h = _patch_cells(arr, [first, second])
    assert cell_w > 20 and abs(cell_w - cell_h) <= 1  # square patches, big enough to sample

    def centre(index):
        row, col = divmod(index, grid[1])
        return arr[int(y0 + (row + 0.5) * cell_h), int(x0 + (col + 0.5) * cell_w)]

    def darkest_on_left_edge(index):
        row, col = divmod(index, grid[1])
        x, y = round(x0 + col * cell_w), int(y0 + (row + 0.5) * cell_h)
        return arr[y - 3:y + 4, x - 4:x + 5].sum(axis=-1).min() / 3

    for index in range(15):
        expected = first if index < 6 else second
        np.testing.assert_allclose(centre(index), expected, atol=3, err_msg=f"patch {index}")
    np.testing.assert_allclose(centre(15), _blend(PALETTE[2], under=0.0), atol=3)  # black picture beneath
    assert np.abs(centre(5) - centre(6)).max() > 30  # the boundary mid-row changes colour
    assert darkest_on_left_edge(6) < 60  # patch 6 starts a concept: outlined
    assert darkest_on_left_edge(5) > 150 and darkest_on_left_edge(2) > 150  # inside a concept: no line


def test_cli_draws_a_checkpoint(tmp_path):
    tok = tiny_tokenizer(str(tmp_path / "tok"))
    ids = {name: tok.convert_tokens_to_ids(name) for name in ("<image>", "<im_start>", "<im_end>")}
    cfg = ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml", vocab_size=len(tok),
                                        image_token_id=ids["<image>"], im_start_token_id=ids["<im_start>"],
                                        im_end_token_id=ids["<im_end>"])
    torch.manual_seed(0)
    model = ConceptMoEVLMForConditionalGeneration(cfg)
    processor = ConceptMoEVLMProcessor(tok, num_image_tokens=model.num_image_tokens,
                                       image_size=model.vision.image_size)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    processor.save_pretrained(str(ckpt))
    image = write_image(str(tmp_path / "digit.png"))
    out = tmp_path / "b.png"
    assert main(["--checkpoint", str(ckpt), "--image", image, "--prompt", "What digit is this?",
                 "--out", str(out)]) == 0
    pic = Image.open(out)
    assert pic.size[0] >= 800
