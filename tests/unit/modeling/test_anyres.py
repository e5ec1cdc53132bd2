"""image_aspect "anyres" (LLaVA-NeXT tiles + a thumbnail): the grid choice against transformers'
select_best_resolution, views known from the size, tiles that reassemble the canvas, resize/pad
unchanged, the processor (round trip, token counts before the forward), the training data path
(SampleEncoder, truncation that keeps a picture whole), a tiny VLM forward and a few training steps."""
import json
import math
import pickle
import random

import pytest
import torch
from _data_helpers import digit_record, tiny_tokenizer, write_llava
from PIL import Image
from torchvision import transforms
from transformers.image_processing_utils import (
    get_patch_output_size,
    select_best_resolution,
)

from vlm.modeling.chat_template import ChatTokenizer
from data_pipelines.collate import PadCollator, truncate_sample
from data_pipelines.encode import SampleEncoder
from vlm.modeling.image_transform import (
    ANYRES_GRIDS,
    RESAMPLE_MODES,
    ImageTransform,
    best_grid,
    fit_size,
    pad_to_square,
    split_tiles,
    to_rgb,
)
from vlm import ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration
from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

S, P = 16, 4  # tower side; image tokens per view in the processor / encoder tests
MEAN, STD = [0.5, 0.4, 0.3], [0.25, 0.2, 0.3]
SIZES = [(1, 1), (16, 16), (40, 16), (16, 40), (17, 5), (5, 17), (100, 3), (3, 100), (33, 31), (48, 16),
         (64, 64), (1000, 999), (31, 47), (2, 65)]


def anyres(**kw) -> ImageTransform:
    return ImageTransform(S, MEAN, STD, kw.pop("resample", "bicubic"), "anyres", **kw)


