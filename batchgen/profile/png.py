"""A small RGB raster and its PNG encoding (zlib + struct: no imaging library)."""

from __future__ import annotations

import struct
import zlib

from batchgen.profile.font import HEIGHT, WIDTH, glyph

Color = tuple[int, int, int]


class Canvas:
    """width x height RGB pixels; drawing clips at the edges."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill [x0, x1) x [y0, y1)."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x0 >= x1 or y0 >= y1:
            return
        span = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = 3 * (y * self.width + x0)
            self.pixels[start : start + len(span)] = span

    def point(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            start = 3 * (y * self.width + x)
            self.pixels[start : start + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """A one-pixel line (Bresenham)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            self.point(x0, y0, color)
            if x0 == x1 and y0 == y1:
                return
            twice = 2 * error
            if twice >= dy:
                error += dy
                x0 += sx
            if twice <= dx:
                error += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 1) -> int:
        """Draw text with its top-left corner at (x, y); -> the x after it."""
        for char in text:
            for gx, gy in glyph(char):
                self.rect(x + gx * scale, y + gy * scale, x + (gx + 1) * scale,
                          y + (gy + 1) * scale, color)  # fmt: skip
            x += (WIDTH + 1) * scale
        return x

    def png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels))


TEXT_HEIGHT = HEIGHT


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """8-bit RGB, no interlace; each row with filter 0."""
    stride = 3 * width
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 6))
        + _chunk(b"IEND", b"")
    )


def _chunk(tag: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(tag + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)
