#!/usr/bin/env python3
"""Golden data for the Rust image pipeline (`src/image/`, checked by `tests/image_parity.rs`).

Rerun (deterministic; overwrites `tests/fixtures/image/`):

    /work/venv/bin/python tools/image_golden.py

Add `--full target/image-golden-full` to also dump the full reference arrays (decoded RGB and
resized uint8 per fixture, a few tens of MB, not committed); `tests/image_parity.rs` then prints
per-pixel diff statistics on a mismatch (it looks there, or in $IMAGE_GOLDEN_FULL).

Reference stack: transformers 5.17 (`Qwen2VLImageProcessor`, torchvision backend, which is what
`AutoImageProcessor` returns for model_type qwen3_5), torchvision 0.26, torch 2.11 (CPU), Pillow 13
(libjpeg-turbo 3.2, libwebp 1.6).  Run it on an x86-64 CPU: torch's uint8 antialiased bicubic resize
is a different code path on AVX2 and AVX-512 builds (both were checked to give the same bytes;
set ATEN_CPU_CAPABILITY=avx2 / default to compare).

What it writes:

* small test images (PNG of every colour type and bit depth Pillow maps differently, JPEG with
  several subsamplings / progressive / grayscale / EXIF orientations, WebP lossless and lossy,
  upscaling, mild downscaling, extreme aspect ratios) plus a few files that must be rejected
  (GIF, animated PNG and WebP, truncated and corrupt JPEG, decompression-bomb headers);
* `expected.json` with, per image and per processor configuration, what the REAL processor
  produced when fed `transformers.image_utils.load_image(path)` (PIL open, `exif_transpose`,
  `convert("RGB")`): decoded size and SHA-256 of the decoded RGB bytes, the smart-resized size
  and SHA-256 of the resized uint8 HWC image, `image_grid_thw`, the SHA-256 of `pixel_values`
  as little-endian f32 bytes and a few sample values;
* `smart_resize` cases (including errors) computed by transformers' own function;
* standalone resize cases on synthetic inputs (a 32-bit integer hash of the byte index, so the
  Rust test can regenerate them) checked against `torchvision...resize(uint8, BICUBIC,
  antialias=True)`, covering extreme ratios that the fixtures cannot reach.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as tvF
from transformers import AutoImageProcessor
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "image"

# preprocessor_config.json of Qwen3.5 (what `ImageProcessorConfig::to_json()` writes).
QWEN35_PREPROCESSOR = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "processor_class": "Qwen3VLProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "temporal_patch_size": 2,
}

# Extra configurations exercised through the whole pipeline (keys as they may appear in a
# preprocessor_config.json; the Rust test deserialises exactly these objects).
CONFIGS = {
    "qwen35": {},
    # strong downscaling through max_pixels, with the legacy min_pixels/max_pixels keys
    "small": {"min_pixels": 1024, "max_pixels": 12288},
    # non-trivial mean/std: checks how the fused constants are rounded to float32
    "clip": {
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
}


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def hash_bytes(n: int, seed: int) -> np.ndarray:
    """Synthetic uint8 data, byte i = low 8 bits of a 32-bit hash of (i + seed*0x9E3779B9).

    Rust twin: `synthetic_bytes` in tests/image_parity.rs."""
    with np.errstate(over="ignore"):
        v = np.arange(n, dtype=np.uint32) + np.uint32((seed * 0x9E3779B9) & 0xFFFFFFFF)
        v = v * np.uint32(0x9E3779B1)
        v ^= v >> np.uint32(15)
        v = v * np.uint32(0x85EBCA77)
        v ^= v >> np.uint32(13)
        v = v * np.uint32(0xC2B2AE3D)
        v ^= v >> np.uint32(16)
    return (v & np.uint32(0xFF)).astype(np.uint8)


def synthetic_image(w: int, h: int, seed: int, kind: str) -> np.ndarray:
    """HWC uint8. kind 'noise' = hash bytes; 'smooth' = hash bytes folded into a gradient."""
    raw = hash_bytes(w * h * 3, seed).reshape(h, w, 3)
    if kind == "noise":
        return raw
    ys, xs = np.mgrid[0:h, 0:w]
    base = np.stack([(xs * 255) // max(w - 1, 1), (ys * 255) // max(h - 1, 1), ((xs + ys) * 127) // max(w + h - 2, 1)], -1)
    return ((base.astype(np.int32) * 3 + raw.astype(np.int32) // 4) // 4 + 24).clip(0, 255).astype(np.uint8)


def photo(w: int, h: int, seed: int, noise: float = 6.0) -> np.ndarray:
    """Deterministic photo-like RGB content: gradients, soft blobs, hard edges, stripes, texture."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    u, v = xs / max(w - 1, 1), ys / max(h - 1, 1)
    img = np.zeros((h, w, 3))
    img[..., 0] = 40 + 170 * u
    img[..., 1] = 60 + 120 * v
    img[..., 2] = 200 - 150 * u * v
    for _ in range(6):
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        r = rng.uniform(0.08, 0.35) * max(w, h)
        col = rng.uniform(0, 255, 3)
        m = np.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (2 * r * r))
        img = img * (1 - 0.8 * m[..., None]) + 0.8 * m[..., None] * col
    for _ in range(3):  # hard-edged rectangles (ringing for JPEG, edges for the resampler)
        x0, y0 = rng.integers(0, max(w - 2, 1)), rng.integers(0, max(h - 2, 1))
        x1, y1 = x0 + rng.integers(1, max(w // 3, 2)), y0 + rng.integers(1, max(h // 3, 2))
        img[y0:y1, x0:x1] = rng.uniform(0, 255, 3)
    img[..., 1] += 25 * np.sin(xs * 0.9 + ys * 0.3)  # fine stripes (aliasing when downscaled)
    img += rng.normal(0, noise, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Minimal PNG writer for what Pillow cannot write (16-bit colour, low bit depths, APNG headers).


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(width: int, height: int, bit_depth: int, color_type: int, rows: list[bytes], extra: list[bytes] = (), interlace: int = 0) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, interlace)
    raw = b"".join(b"\x00" + r for r in rows)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + b"".join(extra) + png_chunk(b"IDAT", zlib.compress(raw, 9)) + png_chunk(b"IEND", b"")


def adam7_rows(img: np.ndarray) -> list[bytes]:
    """Rows of the 7 Adam7 passes of an 8-bit HWC image, in file order (empty passes skipped)."""
    h, w = img.shape[:2]
    rows = []
    for x0, y0, dx, dy in ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)):
        if x0 < w and y0 < h:
            rows += [img[y, x0::dx].tobytes() for y in range(y0, h, dy)]
    return rows


