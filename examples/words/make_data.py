"""A non-numeric task as a user would bring it: arithmetic answered in words, as Parquet files.

    python examples/words/make_data.py [OUT_DIR]   (default: examples/words/data)

writes ``train.parquet`` and ``test.parquet`` for GRPO (a chat ``prompt`` column: a system and
a user message; the ``label``, e.g. ``"seven"``; the ``expression``) and ``sft.parquet`` for
the warm start (a ``messages`` column: the prompt plus a worked answer ending ``#### seven``).
The problems are the embedded demo's (``rl_core.data.synthetic``), so the demo's tiny model
already does the arithmetic; what it must learn is the new answer format and task.
docs/data-and-rewards.md walks through it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rl_core.data.synthetic import generate_splits

SYSTEM = "Answer in words."
_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def in_words(n: int) -> str:
    """0..99 in English words (``twenty-seven``)."""
    if not 0 <= n < 100:
        raise ValueError(f"{n} is out of 0..99")
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def rows(records: list) -> tuple[list[dict], list[dict]]:
    """(GRPO rows, SFT rows) of synthetic records."""
    grpo, sft = [], []
    for r in records:
        number = int(r.final_answer)
        worked = r.answer.rpartition("####")[0] + f"#### {in_words(number)}"
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r.question}]
        grpo.append({"id": r.id, "prompt": prompt, "label": in_words(number),
                     "expression": r.question.removeprefix("What is ").removesuffix("?")})
        sft.append({"id": r.id, "messages": [*prompt, {"role": "assistant", "content": worked}]})
    return grpo, sft


def main(out: str = "examples/words/data") -> None:
    train, test = generate_splits(3000, 300, seed=7, digits=(1, 1), operations=("+", "-"),
                                  steps=(1, 2))
    (train_rows, sft_rows), (test_rows, _) = rows(train), rows(test)
    Path(out).mkdir(parents=True, exist_ok=True)
    for name, table in (("train", train_rows), ("test", test_rows), ("sft", sft_rows)):
        pq.write_table(pa.Table.from_pylist(table), Path(out) / f"{name}.parquet")
    print(f"{len(train_rows)} train, {len(test_rows)} test and {len(sft_rows)} SFT rows in {out}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
