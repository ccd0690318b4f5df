"""The PNG writer: what a decoder reads back is what was drawn."""

from __future__ import annotations

import struct
import zlib

from batchgen.profile.png import Canvas


def decode(data: bytes) -> tuple[int, int, list[bytes]]:
    """A minimal PNG reader for 8-bit RGB, filter 0: -> (width, height, rows)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = {}, 8
    while pos < len(data):
        (size,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + size]
        (crc,) = struct.unpack(">I", data[pos + 8 + size : pos + 12 + size])
        assert crc == zlib.crc32(tag + body), tag
        chunks[tag] = chunks.get(tag, b"") + body
        pos += 12 + size
    width, height, depth, kind = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, kind) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    rows = [raw[y * stride : (y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, [row[1:] for row in rows]


def test_rectangles_lines_and_text_read_back() -> None:
    canvas = Canvas(7, 5)
    canvas.rect(1, 1, 3, 4, (255, 0, 0))
    canvas.rect(5, -2, 99, 2, (0, 0, 255))  # clipped at the edges
    canvas.line(0, 4, 6, 4, (0, 255, 0))
    width, height, rows = decode(canvas.png())
    assert (width, height) == (7, 5)

    def at(x: int, y: int) -> tuple[int, ...]:
        return tuple(rows[y][3 * x : 3 * x + 3])

    assert at(1, 1) == at(2, 3) == (255, 0, 0) and at(3, 1) == at(0, 0) == (255, 255, 255)
    assert at(6, 0) == at(5, 1) == (0, 0, 255) and at(5, 2) == (255, 255, 255)
    assert all(at(x, 4) == (0, 255, 0) for x in range(7))
    text = Canvas(20, 9)
    assert text.text(1, 1, "I1") == 13  # two 5-pixel glyphs and their spacing
    _, _, rows = decode(text.png())
    assert any(rows[y][3 * x] == 0 for y in range(1, 8) for x in range(1, 13))
