"""One set of trainer rank processes for a module's groups (each process imports torch,
transformers and megatron: seconds of CPU per rank and group).

``TrainerGroup.start(actors=...)`` forms each test's group on the ranks the last group
handed back with ``TrainerGroup.release``: the same process group set-up and model load as
a fresh start, without new processes. A group that broke (a rank died or timed out), or
whose ranks fail to leave, is shut down; the next group then starts fresh ranks. The
fresh-start path itself stays covered by the tests that call ``TrainerGroup.start`` plainly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from rl_core.training.distributed import TrainerGroup


class RankPool:
    """Rank actors kept between groups, by number of ranks (one size at a time: starting
    another size ends the kept ones, whose reserved CPUs the new ranks may need)."""

    def __init__(self) -> None:
        self._idle: dict[int, list[Any]] = {}
        self.started = 0  # groups formed on fresh rank processes (the first, or after a break)

    @contextlib.contextmanager
    def group(self, *args: Any, num_ranks: int, **kwargs: Any) -> Iterator[TrainerGroup]:
        """``TrainerGroup.start(*args, num_ranks=..., **kwargs)`` on kept ranks when there are
        some; the group is released (or shut down) when the block ends."""
        actors = self._idle.pop(num_ranks, None)
        if actors is None:  # fresh ranks: the kept ones of other sizes would hold their CPUs
            self.close()
            self.started += 1
        group = TrainerGroup.start(*args, num_ranks=num_ranks, actors=actors, **kwargs)
        try:
            yield group
        finally:
            if group._broken is None and group.num_ranks == num_ranks:
                with contextlib.suppress(Exception):  # a failed release shuts the group down
                    self._idle[num_ranks] = group.release()
            group.shutdown()  # a no-op after a release

    def close(self) -> None:
        import ray

        for actors in self._idle.values():
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        self._idle.clear()


@pytest.fixture(scope="module", name="ranks")
def kept_ranks(ray_session):  # noqa: ANN001, ANN201 - the importing module's own Ray fixture
    """The module's :class:`RankPool` as fixture ``ranks`` (import ``kept_ranks`` into a test
    module with a module-scoped ``ray_session`` fixture): its first group starts the rank
    processes, the others reuse them; the kept ones end with the module."""
    pool = RankPool()
    yield pool
    pool.close()
