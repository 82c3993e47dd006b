"""Images in: the resize plan against hand-derived values, loading and its one-sentence errors,
patching, the tower's pieces against their formulas, prompts with image spans, and the model's
forward with them (bias_vl routing, the Engram mask, parity with one-shot prefill, rollback,
generation, the command line and the load report)."""

import io
import math

import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

import dsv41
from dsv41.core.config import RELEASED, TINY
from dsv41.core.numerics import Numerics
from dsv41.generation.generate import compare_prefill_decode, generate
from dsv41.model import sequence, vision
from dsv41.model.layers import init_random_
from dsv41.model.trace import ForwardTrace
from dsv41.model.vision import IMAGE, IMAGE_END, IMAGE_NEWLINE, IMAGE_START, TEXT, ImageError

pytestmark = pytest.mark.usefixtures("one_thread")

MARK = "<｜deepseek_image｜>"


def drawn(width, height, seed=0):
    """A small test image: a coloured background, an ellipse and a diagonal."""
    im = Image.new("RGB", (width, height), (30 + seed, 60, 200))
    d = ImageDraw.Draw(im)
    d.ellipse((width * 0.2, height * 0.2, width * 0.8, height * 0.8), fill=(240, 200, 20 + seed))
    d.line((0, 0, width, height), fill=(10, 200, 10), width=3)
    return im


def png(im) -> bytes:
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


# ---------------------------------------------------------------------- the plan
def shape(p):
    return (p.pixel_width, p.pixel_height), (p.vit_rows, p.vit_cols), (p.llm_rows, p.llm_cols), p.span_tokens


# The tiny config: 14-pixel patches, 3 x 3 merges (42-pixel cells), at most 64 span tokens, at least
# 3,136 (56 x 56) pixels. Each case is worked out from the formulas in the comment beside it.
TINY_CASES = [
    # 100 x 100: 10,000 px is enough; ceil(100/14) = 8 patches a side (112 px); ceil(8/3) = 3 cells;
    # span 3 * (3 + 1) + 2 = 14
    ((100, 100), ((112, 112), (8, 8), (3, 3), 14)),
    # 20 x 20 (tiny): 400 px < 3,136, scaled by sqrt(3136/400) = 2.8 to about 56 px a side; 4 patches
    # (56 px), 2 cells; span 2 * 3 + 2 = 8
    ((20, 20), ((56, 56), (4, 4), (2, 2), 8)),
    # 1000 x 1000 (huge): 72 patches a side, 24 cells, span 602 > 64: the budget's columns solve
    # c (c + 1) = 62 -> c = 7.39, floor 7 cells = 294 px, 21 patches, 7 cells; span 7 * 8 + 2 = 58
    ((1000, 1000), ((294, 294), (21, 21), (7, 7), 58)),
    # 210 x 84 (wide): 15 x 6 patches, 5 x 2 cells; span 2 * 6 + 2 = 14
    ((210, 84), ((210, 84), (6, 15), (2, 5), 14)),
    # 84 x 210 (tall): 6 x 15 patches the other way, 2 x 5 cells; span 5 * 3 + 2 = 17
    ((84, 210), ((84, 210), (15, 6), (5, 2), 17)),
    # 1 x 1000: 1,000 px scaled by sqrt(3.136) to 1 x 1770; 1 x 127 patches, 1 x 43 cells, span 88 > 64;
    # even one column cannot hold the aspect, so a single column of (64 - 2) // 2 = 31 cells: 42 x 1302 px
    ((1, 1000), ((42, 1302), (93, 3), (31, 1), 64)),
    # 1000 x 1: scaled to 1770 x 1; 127 x 1 patches, 43 x 1 cells, span 1 * 44 + 2 = 46 fits as it is
    ((1000, 1), ((1778, 14), (1, 127), (1, 43), 46)),
    # 5000 x 1: no upscale; 358 x 1 patches, 120 x 1 cells, span 123 > 64; a single row of 64 - 3 = 61
    # cells: 2562 x 42 px
    ((5000, 1), ((2562, 42), (3, 183), (1, 61), 64)),
]


