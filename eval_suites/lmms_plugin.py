"""lmms-eval model ``conceptmoe_vlm``: a ConceptMoE-VL checkpoint behind lmms-eval's ``lmms`` API.

Registration: lmms-eval >= 0.6 reads the entry-point group ``lmms_eval.models``; each entry
point must load to a ``ModelManifest``, an iterable of them, or a callable returning one
(``MANIFEST`` here is such a callable, see its docstring). pyproject.toml has::

    [project.entry-points."lmms_eval.models"]
    conceptmoe_vlm = "eval_suites.lmms_plugin:MANIFEST"

so after ``pip install -e .`` this works with an unmodified lmms-eval 0.7.x::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m lmms_eval --model conceptmoe_vlm \\
        --model_args pretrained=runs/train-vlm/hf,dtype=float32,device=cpu \\
        --tasks cmoe_digits_vqa,cmoe_digits_mc --include_path eval_suites/tasks --output_path runs/eval/x

Without the installed entry point, ``register()`` adds the manifest to the running registry.

model_args (``key=value,...``): ``pretrained`` (HF export dir with config.json, model.safetensors
and the processor files, or an already built ``ConceptMoEVLMForConditionalGeneration`` when the
class is constructed in Python), ``processor`` (dir or ``ConceptMoEVLMProcessor``; defaults to
``pretrained``), ``device`` (default cuda if available, else cpu), ``dtype`` (float32 | bfloat16 |
float16 | auto), ``batch_size``, ``max_new_tokens`` (default when a task sets none, 32),
``score_end_token`` (default true, see ``loglikelihood``).

Prompts: the task's text is one user turn of our chat format; a task text without ``<image>``
placeholders gets one ``<image>\\n`` per visual in front (the training format
``<image>\\nWhat digit is this?``). Generation stops at ``<|end|>`` (and at any ``until`` string
that is a single token); ``until`` strings are also cut from the decoded text.

loglikelihood (multiple_choice tasks): lmms-eval's own ``ConfigurableTask.process_results``
(0.6.x and 0.7.x alike) picks the answer with ``np.argmin`` of the first element of each result,
since lmms-eval models return a *loss* there. We therefore return
``(negative log-likelihood of the continuation, is_greedy)``: the most likely choice has the
smallest value and wins. The NLL is summed over the continuation tokens plus, with
``score_end_token`` (default), the closing ``<|end|>``, so "1" is scored as the whole answer
"1", not as a prefix of "10". Note: ``acc_mutual_info`` (argmax of ll differences) is not
meaningful with this sign convention; our tasks use ``acc``.

Compatibility fix (lmms-eval 0.7, 0.7.1, 0.7.2, 0.7.3): ``lmms_eval.api.instance.
unwrap_generation_output``, applied by the evaluator to EVERY result of every request type,
turns anything that is not a string / GenerationResult / (str, meta) pair into ``str(output)``:
a loglikelihood result ``(1.23, True)`` becomes the string ``"(1.23, True)"``, and
``process_results`` then fails (``lls, is_greedy = zip(*results)`` over characters), so every
multiple_choice / loglikelihood task crashes. ``apply_lmms_eval_compat()`` wraps that function
so that (real number, bool) pairs pass through unchanged and everything else goes to the
original. It is applied when this model is constructed (so only runs that use this model are
touched), only when lmms-eval >= 0.7 is installed AND a probe shows the installed function
really mangles such a pair (a fixed release is left alone). Idempotent.
"""
from __future__ import annotations

import functools
import json
import numbers
import os
import sys
import warnings
from typing import Any

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
from lmms_eval.api.model import lmms

IMAGE_PLACEHOLDER = "<image>"


# ----- registration without the installed entry point -----
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


# ----- lmms-eval 0.7.x compatibility fix -----
_COMPAT_MIN_VERSION = (0, 7)  # first release with unwrap_generation_output (0.6.x passes results as they are)
KNOWN_AFFECTED_VERSIONS = ("0.7", "0.7.1", "0.7.2", "0.7.3")


def _lmms_eval_version() -> tuple[int, ...] | None:
    try:
        from importlib.metadata import version

        raw = version("lmms-eval")
    except Exception:  # pragma: no cover
        return None
    parts = []
    for piece in raw.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts) or None


