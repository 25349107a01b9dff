"""Would sampling a collapsed demo-real policy hotter find the bare word?

    .venv/bin/python bench/hot_resample.py WEIGHTS_DIR [--temperatures 0.7 1.0 1.3 1.6]

For 24 training lists of the real-model demo's task (services/tasks/last_word.py,
seed 7), 16 samples each at every temperature (no top-k/top-p, 16 new tokens,
the demo's system prompt, transformers' generate, 2 threads): how many replies'
first line is the bare word (the exact scorer's test, "." stripped), and the
commonest replies with the word masked as X. Measures a run's weights after the
fact (bench/results_learning.md, "Why seeds 0, 1 and 3 stay at 0.000").
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("weights", type=Path)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.3, 1.6])
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.tasks.last_word import rows

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(args.weights)
    model = AutoModelForCausalLM.from_pretrained(args.weights, dtype=torch.float32)
    system = "Reply with only the final answer, nothing else."  # configs/demo-real.toml's
    lists = rows("train", 24, seed=7)
    for t in args.temperatures:
        hits, n, replies = 0, 0, collections.Counter[str]()
        for r in lists:
            chat = [{"role": "system", "content": system}, {"role": "user", "content": r["prompt"]}]
            ids = tok.apply_chat_template(
                chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            out = model.generate(
                ids.repeat(16, 1), do_sample=True, temperature=t, top_k=0, top_p=1.0,
                max_new_tokens=16,
            )  # fmt: skip
            for o in out:
                text = tok.decode(o[ids.shape[1] :], skip_special_tokens=True).strip()
                hits += text.split("\n")[0].strip().rstrip(".") == r["answer"]
                n += 1
                replies[text.replace(r["answer"], "X")[:20]] += 1
        print(t, hits, n, round(hits / n, 4), replies.most_common(5), flush=True)


if __name__ == "__main__":
    main()
