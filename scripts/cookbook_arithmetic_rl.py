"""tinker-cookbook's arithmetic RL recipe, sized for the tiny CPU model (runs in the cookbook venv).

The stock recipe (``python -m tinker_cookbook.recipes.math_rl.train env=arithmetic``) asks
"What is x + y?" for x, y in 0..100. grpoflow's tiny demo model (1.7M parameters) was
warm-started on one-digit sums only, so on the stock task every sample of every group scores the
same (-0.1: wrong and unstopped) and GRPO has no signal. This script is that recipe with one
change: the operands are 0..``max_operand`` (default 9). Everything else is the cookbook's own:
its ``ArithmeticEnv`` (question, few-shot prefix, reward: 1 for the right sum, -0.1 without
the renderer's stop token), ``ProblemGroupBuilder``, the renderer picked by ``model_info``, and
``tinker_cookbook.rl.train.main`` (sampling through the SDK, advantages, ``forward_backward``,
``optim_step``, metrics.jsonl). No hub: the data are made here.

The held-out measurement is the recipe's own too: the dataset builder returns a test set (as
math_rl's GSM8K/MATH builders do), which ``rl.train.main`` scores with its
``RLTestSetEvaluator`` at step 0 (the base model: LoRA's B is 0) and after the last step,
through the SDK's sampling client on the saved sampler weights: every sum x + y with
x, y in 0..``max_operand`` (100 problems), ``eval_group_size`` samples each at the training
temperature; metrics.jsonl's ``test/env/all/correct`` at both steps. Unlike the training
reward, whose batches come in a fixed order (seeded by the batch's index: later batches
need not be as hard), the test set is the same before and after.

    python scripts/cookbook_arithmetic_rl.py base_url=http://127.0.0.1:8000 \
        model_name=Qwen/Qwen3-4B-Instruct-2507 log_path=runs/cookbook-rl max_steps=20
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial

import chz
import numpy as np
from tinker_cookbook import cli_utils, model_info, renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import (
    ArithmeticDataset,
    ArithmeticDatasetBuilder,
    ArithmeticEnv,
)
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
from tinker_cookbook.rl.types import RLDataset
from tinker_cookbook.tokenizer_utils import get_tokenizer


class SmallArithmeticDataset(ArithmeticDataset):
    """The cookbook's ArithmeticDataset with operands 0..max_operand (seeded per batch, as
    the original)."""

    def __init__(self, *args: object, max_operand: int = 9, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.max_operand = max_operand

    def _make_env_group_builder(self, rng: np.random.RandomState) -> ProblemGroupBuilder:
        x, y = rng.randint(0, self.max_operand + 1, size=2)
        prefix = ArithmeticEnv.standard_fewshot_prefix() if self.include_fewshot else None
        return ProblemGroupBuilder(
            env_thunk=partial(ArithmeticEnv, int(x), int(y), convo_prefix=prefix,
                              renderer=self.renderer),
            num_envs=self.group_size)


class AllSumsDataset(RLDataset):
    """The test set: one group of ``group_size`` per sum x + y, x, y in 0..max_operand, in
    one batch (the same problems at every evaluation)."""

    def __init__(self, renderer: renderers.Renderer, group_size: int, max_operand: int,
                 include_fewshot: bool = True) -> None:
        prefix = ArithmeticEnv.standard_fewshot_prefix() if include_fewshot else None
        self.builders = [
            ProblemGroupBuilder(env_thunk=partial(ArithmeticEnv, x, y, convo_prefix=prefix,
                                                  renderer=renderer), num_envs=group_size)
            for x in range(max_operand + 1) for y in range(max_operand + 1)]

    def get_batch(self, index: int) -> Sequence[ProblemGroupBuilder]:
        return self.builders

    def __len__(self) -> int:
        return 1


@chz.chz
class SmallArithmeticDatasetBuilder(ArithmeticDatasetBuilder):
    max_operand: int = 9
    eval_group_size: int = 0  # samples per test problem; 0: no test set

    async def __call__(self) -> tuple[SmallArithmeticDataset, AllSumsDataset | None]:
        renderer = renderers.get_renderer(
            self.renderer_name, tokenizer=get_tokenizer(self.model_name_for_tokenizer))
        test = (AllSumsDataset(renderer, self.eval_group_size, self.max_operand,
                               self.include_fewshot) if self.eval_group_size > 0 else None)
        return SmallArithmeticDataset(
            batch_size=self.batch_size, renderer=renderer, group_size=self.group_size,
            n_batches=self.n_batches, include_fewshot=self.include_fewshot,
            max_operand=self.max_operand), test


@chz.chz
class CLIConfig:
    """math_rl/train.py's knobs that this run uses (the same names and defaults otherwise)."""

    base_url: str | None = None
    model_name: str = "Qwen/Qwen3-4B-Instruct-2507"
    log_path: str = "runs/cookbook-arithmetic-rl"
    lora_rank: int = 8
    group_size: int = 8
    groups_per_batch: int = 8
    learning_rate: float = 2e-3
    max_tokens: int = 16
    temperature: float = 1.0
    max_operand: int = 9
    loss_fn: str = "importance_sampling"
    max_steps: int | None = 20
    eval_group_size: int = 0  # > 0: the held-out test set (above), this many samples a sum
    eval_every: int = 0  # with a test set: at step 0, every eval_every (0: max_steps), the end
    n_batches: int = 100
    behavior_if_log_dir_exists: cli_utils.LogdirBehavior = "delete"


async def cli_main(cli: CLIConfig) -> None:
    renderer_name = model_info.get_recommended_renderer_name(cli.model_name)
    config = train.Config(
        learning_rate=cli.learning_rate,
        dataset_builder=SmallArithmeticDatasetBuilder(
            batch_size=cli.groups_per_batch, model_name_for_tokenizer=cli.model_name,
            renderer_name=renderer_name, n_batches=cli.n_batches, group_size=cli.group_size,
            max_operand=cli.max_operand, eval_group_size=cli.eval_group_size),
        model_name=cli.model_name, recipe_name="recipe_math_rl", renderer_name=renderer_name,
        lora_rank=cli.lora_rank, max_tokens=cli.max_tokens, temperature=cli.temperature,
        log_path=cli.log_path, base_url=cli.base_url,
        eval_every=(cli.eval_every or cli.max_steps or 0) if cli.eval_group_size > 0 else 0,
        save_every=0,
        loss_fn=cli.loss_fn, max_steps=cli.max_steps)
    cli_utils.check_log_dir(cli.log_path, behavior_if_exists=cli.behavior_if_log_dir_exists)
    await train.main(config)


if __name__ == "__main__":
    asyncio.run(cli_main(chz.entrypoint(CLIConfig)))