@pytest.mark.parametrize("size, expected", TINY_CASES, ids=[f"{w}x{h}" for (w, h), _ in TINY_CASES])
def test_plan_tiny_geometry(size, expected):
    assert shape(vision.plan(*size, TINY)) == expected


def test_plan_released_geometry():
    # 4000 x 4000: 286 patches, 96 cells, span 9,314 > 1,024: c (c + 1) = 1,022 -> 31 cells = 1302 px,
    # 93 patches a side (8,649), span 31 * 32 + 2 = 994
    assert shape(vision.plan(4000, 4000, RELEASED)) == ((1302, 1302), (93, 93), (31, 31), 994)
    # 100 x 100: under 544 x 544 px, scaled to 544 a side: 39 patches (546 px), 13 cells, span 184
    assert shape(vision.plan(100, 100, RELEASED)) == ((546, 546), (39, 39), (13, 13), 184)


def test_plan_max_wh_ratio_caps_width_and_stretches():
    cfg = TINY.replace(vision_max_wh_ratio=2)
    # 300 x 100: the width is cut to 2 x 100 = 200 before rounding (15 x 8 patches, 5 x 3 cells), and an
    # image at or past the ratio is stretched to that size rather than padded
    p = vision.plan(300, 100, cfg)
    assert shape(p) == ((210, 112), (8, 15), (3, 5), 20) and p.stretch
    q = vision.plan(150, 100, cfg)
    assert shape(q) == ((154, 112), (8, 11), (3, 4), 17) and not q.stretch
    assert not vision.plan(300, 100, TINY).stretch  # no ratio: always padded


