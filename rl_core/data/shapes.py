"""Seeded pictures of coloured shapes with questions about them: the visual task of the tiny
vision-language demo (docs/vlm.md). Two kinds, mixed: "How many <colour> squares are there?"
(1 to ``max_count``, among distractors of other colours and shapes; answer a number) and
"What colour is the circle?" (one circle among squares; answer a colour word). Drawn with
Pillow on ``size`` x ``size`` pixels, no overlaps; a pure function of (n, seed, knobs), no
global random state, no I/O.
"""

from __future__ import annotations

import io
import random

from rl_core.data.records import Record, content_id

__all__ = ["COLOURS", "generate_shapes", "shape_splits"]

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
           "yellow": (235, 200, 20)}
_MAX_TRIES = 200


def _place(rng: random.Random, boxes: list[tuple[int, int, int, int]], size: int,
           side: int) -> tuple[int, int, int, int] | None:
    """A free ``side``-pixel box (with a 2-pixel gap to the others), or None."""
    for _ in range(_MAX_TRIES):
        x, y = rng.randrange(0, size - side), rng.randrange(0, size - side)
        box = (x, y, x + side, y + side)
        if all(box[2] + 2 <= b[0] or b[2] + 2 <= box[0] or box[3] + 2 <= b[1] or
               b[3] + 2 <= box[1] for b in boxes):
            return box
    return None


def _picture(rng: random.Random, size: int, max_count: int) -> tuple[str, str, bytes]:
    """(question, answer, PNG bytes) of one picture."""
    from PIL import Image, ImageDraw

    side = max(6, size // 8)
    while True:  # a crowded draw that cannot place every shape is drawn again
        im = Image.new("RGB", (size, size), (255, 255, 255))
        draw, boxes, ok = ImageDraw.Draw(im), [], True
        colours = list(COLOURS)
        if rng.random() < 0.5:
            colour = rng.choice(colours)
            count = rng.randint(1, max_count)
            shapes = [("square", colour)] * count + [
                rng.choice([("square", c) for c in colours if c != colour] +
                           [("circle", c) for c in colours]) for _ in range(rng.randint(0, 2))]
            question, answer = f"How many {colour} squares are there?", str(count)
        else:
            colour = rng.choice(colours)
            shapes = [("circle", colour)] + [("square", rng.choice(colours))
                                             for _ in range(rng.randint(1, 3))]
            question, answer = "What colour is the circle?", colour
        for kind, c in shapes:
            box = _place(rng, boxes, size, side)
            if box is None:
                ok = False
                break
            boxes.append(box)
            (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=COLOURS[c])
        if ok:
            out = io.BytesIO()
            im.save(out, format="PNG")
            return question, answer, out.getvalue()


def generate_shapes(n: int, seed: int = 0, *, size: int = 64, max_count: int = 4) -> list[Record]:
    """``n`` seeded pictures as records: a text question, the answer, one image each; ids are
    content hashes over question, answer and the picture (as the data layer makes them)."""
    if n < 0 or not 32 <= size <= 448 or not 1 <= max_count <= 6:
        raise ValueError(f"need n >= 0, 32 <= size <= 448, 1 <= max_count <= 6; got {n}, "
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
    pool = generate_shapes(train_size + test_size + test_size // 4 + 8, seed, **knobs)
    unique = list({r.id: r for r in pool}.values())
    test = unique[:test_size]
    train = unique[test_size:test_size + train_size]
    if len(test) < test_size or len(train) < train_size:
        raise ValueError(f"only {len(unique)} distinct pictures for {train_size} + {test_size}")
    return train, test