def is_loglikelihood_result(output: Any) -> bool:
    """A ``(number, bool)`` pair as returned by ``loglikelihood`` (never a text result)."""
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        return False
    value, greedy = output
    try:
        import numpy as np

        bool_types = (bool, np.bool_)
    except ImportError:  # pragma: no cover
        bool_types = (bool,)
    return (isinstance(value, numbers.Real) and not isinstance(value, bool_types)
            and isinstance(greedy, bool_types))


def _mangles_pairs(fn) -> bool:
    try:
        text, _ = fn((-1.5, True))
    except Exception:
        return False
    return not (isinstance(text, (tuple, list)) and len(text) == 2 and float(text[0]) == -1.5)


def apply_lmms_eval_compat() -> bool:
    """Install the unwrap fix when (and only when) the installed lmms-eval needs it.

    Returns True when the fix is active afterwards. Safe to call any number of times.
    """
    version = _lmms_eval_version()
    if version is None or version < _COMPAT_MIN_VERSION:
        return False
    try:
        from lmms_eval.api import instance
    except ImportError:  # pragma: no cover
        return False
    original = getattr(instance, "unwrap_generation_output", None)
    if original is None:
        return False
    if getattr(original, "_cmoe_compat", False):
        _point_evaluator_at(original.__wrapped__, original)
        return True
    if not _mangles_pairs(original):
        return False  # a fixed lmms-eval: leave it alone

    @functools.wraps(original)
    def unwrap_generation_output(output):
        if is_loglikelihood_result(output):
            return (float(output[0]), bool(output[1])), None
        return original(output)

    unwrap_generation_output._cmoe_compat = True
    instance.unwrap_generation_output = unwrap_generation_output
    _point_evaluator_at(original, unwrap_generation_output)
    return True


def _point_evaluator_at(original, patched) -> None:
    """lmms_eval.evaluator imported the name at its import time; swap its global too."""
    evaluator = sys.modules.get("lmms_eval.evaluator")
    if evaluator is not None and getattr(evaluator, "unwrap_generation_output", None) is original:
        evaluator.unwrap_generation_output = patched


# ----- helpers -----
def _as_bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "y", "on")
    return bool(value)


def _resolve_dtype(dtype, device: str):
    import torch

    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        return torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    key = str(dtype).lower().replace("torch.", "")
    if key not in table:
        raise ValueError(f"conceptmoe_vlm: unknown dtype {dtype!r} (float32, bfloat16, float16 or auto)")
    return table[key]


def _resolve_device(device) -> str:
    import torch

    if device is None or str(device).strip() in ("", "auto", "None"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"conceptmoe_vlm: device={device} but CUDA is not available (use device=cpu)")
    return device


def check_checkpoint_dir(path: str, need_processor: bool = True) -> None:
    """Raise FileNotFoundError with one clear line when ``path`` is not a ConceptMoE-VL HF export."""
    from eval_suites.common import checkpoint_problem

    problem = checkpoint_problem(path, need_processor=need_processor)
    if problem:
        raise FileNotFoundError(problem)


def _flatten_visuals(visuals) -> list:
    from PIL import Image

    out = []
    stack = [visuals] if visuals is not None else []
    while stack:
        item = stack.pop(0)
        if item is None:
            continue
        if isinstance(item, Image.Image):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack = list(item) + stack
        elif isinstance(item, str):
            raise NotImplementedError(f"conceptmoe_vlm takes images only; got a path/video input {item!r}")
        elif isinstance(item, dict):
            raise NotImplementedError("conceptmoe_vlm takes images only; got an audio/dict input")
        else:
            raise TypeError(f"conceptmoe_vlm: unsupported visual of type {type(item).__name__}")
    return out


def build_prompt(context: str, num_images: int) -> str:
    """The user-turn text: `<image>\\n` per image in front unless the text already places them."""
    context = context or ""
    placed = context.count(IMAGE_PLACEHOLDER)
    if placed == 0:
        return (IMAGE_PLACEHOLDER + "\n") * num_images + context
    if placed != num_images:
        raise ValueError(f"prompt has {placed} {IMAGE_PLACEHOLDER} placeholders but the doc has {num_images} images")
    return context


