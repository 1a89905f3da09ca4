"""Seeded pictures of coloured shapes with questions about them: the visual task of the tiny
vision-language demo (docs/vlm.md). Two kinds, mixed: "How many <colour> squares are there?"
(1 to ``max_count`` squares of that colour, each of random size and place inside its own
quadrant; answer a number) and "What colour is the circle?" (one large disc of random size
and place; answer a colour word). Drawn with Pillow on a black ``size`` x ``size`` picture.
Kept this plain on purpose: a 1M-parameter model reads big shapes within a demo's budget,
while small ones (4 x 4 cells) and relations (a colour among distractors) took it far longer
(docs/vlm.md). A pure function of (n, seed, knobs), no global random state, no I/O.
"""

from __future__ import annotations

import io
import random

from rl_core.data.records import Record, content_id

__all__ = ["COLOURS", "generate_shapes", "shape_splits"]

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
           "yellow": (235, 200, 20)}
GRID = 2  # squares sit in distinct quadrants, a pixel inside them (never touching, no retries)
# Black, not white: normalised by the processor's mean and std a black background sits near
# -1.8 and the shapes far from it (with white, the near-constant background dominates what a
# randomly initialised vision tower passes on).
BACKGROUND = (0, 0, 0)


def _picture(rng: random.Random, size: int, max_count: int) -> tuple[str, str, bytes]:
    """(question, answer, PNG bytes) of one picture: each square (a half to 0.8 of a cell's
    side) at a random place in a random free cell, a pixel clear of its edges; the disc's
    radius a fifth to 0.4 of the picture."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (size, size), BACKGROUND)
    draw, colours = ImageDraw.Draw(im), list(COLOURS)
    if rng.random() < 0.5:
        colour = rng.choice(colours)
        count = rng.randint(1, max_count)
        shapes = [("square", colour)] * count
        question, answer = f"How many {colour} squares are there?", str(count)
    else:
        colour = rng.choice(colours)
        shapes = [("circle", colour)]
        question, answer = "What colour is the circle?", colour
    cell = size / GRID
    for (kind, c), k in zip(shapes, rng.sample(range(GRID * GRID), len(shapes)), strict=True):
        x, y = (k % GRID) * cell, (k // GRID) * cell
        if kind == "circle":  # a disc of random size anywhere: many distinct pictures
            r = rng.uniform(size / 5, size / 2.5)
            x, y = rng.uniform(0, size - 2 * r), rng.uniform(0, size - 2 * r)
            box = (round(x), round(y), round(x + 2 * r) - 1, round(y + 2 * r) - 1)
        else:
            side = rng.uniform(cell / 2, cell * 0.8)
            x, y = x + rng.uniform(1, cell - side - 1), y + rng.uniform(1, cell - side - 1)
            box = (round(x), round(y), round(x + side) - 1, round(y + side) - 1)
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=COLOURS[c])
    out = io.BytesIO()
    im.save(out, format="PNG")
    return question, answer, out.getvalue()


def generate_shapes(n: int, seed: int = 0, *, size: int = 64, max_count: int = 4) -> list[Record]:
    """``n`` seeded pictures as records: a text question, the answer, one image each; ids are
    content hashes over question, answer and the picture (as the data layer makes them)."""
    if n < 0 or not 32 <= size <= 448 or not 1 <= max_count <= GRID * GRID:
        raise ValueError(f"need n >= 0, 32 <= size <= 448, 1 <= max_count <= 4; got {n}, "
                         f"{size}, {max_count}")
    rng = random.Random(f"shapes:{seed}:{size}:{max_count}")
    out = []
    for _ in range(n):
        question, answer, image = _picture(rng, size, max_count)
        out.append(Record(content_id(question, answer, [image]), question, answer,
                          {"answer": answer}, (image,)))
    return out


def shape_splits(train_size: int, test_size: int, seed: int = 0, **knobs: int
                 ) -> tuple[list[Record], list[Record]]:
    """Disjoint train and held-out splits (a held-out picture never appears in training)."""
    want = train_size + test_size
    pool = generate_shapes(want + want // 4 + 8, seed, **knobs)  # repeats are dropped
    unique = list({r.id: r for r in pool}.values())
    test = unique[:test_size]
    train = unique[test_size:test_size + train_size]
    if len(test) < test_size or len(train) < train_size:
        raise ValueError(f"only {len(unique)} distinct pictures for {train_size} + {test_size}")
    return train, test
