"""The tiny VLM demo's visual task (rl_core/data/shapes.py): seeded, disjoint splits, and every
answer is what the picture shows (read back from its pixels)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from rl_core.data.images import ImageSpec, load_image
from rl_core.data.shapes import COLOURS, generate_shapes, shape_splits


def _components(im: Image.Image) -> list[tuple[str, bool]]:
    """(colour, is_square) of each connected blob of one of COLOURS (4-connected)."""
    w, h = im.size
    px = im.load()
    names = {v: k for k, v in COLOURS.items()}
    seen, out = set(), []
    for y in range(h):
        for x in range(w):
            if (x, y) in seen or px[x, y] not in names:
                continue
            colour, stack, cells = px[x, y], [(x, y)], []
            seen.add((x, y))
            while stack:
                cx, cy = stack.pop()
                cells.append((cx, cy))
                for nx, ny in ((cx + 1, cy), (cx - 1, cy), (cx, cy + 1), (cx, cy - 1)):
                    if 0 <= nx < w and 0 <= ny < h and (nx, ny) not in seen and px[nx, ny] == colour:
                        seen.add((nx, ny))
                        stack.append((nx, ny))
            xs, ys = [c[0] for c in cells], [c[1] for c in cells]
            box = (max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1)
            out.append((names[colour], len(cells) == box))
    return out


def test_every_answer_is_what_the_picture_shows() -> None:
    records = generate_shapes(60, seed=3)
    kinds = set()
    for r in records:
        (image,) = r.images
        assert load_image(image, ImageSpec()) == image  # a valid image for the data layer
        blobs = _components(Image.open(io.BytesIO(image)).convert("RGB"))
        if r.question.startswith("How many"):
            colour = r.question.split()[2]
            assert str(sum(1 for c, sq in blobs if c == colour and sq)) == r.answer, r.question
            kinds.add("count")
        else:
            assert [c for c, sq in blobs if not sq] == [r.answer]
            kinds.add("colour")
    assert kinds == {"count", "colour"}


def test_the_splits_are_seeded_and_disjoint() -> None:
    train, test = shape_splits(100, 30, seed=1)
    again, _ = shape_splits(100, 30, seed=1)
    assert [r.id for r in train] == [r.id for r in again] and len(train) == 100
    assert not {r.id for r in train} & {r.id for r in test}
    assert [r.id for r in shape_splits(100, 30, seed=2)[0]] != [r.id for r in train]
    with pytest.raises(ValueError, match="32 <= size"):
        generate_shapes(1, size=16)
