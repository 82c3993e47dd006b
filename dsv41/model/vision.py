"""Images in: the resize plan, loading and patching, the vision tower (ViT and aligner) and the
prompt that carries image spans.

An image becomes a grid of `vision_patch_size` pixel patches for the ViT (`vit_rows x vit_cols`)
and, after the aligner's `vision_downsample_ratio`-square merge, a grid of LLM cells
(`llm_rows x llm_cols`). The language model sees it as one span of positions,

    image start, then per row: llm_cols image cells and one row newline, then image end,

so a span takes `llm_rows * (llm_cols + 1) + 2` positions. Every position of a span carries
`image_token_id`; only the token type tells them apart (TEXT -1, IMAGE_START 0, IMAGE 1,
IMAGE_NEWLINE 2, IMAGE_END 3, the released numbering). After the embedding the image cells take
the aligner rows in reading order and the delimiters take the learned `image_start`,
`image_newline` and `image_end` vectors; inside a span the router selects experts with `bias_vl`
and the Engram skips the positions (no n-gram reaches across them, no update lands on them).

`plan(width, height, cfg)` is the whole resize decision as a pure function: the minimum-pixel
upscale, the optional width/height cap, rounding up to whole patches and the shrink that keeps the
span within `vision_max_n_token` positions. `read_image` takes a path, bytes or a PIL image, says
in one sentence what is wrong with a bad one and holds a source to the plan's pixel budget: up to
Pillow's default limit it decodes at full size (the reference's pixels, bit for bit), past it
reduced to what the plan can use. The tower runs in bf16, as the released runtime holds it, with
float32 norm weights and rotary tables.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import Config
from ..core.config_fields import MIN_IMAGE_SPAN
from ..core.errors import Dsv41Error
from .layers import RMSNorm, param

TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3
# The vision tower's RMSNorm epsilon (the language model's norm_eps does not reach it).
VISION_NORM_EPS = 1e-6
# Letterbox fill around a padded image: mid grey, which normalizes to (almost) zero.
PAD_GREY = (127, 127, 127)
# Sources up to this many pixels are decoded at full size and framed as the released reference
# frames them, bit for bit: Pillow's default MAX_IMAGE_PIXELS, what Pillow decodes without a warning.
# Fixed here, so a change to Pillow's global does not move it.
EXACT_DECODE_PIXELS = 89_478_485
# Larger sources are decoded reduced and may have at most this many times the pixels of the largest
# frame a plan makes (8x per side, as far as a JPEG's DCT draft reduces): past it the tower would see
# less than one pixel in 64 of the source.
SOURCE_REDUCTION_LIMIT = 64
# A reduced decode keeps at least twice the framed size per side for the final bicubic resize, the
# gap Pillow's own thumbnail keeps.
REDUCING_GAP = 2


class ImageError(Dsv41Error, ValueError):
    """An image that cannot be used; the message is one sentence naming the input. Raised by
    `prepare` for one of its images, `number` says which (1 for the first; None otherwise), so a
    caller can name it in its own words."""

    def __init__(self, message: str, number: Optional[int] = None):
        super().__init__(message)
        self.number = number


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class VisionPlan:
    """What an image of `width x height` pixels becomes: the pixel size it is brought to (stretched
    when `stretch`, else scaled to fit and padded grey), the ViT patch grid and the LLM cell grid."""

    width: int
    height: int
    pixel_width: int
    pixel_height: int
    vit_rows: int
    vit_cols: int
    llm_rows: int
    llm_cols: int
    stretch: bool

    @property
    def patches(self) -> int:
        return self.vit_rows * self.vit_cols

    @property
    def cells(self) -> int:
        """Aligner rows: the span's IMAGE positions."""
        return self.llm_rows * self.llm_cols

    @property
    def span_tokens(self) -> int:
        return span_length(self.llm_rows, self.llm_cols)

    def token_types(self) -> list[int]:
        """The span's token types in sequence order."""
        row = [IMAGE] * self.llm_cols + [IMAGE_NEWLINE]
        return [IMAGE_START] + row * self.llm_rows + [IMAGE_END]


def span_length(llm_rows: int, llm_cols: int) -> int:
    return llm_rows * (llm_cols + 1) + 2


