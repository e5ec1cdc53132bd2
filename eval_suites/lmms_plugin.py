"""lmms-eval model ``conceptmoe_vlm``: a ConceptMoE-VL checkpoint behind lmms-eval's ``lmms`` API.

lmms-eval finds it through the entry point ``eval_suites.lmms_plugin:MANIFEST`` (pyproject.toml);
``register()`` adds it to a running registry without one. Usage, model_args and how prompts and
scores are built: eval_suites/README.md.

Prompt and reply format, the same for ``generate_until`` and ``loglikelihood``:

* The user turn is the task's context without trailing whitespace (``<image>`` placeholders added
  by ``build_prompt``); the prompt is ``ChatTokenizer.encode_prompt`` of it, i.e. the user turn
  plus the generation prompt, our ``<|user|>...<|end|>`` format or the LLM's own chat template.
* ``loglikelihood`` scores the continuation as the assistant's reply to that prompt. The reply is
  the continuation without leading whitespace: lmms-eval writes ``target_delimiter`` (default
  " ") between context and continuation, and that delimiter, or whitespace the task moved to the
  end of the context, is never scored. The reply's ids are the tokens the training encoder
  (``ChatTokenizer.encode_conversation``) labels for an assistant turn with that text: the reply
  right after the generation prompt, then the turn end (``end_id``, e.g. ``<|end|>`` or
  ``<|im_end|>``; dropped with ``score_end_token=false``). So ``target_delimiter`` " " and ""
  give identical scores, and a choice scores as the model would generate it.
"""
from __future__ import annotations

import json
import os
import warnings

MODEL_ID = "conceptmoe_vlm"
CLASS_PATH = "eval_suites.lmms_plugin.ConceptMoEVLMEval"


def MANIFEST():
    """Entry-point payload: returns the ``ModelManifest`` of ``conceptmoe_vlm``.

    A callable (which lmms-eval's registry accepts) rather than a module-level ModelManifest:
    importing ``lmms_eval.models.registry_v2`` runs ``lmms_eval.models.__init__``, which loads all
    entry points; if this module is imported first (``from eval_suites.lmms_plugin import ...``),
    the registry would find it half-initialised without a ``MANIFEST`` attribute and drop every
    plugin manifest. Defined before any lmms-eval import, this function is always there.
    """
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=CLASS_PATH)


# lmms-eval's abstract model base class; imported after MANIFEST on purpose (see its docstring)
from lmms_eval.api.model import lmms  # noqa: E402

from vlm.modeling.chat_template import TokenizationMismatch  # noqa: E402
from vlm.modeling.padding import pad_token_lists  # noqa: E402
from vlm.modeling.chat_common import IGNORE_INDEX  # noqa: E402
from eval_suites.common import DEFAULT_BATCH_SIZE, DEFAULT_CPU_THREADS  # noqa: E402
from eval_suites.lmms_compat import apply_lmms_eval_compat  # noqa: E402
from eval_suites.lmms_inputs import (  # noqa: E402
    as_bool,
    as_cpu_threads,
    build_prompt,
    check_checkpoint_dir,
    flatten_visuals,
    messages_to_conversation,
    resolve_device,
    resolve_dtype,
)


def register() -> bool:
    """Add ``conceptmoe_vlm`` to the running lmms-eval registry (no-op when already there)."""
    from lmms_eval import models

    try:
        models.MODEL_REGISTRY_V2.get_manifest(MODEL_ID)
        return False
    except ValueError:
        pass
    models.MODEL_REGISTRY_V2.register_manifest(MANIFEST(), overwrite=True)
    models.AVAILABLE_MODELS[MODEL_ID] = CLASS_PATH.rsplit(".", 1)[-1]
    return True


