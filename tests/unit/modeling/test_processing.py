"""ConceptMoEVLMProcessor round trip, generation inputs, and a SentencePiece (Llama / Mistral style) tokenizer."""

import os

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from vlm.modeling.chat_template import ChatTokenizer
from vlm.modeling.chat_common import IGNORE_INDEX, SPECIAL_TOKENS
from _data_helpers import tiny_tokenizer
from vlm.modeling.tokenizer_files import sentencepiece_tokenizer_folder
from _sentencepiece import train_sentencepiece
from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

CONV = [{"from": "human", "value": "<image>\nWhat digit is this?"}, {"from": "gpt", "value": "7"},
        {"from": "human", "value": "Is it even or odd?"}, {"from": "gpt", "value": "odd"}]


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    tok = tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return ConceptMoEVLMProcessor(tok, num_image_tokens=4, image_size=16, image_mean=[0.5] * 3,
                                  image_std=[0.25] * 3, resample="nearest")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return str(train_sentencepiece(tmp_path_factory.mktemp("sp") / "tokenizer.model"))


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory, sp_model):
    out = str(tmp_path_factory.mktemp("sp_folder"))
    sentencepiece_tokenizer_folder(sp_model, out)
    return out


def gray(value):
    return Image.new("L", (8, 8), value)


def test_generation_inputs_left_padded(processor):
    batch = processor(text=["<image>\nWhat digit is this?", "<image>\n<image>\nSame digit?"],
                      images=[[gray(0)], [gray(255), gray(128)]])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape and ids.shape[0] == 2
    assert mask[1].all() and not mask[0, 0] and mask[0, -1]  # shorter prompt padded on the left
    assert (ids[~mask.bool()] == processor.chat_tokenizer.pad_id).all()
    assert batch["pixel_values"].shape == (3, 3, 16, 16)
    assert torch.allclose(batch["pixel_values"][0], torch.full((3, 16, 16), -2.0))  # (0 - .5) / .25
    assert torch.allclose(batch["pixel_values"][1], torch.full((3, 16, 16), 2.0))
    assert int((ids == processor.chat_tokenizer.image_id).sum()) == 3 * 4
    assert processor.decode(ids[0][mask[0].bool()], skip_special_tokens=False).endswith("<|assistant|>\n")
    right = processor(text="hi", padding_side="right", return_tensors=None)
    assert right["pixel_values"] is None and right["attention_mask"] == [[1] * len(right["input_ids"][0])]
    with pytest.raises(ValueError, match="placeholders"):
        processor(text="<image>\nhi", images=None)


def test_chat_template_and_decode(processor):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What digit is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|user|>\n<image>\nWhat digit is this?<|end|>\n<|assistant|>\n"
    as_ids = processor(text=messages, images=gray(0))["input_ids"][0].tolist()
    assert processor.apply_chat_template(messages, tokenize=True) == as_ids
    ids = processor.tokenizer("7<|end|>", add_special_tokens=False)["input_ids"]
    assert processor.batch_decode(torch.tensor([ids])) == ["7"]


def test_save_and_load_round_trip(processor, tmp_path):
    processor.save_pretrained(str(tmp_path))
    files = sorted(os.listdir(tmp_path))
    assert "processor_config.json" in files and "tokenizer.json" in files
    assert all(f.endswith((".json", ".py")) for f in files)  # nothing pickled (.py: the remote code)
    loaded = ConceptMoEVLMProcessor.from_pretrained(str(tmp_path))
    assert loaded.to_dict() == processor.to_dict()
    a = processor(text=CONV, images=[gray(30)])
    b = loaded(text=CONV, images=[gray(30)])
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    assert loaded.tokenizer.chat_template == processor.tokenizer.chat_template
    assert (loaded.image_token_id, loaded.im_start_token_id, loaded.im_end_token_id, loaded.pad_token_id,
            loaded.end_token_id) == (2, 3, 4, 0, 7)


def test_round_trip_keeps_the_aspect_policy(processor, tmp_path):
    padded = ConceptMoEVLMProcessor(processor.tokenizer, num_image_tokens=4, image_size=16, image_mean=[0.5] * 3,
                                    image_std=[0.25] * 3, resample="nearest", image_aspect="pad")
    loaded = ConceptMoEVLMProcessor.from_pretrained(padded.save_pretrained(str(tmp_path)))
    assert loaded.image_transform.settings()["image_aspect"] == "pad"
    wide = Image.new("RGB", (32, 8), (255, 0, 0))  # padded above and below, not stretched
    assert torch.equal(loaded.preprocess_images([wide]), padded.preprocess_images([wide]))


def test_sentencepiece_folder_matches_sentencepiece(sp_dir, sp_model):
    import sentencepiece
    tok = AutoTokenizer.from_pretrained(sp_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    n = sp.get_piece_size()
    assert type(tok).__name__ == "LlamaTokenizer" and len(tok) == n + 8
    for text in ["Hello world", "What digit is this? It is 7.\nNew line", "Ünïcödé 漢字 ok"]:  # bytes: fallback
        assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text)
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(n, n + 8))
    assert tok("a<|end|>b", add_special_tokens=False)["input_ids"].count(ids[-1]) == 1


