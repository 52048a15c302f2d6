#!/usr/bin/env python3
"""Draws the two photos of the playground's "photo comparison" example.

The playground page (src/api/playground/) must work with no network and no build step, so its
example images are committed PNGs compiled into the binary. This script is how they were made:
a desk printer seen from the front, once as the reference (status light green, screen "OK") and
once as the target (screen red with an error bar, a crack across the front, the paper tray gone).
Standard library only (zlib + struct write the PNG), deterministic: running it again gives the
same bytes.

    python3 tools/playground_example_images.py   # rewrites src/api/playground/examples/*.png
"""

import pathlib
import struct
import zlib

W, H = 320, 240
OUT = pathlib.Path(__file__).resolve().parent.parent / "src" / "api" / "playground" / "examples"


def canvas():
    # A wall with a soft vertical gradient and a desk below it.
    px = []
    for y in range(H):
        row = []
        for x in range(W):
            if y < 170:
                t = y / 170
                row.append((int(214 - 30 * t), int(222 - 28 * t), int(230 - 20 * t)))
            else:
                t = (y - 170) / 70
                row.append((int(150 - 40 * t), int(111 - 30 * t), int(74 - 20 * t)))
        px.append(row)
    return px


def rect(px, x0, y0, x1, y1, color):
    for y in range(max(0, y0), min(H, y1)):
        for x in range(max(0, x0), min(W, x1)):
            px[y][x] = color


def disc(px, cx, cy, r, color):
    for y in range(cy - r, cy + r + 1):
        for x in range(cx - r, cx + r + 1):
            if 0 <= x < W and 0 <= y < H and (x - cx) ** 2 + (y - cy) ** 2 <= r * r:
                px[y][x] = color


def line(px, x0, y0, x1, y1, color, width=2):
    n = max(abs(x1 - x0), abs(y1 - y0))
    for i in range(n + 1):
        x = round(x0 + (x1 - x0) * i / n)
        y = round(y0 + (y1 - y0) * i / n)
        rect(px, x - width // 2, y - width // 2, x + (width + 1) // 2, y + (width + 1) // 2, color)


def printer(px, broken):
    # Shadow, body, top lid, output slot.
    rect(px, 70, 168, 262, 176, (90, 70, 50))
    rect(px, 64, 70, 256, 170, (236, 236, 232))
    rect(px, 64, 62, 256, 74, (205, 205, 200))
    rect(px, 92, 80, 228, 88, (60, 60, 64))
    # Control panel: screen, status light, buttons.
    screen = (150, 40, 40) if broken else (40, 120, 70)
    rect(px, 84, 100, 170, 136, (30, 30, 34))
    rect(px, 88, 104, 166, 132, screen)
    if broken:
        rect(px, 94, 114, 160, 122, (250, 220, 220))  # the error text, as a bar
    else:
        rect(px, 110, 110, 122, 126, (210, 250, 220))  # "O"
        rect(px, 114, 114, 118, 122, screen)
        rect(px, 128, 110, 132, 126, (210, 250, 220))  # "K"
        line(px, 132, 118, 140, 110, (210, 250, 220), 3)
        line(px, 132, 118, 140, 126, (210, 250, 220), 3)
    disc(px, 190, 110, 6, (220, 40, 40) if broken else (40, 200, 80))
    for i in range(3):
        disc(px, 184 + i * 18, 130, 5, (120, 120, 126))
    # Paper tray (gone in the target).
    if not broken:
        rect(px, 96, 150, 224, 160, (180, 180, 176))
        rect(px, 104, 146, 216, 151, (250, 250, 250))
    else:
        rect(px, 96, 150, 224, 160, (70, 70, 74))
        # A crack across the front.
        pts = [(66, 92), (98, 140), (120, 146), (150, 162), (176, 168)]
        for (a, b), (c, d) in zip(pts, pts[1:]):
            line(px, a, b, c, d, (50, 50, 50), 2)


def png(px):
    raw = b"".join(b"\x00" + bytes(c for p in row for c in p) for row in px)

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, broken in (("reference.png", False), ("target.png", True)):
        px = canvas()
        printer(px, broken)
        (OUT / name).write_bytes(png(px))
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
