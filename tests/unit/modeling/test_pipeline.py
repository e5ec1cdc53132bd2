"""pipeline("image-text-to-text") on a tiny random VLM export, with our processor end to end.

The answer is whatever the random model generates; the point is that transformers' pipeline loads
the export (AutoProcessor -> ConceptMoEVLMProcessor) and turns a PIL image + question into text.
"""
from __future__ import annotations

import pytest
import torch
from PIL import Image
from _eval_helpers import tiny_export

import vlm.modeling.processing_conceptmoe_vl  # noqa: F401 - registers the processor with AutoProcessor
from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration
from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

QUESTION = "What digit is this?"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return tiny_export(root)


@pytest.fixture(scope="module")
def pipe(export):
    from transformers import pipeline

    return pipeline("image-text-to-text", model=export)


def messages(image):
    return [{"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]


def digit():
    return Image.new("RGB", (20, 30), (200, 10, 10))


def new_text(processor, generated, input_ids):
    """The decoded tokens after the prompt (generate may or may not return the prompt)."""
    if generated.shape[1] > input_ids.shape[1] and torch.equal(generated[:, :input_ids.shape[1]], input_ids):
        generated = generated[:, input_ids.shape[1]:]
    return processor.batch_decode(generated)[0]


def test_pipeline_steps_with_our_processor(pipe, export):
    """The pipeline's own preprocess and postprocess around the model's generate."""
    from transformers.utils.chat_template_utils import Chat

    assert type(pipe.processor) is ConceptMoEVLMProcessor and type(pipe.model) is ConceptMoEVLMForConditionalGeneration
    image = digit()
    inputs = pipe.preprocess(Chat(messages(image)))
    expected = pipe.processor.apply_chat_template(messages(image), tokenize=True, return_dict=True)
    assert torch.equal(inputs["input_ids"], expected["input_ids"])
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])
    assert int((inputs["input_ids"] == pipe.processor.image_token_id).sum()) == pipe.model.num_image_tokens
    model_inputs = {k: v for k, v in inputs.items() if k != "text"}
    generated = pipe.model.generate(**model_inputs, max_new_tokens=4)
    out = pipe.postprocess({"generated_sequence": generated, "prompt_text": inputs["text"],
                            "input_ids": inputs["input_ids"]})
    reply = out[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and isinstance(reply["content"], str)
    assert reply["content"] == new_text(pipe.processor, generated, inputs["input_ids"])


def test_pipeline_answers_a_question_about_an_image(pipe):
    assert ConceptMoEVLMForConditionalGeneration.can_generate()  # else the pipeline sets up no generation
    image = digit()
    out = pipe(text=messages(image), max_new_tokens=4)
    reply = out[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and isinstance(reply["content"], str)
    inputs = pipe.processor.apply_chat_template(messages(image), tokenize=True, return_dict=True)
    generated = pipe.model.generate(**inputs, max_new_tokens=4)  # greedy: the same answer
    assert reply["content"] == new_text(pipe.processor, generated, inputs["input_ids"])
    plain = pipe(images=image, text="<image>\n" + QUESTION, max_new_tokens=4)
    assert plain[0]["generated_text"].startswith("<image>\n" + QUESTION)
