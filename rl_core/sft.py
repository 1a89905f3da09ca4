"""Supervised fine-tuning (SFT): its config schema and its data, up to token ids and labels.

The SFT flow trains on demonstrations before GRPO; this module holds what it needs without
torch: :class:`SFTConfig` (:func:`load_sft_config`), :func:`read_examples` (chat or
prompt/completion rows from any source, with their images, bad rows named by file and row;
``synthetic``; or a teacher's samples with ``data.teacher``) and :func:`tokenize_example`
(labels ``-100`` but on the tokens the model must produce, each part tokenized as the rollout
sees it, images placed and expanded as GRPO does: :mod:`rl_core.sft_images`; docs/sft.md).
Never imports torch, Prefect or MLflow; reads remotely only an explicit hub name or ``s3://``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rl_core.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    EnginesConfig,
    ModelConfig,
    OptimizerConfig,
    Section,
    SourceConfig,
    StorageConfig,
    TrackingConfig,
    TrainConfig,
    read_config,
    validate_config,
)
from rl_core.data.images import ImageSpec, image_digest, image_spec
from rl_core.data.numbers import parse_number
from rl_core.data.prompts import place_images, render_prompt
from rl_core.data.records import BadRow, DataValidationError, extract_final_answer
from rl_core.sft_images import (
    encode_image_prompt,
    expand_parts,
    keep_whole_images,
    parts_problem,
    row_images,
)

__all__ = ["TINY_INIT", "Example", "SFTConfig", "SFTDataConfig", "SFTEvalConfig",
           "SFTTeacherConfig", "SFTTrainConfig", "TokenizedExample", "examples_digest",
           "load_sft_config", "prompt_text", "read_examples", "split_examples",
           "synthetic_examples", "tokenize_example"]

log = logging.getLogger(__name__)

# model.path of a bare tiny model: the demo's tokenizer and architecture, randomly initialised
# (what rl_core.models.tiny builds before its warm start), so SFT does the warm start's job.
TINY_INIT = "embedded:tiny-init"
MAX_LISTED = 10  # bad rows named in one error


# ---------------------------------------------------------------------------------- config


class SFTTeacherConfig(EnginesConfig):
    """SFT on a teacher's samples (``path`` set): the completions of the prompt rows are
    replaced by what the teacher generates for their prompts (docs/distillation.md). The loss
    on them is then a Monte-Carlo estimate of the forward KL from the teacher to the student,
    on-policy distillation's baseline; ``keep: correct`` is rejection sampling."""
    path: str | None = Field(None, description="The teacher: HF hub id, local HF directory, "
        "s3:// or an `embedded:` model, with the student's tokenizer; None: the rows as read.")
    samples_per_prompt: int = Field(1, ge=1, description="Teacher samples per prompt row.")
    temperature: float = Field(1.0, ge=0.0, description="1.0: the teacher's own distribution "
        "(the forward KL's); 0: its greedy answer.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of the teacher's "
        "samples; 1.0: off.")
    max_new_tokens: int = Field(128, ge=1, description="The teacher's budget per sample; a "
        "sample that hits it has no end to imitate and is dropped (counted).")
    keep: Literal["all", "correct"] = Field("all", description="`correct`: only samples whose "
        "final number the gsm8k reward finds equal to the row's reference (rejection sampling).")
    seed: int = Field(0, description="Sampling seeds are f(seed, row id, sample index).")

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @model_validator(mode="after")
    def _check_samples(self) -> SFTTeacherConfig:
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError(f"samples_per_prompt={self.samples_per_prompt} with temperature 0 "
                             "repeats one greedy answer; set samples_per_prompt to 1 or raise "
                             "temperature")
        return self


