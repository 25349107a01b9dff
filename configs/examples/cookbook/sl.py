"""tinker-cookbook's supervised loop, unchanged, against `flywheel tinker`.

    flywheel tinker --model ~/.cache/flywheel/models/SmolLM2-135M-Instruct --port 8000
    # or: flywheel up -c configs/examples/tinker.toml (the same port, sampling on an engine)
    python configs/examples/cookbook/sl.py --model ~/.cache/flywheel/models/SmolLM2-135M-Instruct

This script is what a cookbook user writes: a `tinker_cookbook.supervised.train.Config`
and `train.main`, nothing of the cookbook patched. Two choices make it run on a machine
with no hub:

- `model_name` is the model *directory*, the same one the server was started with: the
  server accepts it as `base_model` (beside the directory's bare name), and the
  cookbook's `get_tokenizer` loads a directory locally (`AutoTokenizer.from_pretrained`
  on a path), so nothing is downloaded.
- the renderer is one the cookbook ships that writes the model's chat format:
  `qwen3_instruct` is ChatML (`<|im_start|>role\\n...<|im_end|>`), SmolLM2's template;
  `role_colon` (`User: ...\\n\\nAssistant: ...`) needs no special tokens, for the tiny
  test model's character tokenizer.

The data is a JSONL of `{"messages": [...]}` chats (the cookbook's
`FromConversationFileBuilder`); data/cookbook-chat.jsonl teaches made-up facts, so a
falling `train_mean_nll` in <log-path>/metrics.jsonl is learning, not recall.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path,
                   help="the model directory `flywheel tinker --model` serves")  # fmt: skip
    p.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--renderer", default="qwen3_instruct",
                   help="a cookbook renderer that fits the model's chat template")  # fmt: skip
    p.add_argument("--data", type=Path, default=HERE / "data" / "cookbook-chat.jsonl")
    p.add_argument("--log-path", default="/tmp/flywheel-cookbook-sl")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--rank", type=int, default=8)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The SDK wants a key shaped like Tinker's (the server checks it only if it has
    # one set); telemetry events would go nowhere; the hub is never needed.
    os.environ.setdefault("TINKER_API_KEY", "tml-flywheel-local")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    model = str(args.model.expanduser().resolve())
    dataset = FromConversationFileBuilder(
        file_path=str(args.data),
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=model,
            renderer_name=args.renderer,
            max_length=args.max_length,
            batch_size=args.batch_size,
            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
        ),
    )
    config = train.Config(
        log_path=args.log_path,
        model_name=model,
        recipe_name="flywheel_cookbook_sl",
        renderer_name=args.renderer,
        dataset_builder=dataset,
        learning_rate=args.learning_rate,
        lr_schedule="constant",
        num_epochs=args.epochs,
        max_steps=args.max_steps,
        lora_rank=args.rank,
        base_url=args.base_url,
        save_every=0,  # the final checkpoint only
        eval_every=0,
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
