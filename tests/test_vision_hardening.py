"""Image input at its edges: sources past Pillow's pixel limit (the plan's own budget, reduced
decoding, no raw warning), 16-bit / float / 32-bit integer modes scaled rather than clipped, an
unfilled image placeholder, a single image passed where a list goes, a span budget too small for
any image, and the NaN diagnosis of a broken vision tower."""

import io
import json
import shutil
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from test_vision import MARK, drawn  # the same drawn test image

import dsv41
from dsv41.core.config import RELEASED, TINY
from dsv41.core.config_fields import MIN_IMAGE_SPAN
from dsv41.generation.generate import NonFiniteLogits, generate, locate_non_finite
from dsv41.model import vision
from dsv41.model.vision import ImageError

pytestmark = pytest.mark.usefixtures("one_thread")


def encoded(im, fmt="PNG", **options) -> bytes:
    out = io.BytesIO()
    im.save(out, format=fmt, **options)
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def crafted_png(
    width: int, height: int, channels: int = 3, row: bytes | None = None, header_only: bool = False
) -> bytes:
    """An 8-bit PNG of any size written by hand: every row the same (`row`, default black), so a
    huge image compresses to a few MB; `header_only` leaves the pixel data a stub (fine for
    anything refused from the header)."""
    color_type = {1: 0, 3: 2, 4: 6}[channels]
    head = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0))
    if header_only:
        return head + _chunk(b"IDAT", zlib.compress(bytes(16))) + _chunk(b"IEND", b"")
    line = b"\0" + (row if row is not None else bytes(width * channels))  # filter type 0, then the pixels
    packer = zlib.compressobj(1)
    data = b"".join(packer.compress(line) for _ in range(height)) + packer.flush()
    return head + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def one_sentence(message: str) -> bool:
    return "\n" not in message and "Traceback" not in message and message.count(". ") == 0