def picture(width, height, seed=0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


# ----- the geometry ---------------------------------------------------------------------------------
def test_grid_choice_matches_transformers():
    rng = random.Random(0)
    sizes = SIZES + [(rng.randint(1, 2000), rng.randint(1, 2000)) for _ in range(400)] \
        + [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(200)]
    grid_lists = [ANYRES_GRIDS, ((1, 1), (2, 2), (3, 3)), ((4, 1), (1, 4), (2, 2), (1, 1)), ((3, 2), (2, 3))]
    for side in (16, 336, 384):
        for grids in grid_lists:
            pinpoints = [(rows * side, cols * side) for cols, rows in grids]  # transformers: (height, width)
            for width, height in sizes:
                cols, rows = best_grid(width, height, grids, side)
                assert (rows * side, cols * side) == select_best_resolution((height, width), pinpoints), \
                    (side, grids, width, height)


def test_fit_size_matches_transformers():
    rng = random.Random(1)
    for _ in range(300):
        width, height = rng.randint(1, 900), rng.randint(1, 900)
        canvas_w, canvas_h = rng.choice([1, 2, 3]) * 16, rng.choice([1, 2, 3]) * 16
        new_h, new_w = get_patch_output_size(torch.zeros(3, height, width), (canvas_h, canvas_w), "channels_first")
        assert fit_size(width, height, canvas_w, canvas_h) == (new_w, new_h)


def test_num_views_from_size_equals_views():
    t = anyres()
    for width, height in SIZES:
        image = picture(width, height)
        views = t.views(image)
        cols, rows = t.grid(width, height)
        assert views.shape == (t.num_views(width, height), 3, S, S) == (1 + cols * rows, 3, S, S)
        assert views.dtype == torch.float32 and torch.isfinite(views).all()
    assert t.num_views(40, 16) == 1 + 3 and t.num_views(16, 40) == 1 + 3 and t.num_views(30, 30) == 1 + 4
    clone = pickle.loads(pickle.dumps(t))  # DataLoader workers get a pickled copy
    assert clone == t and torch.equal(clone.views(picture(40, 16)), t.views(picture(40, 16)))


def test_tiles_reassemble_the_canvas_and_thumbnail_is_pad():
    t = anyres()
    for width, height in [(40, 16), (16, 40), (33, 31), (17, 5), (100, 3)]:
        image = picture(width, height, seed=width)
        views, canvas_3HW = t.views(image), t.anyres_canvas(image)
        cols, rows = t.grid(width, height)
        assert canvas_3HW.shape == (3, rows * S, cols * S)
        for r in range(rows):  # plain reference for split_tiles: raster order, one slice per tile
            for c in range(cols):
                assert torch.equal(views[1 + r * cols + c], canvas_3HW[:, r * S:(r + 1) * S, c * S:(c + 1) * S])
        assert torch.equal(split_tiles(canvas_3HW, S), views[1:])
        pad = ImageTransform(S, MEAN, STD, "bicubic", "pad")
        assert torch.equal(views[0], pad(image))
        # resized keeping the aspect, centred, the rest the mean colour
        fit_w, fit_h = fit_size(width, height, cols * S, rows * S)
        x0, y0 = (cols * S - fit_w) // 2, (rows * S - fit_h) // 2
        fill = (torch.tensor([int(255 * m) for m in MEAN]) / 255 - torch.tensor(MEAN)) / torch.tensor(STD)
        outside = torch.ones(rows * S, cols * S, dtype=torch.bool)
        outside[y0:y0 + fit_h, x0:x0 + fit_w] = False
        assert torch.allclose(canvas_3HW[:, outside], fill[:, None].expand(3, int(outside.sum())))
        inner = transforms.functional.resize(image, [fit_h, fit_w], RESAMPLE_MODES["bicubic"], antialias=True)
        expected = transforms.Normalize(MEAN, STD)(transforms.ToTensor()(inner))
        assert torch.equal(canvas_3HW[:, y0:y0 + fit_h, x0:x0 + fit_w], expected)


def test_resize_and_pad_unchanged():
    """views(image)[0] is __call__, and both equal the transform as it was before anyres."""
    for aspect in ("resize", "pad"):
        t = ImageTransform(S, MEAN, STD, "bicubic", aspect)
        old = transforms.Compose([transforms.Resize((S, S), interpolation=RESAMPLE_MODES["bicubic"], antialias=True),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        for width, height in SIZES[:8]:
            image = picture(width, height).convert("L")
            rgb = to_rgb(image)
            expected = old(pad_to_square(rgb, t.pad_fill) if aspect == "pad" else rgb)
            assert t.num_views(width, height) == 1
            assert torch.equal(t(image), expected) and torch.equal(t.views(image), expected[None])
        assert "anyres_grids" not in t.settings()  # processor_config.json of resize / pad is as before
    with pytest.raises(ValueError, match="views"):
        anyres()(picture(8, 8))


def test_bad_grids_are_one_line_errors():
    for grids, match in [([], "at least one"), ([[1, 1], [1, 1]], "repeats"), ([[0, 1]], "positive"),
                         ([[1, 2, 3]], "positive"), ([[True, 1]], "positive")]:
        with pytest.raises(ValueError, match=match) as info:
            anyres(anyres_grids=grids)
        assert "\n" not in str(info.value)


# ----- config -> encoder -> processor --------------------------------------------------------------
def tiny_vlm(tok, **vision):
    """The tiny VLM (16 px tiny ViT, 16 tokens per view) with ``tok``'s image token ids."""
    overrides = {f"vision.{k}": v for k, v in vision.items()}
    chat = ChatTokenizer(tok, num_image_tokens=1)
    cfg = ConceptMoEVLMConfig.from_yaml("configs/model/vlm_tiny.yaml", image_token_id=chat.image_id,
                                        im_start_token_id=chat.image_start_id, im_end_token_id=chat.image_end_id,
                                        vocab_size=len(tok), **overrides)
    torch.manual_seed(0)
    return ConceptMoEVLMForConditionalGeneration(cfg).eval()


def test_config_grids_reach_the_transform_and_the_saved_processor(tok, tmp_path):
    model = tiny_vlm(tok, image_aspect="anyres", anyres_grids=[[1, 1], [4, 1], [1, 4]])
    t = model.vision.image_transform()
    assert t.image_aspect == "anyres" and t.anyres_grids == ((1, 1), (4, 1), (1, 4))
    assert t.num_views(64, 16) == 5 and t.num_views(20, 20) == 2
    assert tiny_vlm(tok, image_aspect="anyres").vision.image_transform().anyres_grids == ANYRES_GRIDS
    proc = ConceptMoEVLMProcessor(tok, num_image_tokens=P, image_transform=t)
    proc.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["image_aspect"] == "anyres" and saved["anyres_grids"] == [[1, 1], [4, 1], [1, 4]]
    loaded = ConceptMoEVLMProcessor.from_pretrained(str(tmp_path))
    assert loaded.image_transform == t and loaded.image_transform.anyres_grids == t.anyres_grids
    image = picture(64, 16)
    assert torch.equal(loaded.preprocess_images([image]), t.views(image))


def test_processor_counts_image_tokens_before_the_forward(tok):
    proc = ConceptMoEVLMProcessor(tok, num_image_tokens=P, image_transform=anyres())
    chat = proc.chat_tokenizer
    wide, tall, square = picture(40, 16), picture(16, 40, 1), picture(30, 30, 2)
    batch = proc(text=["<image>\nWhat digit is this?", "<image>\n<image>\nSame digit?"], images=[[wide], [tall, square]])
    tiles = proc.image_tiles([wide, tall, square])
    assert tiles == [4, 4, 5] and batch["pixel_values"].shape == (13, 3, S, S)
    ids = batch["input_ids"]
    assert int((ids[0] == chat.image_id).sum()) == 4 * P and int((ids[1] == chat.image_id).sum()) == 9 * P
    assert int((ids == chat.image_start_id).sum()) == 13 == int((ids == chat.image_end_id).sum())
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What digit is this?"}]}]
    row = proc.apply_chat_template(conv, tokenize=True, images=[wide])
    assert row == proc(text=conv, images=[wide], return_tensors=None)["input_ids"][0]
    with pytest.raises(ValueError, match="images="):
        proc.apply_chat_template(conv, tokenize=True)
    with pytest.raises(ValueError, match="2 <image> placeholders but 1 images"):
        proc(text="<image>\n<image>\nhi", images=[wide])


# ----- the training data path ------------------------------------------------------------------------
def encode(chat, transform, images, question="What digit is this?"):
    record = {"id": "s", "images": images, "conversations": [
        {"from": "human", "value": "<image>\n" * len(images) + question}, {"from": "gpt", "value": "3"}]}
    return SampleEncoder(chat, transform)(record)


def test_encoder_views_and_a_tiny_vlm_forward(tok):
    model = tiny_vlm(tok, image_aspect="anyres")
    chat = ChatTokenizer(tok, num_image_tokens=model.num_image_tokens)
    transform = model.vision.image_transform()
    images = [picture(40, 16), picture(16, 40, 1), picture(30, 30, 2)]
    sample = encode(chat, transform, images)
    views = [transform.num_views(*im.size) for im in images]
    assert views == [4, 4, 1 + 4] and sample["image_views"] == views
    assert int((sample["input_ids"] == chat.image_id).sum()) == sum(views) * model.num_image_tokens
    assert torch.equal(sample["pixel_values"], torch.cat([transform.views(im) for im in images]))
    batch = PadCollator.from_chat_tokenizer(chat, 512)([sample])
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                    attention_mask=batch["attention_mask"])
    assert out.logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(out.logits).all()


def test_truncation_keeps_a_picture_whole(tok):
    """A cut between two views of one picture moves before the picture's first view."""
    chat = ChatTokenizer(tok, num_image_tokens=P)
    t = anyres()
    record = {"id": "two", "images": [picture(30, 30), picture(40, 16, 1)], "conversations": [  # 1 + 2x2, 1 + 3x1
        {"from": "human", "value": "<image>\nWhat digit is this?"}, {"from": "gpt", "value": "3"},
        {"from": "human", "value": "<image>\nIs it even or odd?"}, {"from": "gpt", "value": "odd"}]}
    sample = SampleEncoder(chat, t)(record)
    assert sample["image_views"] == [5, 4]
    ids = sample["input_ids"]
    ends = (ids == chat.image_end_id).nonzero().flatten().tolist()
    starts = (ids == chat.image_start_id).nonzero().flatten().tolist()
    first_of_second = starts[5]
    for max_length in (ends[5] + 1, ends[6] + 1, ends[7] + 3, ends[8]):  # between / inside views of picture 2
        cut = truncate_sample(sample, max_length, chat.image_start_id, chat.image_end_id)
        assert cut["input_ids"].tolist() == ids[:first_of_second].tolist()
        assert torch.equal(cut["pixel_values"], sample["pixel_values"][:5]) and cut["image_views"] == [5]
    # without the grouping every view counts as a picture (the pre-anyres rule): consistent, but split
    loose = truncate_sample({**sample, "image_views": None}, ends[6] + 1, chat.image_start_id, chat.image_end_id)
    assert loose["pixel_values"].shape[0] == 7 == int((loose["input_ids"] == chat.image_end_id).sum())
    whole = truncate_sample(sample, ends[8] + 1, chat.image_start_id, chat.image_end_id)
    assert torch.equal(whole["pixel_values"], sample["pixel_values"]) and whole["image_views"] == [5, 4]


def test_a_few_training_steps_on_non_square_images(tmp_path):
    import _train_helpers as helpers

    tiny_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "images").mkdir()
    records = []
    for i, size in enumerate([(40, 16), (16, 40), (24, 24), (50, 12), (12, 30), (16, 16)]):
        picture(*size, seed=i).save(tmp_path / "images" / f"{i}.png")
        records.append(digit_record(i, f"{i}.png", answer=str(i)))
    write_llava(str(tmp_path / "train.json"), records)
    raw = helpers.config(tmp_path, base=helpers.TINY_VLM, name="anyres",
                         model={"tokenizer": str(tmp_path / "tok"), "vision": {"image_aspect": "anyres"}},
                         data={"kind": "mixture", "root": str(tmp_path), "max_length": 160, "num_workers": 0,
                               "datasets": [{"name": "d", "type": "llava_json", "path": "train.json",
                                             "image_root": "images", "weight": 1.0}]},
                         train={"max_steps": 3, "micro_batch_size": 4}, checkpoint={"every_steps": 0})
    trainer = helpers.run_inprocess(raw, tmp_path)
    assert trainer.step == 3
    assert trainer.processor.image_transform.image_aspect == "anyres"
    records = helpers.records(tmp_path / "anyres")
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["skipped_samples"] == {} for r in records)
    assert all(math.isfinite(r["loss"]) for r in records), [r["loss"] for r in records]  # finite
    # every picture here has at least 3 views of 16 + 2 tokens: 4 samples a step carry >= 216 tokens
    assert all(r["tokens"] >= 4 * 3 * (16 + 2) for r in records)
