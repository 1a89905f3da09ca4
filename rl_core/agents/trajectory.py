"""One episode's token chain, recorded the same way by :class:`EpisodeRunner` and the OpenAI
gateway's sessions: the prompt, then model turns (trained on: ``loss_mask`` 1, their
log-probs and weight versions) and observations (mask 0), the last turn's routed experts, and
the trace; :meth:`Trajectory.to_sample` makes the episode's :class:`~rl_core.types.Sample`
(``meta["episode"]``: docs/agents.md, 'What an episode is'). Where the chat template renders
the conversation differently from the chain (``agent.template_mismatch: new_sample``),
:meth:`Trajectory.split` ends the chain as a segment, trained as its own row with the episode's
advantage (:func:`rl_core.types.expand_segments`; docs/agents.md, 'Reasoning templates').
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rl_core.types import TEMPLATE_SEGMENTS, Sample, pad_routed_experts

__all__ = ["Trajectory"]


class Trajectory:
    """The chain so far (see the module docstring)."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] = []
        self.ids: list[int] = []  # everything after the prompt
        self.mask: list[int] = []
        self.logps: list[float] = []
        self.versions: list[int] = []
        self.routed: tuple[str, int] | None = None  # the last turn's routed_experts, its rows
        self.last_turn: list[int] = []
        self.text, self.finish_reason, self.version, self.turns = "", {}, 0, 0
        self.trace: list[dict[str, Any]] = []
        self.images: list[bytes] = []  # the chain's images, in the order of its image pads
        # The chain as text (the template's for prompts and observations, model turns
        # decoded), to compare with the template's rendering; None: not from chat messages.
        self.rendered: str | None = None
        self.root = 0  # the first prompt's length: agent.max_tokens counts what follows it
        self.history = 0  # of a segment's prompt, the tokens past the first prompt's length
        self.segments: list[dict[str, Any]] = []  # the chains ended by split(), in order
        self.checks = self.mismatches = 0  # prompts compared with the template's; differing

    @property
    def used(self) -> int:
        """Tokens counted against ``agent.max_tokens``: after the first prompt, in the chain
        the model sees."""
        return self.history + len(self.ids)

    def restart(self, prompt_ids: Sequence[int], rendered: str | None = None) -> None:
        """A new chain from ``prompt_ids`` (a retried episode, or a history the model did
        not write); earlier segments are dropped."""
        self.prompt_ids = list(prompt_ids)
        self.ids, self.mask, self.logps, self.versions = [], [], [], []
        self.images, self.segments, self.routed = [], [], None
        self.rendered, self.root, self.history = rendered, len(self.prompt_ids), 0

    def split(self, prompt_ids: Sequence[int], rendered: str | None,
              images: Sequence[bytes] = ()) -> None:
        """End the chain as a segment (trained as its own row) and go on from ``prompt_ids``:
        the template's rendering of the whole conversation, with ``images``."""
        self.segments.append({"prompt_ids": self.prompt_ids, "ids": self.ids, "mask": self.mask,
                              "logps": self.logps, "versions": self.versions,
                              "routed": self.routed, "images": self.images,
                              "finish_reason": self.finish_reason, "version": self.version,
                              "text": self.text})
        self.prompt_ids = list(prompt_ids)
        self.ids, self.mask, self.logps, self.versions = [], [], [], []
        self.images, self.routed, self.rendered = list(images), None, rendered
        self.history = max(0, len(self.prompt_ids) - self.root)

    def observe(self, tokens: Sequence[int], images: Sequence[bytes] = ()) -> None:
        """Tokens the environment wrote (and the images whose pads they hold): in the chain,
        never trained on."""
        self.images += images
        self.ids += tokens
        self.mask += [0] * len(tokens)
        self.logps += [0.0] * len(tokens)
        self.versions += [self.version] * len(tokens)

    def model_turn(self, s: Sample, text: str | None = None) -> list[int]:
        """The model's turn ``s``, generated from the whole chain: its tokens, trained on."""
        ids = list(s.completion_ids)
        # the request held the chain: its routing covers every token before the turn's last
        self.routed = (None if s.routed_experts is None else
                       (s.routed_experts, len(self.prompt_ids) + len(self.ids) + len(ids) - 1))
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logps += [float(x) for x in s.logprobs]
        self.versions += [s.weight_version] * len(ids)
        self.last_turn, self.version = ids, s.weight_version
        self.text = s.text if text is None else text
        self.finish_reason = dict(s.finish_reason)
        self.turns += 1
        return ids

    def to_sample(self, *, step: int, record_id: str, answer: str, index: int, group: int,
                  failed: bool, env_reward: float, fallback_prompt: Sequence[int], finish: str,
                  attempts: int, errors: Sequence[str], tool_calls: int, info: dict[str, Any],
                  trace: list[dict[str, Any]], seconds: float, started_at: float) -> Sample:
        """The episode's sample: ``failed`` trains on nothing, with reward 0;
        ``fallback_prompt`` stands in for a prompt never set (no reset succeeded)."""
        prompt = list(self.prompt_ids) or list(fallback_prompt)
        mask = [0] * len(self.ids) if failed else list(self.mask)
        episode = {"status": "failed" if failed else "ok", "finish": "failed" if failed else finish,
                   "turns": self.turns, "attempts": attempts, "errors": list(errors),
                   "env_reward": float(env_reward), "tool_calls": tool_calls, "info": info,
                   "masked_tokens": len(mask) - sum(mask), "trace": trace, "seconds": seconds,
                   "started_at": started_at, "template_checks": self.checks,
                   "template_mismatches": self.mismatches,
                   "segments": 1 + (0 if failed else len(self.segments))}  # fmt: skip
        uid = f"{step}:{record_id}:{index}"
        common = {"group": group, "record_id": record_id, "answer": answer,
                  "reward": 0.0 if failed else float(env_reward)}
        routed = None
        if self.routed is not None and not failed and self.prompt_ids:
            routed = pad_routed_experts(*self.routed, len(prompt) + len(self.ids) - 1)
        meta: dict[str, Any] = {"episode": episode}
        if self.segments and not failed:
            meta[TEMPLATE_SEGMENTS] = [_segment(seg, f"{uid}#{k}", common)
                                       for k, seg in enumerate(self.segments)]
        return Sample(prompt, list(self.ids), list(self.logps), dict(self.finish_reason),
                      self.version, self.text, loss_mask=mask, uid=uid,
                      versions=list(self.versions), meta=meta, routed_experts=routed,
                      images=tuple(self.images), **common)  # fmt: skip


def _segment(seg: dict[str, Any], uid: str, common: dict[str, Any]) -> Sample:
    """An earlier chain of an episode as a row of its own (its owner's reward and group)."""
    p, ids = seg["prompt_ids"], seg["ids"]
    routed = None if seg["routed"] is None else pad_routed_experts(*seg["routed"],
                                                                   len(p) + len(ids) - 1)
    return Sample(list(p), list(ids), list(seg["logps"]), dict(seg["finish_reason"]),
                  seg["version"], seg["text"], loss_mask=list(seg["mask"]), uid=uid,
                  versions=list(seg["versions"]), routed_experts=routed,
                  images=tuple(seg["images"]), **common)
