"""What the ``conceptmoe_vlm`` lmms-eval model receives, made usable: model_args values, visuals, prompts."""
from __future__ import annotations

IMAGE_PLACEHOLDER = "<image>"


def as_bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "y", "on")
    return bool(value)


def as_cpu_threads(value) -> int | None:
    """model arg ``cpu_threads``: a positive count, or None / "auto" (OMP_NUM_THREADS, else all cores)."""
    if value is None or str(value).strip().lower() in ("", "auto", "none", "null"):
        return None
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"conceptmoe_vlm: cpu_threads must be a positive integer or auto, got {value!r}")
    return int(text)


def resolve_dtype(dtype, device: str):
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


def resolve_device(device) -> str:
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


def flatten_visuals(visuals) -> list:
    """The PIL images of a doc's visuals (nested lists flattened, in order); videos, audio and paths refused."""
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


def messages_to_conversation(messages) -> tuple[list[dict], list]:
    """lmms-eval chat messages (``doc_to_messages``) -> (our conversation, its PIL images in order).

    Each turn's content parts become one text: an image part is ``<image>`` on its own line at its
    place, text parts are kept as they are; consecutive parts are joined by a newline and the turn
    loses trailing whitespace. So the usual ``[image, text]`` user turn gives
    ``<image>\\n{text}``, the same user turn as the simple interface. A system message is put in
    front of the next user turn (our chat format has no system role); video/audio are refused.
    """
    from PIL import Image

    conversation, images, system = [], [], []
    for message in messages or []:
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"conceptmoe_vlm: chat message role must be system/user/assistant, got {role!r}")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        pieces = []
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if part.get("text"):
                    pieces.append(str(part["text"]))
            elif kind == "image":
                url = part.get("url", part.get("image"))
                if isinstance(url, str):
                    url = Image.open(url)
                if not isinstance(url, Image.Image):
                    raise TypeError(f"conceptmoe_vlm: unsupported image of type {type(url).__name__}")
                images.append(url)
                pieces.append(IMAGE_PLACEHOLDER)
            elif kind in ("video", "audio"):
                raise NotImplementedError(f"conceptmoe_vlm takes images only; got a {kind} message part")
            else:
                raise ValueError(f"conceptmoe_vlm: unknown chat content part {kind!r}")
        text = "\n".join(pieces).rstrip()
        if role == "system":
            system.append(text)
            continue
        if role == "user" and system:
            text = "\n".join(system + [text])
            system = []
        conversation.append({"role": role, "content": text})
    if not conversation or conversation[-1]["role"] != "user":
        raise ValueError("conceptmoe_vlm: chat messages must end with a user turn")
    placed = sum(turn["content"].count(IMAGE_PLACEHOLDER) for turn in conversation)
    if placed != len(images):
        raise ValueError(f"chat messages hold {placed} {IMAGE_PLACEHOLDER} placeholders but {len(images)} images")
    return conversation, images