@pytest.fixture
def no_bomb_warning(capfd):
    """Fails the test when a DecompressionBombWarning is raised or anything reaches stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------------- the pixel budget
def test_the_budget_comes_from_the_largest_plan():
    for cfg in (TINY, RELEASED, TINY.replace(vision_max_n_token=MIN_IMAGE_SPAN)):
        cell = cfg.vision_patch_size * cfg.vision_downsample_ratio
        largest = vision.largest_plan_pixels(cfg)
        # a single row of cells takes the most: rows * (cols + 1) + 2 <= budget leaves at most budget - 3 cells
        assert largest == (cfg.vision_max_n_token - 3) * cell * cell
        widest = vision.plan(10**6, 1, cfg)
        assert widest.pixel_width * widest.pixel_height == largest
        assert vision.source_pixel_budget(cfg) == max(vision.EXACT_DECODE_PIXELS, 64 * largest)
    assert vision.source_pixel_budget(RELEASED) == 64 * 1021 * 42 * 42 == 115_266_816
    assert vision.source_pixel_budget(TINY) == vision.EXACT_DECODE_PIXELS == 89_478_485


@pytest.mark.parametrize(
    "size, channels", [((12000, 12000), 3), ((13300, 13300), 4), ((17895, 10000), 3), ((20000, 20000), 3)]
)
def test_sources_past_the_budget_are_one_sentence_without_a_warning(size, channels, no_bomb_warning):
    width, height = size
    data = crafted_png(width, height, channels, header_only=True)  # refused from the header: no decode
    for cfg in (RELEASED, TINY):
        with pytest.raises(ImageError) as info:
            vision.prepare(cfg, [1], [data])
        message = str(info.value)
        assert one_sentence(message), message
        assert message.startswith(f"the image bytes ({len(data):,} bytes): ") and "shrink it first" in message
        if width * height <= 2 * Image.MAX_IMAGE_PIXELS:  # Pillow would have decoded these, with a warning
            assert f"{width:,} x {height:,}" in message and f"{vision.source_pixel_budget(cfg):,}" in message
        else:
            assert "decompression-bomb limit" in message


def test_load_image_without_a_plan_decodes_only_what_pillow_decodes_silently(no_bomb_warning):
    data = crafted_png(10000, 9000, 1, header_only=True)
    with pytest.raises(ImageError, match=r"90,000,000 pixels, more than the 89,478,485 pixels load_image decodes"):
        vision.load_image(data)


def test_a_big_but_allowed_source_is_decoded_reduced_and_planned_at_its_size(no_bomb_warning):
    width, height = 10000, 9000  # 90,000,000 pixels: past Pillow's warning, within RELEASED's budget
    gradient = bytes(x * 256 // width for x in range(width))
    data = crafted_png(width, height, 1, row=gradient)
    image, source_size = vision.read_image(data, RELEASED)
    assert source_size == (width, height) and image.mode == "RGB"
    shape = vision.plan(width, height, RELEASED)
    # reduced by a whole factor to no less than twice the framed size
    fitted = vision.contained_size(width, height, (shape.pixel_width, shape.pixel_height))
    assert fitted[0] * 2 <= image.width < width and fitted[1] * 2 <= image.height < height
    plan, patches = vision.patchify(image, RELEASED, source_size=source_size)
    assert plan == shape  # the plan of the source's own size, not of the reduced copy
    # the grey gradient survives: each patch column's mean follows x / width
    grid = patches.float().reshape(plan.vit_rows, plan.vit_cols, 3, 14, 14)
    frame_top = round((plan.pixel_height - fitted[1]) / 2) // 14 + 1  # a patch row inside the image
    columns = grid[frame_top, :, 0].mean(dim=(-1, -2))  # [vit_cols], in [-1, 1]
    want = torch.tensor([((c * 14 + 7) / plan.pixel_width) * 2 - 1 for c in range(plan.vit_cols)])
    assert (columns - want).abs().max() < 0.02


REDUCED_MEMORY = r"""
import json, resource, sys
from dsv41.model import vision
from dsv41.core.config import RELEASED

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
prompt = vision.prepare(RELEASED, [1], [sys.argv[1]])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"kib": after - before, "patches": prompt.images[0].plan.patches}))
"""


@pytest.mark.slow  # a fresh interpreter imports torch: about 5 s on two shared cores
def test_a_reduced_decode_holds_the_source_once(tmp_path):
    # RGBA, 10000 x 9000: Pillow decodes it into 360 MB; the path that converted the whole image to
    # RGB before resizing held a second 360 MB copy. Measured in a fresh interpreter (peak RSS).
    width, height = 10000, 9000
    path = tmp_path / "big.png"
    path.write_bytes(crafted_png(width, height, 4, row=bytes(range(200)) * (width * 4 // 200)))
    run = subprocess.run([sys.executable, "-c", REDUCED_MEMORY, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    result = json.loads(run.stdout)
    decoded_mib = width * height * 4 / 2**20
    grown_mib = result["kib"] / 1024
    assert result["patches"] == vision.plan(width, height, RELEASED).patches
    assert grown_mib < decoded_mib * 1.3, f"peak grew {grown_mib:.0f} MiB for a {decoded_mib:.0f} MiB decode"


def test_jpeg_past_the_exact_range_is_drafted(monkeypatch, no_bomb_warning):
    # the exact range shrunk so an ordinary JPEG stands in for a huge one
    from PIL import JpegImagePlugin

    monkeypatch.setattr(vision, "EXACT_DECODE_PIXELS", 100_000)
    drafted = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        result = original(self, mode, size)
        drafted.append(self.size)
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    im = drawn(1600, 1200)
    data = encoded(im, "JPEG", quality=95)
    image, size = vision.read_image(data, TINY)
    assert size == (1600, 1200) and drafted == [(800, 600)] and image.size == (800, 600)  # decoded at 1/2 scale
    reduced_plan, reduced = vision.patchify(image, TINY, source_size=size)
    exact_plan, exact = vision.patchify(Image.open(io.BytesIO(data)).convert("RGB"), TINY)  # a full decode
    assert reduced_plan == exact_plan
    assert (reduced.float() - exact.float()).abs().mean() < 0.03  # [-1, 1] units: a close picture, not the same bits


def test_png_past_the_exact_range_is_box_reduced_close_to_the_exact_frame(monkeypatch, no_bomb_warning):
    monkeypatch.setattr(vision, "EXACT_DECODE_PIXELS", 100_000)
    im = drawn(3000, 1400)
    image, size = vision.read_image(encoded(im), TINY)
    assert size == (3000, 1400) and image.width <= 1500
    reduced_plan, reduced = vision.patchify(image, TINY, source_size=size)
    exact_plan, exact = vision.patchify(im, TINY)
    assert reduced_plan == exact_plan
    assert (reduced.float() - exact.float()).abs().mean() < 0.03


def test_images_in_the_exact_range_keep_todays_pixels(tmp_path):
    im = drawn(333, 211)
    for source in (encoded(im), im, im.convert("RGBA"), im.convert("P")):
        image, size = vision.read_image(source, TINY)
        assert size == (333, 211) and np.array_equal(np.asarray(image), np.asarray(vision.load_image(source)))
        want = vision.patchify(vision.load_image(source), TINY)[1]
        got = vision.prepare(TINY, [1], [source]).images[0].patches
        assert torch.equal(got, want)


@pytest.mark.parametrize("size", [(100, 100), (333, 211), (211, 333), (5000, 7), (7, 5000), (1, 900), (901, 3)])
def test_the_reduced_frame_has_the_exact_frames_geometry(size):
    # fed the full-size image, the frame the reduced path builds is ImageOps.pad's, pixel for pixel
    im = drawn(*size)
    shape = vision.plan(*size, TINY)
    frame = (shape.pixel_width, shape.pixel_height)
    assert np.array_equal(
        np.asarray(vision.frame_reduced(im, shape)), np.asarray(ImageOps.pad(im, frame, color=vision.PAD_GREY))
    )
    assert vision.contained_size(*size, frame) == ImageOps.contain(im, frame).size


# ---------------------------------------------------------------------- high-bit modes
def test_sixteen_bit_images_are_scaled_not_clipped():
    values = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)  # the full range once
    want = (values.astype(np.int64) + 128) // 257  # round(v / 257): 0 -> 0, 65535 -> 255, 257 k -> k
    for im in (Image.fromarray(values), Image.fromarray(values.astype(">u2"))):
        assert im.mode in ("I;16", "I;16B")
        for source in (im, encoded(im)):
            got = np.asarray(vision.load_image(source))
            assert got.shape == (256, 256, 3) and (got == want[..., None]).all()
    assert (np.asarray(vision.load_image(Image.fromarray(values)))[..., 0] == 255).mean() < 0.01  # was 99.6%


def test_sixteen_bit_sources_past_the_exact_range_are_scaled_strip_by_strip(monkeypatch):
    monkeypatch.setattr(vision, "EXACT_DECODE_PIXELS", 100_000)
    ramp = (np.arange(2400, dtype=np.float64) * 65535 / 2399).astype(np.uint16)
    values = np.broadcast_to(ramp, (1800, 2400))
    image, size = vision.read_image(encoded(Image.fromarray(np.ascontiguousarray(values))), TINY)
    assert size == (2400, 1800) and image.width < 2400
    row = np.asarray(image)[image.height // 2, :, 0].astype(float)
    want = np.linspace(0, 255, image.width)
    assert np.abs(row - want).max() < 3  # a ramp from black to white, not white from the 256th level on


def test_mode_i_is_taken_as_16_bit_and_mode_f_as_unit_range():
    ints = np.array([[-5, 0, 128, 129, 257, 32768, 65535, 70000]], dtype=np.int32)
    got = np.asarray(vision.load_image(Image.fromarray(ints)))[0, :, 0]
    assert got.tolist() == [0, 0, 0, 1, 1, 128, 255, 255]
    floats = np.array([[-1.0, 0.0, 0.25, 0.5, 1.0, 2.0, np.nan, np.inf]], dtype=np.float32)
    got = np.asarray(vision.load_image(Image.fromarray(floats)))[0, :, 0]
    assert got.tolist() == [0, 0, 64, 128, 255, 255, 0, 255]  # x * 255 rounded half up, NaN as 0


def test_eight_bit_modes_convert_as_before():
    im = drawn(40, 30)
    for mode in ("L", "RGBA", "P", "CMYK", "1", "LA"):
        source = im.convert(mode)
        assert np.array_equal(np.asarray(vision.load_image(source)), np.asarray(source.convert("RGB")))


# ---------------------------------------------------------------------- placeholders and lists
@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return dsv41.load(tiny_checkpoint, quiet=True)


def test_an_unfilled_placeholder_is_refused_by_generate(model):
    with pytest.raises(ImageError) as info:
        generate(model, f"a {MARK} b", max_new_tokens=1)
    message = str(info.value)
    assert "marks 1 image place (token 1001) but 0 images were given" in message and one_sentence(message)
    assert generate(model, "a b", max_new_tokens=1).timings["vision_s"] == 0.0  # plain text still runs
    with pytest.raises(ImageError, match="but 0 images were given"):
        model.prepare(f"a {MARK} b")  # the same sentence prepare gives


def test_cli_refuses_an_unfilled_placeholder(tiny_checkpoint, capsys):
    from dsv41.app.cli import main

    code = main(["generate", "--checkpoint", tiny_checkpoint, "--prompt", f"a {MARK} b", "--quiet"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("dsv41 generate: the prompt marks 1 image place")


def test_a_single_image_where_a_list_goes_is_refused(model, tmp_path):
    path = tmp_path / "ok.png"
    drawn(40, 30).save(path)
    for single in (str(path), path, path.read_bytes(), drawn(40, 30)):
        for call in (
            lambda: model.prepare("x", single),
            lambda: vision.prepare(TINY, [1], single),
            lambda: generate(model, "x", images=single, max_new_tokens=1),
        ):
            with pytest.raises(ImageError) as info:
                call()
            message = str(info.value)
            assert "pass a list" in message and one_sentence(message), message
    assert len(model.prepare("x", [str(path)]).images) == 1
    assert model.prepare("x", None).images == ()  # None is no images


# ---------------------------------------------------------------------- the span budget
@pytest.fixture(scope="module")
def tiny_cfg(tiny_checkpoint):
    from dsv41.core.config import load_config

    cfg = load_config(tiny_checkpoint)  # TINY with the Engram fields the checkpoint states
    assert cfg.verify() == []
    return cfg


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_a_span_budget_below_one_image_is_refused(budget, tiny_cfg):
    cfg = tiny_cfg.replace(vision_max_n_token=budget)
    assert any("vision_max_n_token" in p for p in cfg.value_problems())  # what the audit and loader check
    assert any("vision_max_n_token" in p for p in cfg.verify())
    with pytest.raises(ImageError) as info:
        vision.plan(100, 100, cfg)  # was a math domain error (1) or a span with no cell (2, 3)
    assert f"vision_max_n_token {budget}" in str(info.value) and one_sentence(str(info.value))


def test_the_smallest_budget_holds_one_cell_and_no_plan_drops_an_image(tiny_cfg):
    assert vision.span_length(1, 1) == MIN_IMAGE_SPAN == 4  # start, one cell, its row newline, end
    assert tiny_cfg.replace(vision_max_n_token=MIN_IMAGE_SPAN).verify() == []
    import random

    rng = random.Random(1)
    for budget in range(MIN_IMAGE_SPAN, 14):
        cfg = TINY.replace(vision_max_n_token=budget)
        for _ in range(200):
            w, h = rng.choice([1, 2, 7, 50, 999, 40000]) * rng.randint(1, 3), rng.randint(1, 5000)
            p = vision.plan(w, h, cfg)
            assert p.cells >= 1 and p.span_tokens <= budget, (budget, w, h, p)


def test_config_cli_refuses_a_budget_too_small(tiny_checkpoint, tmp_path, capsys):
    from dsv41.core.config import cli_main

    nested = json.loads((Path(tiny_checkpoint) / "config.json").read_text())
    nested["vision_config"]["max_image_tokens"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(nested))
    assert cli_main([str(path)]) == 1
    assert "vision_max_n_token (vision_config.max_image_tokens) is 2, outside [4, " in capsys.readouterr().out


# ---------------------------------------------------------------------- a NaN vision tower
def _poisoned(model, tensor):
    class Poison:
        def __enter__(self):
            self.saved = tensor.detach().clone()
            with torch.no_grad():
                tensor.view(-1)[0] = float("nan")

        def __exit__(self, *exc):
            with torch.no_grad():
                tensor.copy_(self.saved)
            model.reset()

    return Poison()


def test_a_nan_tower_is_named_by_the_diagnosis(model):
    with _poisoned(model, model.backbone.vision.blocks[0].mlp.w2.weight):
        with pytest.raises(NonFiniteLogits) as info:
            generate(model, f"see {MARK} this", images=[drawn(60, 60)], max_new_tokens=3)
        message = str(info.value)
        assert "vision tower" in message and "stays finite" not in message and one_sentence(message), message
        assert model.position == 0  # the diagnosis left the model reset
        prompt = model.prepare(f"see {MARK}", [drawn(60, 60)])
        assert "image 1" in locate_non_finite(model, prompt)


def test_a_nan_delimiter_is_found_by_a_rerun_with_the_images(model):
    with _poisoned(model, model.backbone.image_start):
        with pytest.raises(NonFiniteLogits) as info:
            generate(model, f"see {MARK} this", images=[drawn(60, 60)], max_new_tokens=3)
        assert "the first non-finite output is embedding" in str(info.value)


def test_cli_names_a_nan_tower(tiny_checkpoint, tmp_path, capsys):
    import safetensors.torch as st

    from dsv41.app.cli import main

    folder = tmp_path / "nan"
    shutil.copytree(tiny_checkpoint, folder)
    name = "vision.blocks.0.mlp.w2.weight"
    shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = st.load_file(shard)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    st.save_file(tensors, shard, metadata={"format": "pt"})
    image = tmp_path / "pic.png"
    drawn(60, 60).save(image)
    code = main(["generate", "--checkpoint", str(folder), "--prompt", "hi", "--image", str(image), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "NaN or Inf" in err and "vision tower" in err, err