class SFTDataConfig(SourceConfig):
    """Demonstrations: where they come from (as GRPO's ``data``) and how a row becomes tokens."""
    source: str = Field("synthetic", min_length=1, description="`synthetic` (the demo's "
        "arithmetic with worked answers), a .jsonl/.parquet file, a directory with "
        "{split}.jsonl/.parquet, a hub dataset name or s3://.")
    eval_source: str | None = Field(None, description="Held-out rows (read with eval_split); "
        "null: `synthetic`'s test split, else eval_size rows held out of `source`.")
    eval_size: int = Field(200, ge=1, description="Rows held out of `source` (a seeded choice) "
        "when there is no eval_source.")
    messages_field: str = Field("messages", min_length=1, description="Chat rows: the list of "
        "{role, content} turns; loss on the assistant turns.")
    prompt_field: str = Field("prompt", min_length=1, description="Prompt rows: the prompt.")
    completion_field: str = Field("completion", min_length=1,
                                  description="Prompt rows: the completion (the loss is on it).")
    max_seq_len: int = Field(512, ge=8, description="Tokens per example; longer ones are cut "
        "(from the right), and dropped when nothing to train on is left.")
    render_prompts: bool = Field(True, description="Prompt rows: render the prompt as "
        "grpo_train renders a question (chat template with system_prompt, else plain_template), "
        "so the model learns the format GRPO samples from; false: the prompt is literal text.")
    system_prompt: str | None = Field(None, description="A system turn for rendered prompts and "
        "for chat rows that have none.")
    teacher: SFTTeacherConfig = Field(SFTTeacherConfig(), description="Train on a teacher's "
        "samples for the prompt rows (`path` set; docs/distillation.md).")

    def grpo_data(self) -> DataConfig:
        """GRPO's data section for the same synthetic task and prompt rendering (what
        ``fetch_model`` builds the embedded tiny models from)."""
        shared = {"seed", "system_prompt", "use_chat_template", "plain_template",
                  *(k for k in SourceConfig.model_fields if k.startswith("synthetic_"))}
        return DataConfig(**self.model_dump(include=shared))