def test_chat_tokenizer_on_sentencepiece_tokenizer(sp_dir):
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(sp_dir), num_image_tokens=5)
    ids, labels = chat.encode_conversation(CONV, "m", num_images=1)
    assert ids[0] == chat.tokenizer.bos_token_id == 1 and labels[0] == IGNORE_INDEX
    runs, run = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            run.append(t)
        elif run:
            runs.append(chat.decode(run))
            run = []
    assert runs == ["7<|end|>", "odd<|end|>"]
    assert ids.count(chat.image_id) == 5 and labels[ids.index(chat.image_id)] == IGNORE_INDEX
    prompt = chat.encode_prompt(CONV[:1])
    assert ids[:len(prompt)] == prompt
    processor = ConceptMoEVLMProcessor(chat.tokenizer, num_image_tokens=5, image_size=8)
    batch = processor(text=[CONV[:1], "Hi"], images=[gray(9)])
    assert batch["input_ids"].shape[0] == 2 and batch["pixel_values"].shape == (1, 3, 8, 8)
    assert np.isclose(batch["pixel_values"].mean().item(), (9 / 255 - 0.5) / 0.5, atol=1e-3)


def test_processor_uses_the_backbone_transform(tmp_path):
    """for_model takes the vision tower's own transform; saving and loading keeps it and its pixels."""
    from vlm.modeling.image_transform import ImageTransform
    from vlm.modeling.vision_base import VisionEncoderConfig
    from vlm.modeling.vision_registry import build_vision_encoder

    class Model:  # what for_model reads off a VLM
        num_image_tokens = 4
        vision = build_vision_encoder(VisionEncoderConfig(
            backbone="tiny-vit", model_kwargs={"pretrained_cfg_overlay": {"mean": (0.1, 0.2, 0.3)}}))

    tok = tiny_tokenizer(str(tmp_path / "tok"))
    processor = ConceptMoEVLMProcessor.for_model(tok, Model)
    assert processor.image_transform == Model.vision.image_transform()
    assert processor.num_image_tokens == 4 and processor.image_size == 16
    image = Image.fromarray(((np.arange(9 * 13 * 3).reshape(9, 13, 3) * 29) % 256).astype(np.uint8))
    expected = Model.vision.image_transform()(image)
    assert torch.equal(processor.preprocess_images([image])[0], expected)
    loaded = ConceptMoEVLMProcessor.from_pretrained(processor.save_pretrained(str(tmp_path / "p")))
    assert loaded.image_transform == processor.image_transform
    assert torch.equal(loaded.preprocess_images(image)[0], expected)
    other = ImageTransform(8)
    assert ConceptMoEVLMProcessor.from_pretrained(str(tmp_path / "p"), image_transform=other).image_transform == other
    with pytest.raises(ValueError, match="not both"):
        ConceptMoEVLMProcessor(tok, num_image_tokens=4, image_transform=other, image_size=16)


