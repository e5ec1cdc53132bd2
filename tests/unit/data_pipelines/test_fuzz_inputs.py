"""Fuzzed data inputs (hypothesis): every bad record, image file, shard or text file is skipped and
counted by the data loader with a named reason, or - where a user hands it over directly - refused
with one clear line. Never a crash, never an `unexpected_error:*` skip, and the counts add up.

Example counts are in each test's ``examples(N)`` (``ci`` profile; ``VLM_FUZZ_PROFILE=faults``: 8x,
random; tests/_fuzz.py); the counts really run are printed at teardown ("fuzz examples run ...").
"""
from __future__ import annotations

import io
import json
import struct
import tarfile
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from _fuzz import FUZZ, examples, report
from vlm.modeling.chat_template import ChatTokenizer
from data_pipelines.collate import PadCollator
from vlm.modeling.chat_common import SKIP_REASONS, Skip
from data_pipelines.encode import SampleEncoder
from vlm.modeling.image_transform import ImageTransform, load_image
from data_pipelines.mixture import build_loader
from _data_helpers import tiny_tokenizer
from data_pipelines.webdataset_shards import WebDatasetShards, has_end_marker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")  # truncated TIFFs
RUNS: Counter = Counter()
MAX_PIXELS = 4096  # max_image_pixels of the fuzzed datasets (64 x 64)
MAX_LENGTH = 64
IMAGE_SIZE = 8
KNOWN = set(SKIP_REASONS)
QUESTION, ANSWER = "What digit is this?", "3"
SPECIALS = ["<|pad|>", "<|endoftext|>", "<im_start>", "<im_end>", "<|user|>", "<|assistant|>", "<|end|>"]


# ----- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    yield
    report(request, RUNS, "fuzz examples run")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatTokenizer(tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))), num_image_tokens=4)


def encode_image(mode: str, fmt: str, size=(4, 4), payload: bytes | None = None, **save_kwargs) -> bytes:
    n = len(Image.new(mode, size).tobytes())
    data = (payload or bytes(range(256)) * (n // 256 + 1))[:n].ljust(n, b"\0")
    buf = io.BytesIO()
    Image.frombytes(mode, size, data).save(buf, fmt, **save_kwargs)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that is only a header claiming width x height (plus an empty IDAT): cheap to craft."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", b"") + chunk(b"IEND", b""))


def bmp_with_size(width: int, height: int) -> bytes:
    data = bytearray(encode_image("RGB", "BMP"))
    data[18:26] = struct.pack("<ii", width, height)
    return bytes(data)


# the image pool of the record fuzz: name -> expected outcome of a record using it
GOOD_IMAGES = {"L.png": ("L", "PNG", {}), "RGB.jpg": ("RGB", "JPEG", {}), "RGBA.png": ("RGBA", "PNG", {}),
               "LA.png": ("LA", "PNG", {}), "P.gif": ("P", "GIF", {}), "Pt.png": ("P", "PNG", {"transparency": 3}),
               "CMYK.jpg": ("CMYK", "JPEG", {}), "CMYK.tif": ("CMYK", "TIFF", {}), "I16.png": ("I;16", "PNG", {}),
               "1.bmp": ("1", "BMP", {}), "F.tif": ("F", "TIFF", {}), "PA.tif": ("PA", "TIFF", {})}