def _llm_grid(pixel_height: int, pixel_width: int, patch: int, ratio: int) -> tuple[int, int]:
    # whole patches, then ceil over the merge: a partial merge block is zero-padded by the aligner
    return math.ceil((pixel_height // patch) / ratio), math.ceil((pixel_width // patch) / ratio)


def _fit_budget(height, width, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest pixel size of this aspect whose span fits `max_tokens`: the cell counts solve
    rows * (cols + 1) + 2 = max_tokens with rows = cols * height / width; an aspect too extreme for
    one cell on the short side collapses to a single column (or row) as long as the budget allows."""
    aspect = height / width
    cols = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    cell = patch * ratio
    if cols < 1.0:
        return (max_tokens - 2) // 2 * cell, cell
    if rows < 1.0:
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch


def plan(width: int, height: int, cfg: Config) -> VisionPlan:
    """The resize plan for an image of `width x height` pixels under `cfg` (a pure function)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (width, height)):
        raise ImageError(f"an image size is two whole numbers of pixels, got {width!r} x {height!r}")
    if width < 1 or height < 1:
        raise ImageError(f"an image of {width} x {height} pixels has zero size")
    if not cfg.vision_n_layers:
        raise ImageError("this model's config has no vision tower (vision_n_layers is 0), so it takes no images")
    patch, ratio, budget = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    if budget < MIN_IMAGE_SPAN:  # Config.verify refuses it; a config built in Python may not have been verified
        raise ImageError(
            f"vision_max_n_token {budget} cannot hold an image span, which takes at least "
            f"{MIN_IMAGE_SPAN} positions (image start, one cell, its row newline, image end)"
        )
    max_wh = cfg.vision_max_wh_ratio
    w, h = width, height
    if max_wh is not None and w > h * max_wh:
        w = h * max_wh
    if w * h < cfg.vision_min_pixels:
        up = (cfg.vision_min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    pixel_w, pixel_h = math.ceil(w / patch) * patch, math.ceil(h / patch) * patch
    rows, cols = _llm_grid(pixel_h, pixel_w, patch, ratio)
    if span_length(rows, cols) > budget:
        pixel_h, pixel_w = _fit_budget(h, w, patch, ratio, budget)
        rows, cols = _llm_grid(pixel_h, pixel_w, patch, ratio)
    if rows < 1 or cols < 1:  # never a span without cells: the image would vanish from the prompt
        raise ImageError(f"an image of {width} x {height} pixels gets no image cell under vision_max_n_token {budget}")
    return VisionPlan(
        width,
        height,
        int(pixel_w),
        int(pixel_h),
        int(pixel_h) // patch,
        int(pixel_w) // patch,
        rows,
        cols,
        stretch=max_wh is not None and width >= max_wh * height,
    )


def largest_plan_pixels(cfg: Config) -> int:
    """The most pixels any plan under `cfg` frames an image to: one row of the most cells a span
    holds (rows * (cols + 1) + 2 <= vision_max_n_token leaves at most vision_max_n_token - 3 cells)."""
    cell = cfg.vision_patch_size * cfg.vision_downsample_ratio
    return (cfg.vision_max_n_token - 3) * cell * cell


def source_pixel_budget(cfg: Config) -> int:
    """The most pixels a source image may have under `cfg`: what Pillow decodes silently, or
    SOURCE_REDUCTION_LIMIT times the largest frame, whichever is more."""
    return max(EXACT_DECODE_PIXELS, SOURCE_REDUCTION_LIMIT * largest_plan_pixels(cfg))


# ---------------------------------------------------------------------- loading
def _describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source) or "the empty path"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"the image bytes ({len(source):,} bytes)"
    return "the PIL image"


def load_image(source):
    """A path, bytes or a PIL image -> an RGB PIL image at full size (a copy; the source is left as
    it was), for sources of up to EXACT_DECODE_PIXELS pixels (`read_image` reads larger ones
    reduced, for a plan). Anything unusable raises ImageError with one sentence naming the input."""
    return _read(source, None)[0]


def read_image(source, cfg: Config):
    """A path, bytes or a PIL image -> (an RGB PIL image, the source's (width, height)) for `cfg`'s
    plan. Up to EXACT_DECODE_PIXELS the image is `load_image`'s, at full size. A larger source, up
    to `source_pixel_budget(cfg)`, is decoded reduced to no less than REDUCING_GAP times its frame
    per side: a JPEG through its DCT draft, then any format box-reduced by whole factors, strip by
    strip. Pass the size on to `patchify`, which plans the source, not the reduced copy."""
    return _read(source, cfg)


def _read(source, cfg):
    from PIL import Image, UnidentifiedImageError

    name = _describe(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ImageError(f"{name}: no such image file")
        opener = lambda: Image.open(path)  # noqa: E731
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        opener = lambda: Image.open(io.BytesIO(data))  # noqa: E731
    elif isinstance(source, Image.Image):
        opener = None
    else:
        raise ImageError(f"an image is a file path, bytes or a PIL image, got {type(source).__name__}")
    try:
        with warnings.catch_warnings():
            # the size is held to this module's budget in _decode; Pillow's warning would only say
            # so again, raw, on stderr
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            if opener is None:
                return _decode(source, name, cfg, owned=False)
            with opener() as opened:
                return _decode(opened, name, cfg, owned=True)
    except ImageError:
        raise
    except Image.DecompressionBombError:  # past twice Pillow's limit: refused in Image.open, before any size is read
        raise ImageError(
            f"{name}: more pixels than Pillow's decompression-bomb limit "
            f"({2 * Image.MAX_IMAGE_PIXELS:,} pixels) allows; shrink it first"
        ) from None
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not an image file Pillow can read") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's truncated / damaged data
        raise ImageError(f"{name}: the image data is truncated or damaged ({_first_line(exc)})") from None


def _decode(image, name: str, cfg, owned: bool):
    """(RGB image, source size) of an opened image; `owned`: opened here, so it may be drafted."""
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"{name}: the image has zero size ({width} x {height} pixels)")
    if width * height <= EXACT_DECODE_PIXELS:
        if owned:
            image.load()  # decode now: a truncated file fails here, not later in a resize
        return _to_rgb(image, name), (width, height)
    _check_budget(name, width, height, cfg)
    wanted = _reduced_size(width, height, cfg)
    if owned:
        image.draft(None, wanted)  # a JPEG decodes at 1/2, 1/4 or 1/8 scale, never below `wanted`; others ignore it
    image.load()
    factor = (max(1, image.width // wanted[0]), max(1, image.height // wanted[1]))
    return _reduce_to_rgb(image, name, factor), (width, height)


def _check_budget(name: str, width: int, height: int, cfg) -> None:
    pixels = width * height
    if cfg is None:
        raise ImageError(
            f"{name}: {width:,} x {height:,} is {pixels:,} pixels, more than the "
            f"{EXACT_DECODE_PIXELS:,} pixels load_image decodes at full size; read_image and "
            "model.prepare read larger ones reduced"
        )
    budget = source_pixel_budget(cfg)
    if pixels > budget:
        raise ImageError(
            f"{name}: {width:,} x {height:,} is {pixels:,} pixels, more than the {budget:,} this "
            f"model reads (the larger of Pillow's default limit and {SOURCE_REDUCTION_LIMIT} x its "
            f"largest image frame, {largest_plan_pixels(cfg):,} pixels); shrink it first"
        )


def _reduced_size(width: int, height: int, cfg) -> tuple[int, int]:
    """The smallest size a reduced decode keeps: REDUCING_GAP times the frame the source fills."""
    shape = plan(width, height, cfg)
    frame = (shape.pixel_width, shape.pixel_height)
    fitted = frame if shape.stretch else contained_size(width, height, frame)
    return max(1, fitted[0] * REDUCING_GAP), max(1, fitted[1] * REDUCING_GAP)


def _reduce_to_rgb(image, name: str, factor: tuple[int, int]):
    """`image` converted to RGB and box-reduced by `factor`, a strip at a time: the strips are a
    whole number of reduction blocks tall, so the result is the whole image's reduction, and no
    full-size second copy of the source is ever held."""
    from PIL import Image

    if factor == (1, 1):
        return _to_rgb(image, name)
    fx, fy = factor
    out = Image.new("RGB", (-(-image.width // fx), -(-image.height // fy)))
    step = max(1, (1 << 22) // (image.width * fy)) * fy  # about 4 M source pixels a strip
    for top in range(0, image.height, step):
        strip = image.crop((0, top, image.width, min(image.height, top + step)))
        out.paste(_to_rgb(strip, name).reduce(factor), (0, top // fy))
    return out


def _to_rgb(image, name: str):
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        image = _to_eight_bit(image)
    try:
        return image.convert("RGB")
    except (ValueError, OSError) as exc:
        raise ImageError(f"{name}: its mode {image.mode} cannot be converted to RGB ({_first_line(exc)})") from None


def _to_eight_bit(image):
    """A 16-bit, 32-bit integer or float greyscale image -> mode L, scaled by its type's range where
    Pillow's own conversion clips at 255: 16-bit and mode I (Pillow's mode for 16-bit data too) are
    taken as [0, 65535] -> round(v / 257), values outside it clamped; mode F as [0, 1] ->
    round(v * 255) half up, NaN as 0."""
    import numpy as np
    from PIL import Image

    values = np.asarray(image)
    if image.mode == "F":
        unit = np.nan_to_num(values, nan=0.0, posinf=1.0, neginf=0.0).clip(0.0, 1.0)
        scaled = np.floor(unit * 255 + 0.5)
    else:
        scaled = (values.clip(0, 65535).astype(np.int32) + 128) // 257  # 257 is odd: no halves to break
    return Image.fromarray(scaled.astype(np.uint8))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")


def contained_size(width: int, height: int, frame: tuple[int, int]) -> tuple[int, int]:
    """The size ImageOps.contain gives a `width x height` image inside `frame`, with its rounding."""
    ratio, frame_ratio = width / height, frame[0] / frame[1]
    if ratio > frame_ratio:
        return frame[0], round(height / width * frame[0])
    if ratio < frame_ratio:
        return round(width / height * frame[1]), frame[1]
    return frame


def frame_reduced(image, shape: VisionPlan):
    """`image`, a reduced copy of a `shape.width x shape.height` source, framed to the plan's pixel
    size as ImageOps.pad frames the source itself: the fitted size from the source's size, the same
    offset on grey (or stretched, when the plan says so); only the resize starts from fewer pixels."""
    from PIL import Image

    frame = (shape.pixel_width, shape.pixel_height)
    fitted = frame if shape.stretch else contained_size(shape.width, shape.height, frame)
    if fitted == frame:
        return image.resize(frame)
    out = Image.new("RGB", frame, PAD_GREY)
    if min(fitted) > 0:  # a sliver too thin for one pixel leaves the frame grey, as ImageOps.pad does
        if fitted[0] != frame[0]:
            offset = (round((frame[0] - fitted[0]) * 0.5), 0)
        else:
            offset = (0, round((frame[1] - fitted[1]) * 0.5))
        out.paste(image.resize(fitted), offset)
    return out


def patchify(image, cfg: Config, *, source_size: Optional[tuple[int, int]] = None) -> tuple[VisionPlan, torch.Tensor]:
    """An RGB PIL image -> (its plan, bf16 patches [vit_rows * vit_cols, 3, p, p] in row-major order).

    The image is stretched to the plan's pixel size when `plan.stretch`, else scaled to fit and
    centred on grey; pixels go to [-1, 1] in float32 and are rounded to bf16 once. `source_size`:
    the (width, height) of the source a reduced image was read from (`read_image`); the plan is
    that size's."""
    import numpy as np
    from PIL import ImageOps

    p = cfg.vision_patch_size
    shape = plan(*(source_size or image.size), cfg)
    size = (shape.pixel_width, shape.pixel_height)
    if image.size == (shape.width, shape.height):  # full size: the released reference's framing, bit for bit
        framed = image.resize(size) if shape.stretch else ImageOps.pad(image, size, color=PAD_GREY)
    else:
        framed = frame_reduced(image, shape)
    pixels = torch.from_numpy(np.asarray(framed, dtype=np.float32)).permute(2, 0, 1) / 255  # [3, H, W]
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16)
    patches = pixels.reshape(3, shape.vit_rows, p, shape.vit_cols, p)  # [3, rows, p, cols, p]
    patches = patches.permute(1, 3, 0, 2, 4).reshape(shape.patches, 3, p, p)  # [rows * cols, 3, p, p]
    return shape, patches


# ---------------------------------------------------------------------- the prompt
@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: where its span starts (an offset into the prompt; negative in a
    slice that begins inside the span), its plan and patches, and once encoded the aligner rows."""

    start: int
    plan: VisionPlan
    patches: torch.Tensor  # bf16 [n_patches, 3, p, p]
    features: Optional[torch.Tensor] = None  # [plan.cells, dim], set by Model.encode_images

    @property
    def length(self) -> int:
        return self.plan.span_tokens


@dataclass(frozen=True)
class Prompt:
    """Token ids with image spans: `ids` (every span position carries image_token_id),
    `token_types` (TEXT or a span type per position) and `images` in order of their spans.
    A model call takes a Prompt wherever it takes ids; slicing keeps the images that overlap."""

    ids: list
    token_types: list
    images: tuple = ()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def image_positions(self) -> int:
        return sum(1 for t in self.token_types if t != TEXT)

    def image_mask(self) -> torch.Tensor:
        """bool [1, n]: True inside an image span."""
        return torch.tensor([[t != TEXT for t in self.token_types]], dtype=torch.bool)

    def __getitem__(self, index) -> "Prompt":
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a Prompt is sliced with [start:stop]")
        lo, hi, _ = index.indices(len(self.ids))
        hi = max(lo, hi)
        kept = tuple(
            dataclasses.replace(img, start=img.start - lo)
            for img in self.images
            if img.start < hi and img.start + img.length > lo
        )
        return Prompt(self.ids[lo:hi], self.token_types[lo:hi], kept)

    def extend(self, ids: Sequence[int]) -> "Prompt":
        """This prompt followed by text tokens (a continuation)."""
        ids = [int(i) for i in ids]
        return Prompt(self.ids + ids, self.token_types + [TEXT] * len(ids), self.images)


def image_sources(images) -> list:
    """`images` as a list (None is none). One image given bare, where the list goes, is refused:
    iterating it would take its characters, bytes or pixel rows for images."""
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return list(images)
    from PIL import Image

    if isinstance(images, (str, os.PathLike, bytes, bytearray, memoryview, Image.Image)):
        raise ImageError(
            f"images takes a list of images, got a single {type(images).__name__} "
            f"({_describe(images)}); pass a list, [image]"
        )
    try:
        return list(images)
    except TypeError:
        raise ImageError(f"images takes a list of paths, bytes or PIL images, got {type(images).__name__}") from None


def check_placeholders(cfg: Config, ids: Sequence[int], count: int) -> None:
    """Refuse token ids whose image placeholders (`image_token_id`) are not one per image given:
    a placeholder without its image would be read as a text token."""
    marker = cfg.image_token_id
    markers = sum(1 for i in ids if i == marker)
    if markers != count:
        hint = "; pass one image per placeholder (images= in Python, --image on the command line)" if not count else ""
        raise ImageError(
            f"the prompt marks {markers} image place{'s' if markers != 1 else ''} (token {marker}) "
            f"but {count} image{'s were' if count != 1 else ' was'} given{hint}"
        )


def prepare(cfg: Config, ids: Sequence[int], images: Sequence = (), *, insert_at: int = 0) -> Prompt:
    """Token ids with image placeholders -> a Prompt: each `image_token_id` in `ids` becomes the
    span of the next image. Without any placeholder the images go first (at `insert_at`, after a
    BOS); any other count that differs from the number of images is an error. An image that cannot
    be read or planned is an ImageError whose `number` says which."""
    ids = [int(i) for i in ids]
    images = image_sources(images)
    marker = cfg.image_token_id
    if images and not cfg.vision_n_layers:
        raise ImageError("this model's config has no vision tower (vision_n_layers is 0), so it takes no images")
    if images and marker not in ids:
        ids = ids[:insert_at] + [marker] * len(images) + ids[insert_at:]
    check_placeholders(cfg, ids, len(images))
    loaded = []
    for number, source in enumerate(images, 1):  # every image read before any is used
        try:
            image, size = read_image(source, cfg)
            loaded.append(patchify(image, cfg, source_size=size))
        except ImageError as exc:
            raise ImageError(str(exc), number) from None
    out_ids, types, inputs = [], [], []
    pending = iter(loaded)
    for token in ids:
        if token != marker:
            out_ids.append(token)
            types.append(TEXT)
            continue
        shape, patches = next(pending)
        inputs.append(ImageInput(len(out_ids), shape, patches))
        span = shape.token_types()
        out_ids += [marker] * len(span)
        types += span
    return Prompt(out_ids, types, tuple(inputs))


# ---------------------------------------------------------------------- the tower
class DenseLinear(nn.Module):
    """y = x W^T (+ b) in the weight's dtype (bf16 here): the tower's projections are unquantized."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = param(torch.zeros(out_features, in_features, dtype=dtype))
        self.bias = param(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _random_init_(self, gen: torch.Generator) -> None:
        w = torch.randn(self.out_features, self.in_features, generator=gen) / math.sqrt(self.in_features)
        self.weight.copy_(w.to(self.weight.dtype))
        if self.bias is not None:
            self.bias.copy_((torch.randn(self.out_features, generator=gen) * 0.02).to(self.bias.dtype))


def rotary_2d(rows: int, cols: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) [rows * cols, 1, dim] for patches in row-major order: the first dim / 2
    angles turn with the patch's row, the last dim / 2 with its column."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim / 2]
    row = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    col = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    angles = torch.stack([row, col], dim=-1).reshape(-1, 2, 1).float() * inv_freq  # [n, 2, dim / 2]
    angles = angles.flatten(1)  # [n, dim]
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, d] by pairing its first and second halves (not adjacent elements, as the
    language model's RoPE does), in float32, back in x's dtype."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wqkv = DenseLinear(dim, 3 * dim)
        self.wo = DenseLinear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))  # [n, h, d]
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        # every patch sees every patch of its image: no mask
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [h, n, d]
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with the gate and up projections fused in `w1` (gate first)."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = DenseLinear(dim, 2 * inter_dim, bias=False)
        self.w2 = DenseLinear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.norm1 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS, dtype=torch.float32)
        self.attn = VisionAttention(cfg.vision_dim, cfg.vision_n_heads)
        self.norm2 = RMSNorm(cfg.vision_dim, VISION_NORM_EPS, dtype=torch.float32)
        self.mlp = VisionMLP(cfg.vision_dim, cfg.vision_inter_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """The vision encoder `vision.*`: patch embedding, pre-norm blocks with bidirectional attention
    and 2D rotary embeddings over half of each head, a final norm. bf16 weights, float32 norms."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.rope_dim = cfg.vision_dim // cfg.vision_n_heads // 2
        self.rope_theta = float(cfg.verified().vision_rope_theta)  # the field's default where the file is silent
        self.patch_embed = nn.Module()
        self.patch_embed.proj = DenseLinear(3 * cfg.vision_patch_size**2, cfg.vision_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_n_layers))
        self.norm = RMSNorm(cfg.vision_dim, VISION_NORM_EPS, dtype=torch.float32)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """bf16 patches [rows * cols, 3, p, p] -> [rows * cols, vision_dim]."""
        x = self.patch_embed.proj(patches.flatten(1))  # [n, 3 p p] -> [n, vision_dim]
        cos, sin = (t.to(x.device) for t in rotary_2d(rows, cols, self.rope_dim, self.rope_theta))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """`aligner.*`: each ratio x ratio block of ViT outputs (zero-padded at the right and bottom
    edges) concatenated channel-major, then two linears with a GELU between, to the model dim."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.ratio = cfg.vision_downsample_ratio
        self.w1 = DenseLinear(cfg.vision_dim * self.ratio**2, cfg.dim)
        self.w2 = DenseLinear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[rows * cols, vision_dim] -> [ceil(rows / r) * ceil(cols / r), dim], cells row-major."""
        r = self.ratio
        grid = x.view(rows, cols, -1).permute(2, 0, 1)  # [C, rows, cols]
        grid = F.pad(grid, (0, -cols % r, 0, -rows % r))
        blocks = F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)  # [cells, C r r]
        return self.w2(F.gelu(self.w1(blocks)))


def encode_image(vit: ViT, aligner: Aligner, image: ImageInput) -> torch.Tensor:
    """The aligner rows [cells, dim] of one image."""
    rows, cols = image.plan.vit_rows, image.plan.vit_cols
    device = next(vit.parameters()).device
    return aligner(vit(image.patches.to(device), rows, cols), rows, cols)


def write_spans(h: torch.Tensor, images: Sequence[ImageInput], delimiters: dict[int, torch.Tensor]) -> None:
    """Overwrite the span positions of h [1, s, dim] in place: image cells take each image's
    `features`, the delimiters their learned vectors ({IMAGE_START: v, IMAGE_NEWLINE: v,
    IMAGE_END: v}). A span that starts before or ends after this call is cut to the call."""
    seqlen = h.size(1)
    for image in images:
        types = torch.tensor(image.plan.token_types())
        span = h.new_empty(len(types), h.size(-1))  # [span, dim]
        for kind, vector in delimiters.items():
            span[types == kind] = vector.to(h.dtype)
        span[types == IMAGE] = image.features.to(h.device, h.dtype)
        lo, hi = max(0, -image.start), min(len(types), seqlen - image.start)
        h[0, image.start + lo : image.start + hi] = span[lo:hi]
