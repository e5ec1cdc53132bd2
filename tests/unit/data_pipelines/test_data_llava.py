"""LLaVA JSON/JSONL reader, image mode handling, and the chat tokenizer's masks and prompts."""

import numpy as np
import pytest

from vlm.modeling.chat_template import CHAT_TEMPLATE, ChatTokenizer
from vlm.modeling.chat_common import IGNORE_INDEX, Skip
from data_pipelines.encode import SampleEncoder
from vlm.modeling.image_transform import ImageTransform
from data_pipelines.llava_json import LlavaJsonDataset
from _data_helpers import digit_record, tiny_tokenizer, write_image, write_llava

P = 3  # image tokens per image in these tests


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatTokenizer(tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))), num_image_tokens=P)


@pytest.mark.parametrize("jsonl", [False, True])
def test_reads_json_and_jsonl(tmp_path, jsonl):
    write_image(str(tmp_path / "img" / "a.png"), "L", value=10)
    write_image(str(tmp_path / "img" / "b.png"), "RGB", value=20)
    records = [digit_record(0, "a.png"),
               {"id": "two", "image": ["a.png", "b.png"], "conversations": [
                   {"from": "human", "value": "<image> and <image>: same?"}, {"from": "gpt", "value": "no"}]},
               digit_record(2, None, question="Say hi", answer="hi")]
    path = write_llava(str(tmp_path / ("d.jsonl" if jsonl else "d.json")), records, jsonl=jsonl)
    ds = LlavaJsonDataset(path, image_root=str(tmp_path / "img"))
    assert len(ds) == 3 and ds.is_jsonl == jsonl
    first, two, text_only = ds[0], ds[1], ds[2]
    assert first["id"] == "r0" and len(first["images"]) == 1 and first["images"][0].mode == "RGB"
    assert np.asarray(first["images"][0])[0, 0].tolist() == [10, 10, 10]
    assert [np.asarray(im)[0, 0, 0] for im in two["images"]] == [10, 20]  # order kept
    assert text_only["images"] == [] and text_only["conversations"][1]["value"] == "hi"


@pytest.mark.parametrize("mode", ["L", "LA", "RGB", "RGBA", "CMYK", "I;16", "P"])
def test_image_modes_become_rgb(tmp_path, mode):
    ext = "tif" if mode == "CMYK" else "png"
    write_image(str(tmp_path / f"x.{ext}"), mode, value=100)
    path = write_llava(str(tmp_path / "d.json"), [digit_record(0, f"x.{ext}")])
    image = LlavaJsonDataset(path)[0]["images"][0]  # image_root defaults to the file's folder
    assert image.mode == "RGB"
    assert np.abs(np.asarray(image).astype(int) - 100).max() <= 1


def test_transparent_pixels_composite_on_white(tmp_path):
    from PIL import Image
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(tmp_path / "t.png")
    path = write_llava(str(tmp_path / "d.json"), [digit_record(0, "t.png")])
    assert np.asarray(LlavaJsonDataset(path)[0]["images"][0]).min() == 255


def test_labels_only_on_assistant_replies(chat):
    conv = [{"from": "human", "value": "<image>\nWhat digit is this?"}, {"from": "gpt", "value": "3"},
            {"from": "human", "value": "Is it even or odd?"}, {"from": "gpt", "value": "odd"}]
    ids, labels = chat.encode_conversation(conv, "s", num_images=1)
    assert len(ids) == len(labels)
    labelled = [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX]
    assert all(labels[i] == ids[i] for i in labelled)
    runs = chat.decode([ids[i] for i in labelled])
    assert runs == "3<|end|>odd<|end|>"
    # image span: <im_start> P x <image> <im_end>, never labelled
    start = ids.index(chat.image_start_id)
    assert ids[start:start + P + 2] == [chat.image_start_id] + [chat.image_id] * P + [chat.image_end_id]
    assert all(labels[i] == IGNORE_INDEX for i in range(start, start + P + 2))
    text = chat.decode(ids).replace("<image>" * P, "<image>").replace("<im_start>", "").replace("<im_end>", "")
    assert text == chat.render(conv)[0]


def test_prompt_is_prefix_of_training_sequence(chat):
    conv = [{"from": "human", "value": "<image>\nWhat digit is this?"}, {"from": "gpt", "value": "7"}]
    ids, labels = chat.encode_conversation(conv, "s", num_images=1)
    prompt = chat.encode_prompt(conv)  # trailing assistant turn dropped, generation prompt added
    assert prompt == ids[:len(prompt)]
    assert labels[len(prompt)] != IGNORE_INDEX and all(lab == IGNORE_INDEX for lab in labels[:len(prompt)])
    assert chat.encode_prompt("<image>\nWhat digit is this?") == prompt
    assert chat.decode(prompt).endswith("<|assistant|>\n")


def test_tokenizer_chat_template_matches_renderer(chat):
    tok = chat.tokenizer
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "<image>\nhi"}, {"role": "assistant", "content": "3"}]
    assert tok.apply_chat_template(messages, tokenize=False) == chat.render(messages)[0]
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == \
        chat.render(messages[:1], add_generation_prompt=True)[0]


def test_encoder_produces_tensors(tmp_path, chat):
    write_image(str(tmp_path / "img.png"), "L")
    ds = LlavaJsonDataset(write_llava(str(tmp_path / "d.json"), [digit_record(0)]))
    sample = SampleEncoder(chat, ImageTransform(16))(ds[0])
    assert sample["pixel_values"].shape == (1, 3, 16, 16)
    assert sample["input_ids"].dtype == sample["labels"].dtype
    assert int((sample["input_ids"] == chat.image_id).sum()) == P
    assert SampleEncoder(chat, ImageTransform(16))(Skip("missing_image", "x")) == Skip("missing_image", "x")
