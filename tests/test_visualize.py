"""The boundary visualiser: colours follow concepts; the CLI writes a PNG from a checkpoint."""
import numpy as np
import torch
from PIL import Image

from _data_helpers import tiny_tokenizer, write_image
from vlm import ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration
from vlm.processing import ConceptMoEVLMProcessor
from vlm.visualize import PALETTE, concept_ids, draw, main


def test_concept_ids_follow_boundaries():
    assert concept_ids([1, 0, 0, 1, 1, 0]) == [0, 0, 0, 1, 2, 2]


def test_merged_patches_share_a_colour():
    grid = (2, 2)
    # text, 4 image patches in 2 concepts (patches 0-1 and 2-3), text
    boundary = [1, 1, 0, 1, 0, 1]
    is_image = [0, 1, 1, 1, 1, 0]
    img = Image.new("RGB", (8, 8), "white")
    pic = draw(["a", "", "", "", "", "b"], boundary, is_image, grid, [img], "t")
    assert pic.size[0] > 100 and pic.size[1] > 100
    arr = np.asarray(pic)
    assert arr.std() > 0  # something was drawn
    assert concept_ids(boundary)[1] == concept_ids(boundary)[2] != concept_ids(boundary)[3]
    assert PALETTE[1] != PALETTE[2]


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