BAD_IMAGES = {"empty.png": "corrupt_image", "text.png": "corrupt_image", "trunc.png": "corrupt_image",
              "eps.png": "corrupt_image", "zero.png": "corrupt_image", "bomb.png": "image_too_large",
              "big.png": "image_too_large", "bomb.bmp": "image_too_large", "missing.png": "missing_image",
              "a_dir": "missing_image"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    img = root / "img"
    img.mkdir()
    for name, (mode, fmt, kwargs) in GOOD_IMAGES.items():
        (img / name).write_bytes(encode_image(mode, fmt, **kwargs))
    png = encode_image("L", "PNG", size=(8, 8))
    files = {"empty.png": b"", "text.png": b"this is not an image\n", "trunc.png": png[: len(png) // 2],
             "eps.png": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "zero.png": png_header(0, 0),
             "bomb.png": png_header(100_000, 100_000), "big.png": png_header(65, 65),
             "bomb.bmp": bmp_with_size(50_000, 50_000)}
    for name, data in files.items():
        (img / name).write_bytes(data)
    (img / "a_dir").mkdir()
    return root


# ----- running a file through the loader ----------------------------------------------------------
def outcome_of(batch) -> str:
    if batch["num_samples"]:
        return "kept"
    (reason,) = batch["skipped"]
    return reason


def run_loader(chat, root, dataset: dict, n: int | None, packing: bool = False):
    """Build the training loader over one dataset of n records (None: as many as it holds) and
    read it once. Returns (per-record outcomes, loader); checks that the loader's counts add up
    and match the per-record outcomes."""
    config = {"root": str(root), "max_length": MAX_LENGTH, "packing": packing, "shuffle": False,
              "num_samples": n, "max_bad_fraction": 1.0, "datasets": [dataset]}
    loader = build_loader(config, chat, ImageTransform(IMAGE_SIZE), batch_size=4)
    if n is None:
        n = loader.num_samples = len(loader.dataset)
    assert len(loader.dataset) == n
    # per record (position i is record i: one dataset, shuffle off), through the loader's own
    # encoder and collator
    outcomes = [outcome_of(loader.collator([loader.dataset[i]])) for i in range(n)]
    kept = 0
    for batch in loader:
        kept += batch["num_samples"]
        if batch["pixel_values"] is not None:
            assert batch["pixel_values"].shape[1:] == (3, IMAGE_SIZE, IMAGE_SIZE)
            assert torch.isfinite(batch["pixel_values"]).all()
    skipped = sum(loader.bad_counts.values())
    assert loader.seen == n and kept + skipped == n, (kept, dict(loader.bad_counts), n)
    assert Counter(outcomes) == Counter({**loader.bad_counts, "kept": kept}) - Counter()
    for reason in loader.bad_counts:
        assert reason in KNOWN, f"unnamed skip reason {reason!r} (a crash caught by the encoder?)"
    return outcomes, loader


# ----- LLaVA records ------------------------------------------------------------------------------
def conversation(n_images: int = 1, question: str = QUESTION, answer: str = ANSWER) -> list:
    return [{"from": "human", "value": "<image>\n" * n_images + question}, {"from": "gpt", "value": answer}]


def record(images=("img/L.png",), as_list: bool = True, **kwargs) -> dict:
    rec = {"id": "r", "conversations": conversation(len(images), **kwargs)}
    if images:
        rec["image"] = list(images) if as_list or len(images) != 1 else images[0]
    return rec


scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
not_str = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(),
                    st.lists(st.integers(), min_size=1, max_size=3),
                    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
safe_text = st.characters(exclude_categories=("Cs",), exclude_characters="<")
good_images = st.lists(st.sampled_from(sorted(GOOD_IMAGES)).map(lambda n: f"img/{n}"), max_size=2)


@st.composite
def valid_record(draw):
    images = draw(good_images)
    rec = record(images, as_list=draw(st.booleans()))
    if draw(st.booleans()):  # a second exchange
        rec["conversations"] += [{"from": "human", "value": "Is it even or odd?"}, {"from": "gpt", "value": "odd"}]
    if draw(st.booleans()):  # HF message style
        rec["conversations"] = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                                for t in rec["conversations"]]
    if draw(st.booleans()):
        rec["id"] = draw(scalars)
    return rec, {"kept"}


@st.composite
def free_text_record(draw):
    """Arbitrary text (no '<', so no special token): kept, or a named skip."""
    question = draw(st.text(safe_text, max_size=40))
    answer = draw(st.text(safe_text, min_size=1, max_size=20))
    return record(question=question, answer=answer), {"kept", "tokenization_mismatch", "too_long"}


@st.composite
def broken_record(draw):
    rec = record(draw(st.lists(st.sampled_from(sorted(GOOD_IMAGES)).map(lambda n: f"img/{n}"),
                               min_size=1, max_size=2)))
    conv = rec["conversations"]
    turn = draw(st.sampled_from([0, 1]))
    kind = draw(st.sampled_from([
        "no_conversations", "conversations_type", "turn_type", "turn_keys", "value_type", "role_type",
        "role_unknown", "image_type", "placeholder_count", "placeholder_in_answer", "too_many_images",
        "no_assistant", "empty_conversation", "special_token", "huge_question", "huge_answer", "huge_id",
        "bad_image", "hf_bad_part"]))
    if kind == "no_conversations":
        del rec["conversations"]
        return rec, {"missing_key"}
    if kind == "conversations_type":
        rec["conversations"] = draw(st.one_of(scalars, st.dictionaries(st.text(max_size=3), scalars, max_size=2)))
        return rec, {"missing_key"}
    if kind == "turn_type":
        conv[turn] = draw(st.one_of(scalars, st.lists(scalars, max_size=2)))
        return rec, {"missing_key"}
    if kind == "turn_keys":
        del conv[turn][draw(st.sampled_from(["from", "value"]))]
        return rec, {"missing_key"}
    if kind == "value_type":
        conv[turn]["value"] = draw(not_str)
        return rec, {"missing_key"}
    if kind == "role_type":
        conv[turn]["from"] = draw(st.one_of(st.booleans(), st.integers(), st.floats(),
                                            st.lists(st.text(max_size=3), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)))
        return rec, {"bad_role"}
    if kind == "role_unknown":
        conv[turn]["from"] = draw(st.text(max_size=10).filter(lambda r: r not in ("human", "user", "gpt", "assistant")))
        return rec, {"bad_role"}
    if kind == "image_type":
        rec["image"] = draw(st.one_of(st.booleans(), st.integers(), st.floats(), st.dictionaries(st.text(max_size=2), st.integers(), min_size=1, max_size=1),
                                      st.lists(st.one_of(st.integers(), st.none(), st.booleans()), min_size=1, max_size=2)))
        return rec, {"missing_key"}
    n_images = len(rec["image"])
    if kind == "placeholder_count":
        k = draw(st.integers(0, 3).filter(lambda k: k != n_images))
        conv[0]["value"] = "<image>\n" * k + QUESTION
        return rec, {"placeholder_mismatch"}
    if kind == "placeholder_in_answer":
        conv[1]["value"] = draw(st.sampled_from(["<image>", "it is <image>", "3 <image>\n"]))
        return rec, {"placeholder_mismatch"}
    if kind == "too_many_images":
        rec["image"] = rec["image"] + ["img/L.png"] * draw(st.integers(1, 3))
        return rec, {"placeholder_mismatch"}
    if kind == "no_assistant":
        rec["conversations"] = conv[:1]
        return rec, {"empty_conversation"}
    if kind == "empty_conversation":
        rec["conversations"] = []
        return rec, {"empty_conversation"}
    if kind == "special_token":
        where = draw(st.sampled_from([0, 1]))
        text = conv[where]["value"]
        pos = draw(st.integers(len(text) - len(QUESTION) if where == 0 else 1, len(text)))
        conv[where]["value"] = text[:pos] + draw(st.sampled_from(SPECIALS)) + text[pos:]
        return rec, {"tokenization_mismatch"}
    if kind == "huge_question":  # far longer than max_length: no answer token survives truncation
        conv[0]["value"] += " " + "seven " * draw(st.integers(200, 2000))
        return rec, {"too_long"}
    if kind == "huge_answer":  # truncated, but the start of the answer keeps the loss
        conv[1]["value"] = "3 " + "odd " * draw(st.integers(200, 2000))
        return rec, {"kept"}
    if kind == "huge_id":
        rec["id"] = "x" * draw(st.integers(10_000, 100_000))
        return rec, {"kept"}
    if kind == "bad_image":
        name = draw(st.sampled_from(sorted(BAD_IMAGES)))
        rec["image"][draw(st.integers(0, n_images - 1))] = f"img/{name}"
        return rec, {BAD_IMAGES[name]}
    # hf_bad_part: HF content parts that are not objects, or whose text is not a string
    conv[0] = {"role": "user", "content": [{"type": "image"}] * n_images
               + [draw(st.one_of(scalars, st.builds(lambda t: {"type": "text", "text": t}, not_str)))]}
    return rec, {"missing_key"}


@st.composite
def raw_line(draw):
    """JSONL lines that are not clean JSON objects (bytes)."""
    good = json.dumps(record()).encode()
    kind = draw(st.sampled_from(["truncated", "not_object", "deep", "deep_inside", "huge_int", "int_ok",
                                 "invalid_bytes", "lone_surrogate", "garbage", "nan"]))
    if kind == "truncated":
        return good[: draw(st.integers(1, len(good) - 1))], {"bad_json_line"}
    if kind == "not_object":
        return json.dumps(draw(st.one_of(scalars, st.lists(scalars, max_size=3)))).encode(), {"bad_json_line"}
    if kind == "deep":
        depth = draw(st.sampled_from([5, 3000, 100_000]))
        return b"[" * depth + b"]" * depth, {"bad_json_line"}
    if kind == "deep_inside":
        depth = draw(st.sampled_from([10, 300, 3000, 100_000]))
        line = b'{"x": ' + b"[" * depth + b"]" * depth + b", " + good[1:]
        return line, {"kept"} if depth <= 300 else {"bad_json_line"}
    if kind in ("huge_int", "int_ok"):
        digits = draw(st.integers(4301, 20_000) if kind == "huge_int" else st.integers(1, 4000))
        return b'{"id": ' + b"7" * digits + b", " + good[1:], {"bad_json_line"} if kind == "huge_int" else {"kept"}
    if kind == "nan":
        return b'{"id": ' + draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity"])) + b", " + good[1:], {"kept"}
    at = good.index(QUESTION.encode()) + draw(st.integers(0, len(QUESTION)))
    if kind == "lone_surrogate":
        return good[:at] + draw(st.sampled_from([b"\\ud800", b"\\udfff", b"\\udc80x"])) + good[at:], {"non_utf8"}
    if kind == "invalid_bytes":  # high bytes inside the question string
        bad = draw(st.binary(min_size=1, max_size=6)).translate(bytes(range(128, 256)) * 2)
        try:
            bad.decode("utf-8")
            expected = {"kept"}  # happened to be valid UTF-8
        except UnicodeDecodeError:
            expected = {"non_utf8"}
        return good[:at] + bad + good[at:], expected
    garbage = draw(st.binary(min_size=1, max_size=64).filter(lambda b: b"\n" not in b and b.strip()))
    return garbage, {"bad_json_line", "missing_key", "non_utf8"}


llava_case = st.one_of(valid_record(), free_text_record(), broken_record(), broken_record(), raw_line())


def write_records(root, cases, as_json_list: bool) -> dict:
    path = root / ("f.json" if as_json_list else "f.jsonl")
    if as_json_list:
        path.write_text(json.dumps([payload for payload, _ in cases]))
    else:
        path.write_bytes(b"".join((p if isinstance(p, bytes) else json.dumps(p).encode()) + b"\n" for p, _ in cases))
    return {"name": "f", "type": "llava_json", "path": path.name, "max_image_pixels": MAX_PIXELS}


@settings(FUZZ, max_examples=examples(300))
@given(cases=st.lists(llava_case, min_size=1, max_size=4), as_json_list=st.booleans(), packing=st.booleans())
def test_fuzz_llava_records(chat, work, cases, as_json_list, packing):
    """A JSON or JSONL file of 1-4 LLaVA records. A turn text that is not a string is `missing_key`, a
    role that is not a known string `bad_role`; JSON that Python refuses beyond syntax (nested too
    deeply, an integer literal over 4300 digits) is `bad_json_line`; a lone-surrogate escape is
    `non_utf8` like raw invalid bytes."""
    RUNS["llava_records"] += 1
    as_json_list = as_json_list and not any(isinstance(p, bytes) for p, _ in cases)
    dataset = write_records(work, cases, as_json_list)
    outcomes, _ = run_loader(chat, work, dataset, len(cases), packing)
    for (payload, expected), got in zip(cases, outcomes):
        assert got in expected, f"{got!r} not in {expected} for {str(payload)[:300]}"


def test_huge_strings_are_skipped_quickly(chat, work):
    """A 1 MB id, a 120 KB question and a 120 KB answer (one example each, outside hypothesis)."""
    cases = [(dict(record(), id="i" * 1_000_000), {"kept"}),
             (record(question="seven " * 20_000), {"too_long"}),
             (record(answer="3 " + "odd " * 30_000), {"kept"})]
    outcomes, _ = run_loader(chat, work, write_records(work, cases, False), len(cases))
    assert outcomes == ["kept", "too_long", "kept"]


# ----- image files ----------------------------------------------------------------------------------
MODE_FORMATS = [("1", "PNG"), ("1", "BMP"), ("1", "TIFF"), ("L", "PNG"), ("L", "JPEG"), ("L", "GIF"), ("L", "PPM"),
                ("LA", "PNG"), ("LA", "TIFF"), ("LA", "WEBP"), ("P", "PNG"), ("P", "BMP"), ("P", "GIF"), ("PA", "TIFF"),
                ("RGB", "PNG"), ("RGB", "JPEG"), ("RGB", "WEBP"), ("RGB", "BMP"), ("RGB", "PPM"), ("RGBA", "PNG"),
                ("RGBA", "TIFF"), ("RGBA", "WEBP"), ("RGBX", "TIFF"), ("CMYK", "JPEG"), ("CMYK", "TIFF"),
                ("YCbCr", "JPEG"), ("YCbCr", "TIFF"), ("LAB", "TIFF"), ("I", "TIFF"), ("I;16", "PNG"),
                ("I;16", "TIFF"), ("I;16B", "PNG"), ("F", "TIFF")]
EXT = {"PNG": "png", "JPEG": "jpg", "GIF": "gif", "BMP": "bmp", "TIFF": "tif", "WEBP": "webp", "PPM": "ppm"}


@st.composite
def image_file(draw):
    """(bytes, file extension, expected outcomes, (w, h) when it must decode)."""
    mode, fmt = draw(st.sampled_from(MODE_FORMATS))
    size = (draw(st.integers(1, 12)), draw(st.integers(1, 12)))
    n = len(Image.new(mode, size).tobytes())
    kwargs = {}
    if mode == "P" and fmt in ("PNG", "GIF") and draw(st.booleans()):
        kwargs["transparency"] = draw(st.integers(0, 255))
    data = encode_image(mode, fmt, size, draw(st.binary(min_size=n, max_size=n)), **kwargs)
    fault = draw(st.sampled_from(["none", "none", "wrong_ext", "truncate", "truncate", "empty", "garbage",
                                  "huge_png_header", "huge_bmp_header", "zero_png_header"]))
    ext = EXT[fmt]
    if fault == "none":
        return data, ext, {"kept"}, size
    if fault == "wrong_ext":  # PIL sniffs the content, not the name
        return data, draw(st.sampled_from(sorted(set(EXT.values()) - {ext}))), {"kept"}, size
    if fault == "truncate":  # a cut that leaves every pixel (e.g. only the PNG IEND chunk) may decode
        cut = draw(st.integers(0, len(data) - 1))
        return data[:cut], ext, {"corrupt_image"} if cut == 0 else {"corrupt_image", "kept"}, None
    if fault == "empty":
        return b"", ext, {"corrupt_image"}, None
    if fault == "garbage":  # a NUL first: no image format's magic bytes
        return b"\0" + draw(st.binary(max_size=200)), ext, {"corrupt_image"}, None
    if fault == "zero_png_header":
        return png_header(*draw(st.sampled_from([(0, 0), (0, 5), (5, 0)]))), "png", {"corrupt_image"}, None
    width = draw(st.integers(1, 2**31 - 1))
    height = draw(st.integers(MAX_PIXELS // width + 1, 2**31 - 1))  # width x height > MAX_PIXELS
    if fault == "huge_png_header":
        return png_header(width, height), "png", {"image_too_large"}, None
    return bmp_with_size(width, height), "bmp", {"image_too_large"}, None


@settings(FUZZ, max_examples=examples(250))
@given(images=st.lists(image_file(), min_size=1, max_size=3))
def test_fuzz_image_files(chat, work, images):
    """1-3 image files referenced by records. Headers claiming more than max_image_pixels are
    `image_too_large` without decoding; only the dataset image formats are opened (a non-image is
    `corrupt_image`); every decodable mode is converted to RGB and kept."""
    RUNS["image_files"] += 1
    folder = work / "imgfuzz"
    folder.mkdir(exist_ok=True)
    cases = []
    for i, (data, ext, expected, size) in enumerate(images):
        path = folder / f"x{i}.{ext}"
        path.write_bytes(data)
        cases.append((record([f"imgfuzz/{path.name}"]), expected))
        if size is not None:  # a decodable file: converted to RGB, same size, whatever its mode
            image = load_image(str(path), MAX_PIXELS)
            assert not isinstance(image, Skip), image
            assert image.mode == "RGB" and image.size == size
    outcomes, _ = run_loader(chat, work, write_records(work, cases, False), len(cases))
    for (data, ext, expected, _), got in zip(images, outcomes):
        assert got in expected, f"{got!r} not in {expected} for {ext} {data[:40]!r}..."


@pytest.mark.parametrize("mode, fmt, kwargs, pixel, rgb", [
    ("RGBA", "PNG", {}, (10, 20, 30, 0), (255, 255, 255)),       # fully transparent -> white
    ("RGBA", "PNG", {}, (10, 20, 30, 255), (10, 20, 30)),
    ("LA", "PNG", {}, (40, 0), (255, 255, 255)),
    ("LA", "PNG", {}, (40, 255), (40, 40, 40)),
    ("P", "PNG", {"transparency": 7}, 7, (255, 255, 255)),         # the transparent palette index
    ("CMYK", "TIFF", {}, (0, 0, 0, 255 - 90), (90, 90, 90)),
    ("I;16", "PNG", {}, 200 * 257, (200, 200, 200)),               # 16 bit -> 8 bit
    ("1", "PNG", {}, 1, (255, 255, 255)),
    ("F", "TIFF", {}, 77.0, (77, 77, 77)),
])
def test_decodable_modes_are_converted_and_kept(tmp_path, mode, fmt, kwargs, pixel, rgb):
    image = Image.new(mode, (3, 3))
    if mode == "P":
        image.putpalette([v for i in range(256) for v in (i, 255 - i, 100)])
    image.putpixel((1, 1), pixel)
    path = tmp_path / f"x.{EXT[fmt]}"
    image.save(path, fmt, **kwargs)
    loaded = load_image(str(path))
    assert not isinstance(loaded, Skip) and loaded.mode == "RGB"
    assert loaded.getpixel((1, 1)) == rgb


# ----- webdataset shards ----------------------------------------------------------------------------
def tar_bytes(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@st.composite
def shard_members(draw):
    """[(member name, bytes)] of a small shard (the tar is built in the test: a short repr)."""
    members = []
    for i in range(draw(st.integers(1, 4))):
        key = f"s{i}"
        kind = draw(st.sampled_from(["txt", "txt", "json", "txt_bad_utf8", "json_bad", "no_text", "bad_image"]))
        png = encode_image("L", "PNG", (4, 4), bytes([i * 40]) * 16)
        members.append((f"{key}.png", b"\x89PNG broken" if kind == "bad_image" else png))
        if kind in ("txt", "bad_image"):
            members.append((f"{key}.txt", draw(st.text(safe_text, min_size=1, max_size=20)).encode()))
        elif kind == "json":
            members.append((f"{key}.json", json.dumps({"conversations": conversation()}).encode()))
        elif kind == "txt_bad_utf8":
            members.append((f"{key}.txt", b"caption \xff\xfe"))
        elif kind == "json_bad":
            members.append((f"{key}.json", draw(st.sampled_from([b"{not json", b"[" * 5000, b'{"a": ' + b"9" * 5000 + b"}",
                                                                   b'{"conversations": "x"}', b'"\\ud800"']))))
    return members


def read_shard(path, encoder, collator, check_end_marker: bool) -> list[tuple[str, str]]:
    """[(sample key or shard url, outcome)] for every item the reader yields."""
    items = []
    for item in WebDatasetShards(str(path), shuffle_shards=False, encoder=encoder,
                                 max_image_pixels=MAX_PIXELS, check_end_marker=check_end_marker):
        key = item.sample_id if isinstance(item, Skip) else item["id"]
        items.append((key, outcome_of(collator([item]))))
    for _, got in items:
        assert got == "kept" or got in KNOWN, got
    return items


@settings(FUZZ, max_examples=examples(150))
@given(members=shard_members(), fault=st.sampled_from(["truncate", "truncate", "truncate", "flip", "none"]),
       check_end_marker=st.booleans(), st_data=st.data())
def test_fuzz_webdataset_shards(chat, work, members, fault, check_end_marker, st_data):
    """A .tar shard of 1-4 samples, truncated or byte-flipped."""
    RUNS["webdataset_shards"] += 1
    data = tar_bytes(members)
    encoder = SampleEncoder(chat, ImageTransform(IMAGE_SIZE))
    collator = PadCollator.from_chat_tokenizer(chat, MAX_LENGTH)
    path = work / "shard.tar"
    path.write_bytes(data)
    baseline = read_shard(path, encoder, collator, check_end_marker)
    assert all(got != "corrupt_shard" for _, got in baseline)
    if fault == "none":
        return
    damaged = bytearray(data)
    if fault == "truncate":
        cut = st_data.draw(st.integers(0, len(data) - 1))
        damaged = damaged[:cut]
    else:
        for _ in range(st_data.draw(st.integers(1, 8))):
            damaged[st_data.draw(st.integers(0, len(data) - 1))] = st_data.draw(st.integers(0, 255))
    path.write_bytes(bytes(damaged))
    items = read_shard(path, encoder, collator, check_end_marker)
    reasons = [got for _, got in items]
    assert reasons.count("corrupt_shard") <= 1 and "corrupt_shard" not in reasons[:-1]
    if fault == "flip":
        return
    body = [item for item in items if item[1] != "corrupt_shard"]
    if check_end_marker and not has_end_marker(str(path)):
        assert items == [(str(path), "corrupt_shard")]  # skipped whole, before reading
        return
    # whatever was read before the cut is what the intact shard gave; the last sample may have lost
    # a member at a member boundary (tarfile then ends cleanly: only the end-marker check sees it,
    # as it sees a shard cut to 0 bytes, which tarfile reads as an empty archive)
    k = len(body)
    assert k <= len(baseline)
    if k:
        assert body[: k - 1] == baseline[: k - 1]
        assert body[-1] == baseline[k - 1] or body[-1][1] in ("missing_key", "missing_image")
    if check_end_marker:  # the cut only removed zero padding after the end-of-archive marker
        assert items == baseline


# ----- text corpora ---------------------------------------------------------------------------------
text_line = st.one_of(
    st.text(max_size=60).map(str.encode),
    st.binary(max_size=60),
    st.text(max_size=20).map(lambda s: ("\0" + s + "\0\0").encode()),
    st.just(b"\0\0\0"),
    st.sampled_from([b"caf\xe9", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"ok \xff ok"]),
    st.integers(100, 600).map(lambda n: ("word " * n).encode()),        # one line split into chunks
    st.integers(50, 300).map(lambda n: ("\u00e9\u4e2d\U0001f600" * n).encode()),  # ... at char boundaries
)


@st.composite
def jsonl_line(draw):
    kind = draw(st.sampled_from(["text", "text", "nul_text", "not_str", "no_text", "not_object", "garbage",
                                 "deep", "huge_int", "lone_surrogate", "invalid_bytes"]))
    if kind in ("text", "nul_text"):
        text = draw(st.text(max_size=80))
        if kind == "nul_text":
            text = "\0" + text + "\0"
        return json.dumps({"text": text}).encode(), {"kept"} if text.replace("\0", "").strip() else {"empty_text"}
    if kind == "not_str":
        return json.dumps({"text": draw(not_str)}).encode(), {"missing_key"}
    if kind == "no_text":
        return json.dumps({"id": 1, "content": "x"}).encode(), {"missing_key"}
    if kind == "not_object":
        return json.dumps(draw(st.one_of(scalars, st.lists(scalars, max_size=2)))).encode(), {"missing_key"}
    if kind == "deep":
        return b'{"text": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", {"bad_json_line"}
    if kind == "huge_int":
        return b'{"text": "a", "n": ' + b"1" * draw(st.integers(4301, 10_000)) + b"}", {"bad_json_line"}
    if kind == "lone_surrogate":
        return b'{"text": "abc \\ud800 def"}', {"non_utf8"}
    if kind == "invalid_bytes":
        return b'{"text": "abc \xff\xfe def"}', {"non_utf8"}
    garbage = draw(st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b.strip()))
    return garbage, {"bad_json_line", "missing_key", "non_utf8"}


def chunk_expectation(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "non_utf8"
    return "kept" if text.replace("\0", "").strip() else "empty_text"


@settings(FUZZ, max_examples=examples(150))
@given(fmt=st.sampled_from(["txt", "jsonl"]), lines=st.lists(text_line, max_size=10),
       jsonl=st.lists(jsonl_line(), min_size=1, max_size=6), final_newline=st.booleans())
def test_fuzz_text_corpus(chat, work, fmt, lines, jsonl, final_newline):
    """A .txt or .jsonl corpus: valid UTF-8 never yields a `non_utf8` chunk (long lines are split at
    character boundaries); NUL bytes are removed from kept text."""
    RUNS["text_corpus"] += 1
    path = work / f"corpus.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(b"\n".join(line for line, _ in jsonl) + b"\n" * final_newline)
    else:
        path.write_bytes(b"\n".join(lines) + b"\n" * final_newline)
    dataset = {"name": "corpus", "type": "text", "path": path.name}
    try:
        outcomes, loader = run_loader(chat, work, dataset, None)
    except ValueError as err:  # an empty corpus: refused at construction, one line naming it
        assert path.stat().st_size == 0 and "\n" not in str(err) and "corpus" in str(err)
        return
    corpus = loader.dataset.datasets[0]
    n = len(corpus)
    if fmt == "jsonl":
        assert n == len(jsonl)
        for (line, expected), got in zip(jsonl, outcomes):
            assert got in expected, f"{got!r} not in {expected} for {line[:80]!r}"
    else:
        expected = [chunk_expectation(corpus._raw(i)) for i in range(n)]
        assert outcomes == expected
        assert b"".join(corpus._raw(i) for i in range(n)) == path.read_bytes()  # the chunks cover the file, in order
        if chunk_expectation(path.read_bytes()) != "non_utf8":
            assert "non_utf8" not in outcomes  # valid UTF-8 is never cut inside a character
    for i in range(n):
        item = corpus[i]
        if not isinstance(item, Skip):
            assert "\0" not in item["text"]


# ----- inputs a user hands over directly ------------------------------------------------------------
direct_turn = st.one_of(
    st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "user", "bot"]), "value": st.text(safe_text, max_size=20)}),
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant"]), scalars),
                           "content": st.one_of(st.text(safe_text, max_size=10), not_str,
                                                st.lists(st.one_of(st.just({"type": "image"}), st.just({"type": "text", "text": "hi"}), scalars), max_size=3))}),
    scalars,
)