def pack_bits(vals: np.ndarray, bits: int) -> bytes:
    per = 8 // bits
    out = bytearray()
    for i in range(0, len(vals), per):
        b = 0
        chunk = list(vals[i : i + per]) + [0] * (per - len(vals[i : i + per]))
        for v in chunk:
            b = (b << bits) | int(v)
        out.append(b)
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Fixtures


def exif_with_orientation(o: int) -> bytes:
    ex = Image.Exif()
    ex[0x0112] = o
    return ex.tobytes()


def _pnginfo_itxt(key: str, text: str):
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_itxt(key, text)
    return info


def save_pil(im: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, format=fmt, **kw)
    return b.getvalue()


def make_fixtures() -> dict[str, bytes]:
    f: dict[str, bytes] = {}
    # --- PNG (must be bit-exact) ---
    f["png_rgb_50x37.png"] = save_pil(Image.fromarray(photo(50, 37, 1)), "PNG")
    f["png_rgb_650x525.png"] = save_pil(Image.fromarray(photo(650, 525, 2, noise=0.0)), "PNG", optimize=True)
    f["png_rgb_400x272.png"] = save_pil(Image.fromarray(photo(400, 272, 3, noise=1.0)), "PNG")  # half-even rounding
    f["png_rgb_20x900.png"] = save_pil(Image.fromarray(photo(20, 900, 4)), "PNG")
    f["png_rgb_1x150.png"] = save_pil(Image.fromarray(photo(1, 150, 5)), "PNG")
    f["png_rgb_333x2.png"] = save_pil(Image.fromarray(photo(333, 2, 6)), "PNG")
    rgba = np.dstack([photo(64, 48, 7), (hash_bytes(64 * 48, 7).reshape(48, 64) & 0xC0) | 0x0F])
    rgba[::5, ::3, 3] = 0  # fully transparent pixels keep (non-zero) colour: alpha must be dropped
    f["png_rgba_64x48.png"] = save_pil(Image.fromarray(rgba, "RGBA"), "PNG")
    f["png_gray_90x70.png"] = save_pil(Image.fromarray(photo(90, 70, 8)[..., 1]), "PNG")
    la = np.dstack([photo(45, 33, 9)[..., 0], hash_bytes(45 * 33, 9).reshape(33, 45)])
    f["png_la_45x33.png"] = save_pil(Image.fromarray(la, "LA"), "PNG")
    pal = Image.fromarray(photo(77, 51, 10)).quantize(colors=37, method=Image.Quantize.MEDIANCUT)
    f["png_palette_77x51.png"] = save_pil(pal, "PNG")
    palt = pal.copy()
    palt.info["transparency"] = 3
    f["png_palette_trns_77x51.png"] = save_pil(palt, "PNG", transparency=3)
    f["png_interlaced_43x29.png"] = png_bytes(43, 29, 8, 2, adam7_rows(photo(43, 29, 18)), interlace=1)
    pal4 = Image.fromarray(photo(33, 21, 19)).quantize(colors=12)
    f["png_palette4bit_33x21.png"] = save_pil(pal4, "PNG", bits=4)
    f["png_1bit_40x30.png"] = save_pil(Image.fromarray(photo(40, 30, 11)[..., 0] > 120), "PNG")
    g4 = (photo(41, 29, 12)[..., 2] >> 4).astype(np.uint8)
    f["png_gray4_41x29.png"] = png_bytes(41, 29, 4, 0, [pack_bits(r, 4) for r in g4])
    # 16-bit: Pillow keeps the HIGH byte for RGB/RGBA/LA but opens gray as I;16 and CLIPS to 255 in convert("RGB")
    g16 = (photo(48, 40, 13)[..., 0].astype(np.uint16) * 257 // 3 + hash_bytes(48 * 40, 13).reshape(40, 48)).astype(np.uint16)
    g16[:, :8] = np.arange(8, dtype=np.uint16) * 40  # some values <= 255
    f["png_gray16_48x40.png"] = png_bytes(48, 40, 16, 0, [r.astype(">u2").tobytes() for r in g16])
    c16 = photo(47, 31, 14).astype(np.uint16) * 257 + hash_bytes(47 * 31 * 3, 14).reshape(31, 47, 3)
    f["png_rgb16_47x31.png"] = png_bytes(47, 31, 16, 2, [r.astype(">u2").tobytes() for r in c16])
    a16 = np.dstack([c16, (hash_bytes(47 * 31, 15).reshape(31, 47).astype(np.uint16) * 251)])
    f["png_rgba16_47x31.png"] = png_bytes(47, 31, 16, 6, [r.astype(">u2").tobytes() for r in a16])
    la16 = np.dstack([c16[..., 1], a16[..., 3]])
    f["png_la16_47x31.png"] = png_bytes(47, 31, 16, 4, [r.astype(">u2").tobytes() for r in la16])
    f["png_exif6_60x40.png"] = save_pil(Image.fromarray(photo(60, 40, 16)), "PNG", exif=exif_with_orientation(6))
    tiny = Image.fromarray(photo(9, 5, 17))
    for o in (2, 3, 4, 5, 7, 8):  # every transpose, lossless so the decode hash pins the geometry
        f[f"png_exif{o}_9x5.png"] = save_pil(tiny, "PNG", exif=exif_with_orientation(o))
    xmp = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF><rdf:Description tiff:Orientation="8"/></rdf:RDF></x:xmpmeta>'
    f["png_xmp8_9x5.png"] = save_pil(tiny, "PNG", pnginfo=_pnginfo_itxt("XML:com.adobe.xmp", xmp.decode()))
    # --- JPEG ---
    base = Image.fromarray(photo(96, 72, 20))
    f["jpeg_420_96x72.jpg"] = save_pil(base, "JPEG", quality=85, subsampling=2)
    f["jpeg_444_96x72.jpg"] = save_pil(base, "JPEG", quality=85, subsampling=0)
    f["jpeg_422_96x72.jpg"] = save_pil(base, "JPEG", quality=85, subsampling=1)
    f["jpeg_progressive_96x72.jpg"] = save_pil(base, "JPEG", quality=80, progressive=True)
    f["jpeg_420_odd_51x37.jpg"] = save_pil(Image.fromarray(photo(51, 37, 21)), "JPEG", quality=90, subsampling=2)
    f["jpeg_420_700x530.jpg"] = save_pil(Image.fromarray(photo(700, 530, 22)), "JPEG", quality=75, subsampling=2)
    f["jpeg_gray_65x49.jpg"] = save_pil(Image.fromarray(photo(65, 49, 23)[..., 1]), "JPEG", quality=88)
    f["jpeg_cmyk_40x30.jpg"] = save_pil(Image.fromarray(photo(40, 30, 26)).convert("CMYK"), "JPEG", quality=90)
    f["jpeg_xmp8_36x20.jpg"] = save_pil(Image.fromarray(photo(36, 20, 27)), "JPEG", quality=90, xmp=xmp)
    f["jpeg_restart_80x64.jpg"] = save_pil(Image.fromarray(photo(80, 64, 24)), "JPEG", quality=70, restart_marker_blocks=2)
    small = Image.fromarray(photo(36, 20, 25))
    for o in range(1, 9):
        f[f"jpeg_exif{o}_36x20.jpg"] = save_pil(small, "JPEG", quality=92, exif=exif_with_orientation(o))
    # --- WebP ---
    f["webp_lossless_63x47.webp"] = save_pil(Image.fromarray(photo(63, 47, 30)), "WEBP", lossless=True)
    f["webp_lossy_96x72.webp"] = save_pil(Image.fromarray(photo(96, 72, 31)), "WEBP", quality=80)
    f["webp_lossy_odd_333x251.webp"] = save_pil(Image.fromarray(photo(333, 251, 32)), "WEBP", quality=70)
    wa = np.dstack([photo(50, 40, 33), (hash_bytes(50 * 40, 33).reshape(40, 50) | 0x80)])
    f["webp_lossy_alpha_50x40.webp"] = save_pil(Image.fromarray(wa, "RGBA"), "WEBP", quality=75)
    f["webp_lossless_alpha_50x40.webp"] = save_pil(Image.fromarray(wa, "RGBA"), "WEBP", lossless=True)
    f["webp_exif6_40x24.webp"] = save_pil(Image.fromarray(photo(40, 24, 34)), "WEBP", lossless=True, exif=exif_with_orientation(6))
    return f


def make_bad_fixtures() -> dict[str, tuple[bytes, str]]:
    """Files the Rust decoder must reject, with the ImageError variant it must return."""
    bad: dict[str, tuple[bytes, str]] = {}
    bad["bad_gif_8x8.gif"] = (save_pil(Image.fromarray(photo(8, 8, 40)), "GIF"), "UnsupportedFormat")
    frames = [Image.fromarray(photo(16, 12, 41 + i)) for i in range(2)]
    b = io.BytesIO()
    frames[0].save(b, format="PNG", save_all=True, append_images=frames[1:], duration=100)
    bad["bad_animated_16x12.png"] = (b.getvalue(), "Animated")
    b = io.BytesIO()
    frames[0].save(b, format="WEBP", save_all=True, append_images=frames[1:], duration=100, lossless=True)
    bad["bad_animated_16x12.webp"] = (b.getvalue(), "Animated")
    jpg = save_pil(Image.fromarray(photo(64, 48, 43)), "JPEG", quality=90)
    bad["bad_truncated.jpg"] = (jpg[: len(jpg) // 2], "Corrupt")
    garbage = bytearray(jpg)
    sos = garbage.find(b"\xff\xda")
    garbage[4:sos] = bytes((i * 37) & 0xFF for i in range(sos - 4))  # headers after the first marker scrambled
    bad["bad_corrupt.jpg"] = (bytes(garbage), "Corrupt")
    # decompression bombs: headers declare 50000 x 50000, almost no data follows
    idat = zlib.compress(b"\x00" * 1000)
    bomb = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 50000, 50000, 8, 2, 0, 0, 0)) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
    bad["bad_bomb_50000x50000.png"] = (bomb, "TooManyPixels")
    j = bytearray(jpg)
    sof = j.find(b"\xff\xc0")
    j[sof + 5 : sof + 9] = struct.pack(">HH", 50000, 50000)
    bad["bad_bomb_50000x50000.jpg"] = (bytes(j), "TooManyPixels")
    bad["bad_text.txt"] = (b"hello, this is not an image\n", "UnsupportedFormat")
    bad["bad_empty.bin"] = (b"", "UnsupportedFormat")
    bad["bad_aspect_1x250.png"] = (save_pil(Image.fromarray(photo(1, 250, 44)), "PNG"), "AspectRatio")
    return bad


# ---------------------------------------------------------------------------------------------


def processor_kwargs(overrides: dict) -> dict:
    kw = json.loads(json.dumps(QWEN35_PREPROCESSOR))
    for k in ("processor_class", "image_processor_type"):
        kw.pop(k)
    kw.update(overrides)
    return kw


def run_processor(proc: Qwen2VLImageProcessor, img: Image.Image) -> dict:
    out = proc(images=[img], return_tensors="pt")
    pv = out["pixel_values"]
    assert pv.dtype == torch.float32 and pv.ndim == 2, (pv.dtype, pv.shape)
    grid = [int(x) for x in out["image_grid_thw"][0]]
    flat = pv.contiguous().numpy().astype("<f4").ravel()
    n = flat.size
    idx = sorted({0, 1, 255, 256, 767, 768, n // 3, n // 2 + 17, n - 1537, n - 1} & set(range(n)))
    return {
        "grid_thw": grid,
        "n_values": int(n),
        "pixel_values_sha256": sha256(flat.tobytes()),
        "samples": [[int(i), float(flat[i])] for i in idx],
    }


def resized_u8(img: Image.Image, proc: Qwen2VLImageProcessor) -> tuple[tuple[int, int], np.ndarray]:
    t = tvF.pil_to_tensor(img)
    h, w = smart_resize(t.shape[1], t.shape[2], factor=proc.patch_size * proc.merge_size, min_pixels=proc.size["shortest_edge"], max_pixels=proc.size["longest_edge"])
    r = tvF.resize(t[None], [h, w], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)[0]
    return (h, w), r.permute(1, 2, 0).contiguous().numpy()


def check_auto_processor() -> str:
    """AutoImageProcessor on a checkpoint dir holding QWEN35_PREPROCESSOR must give this class."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "preprocessor_config.json").write_text(json.dumps(QWEN35_PREPROCESSOR))
        Path(d, "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
        p = AutoImageProcessor.from_pretrained(d)
        name = type(p).__name__
        assert name == "Qwen2VLImageProcessor", name
        assert p.size["shortest_edge"] == 65536 and p.size["longest_edge"] == 16777216
        return name


def main() -> None:
    # --full DIR: also dump the raw reference arrays (not committed; used by the Rust test to
    # print per-pixel diffs on a mismatch): DIR/<file>.decoded.rgb (Pillow RGB, HWC) and
    # DIR/<file>.<config>.resized.rgb (torch-resized uint8, HWC).
    full = Path(sys.argv[sys.argv.index("--full") + 1]) if "--full" in sys.argv else None
    if full:
        full.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    for p in OUT.iterdir():
        if p.is_file():
            p.unlink()

    procs = {name: Qwen2VLImageProcessor(**processor_kwargs(ov)) for name, ov in CONFIGS.items()}
    expected: dict = {
        "generator": "tools/image_golden.py",
        "versions": {
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
            "torchvision": __import__("torchvision").__version__,
            "pillow": Image.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "auto_image_processor": check_auto_processor(),
        "qwen35_preprocessor_config": QWEN35_PREPROCESSOR,
        "configs": CONFIGS,
        "images": [],
        "bad_images": [],
        "smart_resize": [],
        "resize_cases": [],
    }

    for name, data in sorted(make_fixtures().items()):
        path = OUT / name
        path.write_bytes(data)
        img = load_image(str(path))  # PIL open + exif_transpose + convert("RGB"), as the server does
        rgb = np.asarray(img)
        if full:
            (full / f"{name}.decoded.rgb").write_bytes(rgb.tobytes())
        entry = {
            "file": name,
            "format": Image.open(path).format,
            "pil_mode": Image.open(path).mode,
            "file_sha256": sha256(data),
            "decoded_wh": [img.width, img.height],
            "decoded_rgb_sha256": sha256(rgb.tobytes()),
            "results": {},
        }
        for cname, proc in procs.items():
            (h, w), r = resized_u8(img, proc)
            res = run_processor(proc, img)
            # cross-check: undoing the normalisation of pixel_values gives the resized uint8 image back
            if cname == "qwen35":
                pv = proc(images=[img], return_tensors="pt")["pixel_values"]
                gh, gw = h // 16, w // 16
                x = pv.reshape(gh // 2, gw // 2, 2, 2, 3, 2, 16, 16)[:, :, :, :, :, 0]
                x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, h, w)
                back = torch.round(x * 127.5 + 127.5).to(torch.uint8).permute(1, 2, 0).numpy()
                assert np.array_equal(back, r), name
            if full:
                (full / f"{name}.{cname}.resized.rgb").write_bytes(r.tobytes())
            res["resized_hw"] = [h, w]
            res["resized_sha256"] = sha256(r.tobytes())
            entry["results"][cname] = res
        expected["images"].append(entry)
        print(f"{name:34s} {entry['format']:5s} {entry['pil_mode']:5s} {img.width}x{img.height} -> {entry['results']['qwen35']['resized_hw']}  {len(data)} B")

    for name, (data, variant) in sorted(make_bad_fixtures().items()):
        (OUT / name).write_bytes(data)
        try:
            im = load_image(str(OUT / name))
            pil = f"ok {im.size} n_frames={getattr(Image.open(OUT / name), 'n_frames', 1)}"
        except Exception as e:  # noqa: BLE001
            pil = f"{type(e).__name__}: {e}"[:200]
        expected["bad_images"].append({"file": name, "expect": variant, "pil": pil})

    sr_cases = [
        (480, 640), (100, 100), (37, 50), (272, 400), (48, 80), (530, 700), (900, 20), (150, 1), (2, 333),
        (1, 200), (1, 201), (200, 1), (201, 1), (3000, 4000), (4096, 4096), (4097, 4097), (8000, 6000),
        (10000, 50), (50, 10000), (12345, 678), (16, 16), (32, 32), (4000, 4000),
    ]
    for h, w in sr_cases:
        for fac, mn, mx in ((32, 65536, 16777216), (32, 1024, 12288), (28, 3136, 1003520)):
            try:
                r = list(smart_resize(h, w, factor=fac, min_pixels=mn, max_pixels=mx))
                err = None
            except ValueError as e:
                r, err = None, str(e)
            expected["smart_resize"].append({"hw": [h, w], "factor": fac, "min_pixels": mn, "max_pixels": mx, "out": r, "error": err})

    rc = [
        (1, 300, 32, 256, "noise"), (300, 1, 256, 32, "noise"), (50, 37, 256, 352, "smooth"), (37, 50, 352, 256, "noise"),
        (700, 530, 704, 544, "smooth"), (650, 525, 640, 512, "noise"), (1000, 700, 100, 70, "noise"), (513, 257, 31, 17, "noise"),
        (64, 64, 64, 128, "noise"), (64, 64, 32, 64, "smooth"), (7, 5, 2, 3, "noise"), (2, 2, 500, 3, "noise"), (3, 1, 2, 1, "noise"),
        (1280, 960, 1216, 896, "smooth"), (301, 299, 97, 1001, "noise"), (129, 1, 1, 1, "noise"), (33, 33, 32, 32, "noise"),
        (1, 1, 64, 32, "noise"), (20, 900, 32, 1440, "noise"), (4000, 3, 2, 2, "noise"),
    ]
    for i, (w, h, nw, nh, kind) in enumerate(rc):
        src = synthetic_image(w, h, 100 + i, kind)
        t = torch.from_numpy(src).permute(2, 0, 1).contiguous()
        r = tvF.resize(t[None], [nh, nw], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)[0]
        out = r.permute(1, 2, 0).contiguous().numpy()
        expected["resize_cases"].append({"w": w, "h": h, "new_w": nw, "new_h": nh, "seed": 100 + i, "kind": kind, "input_sha256": sha256(src.tobytes()), "sha256": sha256(out.tobytes())})

    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(list(OUT.iterdir()))} files, {total} bytes to {OUT.relative_to(ROOT)}", file=sys.stderr)
    assert total < 2_000_000, total


if __name__ == "__main__":
    main()