class ConceptMoEVLMEval(lmms):
    """lmms-eval ``simple`` model (context string + doc_to_visual) for ConceptMoE-VL checkpoints."""

    is_simple = True

    def __init__(self, pretrained="runs/train-vlm/hf", processor=None, device=None, dtype="float32",
                 batch_size=1, max_new_tokens=32, score_end_token=True, **kwargs) -> None:
        super().__init__()

        import vlm  # noqa: F401  (registers the Auto classes)
        from vlm.modeling.vlm_model import ConceptMoEVLMForConditionalGeneration
        from vlm.processing import ConceptMoEVLMProcessor

        ignored = {k: v for k, v in kwargs.items() if k not in ("max_batch_size",) and v is not None}
        if ignored:
            warnings.warn(f"conceptmoe_vlm: ignoring unsupported model_args {sorted(ignored)}", stacklevel=2)
        apply_lmms_eval_compat()

        self._device_str = _resolve_device(device)
        if isinstance(pretrained, (str, os.PathLike)):
            path = os.fspath(pretrained)
            check_checkpoint_dir(path, need_processor=processor is None)
            torch_dtype = _resolve_dtype(dtype, self._device_str)
            model = ConceptMoEVLMForConditionalGeneration.from_pretrained(path, dtype=torch_dtype)
            processor = processor if processor is not None else path
            self.pretrained = path
        else:
            model = pretrained
            self.pretrained = type(model).__name__
            if processor is None:
                raise ValueError("conceptmoe_vlm: pass processor=... together with a model object")
            if dtype not in (None, "auto"):
                model = model.to(_resolve_dtype(dtype, self._device_str))
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
            warnings.warn(f"conceptmoe_vlm: batch_size={batch_size!r} not supported, using 8", stacklevel=2)
            batch_size = 8
        self.batch_size_per_gpu = max(1, int(batch_size))
        self.max_new_tokens = int(max_new_tokens)
        self.score_end_token = _as_bool(score_end_token)

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
        return _flatten_visuals(doc_to_visual(self._doc(task, split, doc_id)))

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
            context, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
            images = self._visuals(doc_to_visual, task, split, doc_id)
            prompt_ids = self.chat.encode_prompt(build_prompt(context, len(images)))
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

    def generate_batch(self, prompt_ids: list[list[int]], images: list[list], gen_kwargs: dict) -> list[str]:
        """Greedy / sampled continuations for already tokenised prompts (left-padded batch)."""
        import torch

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
        do_sample = temperature > 0 and _as_bool(gen.pop("do_sample", True))
        top_p = gen.pop("top_p", None)
        top_p = 1.0 if top_p in (None, 0) else float(top_p)
        top_k = int(gen.pop("top_k", 0) or 0)
        if int(gen.pop("num_beams", 1) or 1) != 1:
            warnings.warn("conceptmoe_vlm: beam search is not supported; decoding greedily/sampling", stacklevel=2)
        stop_ids = {self.chat.end_id}
        for s in until:
            ids = self.tok_encode(s) if s else []
            if len(ids) == 1:
                stop_ids.add(ids[0])
        width = max(len(r) for r in prompt_ids)
        pad = self.chat.pad_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in prompt_ids], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in prompt_ids], dtype=torch.long)
        flat = [img for row in images for img in row]
        out = self._model.generate(input_ids=input_ids.to(self.device), pixel_values=self._pixel_values(flat),
                                   attention_mask=mask.to(self.device), max_new_tokens=max_new,
                                   do_sample=do_sample, temperature=temperature if do_sample else 1.0,
                                   top_p=top_p, top_k=top_k, eos_token_id=sorted(stop_ids), pad_token_id=pad)
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
        """``(negative log-likelihood, is_greedy)`` per request; see the module docstring for the sign."""
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
        ids = self.tok_encode(continuation)
        return ids + [self.chat.end_id] if self.score_end_token else ids

    def score_batch(self, items) -> list[tuple[float, bool]]:
        """items: (task text, assistant continuation, images) -> (NLL of the continuation, is_greedy).

        The task text becomes the user turn (``build_prompt`` adds the image placeholders); the
        continuation is the assistant reply, scored token by token (+ ``<|end|>``).
        """
        import torch

        rows, lengths, flat = [], [], []
        for prompt, continuation, images in items:
            cont = self.continuation_ids(continuation)
            if not cont:
                raise ValueError("loglikelihood: empty continuation")
            rows.append(self.chat.encode_prompt(build_prompt(prompt, len(images))) + cont)
            lengths.append(len(cont))
            flat.extend(images)
        width = max(len(r) for r in rows)
        pad = self.chat.pad_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=self.device)
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