class SFTTrainConfig(OptimizerConfig):
    """The optimizer and the batches it sees."""
    steps: int = Field(200, ge=0, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Examples per optimizer step.")
    micro_batch_size: int = Field(32, ge=1, description="Examples per forward/backward (packed "
        "into rows with `packing`); the gradient is accumulated exactly across them.")
    packing: bool = Field(False, description="Pack a step's examples into rows of pack_length "
        "tokens (block-diagonal attention, positions restart per example): less padding.")
    pack_length: int | None = Field(None, ge=8, description="Tokens per packed row; default "
        "data.max_seq_len.")
    lr_schedule: Literal["constant", "cosine"] = Field("cosine", description="After warmup: "
        "`constant`, or `cosine` decay to `min_lr_ratio` x `lr` over `steps`.")
    steps_per_task: int = Field(10, ge=1, description="Optimizer steps per Prefect task run "
        "(fewer where an evaluation or a checkpoint falls).")
    step_timeout_s: float = Field(600.0, gt=0, description="Bound on one optimizer step (a "
        "train-steps task run gets this much per step).")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads.")
    seed: int = Field(0, description="Seed of the example order, the trainer and dropout.")

    def torch_config(self) -> TrainConfig:
        """The torch trainer's section for these optimizer settings (one update per step)."""
        return TrainConfig(
            steps=self.steps, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas,
            warmup_steps=self.warmup_steps, lr_schedule=self.lr_schedule,
            min_lr_ratio=self.min_lr_ratio, grad_clip=self.grad_clip, lora=self.lora,
            micro_batch_size=self.micro_batch_size, num_threads=self.num_threads, seed=self.seed,
            pack_groups=False)  # SFT packs first-fit, with `packing` only


class SFTEvalConfig(Section):
    """Held-out loss, and greedy accuracy where the references end in a number."""
    every: int = Field(50, ge=0, description="Evaluate every N steps; 0: before and after only.")
    num_examples: int = Field(200, ge=1, description="Held-out examples for the loss.")
    greedy_examples: int = Field(100, ge=0, description="Of those, how many the model answers "
        "greedily, scored by gsm8k_reward against the reference's final number (rows whose "
        "reference has none are skipped); 0: no accuracy.")
    max_new_tokens: int = Field(
        64, ge=1, description="Tokens per greedy answer (`greedy_examples`) at most.")
    batch_size: int = Field(32, ge=1, description="Rows per forward of the held-out loss.")


class SFTConfig(Section):
    """A whole SFT run."""
    name: str = Field("sft", description="The run's name: run names start with it, and it is "
        "the MLflow experiment unless `tracking.experiment` is set.")
    run_name: str | None = Field(None, description="Defaults to `<name>-<timestamp>`.")
    model: ModelConfig = Field(ModelConfig(), description="The model to fine-tune; `path: "
        "embedded:tiny-init` is the tiny model before its warm start.")
    data: SFTDataConfig = Field(SFTDataConfig(), description="The demonstrations.")
    train: SFTTrainConfig = Field(
        SFTTrainConfig(), description="The optimizer and the batches it sees.")
    eval: SFTEvalConfig = Field(
        SFTEvalConfig(), description="Held-out loss and greedy accuracy.")
    checkpoint: CheckpointConfig = Field(
        CheckpointConfig(), description="Where checkpoints go and how often.")
    storage: StorageConfig = Field(
        StorageConfig(), description="Where runs and cached data and models go.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow tracking and registry.")

    @property
    def pack_length(self) -> int:
        return self.train.pack_length or self.data.max_seq_len

    @model_validator(mode="after")
    def _check_cross_fields(self) -> SFTConfig:
        if self.data.image_field is not None and self.data.teacher.enabled:
            raise ValueError("data.teacher.path with data.image_field: a teacher's samples are "
                             "drawn for text prompts only in this version; unset one of them")
        if self.train.packing and self.pack_length < self.data.max_seq_len:
            raise ValueError(
                f"train.pack_length ({self.pack_length}) is shorter than data.max_seq_len "
                f"({self.data.max_seq_len}): an example could fit in no row; raise "
                "train.pack_length or lower data.max_seq_len")
        return self


def load_sft_config(path: str | Path | None = None,
                    overrides: Sequence[str] | None = None) -> SFTConfig:
    """Load an SFT YAML config (the defaults when ``path`` is None) with dotted overrides;
    raises :class:`~rl_core.config.ConfigError` naming the field and the allowed values."""
    data, origin = read_config(path, overrides, "configs/sft-tiny-cpu.yaml")
    if grpo := sorted({"rollout", "algorithm", "reward"} & set(data)):
        raise ConfigError(f"{origin} is a GRPO config (it has {', '.join(grpo)}); `grpoflow sft` "
                          "takes an SFT config, e.g. configs/sft-tiny-cpu.yaml (docs/sft.md)")
    return validate_config(SFTConfig, data, origin)


# ------------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class Example:
    """One demonstration: chat ``messages``, or a ``prompt`` and its ``completion``; ``images``
    its pictures as encoded bytes (``data.image_field``'s, then the turns' image parts, each
    left in its turn as ``{"type": "image"}``). ``origin`` names where it came from
    (``data/train.jsonl line 12``) for errors."""

    id: str
    origin: str
    messages: tuple[tuple[str, Any], ...] = ()  # (role, text or content parts)
    prompt: str | None = None
    completion: str | None = None
    images: tuple[bytes, ...] = ()

    @property
    def reference(self) -> str:
        """What the model should answer last: the completion, or the last assistant turn."""
        if self.completion is not None:
            return self.completion
        return next(c for r, c in reversed(self.messages) if r == "assistant")

    def to_json(self) -> str:
        body = ({"messages": [{"role": r, "content": c} for r, c in self.messages]}
                if self.messages else {"prompt": self.prompt, "completion": self.completion})
        if self.images:  # the snapshot keeps the pixels (base64), as GRPO's keeps them
            body["images"] = [base64.b64encode(p).decode("ascii") for p in self.images]
        return json.dumps({"id": self.id, "origin": self.origin, **body}, ensure_ascii=False,
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Example:
        d = json.loads(text)
        turns = tuple((m["role"], m["content"]) for m in d.get("messages", ()))
        images = tuple(base64.b64decode(p) for p in d.get("images", ()))
        return cls(d["id"], d["origin"], turns, d.get("prompt"), d.get("completion"), images)


def _check_row(row: object, d: SFTDataConfig,
               spec: ImageSpec | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(the example's fields, images read with ``spec``, None) or (None, why the row is bad)."""
    fields, why = _check_text(row, d)
    if fields is None:
        return None, why
    return row_images(fields, row, d.messages_field, spec or image_spec(d))  # type: ignore[arg-type]


def _check_text(row: object, d: SFTDataConfig) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(row, BadRow):
        return None, row.reason
    if not isinstance(row, Mapping):
        return None, f"expected an object, got {type(row).__name__}"
    if d.messages_field in row:
        turns = row[d.messages_field]
        if not isinstance(turns, list) or not turns:
            return None, f"field {d.messages_field!r} must be a non-empty list of turns"
        out = []
        for i, t in enumerate(turns, 1):
            if not (isinstance(t, Mapping) and isinstance(t.get("role"), str)
                    and isinstance(t.get("content"), str | list)):
                return None, (f"turn {i} of {d.messages_field!r} must be an object with string "
                              "'role' and 'content' (text, or a list of text and image parts)")
            if not isinstance(t["content"], str) and (
                    why := parts_problem(t["role"], t["content"], i, d.messages_field)):
                return None, why
            out.append((t["role"], t["content"]))
        if not any(r == "assistant" and c.strip() for r, c in out):
            return None, f"{d.messages_field!r} has no non-empty assistant turn to train on"
        if out[0][0] == "assistant":
            return None, "the first turn is the assistant's; start with a user (or system) turn"
        return {"messages": tuple(out)}, None
    p, c = d.prompt_field, d.completion_field
    if p not in row or c not in row:
        have = ", ".join(sorted(map(str, row))[:8]) or "none"
        return None, (f"neither {d.messages_field!r} nor {p!r} + {c!r} (row has: {have}); map "
                      "the columns with data.messages_field or data.prompt_field / "
                      "data.completion_field")
    if not isinstance(row[p], str) or not isinstance(row[c], str):
        return None, f"fields {p!r} and {c!r} must be strings"
    if not row[c].strip():
        return None, f"field {c!r} is empty: nothing to train on"
    return {"prompt": row[p], "completion": row[c]}, None


def _content_id(fields: Mapping[str, Any]) -> str:
    """sha1 of a row's text and, where it has images, their sha256s (the same text over other
    pictures is another example)."""
    if fields.get("images"):
        fields = {**fields, "images": [image_digest(p) for p in fields["images"]]}
    blob = json.dumps(fields, ensure_ascii=False, sort_keys=True, default=list)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def validate_rows(rows: Iterable[tuple[int, object]], name: str, d: SFTDataConfig,
                  row_label: str = "row", images: ImageSpec | None = None) -> list[Example]:
    """Examples from numbered raw rows (``images``: how their images are read, default
    ``data.image_*`` with no base folder); raises :class:`DataValidationError` naming ``name``
    and each bad row's number when more than ``data.max_bad_fraction`` are bad, or none is good."""
    good: list[Example] = []
    problems: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    total = 0
    for number, row in rows:
        total += 1
        fields, why = _check_row(row, d, images)
        if fields is not None:
            raw = row.get(d.id_field) if d.id_field and isinstance(row, Mapping) else None
            given = isinstance(raw, str | int) and not isinstance(raw, bool) and str(raw).strip()
            ex_id = str(raw) if given else _content_id(fields)
            if ex_id in seen:
                why, fields = f"duplicate id {ex_id!r} (first at {row_label} {seen[ex_id]})", None
            else:
                seen[ex_id] = number
                good.append(Example(ex_id, f"{name} {row_label} {number}", **fields))
        if why is not None:
            problems.append((number, why))
    listed = "\n".join(f"  {row_label} {n}: {why}" for n, why in problems[:MAX_LISTED])
    if len(problems) > MAX_LISTED:
        listed += f"\n  ... and {len(problems) - MAX_LISTED} more"
    if not good:
        detail = f"all {total} rows are invalid:\n{listed}" if total else "no rows found"
        raise DataValidationError(name, problems, f"{name}: no usable SFT rows: {detail}")
    if problems and len(problems) / total > d.max_bad_fraction:
        raise DataValidationError(name, problems, (
            f"{name}: {len(problems)} of {total} rows are invalid (above data.max_bad_fraction="
            f"{d.max_bad_fraction}):\n{listed}\nFix these rows, or raise data.max_bad_fraction "
            "to skip them."))
    if problems:
        log.warning("%s: skipped %d of %d bad rows (data.max_bad_fraction=%s): %s", name,
                    len(problems), total, d.max_bad_fraction, listed.strip())
    return good


def synthetic_examples(d: SFTDataConfig) -> tuple[list[Example], list[Example]]:
    """(train, test): the demo's arithmetic problems as prompt/completion rows whose
    completions are the worked answers (``3 + 4 = 7`` lines, then ``#### 7``)."""
    from rl_core.data.synthetic import generate_splits

    knobs = d.grpo_data().synthetic_knobs()
    train, test = generate_splits(d.synthetic_train_size, d.synthetic_test_size, d.seed, **knobs)
    def rows(split: str, records: Sequence[Any]) -> list[Example]:
        return [Example(r.id, f"synthetic {split} {i}", prompt=r.question, completion=r.answer,
                        images=tuple(r.images)) for i, r in enumerate(records, 1)]

    return rows("train", train), rows("test", test)


def read_examples(source: str, split: str, d: SFTDataConfig,
                  cache_dir: str | None = None) -> list[Example]:
    """Validated examples of ``source`` (one split), through :mod:`rl_core.data.sources`'
    readers: local files and directories, hub datasets, ``s3://`` (cached in ``cache_dir``);
    images as GRPO reads them (relative paths from the data file's folder)."""
    from rl_core.data.sources import SourceRequest, dispatch_source, source_image_spec

    request = SourceRequest(split, d.subset, (), Path(cache_dir) if cache_dir else None)
    read = dispatch_source(source, request)
    return validate_rows(read.rows, read.name, d, read.row_label,
                         source_image_spec(image_spec(d), source))


def split_examples(d: SFTDataConfig, cache_dir: str | None = None
                   ) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples as the data section says (see :class:`SFTDataConfig`)."""
    if d.source == "synthetic":
        train, test = synthetic_examples(d)
    else:
        train = read_examples(d.source, d.train_split, d, cache_dir)
        if d.eval_source:
            test = read_examples(d.eval_source, d.eval_split, d, cache_dir)
        else:
            if len(train) <= d.eval_size:
                raise ValueError(
                    f"{d.source}: {len(train)} rows, but data.eval_size={d.eval_size} are to be "
                    "held out for evaluation; lower data.eval_size or set data.eval_source")
            held = set(random.Random(f"grpoflow-sft-eval:{d.seed}").sample(
                range(len(train)), d.eval_size))
            test = [e for i, e in enumerate(train) if i in held]
            train = [e for i, e in enumerate(train) if i not in held]
    return train[: d.max_train_examples], test


def examples_digest(examples: Sequence[Example]) -> str:
    """sha256 over the examples' ids, texts and images' sha256s, in order (lineage and resume
    checks); where they were read from is not part of it (a moved file is the same data)."""
    h = hashlib.sha256(b"grpoflow.sft-examples.v1\n")
    for e in examples:
        fields: list[Any] = [e.id, e.messages, e.prompt, e.completion]
        if e.images:  # a text example's line is as it was
            fields.append([image_digest(p) for p in e.images])
        line = json.dumps(fields, ensure_ascii=False)
        h.update(line.encode() + b"\n")
    return h.hexdigest()


# -------------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class TokenizedExample:
    """``ids`` and ``labels`` (``-100``: no loss; else the id itself), unshifted; the prompt
    of the last trained span is ``ids[:prompt_len]`` (what a greedy evaluation answers)."""

    id: str
    ids: list[int]
    labels: list[int]
    prompt_len: int
    reference: str
    images: tuple[bytes, ...] = ()  # a vision-language example's (its pads in ``ids``)

    @property
    def tokens(self) -> int:
        """Tokens the loss is on."""
        return sum(1 for y in self.labels if y != -100)

    @property
    def scorable(self) -> bool:
        """Whether the reference ends in a number (``#### 7`` or a bare number) to score."""
        return parse_number(extract_final_answer(self.reference)) is not None


def _render(tokenizer: Any, turns: Sequence[tuple[str, str]], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns],
                                         tokenize=False, add_generation_prompt=generation_prompt)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def _chat_segments(tokenizer: Any, turns: Sequence[tuple[str, str]]) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) parts: each assistant turn is trained
    through its end-of-turn marker (what the template writes after the content, trailing
    whitespace excluded: the model stops at the marker, so the text after it is never
    generated); everything else is not. Found by rendering the conversation turn by turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a chat row needs the tokenizer's chat template, and this tokenizer "
                         "has none; use prompt/completion rows, or a chat model's tokenizer")
    parts: list[tuple[str, bool]] = []
    done = ""
    for i, (role, content) in enumerate(turns):
        if role != "assistant":
            continue
        head = _render(tokenizer, turns[:i], generation_prompt=True)
        full = _render(tokenizer, turns[: i + 1], generation_prompt=False)
        if not head.startswith(done) or not full.startswith(head):
            raise ValueError("the chat template renders earlier turns differently once more "
                             "follow (it rewrites history), so assistant turns cannot be "
                             "located; split the conversation into one row per assistant turn")
        turn = full[len(head):]
        at = turn.find(content) if content else -1
        end = at + len(content) if at >= 0 else 0
        turn = turn[:end] + turn[end:].rstrip()  # the content, then the end-of-turn marker
        parts += [(head[len(done):], False), (turn, True)]
        done = head + turn
    return parts


def prompt_text(tokenizer: Any, prompt: str, d: SFTDataConfig) -> str:
    """A prompt row's prompt as the model sees it: rendered as ``grpo_train`` renders a
    question (``data.render_prompts``), else literal."""
    if not d.render_prompts:
        return prompt
    return render_prompt(tokenizer, prompt, system_prompt=d.system_prompt,
                         use_chat_template=d.use_chat_template, plain_template=d.plain_template)


def tokenize_example(tokenizer: Any, ex: Example, d: SFTDataConfig,  # noqa: ANN401
                     vision: Any = None) -> TokenizedExample:  # noqa: ANN401
    """Token ids and labels of ``ex`` (module docstring); ``vision``: the model's
    :class:`~rl_core.models.vlm.VisionProcessor`, needed by an example with images (a prompt
    row's are placed as GRPO places them, a chat row's where its turns hold them; each pad
    expanded, none trained). Raises ValueError naming its origin when the template cannot
    place its turns or images, or nothing to train on fits data.max_seq_len."""
    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    try:
        if ex.messages:
            turns = list(ex.messages)
            if ex.images:  # data.image_field's go first in the first user turn, as in GRPO
                if not any(r == "user" for r, _ in turns):
                    raise ValueError("a row with images needs a user turn to hold them")
                turns = [(m["role"], m["content"]) for m in place_images(
                    [{"role": r, "content": c} for r, c in turns], len(ex.images))]
            if d.system_prompt is not None and turns[0][0] != "system":
                turns.insert(0, ("system", d.system_prompt))
            parts = [(enc(text), trained) for text, trained in _chat_segments(tokenizer, turns)]
            if ex.images:
                parts = expand_parts(parts, vision, ex.images)
        else:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token: a completion could never "
                                 "end; set eos_token in tokenizer_config.json")
            prompt = (encode_image_prompt(tokenizer, ex.prompt or "", ex.images, d, vision)
                      if ex.images else enc(prompt_text(tokenizer, ex.prompt or "", d)))
            parts = [(prompt, False), (enc(ex.completion or "") + [tokenizer.eos_token_id], True)]
    except ValueError as exc:
        raise ValueError(f"{ex.origin}: {exc}") from None
    ids: list[int] = []
    labels: list[int] = []
    prompt_len = 0
    for part, trained in parts:
        if trained:
            prompt_len = len(ids)
        ids += part
        labels += part if trained else [-100] * len(part)
    cut, kept = keep_whole_images(ids, d.max_seq_len, vision) if ex.images else (d.max_seq_len, 0)
    ids, labels = ids[:cut], labels[:cut]
    if all(y == -100 for y in labels):
        raise ValueError(f"{ex.origin}: nothing to train on within data.max_seq_len="
                         f"{d.max_seq_len} tokens (the prompt alone is {prompt_len}); raise it")
    return TokenizedExample(ex.id, ids, labels, min(prompt_len, len(ids)), ex.reference,
                            ex.images[:kept])