@settings(FUZZ, max_examples=examples(100))
@given(conv=st.one_of(st.text(safe_text, max_size=30), st.lists(direct_turn, max_size=4)))
def test_fuzz_direct_conversations(chat, conv):
    """A prompt given directly is encoded or refused with ONE line (KeyError/TypeError/ValueError)."""
    RUNS["direct_conversations"] += 1
    try:
        ids = chat.encode_prompt(conv)
    except (KeyError, TypeError, ValueError) as err:
        message = str(err.args[0]) if isinstance(err, KeyError) else str(err)
        assert message and "\n" not in message
        return
    assert ids and all(isinstance(i, int) for i in ids)


ALL_MODES = ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV",
             "I", "I;16", "I;16B", "I;16L", "I;16N", "F"]


@settings(FUZZ, max_examples=examples(100))
@given(mode=st.sampled_from(ALL_MODES), size=st.tuples(st.integers(1, 9), st.integers(1, 9)),
       seed=st.binary(min_size=1, max_size=64), raw=st.binary(max_size=128))
def test_fuzz_direct_images(mode, size, seed, raw):
    """Any in-memory PIL mode goes through the model's ImageTransform (processor path); raw bytes
    given as an image load or come back as a Skip, never an exception."""
    RUNS["direct_images"] += 1
    n = len(Image.new(mode, size).tobytes())
    image = Image.frombytes(mode, size, (seed * (n // len(seed) + 1))[:n])  # F / I: NaN, inf, negatives
    pixels = ImageTransform(IMAGE_SIZE)(image)
    assert pixels.shape == (3, IMAGE_SIZE, IMAGE_SIZE) and torch.isfinite(pixels).all()
    result = load_image(raw, MAX_PIXELS)
    assert isinstance(result, Skip) or result.mode == "RGB"


def test_missing_file_is_one_clear_line(chat, tmp_path):
    """A dataset file that does not exist is a configuration error at construction."""
    config = {"root": str(tmp_path), "datasets": [{"type": "llava_json", "path": "nope.jsonl"}]}
    with pytest.raises(FileNotFoundError) as info:
        build_loader(config, chat, ImageTransform(IMAGE_SIZE), batch_size=1)
    assert "nope.jsonl" in str(info.value) and "\n" not in str(info.value)
    (tmp_path / "broken.json").write_text("[" + "[" * 100_000)
    config["datasets"][0]["path"] = "broken.json"
    with pytest.raises(ValueError) as info:
        build_loader(config, chat, ImageTransform(IMAGE_SIZE), batch_size=1)
    assert "broken.json" in str(info.value) and "\n" not in str(info.value)