# ----- transformers processor API -------------------------------------------------------------------
def picture(width, height, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("aspect", ["resize", "pad", "anyres"])
def test_image_processor_pixels_are_the_transforms(aspect, tmp_path):
    from transformers import AutoImageProcessor

    from vlm.modeling.image_transform import ImageTransform
    from vlm.modeling.image_processing_conceptmoe_vl import ConceptMoEImageProcessor

    settings = dict(image_size=16, image_mean=[0.1, 0.2, 0.3], image_std=[0.3, 0.2, 0.1], resample="bicubic",
                    image_aspect=aspect)
    transform, ip = ImageTransform(**settings), ConceptMoEImageProcessor(**settings)
    images = [picture(8, 8), picture(40, 16, 1), picture(16, 40, 2).convert("L"), picture(30, 30, 3), picture(13, 9, 4)]
    expected = torch.cat([transform.views(image) for image in images])
    assert torch.equal(ip(images)["pixel_values"], expected)
    assert ip.image_tiles(images) == [transform.num_views(*image.size) for image in images]
    assert ip.transform == transform and ConceptMoEImageProcessor.from_transform(transform) == ip
    ip.save_pretrained(str(tmp_path))
    loaded = AutoImageProcessor.from_pretrained(str(tmp_path))
    assert type(loaded) is ConceptMoEImageProcessor and loaded == ip
    assert torch.equal(loaded([images[:2], images[2:]])["pixel_values"], expected)  # nested lists: same order


def test_auto_classes_and_saved_files(tmp_path):
    import json

    from transformers import AutoImageProcessor, AutoProcessor

    from vlm.modeling.chat_template import CHAT_TEMPLATE
    from vlm.modeling.image_processing_conceptmoe_vl import ConceptMoEImageProcessor

    tok = tiny_tokenizer(str(tmp_path / "tok"))
    processor = ConceptMoEVLMProcessor(tok, num_image_tokens=4, image_size=16, image_aspect="anyres")
    folder = processor.save_pretrained(str(tmp_path / "p"))
    saved = json.loads((tmp_path / "p" / "processor_config.json").read_text())
    assert saved["processor_class"] == "ConceptMoEVLMProcessor" and saved["num_image_tokens"] == 4
    assert saved["image_processor"] == {**processor.image_transform.settings(),
                                        "image_processor_type": "ConceptMoEImageProcessor"}
    assert not os.path.exists(tmp_path / "p" / "chat_template.jinja")  # the tokenizer's template stays inline
    loaded = AutoProcessor.from_pretrained(folder)
    assert type(loaded) is ConceptMoEVLMProcessor and loaded.to_dict() == processor.to_dict()
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE and loaded.chat_template == processor.chat_template
    image_processor = AutoImageProcessor.from_pretrained(folder)
    assert type(image_processor) is ConceptMoEImageProcessor and image_processor == processor.image_processor
    # an export written before the image processor existed: the image settings flat at the top
    old = {"processor_class": "ConceptMoEVLMProcessor", "num_image_tokens": 4, **processor.image_transform.settings(),
           "add_bos": None, "token_ids": saved["token_ids"]}
    (tmp_path / "p" / "processor_config.json").write_text(json.dumps(old))
    for cls in (ConceptMoEVLMProcessor, AutoProcessor):
        assert cls.from_pretrained(folder).to_dict() == processor.to_dict()


def test_hf_messages_with_system_turns_and_return_dict(processor):
    image = gray(0)
    user = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What digit is this?"}]}
    system = {"role": "system", "content": "Be brief."}
    text = processor.apply_chat_template([system, user])
    assert text == "<|user|>\nBe brief.\n\n<image>\nWhat digit is this?<|end|>\n<|assistant|>\n"
    out = processor.apply_chat_template([system, user], add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    expected = processor(text=text, images=[image], chat=False)
    assert set(out) == {"input_ids", "attention_mask", "pixel_values"}
    for key in out:
        assert torch.equal(out[key], expected[key])
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 4 and out["input_ids"].shape[0] == 1
    assert torch.equal(processor(text=[system, user], images=image)["input_ids"], out["input_ids"])
    # without a system turn: the training encoder's prompt, string or list content alike
    plain = [{"role": "user", "content": "<image>\nWhat digit is this?"}]
    ids = processor.apply_chat_template(plain, tokenize=True, return_dict=True, images=[image])["input_ids"][0]
    assert ids.tolist() == processor.chat_tokenizer.encode_prompt(CONV[:1])
    assert processor.apply_chat_template([user], tokenize=True) == ids.tolist()
    assert processor.apply_chat_template(CONV) == processor.chat_tokenizer.render(CONV)[0]  # ends with a reply
    batch = processor.apply_chat_template([[system, user], plain], tokenize=True, return_dict=True, images=[[image], [image]])
    assert batch["input_ids"].shape[0] == 2 and batch["pixel_values"].shape == (2, 3, 16, 16)
    assert not batch["attention_mask"][1, 0] and batch["attention_mask"][0].all()  # left padded
    rows = processor.apply_chat_template([[system, user], plain], tokenize=True, images=[[image], [image]])
    assert rows == [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    text_only = processor.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, return_dict=True)
    assert text_only["input_ids"].shape[0] == 1 and text_only["pixel_values"] is None  # tensors, as with images
    prefill = [plain[0], {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    assert processor.apply_chat_template(prefill, continue_final_message=True).endswith("<|assistant|>\nIt is")
    with pytest.raises(Exception, match="system message must be followed by a user message"):
        processor.apply_chat_template([user, {"role": "assistant", "content": "7"}, system])


@pytest.mark.parametrize("flavour", ["chatml", "llama3"])
def test_pretrained_llm_template_with_system(flavour, tmp_path):
    from data_pipelines.llm_tokenizer import prepare_llm_tokenizer
    from test_llm_tokenizer import CONVERSATION, llm_tokenizer_folder

    tok = AutoTokenizer.from_pretrained(llm_tokenizer_folder(str(tmp_path / "raw"), flavour))
    prepare_llm_tokenizer(tok)
    processor = ConceptMoEVLMProcessor(tok, num_image_tokens=3, image_size=16)
    assert processor.chat_tokenizer.use_model_template and processor.chat_template == tok.chat_template
    image = gray(40)
    prompt = processor.apply_chat_template(CONVERSATION[:1], tokenize=True, images=[image])
    assert prompt == processor.chat_tokenizer.encode_prompt(CONVERSATION[:1])
    if tok.bos_token_id is not None:
        assert prompt.count(tok.bos_token_id) == 1
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CONVERSATION[0]["value"]}]
    text = processor.apply_chat_template(messages)
    assert "Be brief." in text and "You are a helpful assistant." not in text and text.count("<image>") == 1
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, images=image)
    assert torch.equal(out["input_ids"], processor(text=messages, images=[image])["input_ids"])
    loaded = ConceptMoEVLMProcessor.from_pretrained(processor.save_pretrained(str(tmp_path / "p")))
    assert loaded.chat_template == tok.chat_template and loaded.apply_chat_template(messages) == text