class ConceptMoEVLMEval(lmms):
    """lmms-eval model for ConceptMoE-VL checkpoints: the ``simple`` interface (context string +
    ``doc_to_visual``; every output type) by default, the ``chat`` one with ``interface=chat``.

    With ``interface=chat`` the instance reports ``is_simple = False``: lmms-eval then builds its
    tasks as message tasks and every generation request carries ``doc_to_messages`` (the task's own,
    e.g. MMMU's interleaved images, or lmms-eval's ``[images..., text]`` default). lmms-eval 0.7
    builds only generation requests that way, so loglikelihood / multiple_choice tasks need the
    default simple interface. ``generate_until`` answers both request shapes either way.
    """

    is_simple = True

    def __init__(self, pretrained="runs/train-vlm/hf", processor=None, device=None, dtype="float32",
                 batch_size=DEFAULT_BATCH_SIZE, max_new_tokens=32, score_end_token=True, interface="simple",
                 cpu_threads=DEFAULT_CPU_THREADS, **kwargs) -> None:
        super().__init__()
        if str(interface).strip().lower() not in ("simple", "chat"):
            raise ValueError(f"conceptmoe_vlm: interface must be simple or chat, got {interface!r}")
        self.is_simple = str(interface).strip().lower() == "simple"

        from vlm import register_auto_classes
        from vlm.modeling.modeling_conceptmoe_vl import ConceptMoEVLMForConditionalGeneration
        from vlm.modeling.processing_conceptmoe_vl import ConceptMoEVLMProcessor

        register_auto_classes()
        ignored = {k: v for k, v in kwargs.items() if k not in ("max_batch_size",) and v is not None}
        if ignored:
            warnings.warn(f"conceptmoe_vlm: ignoring unsupported model_args {sorted(ignored)}", stacklevel=2)
        apply_lmms_eval_compat()

        self._device_str = resolve_device(device)
        if self._device_str == "cpu":  # the trainer's policy (vlm/config/threads.py), one line
            from vlm.config.threads import apply_cpu_threads

            print(f"[conceptmoe_vlm] {apply_cpu_threads(as_cpu_threads(cpu_threads))}", flush=True)
        if isinstance(pretrained, (str, os.PathLike)):
            path = os.fspath(pretrained)
            check_checkpoint_dir(path, need_processor=processor is None)
            torch_dtype = resolve_dtype(dtype, self._device_str)
            model = ConceptMoEVLMForConditionalGeneration.from_pretrained(path, dtype=torch_dtype)
            processor = processor if processor is not None else path
            self.pretrained = path
        else:
            model = pretrained
            self.pretrained = type(model).__name__
            if processor is None:
                raise ValueError("conceptmoe_vlm: pass processor=... together with a model object")
            if dtype not in (None, "auto"):
                model = model.to(resolve_dtype(dtype, self._device_str))
        if isinstance(processor, (str, os.PathLike)):
            if not os.path.isfile(os.path.join(processor, "processor_config.json")):
                raise FileNotFoundError(f"no processor_config.json in {processor} (export the processor with the model)")
            processor = ConceptMoEVLMProcessor.from_pretrained(os.fspath(processor))
        self._model = model.to(self._device_str).eval()
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.chat = processor.chat_tokenizer
        if self.chat.end_id is None:
            raise ValueError("conceptmoe_vlm: the tokenizer has no <|end|> token")
        if isinstance(batch_size, str) and not batch_size.strip().isdigit():
            warnings.warn(f"conceptmoe_vlm: batch_size={batch_size!r} not supported, using {DEFAULT_BATCH_SIZE}",
                          stacklevel=2)
            batch_size = DEFAULT_BATCH_SIZE
        self.batch_size_per_gpu = max(1, int(batch_size))
        self.max_new_tokens = int(max_new_tokens)
        self.score_end_token = as_bool(score_end_token)
        self._reply_cache: dict[str, list[int]] = {}

    # ----- lmms-eval surface -----
    @property
    def model(self):
        return self._model

    @property
    def device(self):
        import torch

        return torch.device(self._device_str)

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def eot_token_id(self) -> int:
        return self.chat.end_id

    def tok_encode(self, string: str) -> list[int]:
        return self.tokenizer(string, add_special_tokens=False)["input_ids"]

    def tok_decode(self, tokens) -> str:
        return self.processor.decode(tokens, skip_special_tokens=True)

    # ----- request plumbing -----
    def _doc(self, task, split, doc_id):
        return self.task_dict[task][split][doc_id]

    def _visuals(self, doc_to_visual, task, split, doc_id) -> list:
        if doc_to_visual is None:
            return []
        return flatten_visuals(doc_to_visual(self._doc(task, split, doc_id)))

    def user_turn(self, context: str, num_images: int) -> str:
        """The user-turn text for a task context (module docstring): trailing whitespace dropped."""
        return build_prompt((context or "").rstrip(), num_images)

    def _pixel_values(self, images):
        pix = self.processor.preprocess_images(images) if images else None
        if pix is None:
            return None
        param = next(self._model.parameters())
        return pix.to(device=param.device, dtype=param.dtype)

    # ----- generate_until -----
    def generate_until(self, requests) -> list[str]:
        from tqdm import tqdm

        prepared = []
        for index, req in enumerate(requests):
            prompt_ids, images, gen_kwargs = self._generation_input(req.args)
            key = json.dumps(gen_kwargs or {}, sort_keys=True, default=str)
            prepared.append((key, -len(prompt_ids), index, prompt_ids, images, dict(gen_kwargs or {})))
        prepared.sort(key=lambda p: (p[0], p[1], p[2]))  # group by gen_kwargs, longest first
        results: list[str | None] = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=(self.rank != 0), desc="conceptmoe_vlm generate")
        start = 0
        while start < len(prepared):
            key = prepared[start][0]
            stop = start
            while stop < len(prepared) and stop - start < self.batch_size and prepared[stop][0] == key:
                stop += 1
            batch = prepared[start:stop]
            texts = self.generate_batch([p[3] for p in batch], [p[4] for p in batch], batch[0][5])
            for item, text in zip(batch, texts):
                results[item[2]] = text
            pbar.update(len(batch))
            start = stop
        pbar.close()
        return results

    def _generation_input(self, args) -> tuple[list[int], list, dict]:
        """(prompt ids, images, gen_kwargs) of a generation request of either interface:
        simple ``(context, gen_kwargs, doc_to_visual, doc_id, task, split)`` or chat
        ``(context, doc_to_messages, gen_kwargs, doc_id, task, split)``."""
        if len(args) == 6 and callable(args[1]) and not isinstance(args[1], dict):
            _context, doc_to_messages, gen_kwargs, doc_id, task, split = args
            conversation, images = messages_to_conversation(doc_to_messages(self._doc(task, split, doc_id)))
            prompt = conversation
        else:
            context, gen_kwargs, doc_to_visual, doc_id, task, split = args
            images = self._visuals(doc_to_visual, task, split, doc_id)
            prompt = self.user_turn(context, len(images))
        return self.chat.encode_prompt(prompt, image_tiles=self.processor.image_tiles(images)), images, gen_kwargs

    def generate_batch(self, prompt_ids: list[list[int]], images: list[list], gen_kwargs: dict) -> list[str]:
        """Greedy / sampled / beam-search continuations for already tokenised prompts (left-padded batch)."""
        gen = dict(gen_kwargs)
        until = gen.pop("until", None)
        if until is None:
            until = []
        elif isinstance(until, str):
            until = [until]
        elif not isinstance(until, (list, tuple)):
            raise ValueError(f"gen_kwargs['until'] must be a str or list, got {type(until).__name__}")
        max_new = int(gen.pop("max_new_tokens", None) or self.max_new_tokens)
        temperature = float(gen.pop("temperature", 0) or 0)
        # sampling needs temperature > 0; an explicit do_sample=false keeps it greedy (HF semantics)
        do_sample = as_bool(gen.pop("do_sample", True)) and temperature > 0
        top_p = gen.pop("top_p", None)
        top_p = 1.0 if top_p in (None, 0) else float(top_p)
        top_k = int(gen.pop("top_k", 0) or 0) or None  # None: no top-k filter (0 would warn in transformers)
        beams = {"num_beams": int(gen.pop("num_beams", 1) or 1)}  # beam search runs on the concept cache
        for key in ("repetition_penalty", "length_penalty", "no_repeat_ngram_size"):
            if gen.get(key) is not None:
                beams[key] = gen.pop(key)
        if gen:
            warnings.warn(f"conceptmoe_vlm: generation kwargs not used: {sorted(gen)}", stacklevel=2)
        stop_ids = {self.chat.end_id}
        for s in until:
            ids = self.tok_encode(s) if s else []
            if len(ids) == 1:
                stop_ids.add(ids[0])
        pad = self.chat.pad_id
        input_ids, mask = pad_token_lists(prompt_ids, pad, "left", device=self.device)
        width = input_ids.shape[1]
        flat = [img for row in images for img in row]
        out = self._model.generate(input_ids=input_ids, pixel_values=self._pixel_values(flat),
                                   attention_mask=mask, max_new_tokens=max_new,
                                   do_sample=do_sample, temperature=temperature if do_sample else 1.0,
                                   top_p=top_p, top_k=top_k, eos_token_id=sorted(stop_ids), pad_token_id=pad,
                                   **beams)
        texts = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
            text = self.tok_decode(row[:cut])
            for s in until:
                if s:
                    text = text.split(s)[0]
            texts.append(text)
        return texts

    # ----- loglikelihood -----
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """``(negative log-likelihood, is_greedy)`` per request.

        A loss, not a log-likelihood: lmms-eval's ``process_results`` picks the multiple-choice answer
        with ``argmin`` of the first element, so the most likely choice must have the smallest value
        (``acc_mutual_info``, which assumes the opposite sign, is not supported). With
        ``score_end_token`` the closing ``<|end|>`` is scored too, so "1" is the whole answer "1",
        not a prefix of "10". The continuation is scored as the assistant reply (module docstring):
        its leading whitespace (lmms-eval's ``target_delimiter``) is not part of it.
        """
        from tqdm import tqdm

        items = []
        for req in requests:
            args = req.args
            if len(args) == 2:  # unconditional requests (acc_mutual_info): no doc, no visuals
                context, continuation, images = args[0], args[1], []
            else:
                context, target, doc_to_visual, doc_id, task, split = args
                continuation = target if isinstance(target, str) else target(self._doc(task, split, doc_id))
                images = self._visuals(doc_to_visual, task, split, doc_id)
            items.append((context, str(continuation), images))
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(items)
        pbar = tqdm(total=len(items), disable=(self.rank != 0), desc="conceptmoe_vlm loglikelihood")
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            scores = self.score_batch([items[i] for i in idx])
            for i, score in zip(idx, scores):
                results[i] = score
            pbar.update(len(idx))
        pbar.close()
        return results

    def continuation_ids(self, continuation: str) -> list[int]:
        """The scored ids of a continuation: its reply tokens + the turn end (module docstring)."""
        reply = str(continuation).lstrip()
        labelled = self._reply_cache.get(reply)
        if labelled is None:
            labelled = self._reply_cache[reply] = self._training_reply_ids(reply)
        if self.score_end_token:
            return list(labelled)
        marker = self.tokenizer(self.chat.marker, add_special_tokens=False)["input_ids"] if self.chat.marker else []
        if marker and labelled[-len(marker):] == marker:
            return labelled[:-len(marker)]
        return list(labelled)

    def _training_reply_ids(self, reply: str) -> list[int]:
        """Ids the training encoder labels for an assistant turn ``reply`` (reply + turn end).

        The user turn is a fixed stand-in: turns are separated by the template's role markers, so it
        does not change how the reply is tokenised."""
        conversation = [{"from": "human", "value": "?"}, {"from": "gpt", "value": reply}]
        try:
            ids, labels = self.chat.encode_conversation(conversation, sample_id="loglikelihood")
        except TokenizationMismatch as err:
            raise ValueError(f"loglikelihood: continuation {reply!r} cannot be encoded as an assistant "
                             f"reply: {err.detail}") from None
        return [tok for tok, lab in zip(ids, labels) if lab != IGNORE_INDEX]

    def encode_request(self, context: str, continuation: str, images) -> tuple[list[int], int]:
        """(prompt ids + scored ids, number of scored ids) of one loglikelihood request."""
        cont = self.continuation_ids(continuation)
        if not cont:
            raise ValueError("loglikelihood: empty continuation")
        prompt = self.chat.encode_prompt(self.user_turn(context, len(images)),
                                         image_tiles=self.processor.image_tiles(images))
        return prompt + cont, len(cont)

    def score_batch(self, items) -> list[tuple[float, bool]]:
        """items: (task text, assistant continuation, images) -> (NLL of the continuation, is_greedy).

        The task text becomes the user turn and the continuation the assistant reply, scored token
        by token (+ the turn end); see the module docstring for the exact rule.
        """
        import torch

        rows, lengths, flat = [], [], []
        for prompt, continuation, images in items:
            row, scored = self.encode_request(prompt, continuation, images)
            rows.append(row)
            lengths.append(scored)
            flat.extend(images)
        input_ids, mask = pad_token_lists(rows, self.chat.pad_id, "left", device=self.device)
        width = input_ids.shape[1]
        with torch.no_grad():
            logits = self._model(input_ids=input_ids, pixel_values=self._pixel_values(flat), attention_mask=mask).logits
        out = []
        for b, n in enumerate(lengths):
            pred = logits[b, width - n - 1: width - 1].float()  # logits at t-1 predict token t
            target = input_ids[b, width - n:]
            logprobs = torch.log_softmax(pred, dim=-1).gather(-1, target[:, None])[:, 0]
            greedy = bool((pred.argmax(-1) == target).all())
            out.append((float(-logprobs.sum()), greedy))
        return out

    # ----- not supported -----
    def generate_until_multi_round(self, requests) -> list[str]:
        raise NotImplementedError(
            "conceptmoe_vlm does not implement generate_until_multi_round (multi-round / agentic "
            "tasks); use generate_until or multiple_choice tasks")
