"""The VLM: vision encoder -> projector -> patch tokens placed in the text stream -> ConceptMoE LM.

The processor expands each ``<image>`` in the text to ``<im_start>`` + P x ``<image>`` +
``<im_end>`` (P = ``num_image_tokens``). Here the embeddings at the ``<image>`` positions are
replaced, in order of appearance (row-major over the batch), by the projected patch features of
the images in ``pixel_values``; patches are fed in raster order (row by row of the patch grid), so
the chunker sees an image as a 1-D sequence of rows. ``modality_ids`` (1 = image token) let the
chunker apply the cross-modal policy and report per-modality ratios.
"""
from __future__ import annotations

import torch
from transformers import AutoModel, GenerationMixin

from .modeling_conceptmoe import ConceptMoEForCausalLM, ConceptMoEOutput, ConceptMoEPreTrainedModel
from .configuration_conceptmoe_vl import ConceptMoEVLMConfig
from .projector import build_projector
from .vision_registry import build_vision_encoder


class ImageTokenMismatch(ValueError):
    """The number of ``<image>`` tokens does not match the images given."""


class ConceptMoEVLMForConditionalGeneration(ConceptMoEPreTrainedModel, GenerationMixin):
    config_class = ConceptMoEVLMConfig
    base_model_prefix = "vlm"
    _no_split_modules = ["TransformerBlock"]

    def __init__(self, config: ConceptMoEVLMConfig):
        super().__init__(config)
        self.vision = build_vision_encoder(config.vision_config)
        for module in self.vision.modules():
            module._vision_tower = True
        self.projector = build_projector(config.projector_config, self.vision.embed_dim,
                                         config.text_config.hidden_size, self.vision.patch_grid)
        self.language_model = ConceptMoEForCausalLM(config.text_config)
        self.post_init()

    def _init_weights(self, module):
        if getattr(module, "_vision_tower", False):
            return  # the vision tower keeps its own (possibly pretrained) weights
        super()._init_weights(module)

    @property
    def num_image_tokens(self) -> int:
        return self.projector.num_output_tokens(self.vision.num_patches)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def embed(self, input_ids_BT: torch.Tensor, pixel_values=None):
        """Token embeddings with image features spliced in; also returns modality ids."""
        embeds = self.language_model.get_input_embeddings()(input_ids_BT)
        image_pos_BT = input_ids_BT == self.config.image_token_id
        n_tokens, n_images = int(image_pos_BT.sum()), 0 if pixel_values is None else pixel_values.shape[0]
        if n_tokens != n_images * self.num_image_tokens:
            raise ImageTokenMismatch(
                f"{n_tokens} <image> tokens in input_ids but {n_images} image(s) x {self.num_image_tokens} "
                "tokens each: expand every <image> placeholder with the processor, once per image")
        if n_images:
            feats_NPD = self.projector(self.vision(pixel_values.to(next(self.vision.parameters()).dtype)))
            embeds = embeds.masked_scatter(image_pos_BT[..., None], feats_NPD.to(embeds.dtype).reshape(-1))
        return embeds, image_pos_BT.long()

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None,
                labels=None, segment_ids=None, doc_layout=None, **kwargs) -> ConceptMoEOutput:
        embeds, modality_BT = self.embed(input_ids, pixel_values)
        return self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                                   labels=labels, segment_ids=segment_ids, modality_ids=modality_BT,
                                   doc_layout=doc_layout)

    @torch.no_grad()
    def generate(self, input_ids=None, pixel_values=None, attention_mask=None, **kwargs):
        """The image features are spliced into the prompt's embeddings here, once: they are the prefill's
        ``inputs_embeds`` (a beam or returned sequence is a row of those, so no per-image expansion),
        then the language model's ``GenerationMixin.generate`` decodes text over the ConceptCache. Every
        generation option of ``ConceptMoEForCausalLM.generate`` applies (greedy, sampling, beams,
        streamer, scores, ...); the generation config is this model's (saved as generation_config.json).
        Runs in eval mode (then back to the previous mode); returns the prompt ids followed by the new tokens.

        This model's generation config stands in for the language model's during the call (the defaults
        that options and a given ``generation_config`` override), rather than being passed as
        ``generation_config``: transformers warns when one is passed together with other options."""
        lm, was_training = self.language_model, self.training
        lm_config = lm.generation_config
        self.eval()
        try:
            embeds, modality_BT = self.embed(input_ids, pixel_values)
            lm.generation_config = self.generation_config
            return lm.generate(input_ids=input_ids, inputs_embeds=embeds, attention_mask=attention_mask,
                               modality_ids=modality_BT, **kwargs)
        finally:
            lm.generation_config = lm_config
            self.train(was_training)

    def release_decode_graphs(self) -> None:
        """The language model's ``release_decode_graphs``."""
        self.language_model.release_decode_graphs()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """The vision weights travel inside the checkpoint, so the saved config points at no file. The
        export's ``auto_map`` names this class for ``AutoModel`` as well (``register_for_auto_class``, below,
        names one auto class: ``AutoModelForImageTextToText``)."""
        original = dict(self.config.vision)
        self.config.vision = {**original, "pretrained": None}
        cls = type(self)
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}),
                                "AutoModel": f"{cls.__module__.rpartition('.')[2]}.{cls.__name__}"}
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.config.vision = original


AutoModel.register(ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration, exist_ok=True)
try:  # transformers >= 4.50 has the image-text-to-text auto class
    from transformers import AutoModelForImageTextToText
    AutoModelForImageTextToText.register(ConceptMoEVLMConfig, ConceptMoEVLMForConditionalGeneration, exist_ok=True)
except ImportError:  # pragma: no cover
    pass
# the export carries this package's code and auto_map (see modeling_conceptmoe.py)
ConceptMoEVLMForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")
