"""ConceptMoEVLMProcessor round trip, generation inputs, and a real pretrained (Mistral) tokenizer."""

import os

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from data_pipelines.chat_template import ChatTokenizer
from data_pipelines.common import IGNORE_INDEX, SPECIAL_TOKENS
from _data_helpers import tiny_tokenizer
from data_pipelines.tokenizer_files import mistral_sentencepiece_path, sentencepiece_tokenizer_folder
from vlm.processing import ConceptMoEVLMProcessor

CONV = [{"from": "human", "value": "<image>\nWhat digit is this?"}, {"from": "gpt", "value": "7"},
        {"from": "human", "value": "Is it even or odd?"}, {"from": "gpt", "value": "odd"}]


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    tok = tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return ConceptMoEVLMProcessor(tok, num_image_tokens=4, image_size=16, image_mean=[0.5] * 3,
                                  image_std=[0.25] * 3, resample="nearest")


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mistral"))
    sentencepiece_tokenizer_folder(mistral_sentencepiece_path(), out)
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
    assert all(f.endswith(".json") for f in files)  # nothing pickled
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


def test_mistral_folder_matches_sentencepiece(mistral_dir):
    import sentencepiece
    tok = AutoTokenizer.from_pretrained(mistral_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=mistral_sentencepiece_path())
    assert type(tok).__name__ == "LlamaTokenizer" and len(tok) == 32000 + 8
    for text in ["Hello world", "What digit is this? It is 7.\nNew line", "Ünïcödé 漢字 ok"]:
        assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text)
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(32000, 32008))
    assert tok("a<|end|>b", add_special_tokens=False)["input_ids"].count(ids[-1]) == 1


def test_chat_tokenizer_on_mistral_tokenizer(mistral_dir):
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(mistral_dir), num_image_tokens=5)
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
    from data_pipelines.images import ImageTransform
    from vision_encoders import VisionEncoderConfig, build_vision_encoder

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