def test_plan_invariants_over_many_sizes():
    import random

    rng = random.Random(0)
    for cfg in (TINY, RELEASED, TINY.replace(vision_max_wh_ratio=3)):
        p_size, r = cfg.vision_patch_size, cfg.vision_downsample_ratio
        for _ in range(400):
            w, h = rng.randint(1, 6000), rng.randint(1, 6000)
            p = vision.plan(w, h, cfg)
            assert p.span_tokens <= cfg.vision_max_n_token
            assert p.pixel_width % p_size == 0 and p.pixel_height % p_size == 0
            assert (p.vit_rows, p.vit_cols) == (p.pixel_height // p_size, p.pixel_width // p_size)
            assert (p.llm_rows, p.llm_cols) == (math.ceil(p.vit_rows / r), math.ceil(p.vit_cols / r))
            assert len(p.token_types()) == p.span_tokens == p.llm_rows * (p.llm_cols + 1) + 2


def test_token_types_layout():
    p = vision.plan(126, 84, TINY)  # 9 x 6 patches, 3 x 2 cells
    assert (p.llm_rows, p.llm_cols) == (2, 3)
    assert p.token_types() == [
        IMAGE_START,
        IMAGE,
        IMAGE,
        IMAGE,
        IMAGE_NEWLINE,
        IMAGE,
        IMAGE,
        IMAGE,
        IMAGE_NEWLINE,
        IMAGE_END,
    ]
    assert (TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END) == (-1, 0, 1, 2, 3)


def test_plan_refuses_bad_sizes_and_configs():
    with pytest.raises(ImageError, match="zero size"):
        vision.plan(0, 10, TINY)
    with pytest.raises(ImageError, match="whole numbers"):
        vision.plan(10.5, 10, TINY)
    with pytest.raises(ImageError, match="no vision tower"):
        vision.plan(10, 10, TINY.replace(vision_n_layers=0))


# ---------------------------------------------------------------------- loading
def test_load_image_from_path_bytes_and_pil(tmp_path):
    import numpy as np

    im = drawn(40, 30)
    path = tmp_path / "a.png"
    im.save(path)
    for source in (str(path), path, png(im), im, im.convert("RGBA"), im.convert("P")):
        got = vision.load_image(source)
        assert got.mode == "RGB" and got.size == (40, 30)
    assert (np.asarray(vision.load_image(png(im))) == np.asarray(im)).all()


def test_bad_images_are_one_sentence_naming_the_input(tmp_path, monkeypatch):
    good = png(drawn(40, 30))
    missing = tmp_path / "missing.png"
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(good[: len(good) // 2])
    cases = [
        (str(missing), "missing.png: no such image file"),
        (str(text), "notes.png: not an image file Pillow can read"),
        (str(truncated), "cut.png: the image data is truncated or damaged"),
        (b"hello", "the image bytes (5 bytes): not an image file"),
        (Image.new("RGB", (0, 5)), "the PIL image: the image has zero size"),
        (Image.new("La", (4, 4)), "the PIL image: its mode La cannot be converted to RGB"),
        (42, "an image is a file path, bytes or a PIL image, got int"),
    ]
    for source, expected in cases:
        with pytest.raises(ImageError) as info:
            vision.load_image(source)
        message = str(info.value)
        assert expected in message and "\n" not in message and "Traceback" not in message, message
    # a decompression bomb: more pixels than twice Pillow's limit is refused before decoding
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="decompression-bomb limit"):
        vision.load_image(good)


def test_patchify_normalizes_pads_grey_and_orders_row_major():
    import numpy as np

    p = TINY.vision_patch_size
    # 70 x 28 fills its 5 x 2 patches exactly: no padding, so patch (r, c) is pixel block (r, c)
    im = Image.fromarray((np.arange(70 * 28 * 3) % 256).astype(np.uint8).reshape(28, 70, 3))
    plan, patches = vision.patchify(im, TINY.replace(vision_min_pixels=1))
    assert (plan.vit_rows, plan.vit_cols) == (2, 5) and patches.dtype == torch.bfloat16
    pixels = torch.from_numpy(np.asarray(im, dtype=np.float32)).permute(2, 0, 1)  # [3, H, W]
    want = ((pixels / 255 - 0.5) / 0.5).to(torch.bfloat16)
    for r in range(2):
        for c in range(5):
            assert torch.equal(patches[r * 5 + c], want[:, r * p : (r + 1) * p, c * p : (c + 1) * p])
    # 255 -> 1, 0 -> -1; a 60 x 20 image padded to 70 x 28 keeps grey (127) around it
    magenta = Image.new("RGB", (60, 20), (255, 0, 255))
    plan, patches = vision.patchify(magenta, TINY.replace(vision_min_pixels=1))
    assert (plan.pixel_width, plan.pixel_height) == (70, 28) and not plan.stretch
    grey = (127 / 255 - 0.5) / 0.5
    corner = patches[0, :, 0, 0].float()  # the top-left pixel is padding
    assert torch.equal(corner, torch.tensor([grey] * 3).to(torch.bfloat16).float())
    centre = patches[7, :, 7, 7].float()  # inside the image
    assert centre.tolist() == [1.0, -1.0, 1.0]


# ---------------------------------------------------------------------- the tower's pieces
def test_rotary_2d_turns_rows_then_columns():
    rows, cols, dim, theta = 3, 4, 8, 10000.0
    cos, sin = vision.rotary_2d(rows, cols, dim, theta)
    assert cos.shape == (rows * cols, 1, dim) and cos.dtype == torch.float32
    inv = [1.0 / theta ** (2 * i / dim) for i in range(dim // 2)]
    for r in range(rows):
        for c in range(cols):
            angles = [r * f for f in inv] + [c * f for f in inv]
            assert torch.allclose(cos[r * cols + c, 0], torch.tensor(angles).cos(), atol=1e-6)
            assert torch.allclose(sin[r * cols + c, 0], torch.tensor(angles).sin(), atol=1e-6)


def test_vision_attention_is_softmax_attention_with_half_rotation():
    torch.manual_seed(0)
    attn = vision.VisionAttention(32, 2)
    init_random_(attn, 3)
    n = 6
    x = torch.randn(n, 32).to(torch.bfloat16)
    cos, sin = vision.rotary_2d(2, 3, 8, 10000.0)
    got = attn(x, cos, sin).float()

    qkv = F.linear(x.float(), attn.wqkv.weight.float(), attn.wqkv.bias.float())
    q, k, v = (t.view(n, 2, 16) for t in qkv.chunk(3, dim=-1))

    def rot(t):  # the first half pairs with the second: (a, b) -> (a cos - b sin, b cos + a sin)
        a, b = t[..., :8], t[..., 8:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    q, k = rot(q), rot(k)
    w = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(16), -1)
    o = torch.einsum("hqk,khd->qhd", w, v).reshape(n, 32)
    want = F.linear(o, attn.wo.weight.float(), attn.wo.bias.float())
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # bf16 at every step


def test_aligner_merges_blocks_channel_major_with_zero_padding():
    cfg = TINY
    aligner = init_random_(vision.Aligner(cfg), 0)
    rows, cols, c, r = 4, 5, cfg.vision_dim, 3
    x = torch.randn(rows * cols, c).to(torch.bfloat16)
    seen = {}
    original = aligner.w1.forward
    aligner.w1.forward = lambda t: (seen.setdefault("in", t), original(t))[1]
    out = aligner(x, rows, cols)
    # 4 x 5 patches -> ceil(4/3) x ceil(5/3) = 2 x 2 cells
    assert out.shape == (4, cfg.dim)
    grid = torch.zeros(c, 6, 6, dtype=torch.bfloat16)
    grid[:, :rows, :cols] = x.view(rows, cols, c).permute(2, 0, 1)
    for cell, (br, bc) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        block = grid[:, br * r : (br + 1) * r, bc * r : (bc + 1) * r]  # [C, r, r]
        assert torch.equal(seen["in"][cell], block.reshape(-1))  # channel, then row, then column
    assert torch.equal(out, aligner.w2(F.gelu(aligner.w1(seen["in"]))))


# ---------------------------------------------------------------------- prompts
@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return dsv41.load(tiny_checkpoint, quiet=True)


@pytest.fixture(scope="module")
def parity_model(tiny_checkpoint):
    return dsv41.load(tiny_checkpoint, quiet=True, numerics=Numerics.parity())


def test_prepare_replaces_each_placeholder_by_its_span(model):
    a, b = drawn(100, 60), drawn(60, 100, seed=9)
    prompt = model.prepare(f"one {MARK} and two {MARK} end", [a, png(b)])
    plain = model.encode(f"one {MARK} and two {MARK} end")
    marker = TINY.image_token_id
    first = plain.index(marker)
    pa, pb = vision.plan(100, 60, model.cfg), vision.plan(60, 100, model.cfg)
    assert len(prompt.ids) == len(plain) - 2 + pa.span_tokens + pb.span_tokens
    assert [i.start for i in prompt.images] == [
        first,
        first + pa.span_tokens + (plain.index(marker, first + 1) - first - 1),
    ]
    assert prompt.ids[:first] == plain[:first] and prompt.token_types[:first] == [TEXT] * first
    span = slice(first, first + pa.span_tokens)
    assert prompt.token_types[span] == pa.token_types() and set(prompt.ids[span]) == {marker}
    assert prompt.image_positions == pa.span_tokens + pb.span_tokens
    assert prompt.image_mask().sum() == prompt.image_positions


def test_prepare_without_a_marker_puts_images_first_and_counts_must_match(model):
    im = drawn(50, 50)
    prompt = model.prepare("no marker here", [im, im])
    span = vision.plan(50, 50, model.cfg).span_tokens
    assert prompt.ids[0] == model.cfg.bos_token_id and prompt.token_types[0] == TEXT  # after the BOS
    assert [i.start for i in prompt.images] == [1, 1 + span]
    assert prompt.ids[1 + 2 * span :] == model.encode("no marker here")[1:]
    with pytest.raises(ImageError, match=r"marks 1 image place \(token 1001\) but 2 images were given"):
        model.prepare(f"one {MARK}", [im, im])
    with pytest.raises(ImageError, match="marks 2 image places .* but 1 image was given"):
        model.prepare(f"{MARK}{MARK}", [im])
    no_images = model.prepare("plain text")
    assert no_images.ids == model.encode("plain text") and no_images.images == ()
    with pytest.raises(ImageError, match="not an image file") as info:  # the failing image is named by its number
        model.prepare(f"{MARK}{MARK}", [im, b"not an image"])
    assert info.value.number == 2
    with pytest.raises(ImageError) as info:  # not one image's fault
        model.prepare(f"{MARK}", [im, im])
    assert info.value.number is None


def test_prompt_slices_keep_overlapping_images(model):
    prompt = model.prepare(f"a {MARK} b", [drawn(50, 50)])
    image = prompt.images[0]
    cut = prompt[image.start + 3 :]
    assert cut.images[0].start == -3 and cut.ids == prompt.ids[image.start + 3 :]
    assert prompt[: image.start].images == ()
    longer = prompt.extend([5, 6])
    assert longer.ids[-2:] == [5, 6] and longer.token_types[-2:] == [TEXT, TEXT] and longer.images == prompt.images


# ---------------------------------------------------------------------- the forward
def test_text_prompts_keep_their_logits(model):
    ids = model.encode("The harbor lights came on one by one.")
    want = model(torch.tensor([ids]), 0, all_positions=True)
    got = model(model.prepare("The harbor lights came on one by one."), 0, all_positions=True)
    assert torch.equal(want, got)


def test_spans_hold_aligner_rows_and_learned_delimiters(model):
    prompt = model.encode_images(model.prepare(f"look {MARK} now", [drawn(126, 84)]))
    image = prompt.images[0]
    bb = model.backbone
    assert torch.equal(image.features, bb.encode_image(image))  # [cells, dim]
    h = bb.embed(torch.tensor([prompt.ids]))
    vision.write_spans(
        h, prompt.images, {IMAGE_START: bb.image_start, IMAGE_NEWLINE: bb.image_newline, IMAGE_END: bb.image_end}
    )
    types = prompt.token_types
    cells = [i for i, t in enumerate(types) if t == IMAGE]
    assert torch.equal(h[0, cells], image.features.to(h.dtype))  # reading order
    for kind, vector in ((IMAGE_START, bb.image_start), (IMAGE_NEWLINE, bb.image_newline), (IMAGE_END, bb.image_end)):
        rows = [i for i, t in enumerate(types) if t == kind]
        assert rows and all(torch.equal(h[0, i], vector) for i in rows)
    text = [i for i, t in enumerate(types) if t == TEXT]
    assert torch.equal(h[0, text], bb.embed(torch.tensor([[prompt.ids[i] for i in text]]))[0])


def test_image_tokens_route_with_bias_vl_and_skip_the_engram(tiny_checkpoint):
    m = dsv41.load(tiny_checkpoint, quiet=True)
    gate = m.backbone.layers[0].ffn.gate
    with torch.no_grad():
        gate.bias_vl.zero_()
        gate.bias_vl[5] = 100.0  # every image token of layer 0 must pick expert 5
    prompt = m.prepare(f"see {MARK} this", [drawn(90, 90)])
    mask = prompt.image_mask()[0]
    trace = ForwardTrace()
    m(prompt, 0, trace=trace)
    routing = trace.routing_by_layer()[0]
    ids, text_ids = routing["expert_ids"][0], routing["text_bias_ids"][0]
    assert torch.equal(routing["image_mask"][0], mask)
    assert all(5 in row for row in ids[mask].tolist())
    assert torch.equal(ids[~mask], text_ids[~mask])  # text tokens never see bias_vl
    assert (ids[mask] != text_ids[mask]).any()  # the record says what the text bias would have chosen
    for rec in trace.engram:
        assert (rec.gate[0][mask] == 0).all() and (rec.gate[0][~mask] > 0).all()
    # dead tokens: an image position's n-grams are all pad, and text after a span looks back no further
    m.hasher.reset()
    hashed = m.hasher(torch.tensor([prompt.ids]), ~prompt.image_mask())[0]
    m.hasher.reset()
    pad = m.cfg.engram_pad_id
    alone = m.hasher(torch.tensor([[pad] * 4]))[0, -1]
    first_image = int(mask.nonzero()[0])
    assert torch.equal(hashed[first_image], alone)
    m.hasher.reset()
    after = int(mask.nonzero()[-1]) + 1
    fresh = m.hasher(torch.tensor([[pad] * 4 + [prompt.ids[after]]]), torch.tensor([[False] * 4 + [True]]))[0, -1]
    assert torch.equal(hashed[after], fresh)


def test_prefill_then_decode_equals_one_shot_under_parity(parity_model):
    m = parity_model
    prompt = m.encode_images(m.prepare(f"a {MARK} b {MARK} c", [drawn(100, 60), drawn(40, 90, seed=5)]))
    first = m(prompt, 0)
    tokens, rows = [int(first.argmax(-1))], [first]
    for _ in range(5):
        rows.append(m(torch.tensor([[tokens[-1]]]), m.position))
        tokens.append(int(rows[-1].argmax(-1)))
    one_shot = m(prompt.extend(tokens[:-1]), 0, all_positions=True)[0, len(prompt) - 1 :]
    assert torch.equal(torch.cat(rows), one_shot)
    # chunked prefill that cuts through both spans
    at, chunked = 0, []
    for size in (7, 9, 30, len(prompt)):
        if at < len(prompt):
            chunked.append(m(prompt[at : at + size], at, all_positions=True)[0])
            at += size
    assert torch.equal(torch.cat(chunked), m(prompt, 0, all_positions=True)[0])


def test_rollback_into_an_image_call_continues_exactly(model):
    prompt = model.encode_images(model.prepare(f"x {MARK} y z", [drawn(70, 70)]))
    keep = prompt.images[0].start + 4  # inside the span
    want = model(prompt[:keep], 0)
    want_next = model(torch.tensor([[7]]), keep)
    model(prompt, 0)
    sequence.rollback(model, len(prompt) - keep)
    assert model.position == keep
    assert torch.equal(model(torch.tensor([[7]]), keep), want_next) and want.shape == want_next.shape


def test_generate_with_images_times_the_tower(model, tmp_path):
    path = tmp_path / "pic.png"
    drawn(80, 50).save(path)
    result = generate(model, "describe", images=[str(path)], max_new_tokens=3, stop_at_eos=False, trace=True)
    t = result.timings
    assert t["vision_s"] > 0 and len(result.ids) == 3
    span = vision.plan(80, 50, model.cfg).span_tokens
    assert len(result.prompt_ids) == len(model.encode("describe")) + span
    routing = result.trace.routing()
    assert int(routing[0]["image_mask"].sum()) == span
    assert generate(model, "plain", max_new_tokens=2).timings["vision_s"] == 0.0
    with pytest.raises(ValueError, match="images= goes with a text prompt"):
        generate(model, [1, 2, 3], images=[str(path)])
    # a traced run with images survives the trace file
    saved = result.trace.save(tmp_path / "t.npz")
    again = type(result.trace).load(saved).routing()
    assert torch.equal(again[0]["image_mask"], routing[0]["image_mask"])


def test_cli_generate_with_images(tiny_checkpoint, tmp_path, capsys):
    from dsv41.app.cli import main

    path = tmp_path / "pic.png"
    drawn(64, 40).save(path)
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                tiny_checkpoint,
                "--prompt",
                "hi",
                "--image",
                str(path),
                "--image",
                str(path),
                "--max-new-tokens",
                "2",
                "--quiet",
            ]
        )
        == 0
    )
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    capsys.readouterr()
    assert main(["generate", "--checkpoint", tiny_checkpoint, "--prompt", "hi", "--image", str(bad), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"dsv41 generate: {bad}: not an image file Pillow can read"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--image PATH" in help_text and "images first" in help_text


def test_the_vision_tower_is_loaded_and_accounted(model):
    report, cfg = model.report, model.cfg
    names = [n for n in report.tensors if n.startswith(("vision.", "aligner.", "image_"))]
    assert len(names) == 1 + 1 + 8 * cfg.vision_n_layers + 1 + 4 + 3  # patch embed, blocks, norm, aligner, markers
    assert {report.tensors[n] for n in names} == {"loaded"}
    v, d, p, r = cfg.vision_dim, cfg.dim, cfg.vision_patch_size, cfg.vision_downsample_ratio
    bf16, f32 = 2, 4
    per_block = (
        3 * v * v + 3 * v + v * v + v + 2 * cfg.vision_inter_dim * v + cfg.vision_inter_dim * v
    ) * bf16 + 2 * v * f32  # norm1, norm2 held float32
    derived = (
        (3 * p * p * v + v) * bf16
        + cfg.vision_n_layers * per_block
        + v * f32
        + (v * r * r * d + d + d * d + d) * bf16
        + 3 * d * bf16
    )
    assert report.vision_bytes_retained == derived
    assert report.bytes_retained == report.predicted_bytes_retained
    assert model.backbone.vision.norm.weight.dtype == torch.float32
    assert model.backbone.vision.blocks[0].attn.wqkv.weight.dtype == torch.bfloat16


def test_bench_vision_reports_the_plan(capsys):
    from dsv41.bench import cli_main

    assert cli_main(["vision", "--blocks", "1", "--size", "200x100"]) == 0
    out = capsys.readouterr().out
    p = vision.plan(200, 100, RELEASED)
    assert f"{p.patches:,} patches" in out and f"{p.span_tokens} span tokens" in out
    assert cli_main(["vision", "--size", "big"]) == 2


def test_routing_view_filters_text_and_image_tokens(model):
    from dsv41 import widgets
    from dsv41.widgets.routing import render

    result = generate(model, f"see {MARK} now", images=[drawn(60, 60)], max_new_tokens=2, trace=True, stop_at_eos=False)
    data = widgets.routing_data(result, n_experts=model.cfg.n_routed_experts)
    span = vision.plan(60, 60, model.cfg).span_tokens
    text, image = data["by_tokens"]["text"], data["by_tokens"]["image"]
    assert image["n_tokens"]["all"] == image["n_tokens"]["prefill"] == span and image["n_tokens"]["decode"] == 0
    assert text["n_tokens"]["all"] + span == data["n_tokens"]["all"]
    for phase in ("all", "prefill", "decode"):
        for i in range(len(data["layers"])):
            assert [a + b for a, b in zip(text["load"][phase][i], image["load"][phase][i])] == data["load"][phase][i]
    assert data["bias_vl"]["image_tokens"] == [span] * len(data["layers"])
    assert all(0 <= c <= span * data["top_k"] for c in data["bias_vl"]["changed_selections"])
    assert "image tokens" in render(data, tokens="image")._suptitle.get_text()
    with pytest.raises(ValueError, match="tokens must be one of"):
        render(data, tokens="audio")
    view = widgets.RoutingView(data, tokens="text")
    assert view.options == {"phase": "all", "tokens": "text"} and len(view._controls()) == 2


def test_compare_prefill_decode_takes_a_prompt_with_images(parity_model):
    prompt = parity_model.prepare(f"one {MARK} two", [drawn(90, 50)])
    report = compare_prefill_decode(parity_model, prompt)
    assert report.positions == len(prompt)
    assert report.identical, report.summary()  # one token per call, spans cut to one position each
