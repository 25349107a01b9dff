"""tinker-cookbook's RL loop, unchanged, against `flywheel tinker`: the review task.

    flywheel tinker --model ~/.cache/flywheel/models/SmolLM2-135M-Instruct --port 8000
    # or: flywheel up -c configs/examples/tinker.toml (the same port, sampling on an engine)
    python configs/examples/cookbook/rl.py --model ~/.cache/flywheel/models/SmolLM2-135M-Instruct

What a cookbook user writes for an RL run of their own: an environment (the cookbook's
`ProblemEnv`), a dataset of env groups and its `@chz.chz` builder, a
`tinker_cookbook.rl.train.Config` and `train.main`; the cookbook is not patched. The
task is Flywheel's review-sentiment example (configs/examples/review_sentiment.py, the
data in configs/examples/data/): is a product review positive or negative? The reward is
that example's `sentiment_reward` (1 when the reply names the right sentiment and not
the other), the prompt its run file's (review-sentiment.toml), so the cookbook's loop
and `flywheel up` train the same task.

As in sl.py: `model_name` is the model directory the server serves (the cookbook loads
a directory's tokenizer locally: no hub), and the renderer is one the cookbook ships
for the model's chat format (`qwen3_instruct`, ChatML, for SmolLM2; `role_colon` for
the tiny test model). The reward per step is `env/all/reward/total` in
<log-path>/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import chz
from tinker_cookbook import renderers
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

# `python configs/examples/cookbook/rl.py` puts this directory on sys.path, not the
# repository root, which the review example's module is imported from.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from configs.examples.review_sentiment import sentiment_reward

DATA = Path(__file__).resolve().parents[1] / "data" / "reviews-train.jsonl"
# The prompt of configs/examples/review-sentiment.toml: its system prompt and template.
SYSTEM = "Reply with the answer only."
QUESTION = "Is this product review positive or negative?\n\nReview: {review}"


class ReviewEnv(ProblemEnv):
    """One review, one reply; the reward is the review example's own."""

    def __init__(self, renderer: renderers.Renderer, review: str, sentiment: str) -> None:
        # format_coef 0: the reward is sentiment_reward alone, as in `flywheel up`.
        super().__init__(renderer, [{"role": "system", "content": SYSTEM}], format_coef=0.0)
        self.review, self.sentiment = review, sentiment

    def get_question(self) -> str:
        return QUESTION.format(review=self.review)

    def check_answer(self, sample_str: str) -> bool:
        return sentiment_reward(sample_str, self.sentiment) == 1.0

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return self.sentiment


class ReviewDataset(RLDataset):
    def __init__(self, rows: list[dict[str, str]], batch_size: int, group_size: int,
                 renderer: renderers.Renderer) -> None:  # fmt: skip
        self.rows, self.batch_size, self.group_size = rows, batch_size, group_size
        self.renderer = renderer

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        rows = self.rows[index * self.batch_size : (index + 1) * self.batch_size]
        return [
            ProblemGroupBuilder(
                env_thunk=partial(ReviewEnv, self.renderer, row["review"], row["sentiment"]),
                num_envs=self.group_size,
                dataset_name="reviews",
            )
            for row in rows
        ]

    def __len__(self) -> int:
        return len(self.rows) // self.batch_size


@chz.chz
class ReviewDatasetBuilder(RLDatasetBuilder):
    model_name_for_tokenizer: str
    renderer_name: str
    batch_size: int = 4
    group_size: int = 4
    data_path: str = str(DATA)
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        rows = [json.loads(line) for line in Path(self.data_path).read_text().splitlines()]
        random.Random(self.seed).shuffle(rows)
        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer)
        return ReviewDataset(rows, self.batch_size, self.group_size, renderer), None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path,
                   help="the model directory `flywheel tinker --model` serves")  # fmt: skip
    p.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--renderer", default="qwen3_instruct",
                   help="a cookbook renderer that fits the model's chat template")  # fmt: skip
    p.add_argument("--log-path", default="/tmp/flywheel-cookbook-rl")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4, help="reviews (groups) per step")
    p.add_argument("--group-size", type=int, default=4, help="replies per review")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--learning-rate", type=float, default=4e-4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TINKER_API_KEY", "tml-flywheel-local")  # the SDK wants tml-...
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tinker_cookbook.rl import train

    model = str(args.model.expanduser().resolve())
    config = train.Config(
        learning_rate=args.learning_rate,
        dataset_builder=ReviewDatasetBuilder(
            model_name_for_tokenizer=model,
            renderer_name=args.renderer,
            batch_size=args.batch_size,
            group_size=args.group_size,
            seed=args.seed,
        ),
        model_name=model,
        recipe_name="flywheel_cookbook_rl",
        renderer_name=args.renderer,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        log_path=args.log_path,
        lora_rank=args.rank,
        base_url=args.base_url,
        max_steps=args.steps,
        eval_every=0,
        save_every=0,  # the final checkpoint only
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
