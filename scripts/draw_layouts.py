#!/usr/bin/env python
"""Draw W16 and S32x8 (docs/img/w16.svg, docs/img/s32x8.svg) from the layouts' own transforms.

Nothing here knows where a byte goes: each picture labels every byte with its index, runs the
registered `preshuffle` layout's weight or scale transform on those labels, and draws what comes
out. tests/test_layout_drawings.py regenerates the files and compares them with the committed
ones, so a changed transform changes the pictures or fails the test.

    .venv/bin/python scripts/draw_layouts.py [OUT_DIR]      # default: docs/img
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import layouts
except ImportError:  # run from a checkout without an installed `prep`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import layouts

ROOT = Path(__file__).resolve().parent.parent
FONT = "font-family='DejaVu Sans Mono, Menlo, Consolas, monospace'"
# Four light fills that stay readable under black text, and a grey for pad bytes.
FILLS = ("#a6c8ec", "#f9c99b", "#a8d5a0", "#f2aaab")
DARKER = ("#6f9fd0", "#eda766", "#79b870", "#e07b7d")
PAD = "#d9d9d9"


def trace(forward, shape: tuple[int, int]) -> torch.Tensor:
    """Source index (row-major, from 0) of every byte ``forward`` stores, -1 where it stores pad.

    Indices are pushed through as two uint8 planes (low and high byte), since the transforms move
    bytes; they start at 1 so that the pad the transform writes (0x00 in both planes) reads -1."""
    ids = torch.arange(1, shape[0] * shape[1] + 1, dtype=torch.int64).view(shape)
    lo, hi = (forward((ids % 256).to(torch.uint8)).to(torch.int64),
              forward((ids // 256).to(torch.uint8)).to(torch.int64))
    return (hi * 256 + lo - 1).flatten()


def _svg(width: int, height: int, body: list[str]) -> str:
    return "\n".join([f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
                      f"viewBox='0 0 {width} {height}' {FONT} font-size='9'>",
                      f"<rect width='{width}' height='{height}' fill='white'/>", *body, "</svg>", ""])


def _rect(x: float, y: float, w: float, h: float, fill: str, label: str = "", stroke: str = "#555") -> str:
    text = (f"<text x='{x + w / 2:g}' y='{y + h - 3:g}' text-anchor='middle'>{label}</text>" if label else "")
    return (f"<rect x='{x:g}' y='{y:g}' width='{w:g}' height='{h:g}' fill='{fill}' stroke='{stroke}' "
            f"stroke-width='0.5'/>{text}")


def _title(x: float, y: float, text: str, size: int = 11) -> str:
    return f"<text x='{x:g}' y='{y:g}' font-size='{size}' font-weight='bold'>{text}</text>"


def _note(x: float, y: float, text: str) -> str:
    return f"<text x='{x:g}' y='{y:g}' font-size='10'>{text}</text>"


def draw_w16(n: int = 32, kb: int = 64) -> str:
    """Source ``[n, kb]`` bytes in 16-byte runs (A, B, C, D along K) beside the stored bytes."""
    src = trace(layouts.get_layout("preshuffle").weight.forward, (n, kb))
    run_w, row_h, x0, y0 = 48, 13, 40, 50
    per_line = kb  # the stored buffer is drawn wrapped at one source row's width
    px = run_w / 16  # pixels per byte
    body = [_title(x0, 18, f"W16: weight [N = {n}, K/2 = {kb} bytes], one box = 16 bytes"),
            _title(x0, 40, "source (row-major)", 10)]

    def label(first: int) -> tuple[str, str]:
        row, run = divmod(first, kb)
        run //= 16
        fills = FILLS if (row // 16) % 2 == 0 else DARKER
        return f"{'ABCD'[run % 4]}{row}", fills[run % 4]

    for row in range(n):
        body.append(f"<text x='{x0 - 4}' y='{y0 + row * row_h + row_h - 3}' text-anchor='end'>n{row}</text>")
        for run in range(kb // 16):
            text, fill = label(row * kb + run * 16)
            body.append(_rect(x0 + run * run_w, y0 + row * row_h, run_w, row_h, fill, text))
    for r in range(0, n + 1, 16):  # 16-row x 32-byte tiles
        body.append(f"<line x1='{x0}' y1='{y0 + r * row_h}' x2='{x0 + kb * px}' y2='{y0 + r * row_h}' "
                    "stroke='black' stroke-width='1.5'/>")
    for c in range(0, kb + 1, 32):
        body.append(f"<line x1='{x0 + c * px}' y1='{y0}' x2='{x0 + c * px}' y2='{y0 + n * row_h}' "
                    "stroke='black' stroke-width='1.5'/>")

    x1 = x0 + kb * px + 90
    body.append(_title(x1, 40, f"stored: memory order, {per_line} B a line", 10))
    flat = src.tolist()
    i = 0
    while i < len(flat):  # one box per run of source-consecutive bytes, cut at the line's end
        j = i + 1
        while j < len(flat) and flat[j] == flat[j - 1] + 1 and j % per_line:
            j += 1
        text, fill = label(flat[i])
        line, col = divmod(i, per_line)
        body.append(_rect(x1 + col * px, y0 + line * row_h, (j - i) * px, row_h, fill, text))
        i = j
    tile_lines = 16 * 32 // per_line
    for line in range(0, n * kb // per_line + 1, tile_lines):
        y = y0 + line * row_h
        body.append(f"<line x1='{x1}' y1='{y}' x2='{x1 + per_line * px}' y2='{y}' stroke='black' stroke-width='1.5'/>")
    y = y0 + n * row_h + 20
    body += [_note(x0, y, "A tile is 16 rows x 32 bytes (thick lines). Stored: the tile's first 16 bytes of every "
                          "row,"),
             _note(x0, y + 14, "then its second 16 bytes of every row; tiles follow along K, then down N."),
             _note(x0, y + 28, "Drawn by scripts/draw_layouts.py from layouts.get_layout('preshuffle').weight.")]
    return _svg(max(int(x1 + per_line * px + 20), 660), y + 40, body)


def draw_s32x8(rows: int = 32, cols: int = 12) -> str:
    """Source ``[rows, cols]`` scales (and the column pad) beside the first stored 32-row band."""
    forward = layouts.get_layout("preshuffle").scale.forward
    src = trace(forward, (rows, cols))
    rp, cp = forward(torch.zeros(rows, cols, dtype=torch.uint8)).shape
    band = 32 * cp
    assert bool((src[band:] == -1).all()), "rows past the first band should be pad only"
    where = {s: i for i, s in enumerate(src[:band].tolist()) if s >= 0}
    cell_w, cell_h, x0, y0 = 22, 12, 40, 64

    def fill(r: int, c: int) -> str:  # the tile quadrant: row half a, column half d
        return FILLS[2 * ((c % 8) // 4) + (r % 32) // 16]

    body = [_title(x0, 18, f"S32x8: scale [R = {rows}, K/32 = {cols}], padded to [pad256(R) = {rp}, "
                           f"pad8 = {cp}]; rows {rows}..{rp - 1} are all pad (not drawn)"),
            _title(x0, 40, "source: each cell's stored offset", 10),
            _note(x0, 54, "colour = quarter of the 32 x 8 tile: rows 0-15 / 16-31, columns 0-3 / 4-7")]
    for r in range(rows):
        body.append(f"<text x='{x0 - 4}' y='{y0 + r * cell_h + cell_h - 3}' text-anchor='end'>{r}</text>")
        for c in range(cp):
            x, y = x0 + c * cell_w, y0 + r * cell_h
            body.append(_rect(x, y, cell_w, cell_h, fill(r, c), str(where[r * cols + c]))
                        if c < cols else _rect(x, y, cell_w, cell_h, PAD, "pad"))
    for c in range(0, cp + 1, 8):
        body.append(f"<line x1='{x0 + c * cell_w}' y1='{y0}' x2='{x0 + c * cell_w}' y2='{y0 + rows * cell_h}' "
                    "stroke='black' stroke-width='1.5'/>")

    per_line, sw = 16, 30
    x1 = x0 + cp * cell_w + 70
    body.append(_title(x1, 40, f"stored band 0 (memory order, {per_line} bytes a line): source row,col", 10))
    for i, s in enumerate(src[:band].tolist()):
        line, col = divmod(i, per_line)
        x, y = x1 + col * sw, y0 + line * cell_h
        body.append(_rect(x, y, sw, cell_h, PAD, "pad") if s < 0 else
                    _rect(x, y, sw, cell_h, fill(*divmod(s, cols)), f"{s // cols},{s % cols}"))
    for line in range(0, band // per_line + 1, 256 // per_line):
        body.append(f"<line x1='{x1}' y1='{y0 + line * cell_h}' x2='{x1 + per_line * sw}' y2='{y0 + line * cell_h}' "
                    "stroke='black' stroke-width='1.5'/>")
    y = y0 + max(rows, band // per_line) * cell_h + 20
    body += [_note(x0, y, "A tile is 32 rows x 8 columns = 256 stored bytes (thick lines); tiles follow along the "
                          "columns."),
             _note(x0, y + 14, "Each 4 stored bytes hold one row l and column e of the four quarters: (l, e), "
                               "(l+16, e),"),
             _note(x0, y + 28, "(l, e+4), (l+16, e+4); l runs 0-15, then e 0-3. Pad columns and rows are written "
                               "0x00."),
             _note(x0, y + 42, "Drawn by scripts/draw_layouts.py from layouts.get_layout('preshuffle').scale.")]
    return _svg(int(x1 + per_line * sw + 20), y + 54, body)


DRAWINGS = {"w16.svg": draw_w16, "s32x8.svg": draw_s32x8}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=str(ROOT / "docs" / "img"))
    out = Path(parser.parse_args(argv).out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in DRAWINGS.items():
        (out / name).write_text(draw())
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
