"""The trainer step on a real model, by stage and by cut, in one process and one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/real_step.py \
        --model /work/models/SmolLM2-135M-Instruct [--rounds 2] [--out FILE]

1. A real batch: 4 one-digit-sum prompts (ChatML, the system prompt of
   bench/configs/smollm2-arith.toml) x 8 samples of <= 16 new tokens,
   sampled at temperature 1 from the model itself (transformers
   `generate`), with their sampling logprobs as the rollout logprobs and
   the last number in the reply as the reward (1 if it is the sum).
2. Agreement, before any update: the RL loss and its gradient under each
   configuration against the old CPU path (fp32, padded rows, sdpa).
3. Timing: one `Trainer` (float32 masters, AdamW) trains that batch again
   and again; each round runs every configuration once, in turn
   (interleaved, so load drifts hit all alike); a configuration is the
   trainer's forward spec, layout and attention, set on the live trainer:
   - `fp32 padded` : the old CPU default (packing 'auto' = padded, fp32);
   - `fp32 packed-sdpa`: one packed row, transformers' block-diagonal mask;
   - `fp32 segments`: one packed row, `flywheel_segments` attention;
   - `bf16 padded` / `bf16 segments`: the same under bf16 autocast;
   - `... +recompute`: old_logprobs='recompute' (a no-grad pass the
     default 'rollout' loss does not need);
   - `... -entropy`: no entropy metric (entropy_every 0; it costs a pass
     over the vocabulary's logits the loss does not need at entropy_coef 0).
   Every configuration runs once untimed first (first-call costs).
   Per step: the trainer's own stage times (time_*_s).
4. Weights out and in: the step's snapshot (state.snapshot), the weights
   directory as the trainer writes it (save_weights, from the snapshot) and
   in float32 (before) and in the model's own dtype (now: bf16), and the
   engine's load of each (ModelRunner.load_weights, sha256 check included).

Threads: torch is pinned to 1 thread (on this shared 2-core machine 2 threads
were measured 3-10x slower).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEM = "Reply with only the final number, nothing else."
STAGES = ("prepare", "logprobs", "forward_backward", "optimizer")


def prompts(n: int, seed: int) -> list[tuple[str, int]]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append((f"What is {a} + {b}?", a + b))
    return out


def last_number(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def sample_batch(model: Any, tok: Any, groups: int, per: int, max_new: int, seed: int) -> Any:
    """`groups` prompts x `per` samples from `model` itself, as a TensorBatch (and its reward)."""
    import torch

    from services.trainer.core.batching import TensorBatch

    torch.manual_seed(seed)
    p_ids, r_ids, r_lp, rewards = [], [], [], []
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    for question, answer in prompts(groups, seed):
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            out = model.generate(
                ids.repeat(per, 1),
                attention_mask=torch.ones_like(ids).repeat(per, 1),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
            )
        new = out.sequences[:, ids.shape[1] :]  # [per, L]
        logp = torch.stack(out.scores, 1).float().log_softmax(-1)  # [per, L, V]
        tok_lp = logp.gather(-1, new[..., None])[..., 0]  # [per, L]
        for i in range(per):
            row = new[i].tolist()
            end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            p_ids.append(ids[0].clone())
            r_ids.append(new[i, :end].clone())
            r_lp.append(tok_lp[i, :end].clone())
            text = tok.decode(row[:end], skip_special_tokens=True)
            rewards.append(1.0 if last_number(text) == answer else 0.0)
    n = len(p_ids)
    if len(set(rewards)) == 1:  # no signal at all (a toy model): alternate, and say so
        print("sample_batch: every reward equal; using alternating 0/1 rewards", flush=True)
        rewards = [float(i % 2) for i in range(n)]
    return TensorBatch(
        prompt_ids=p_ids,
        response_ids=r_ids,
        rollout_logprobs=r_lp,
        rewards=torch.tensor(rewards),
        group_ids=torch.arange(n) // per,
        truncated=torch.tensor([r.numel() >= max_new for r in r_ids]),
    )


VARIANTS: dict[str, dict[str, Any]] = {
    "fp32 padded": {"bf16": False, "layout": "padded"},
    "fp32 packed-sdpa": {"bf16": False, "layout": "sdpa"},
    "fp32 segments": {"bf16": False, "layout": "segments"},
    "bf16 padded": {"bf16": True, "layout": "padded"},
    "bf16 segments": {"bf16": True, "layout": "segments"},
    "bf16 segments +recompute": {"bf16": True, "layout": "segments", "recompute": True},
    "bf16 segments -entropy": {"bf16": True, "layout": "segments", "entropy_every": 0},
}


def configure(trainer: Any, v: dict[str, Any]) -> None:
    """Set a configuration on the live trainer (forward spec, layout, attention, loss)."""
    import dataclasses

    import torch

    from services.trainer.attention import register_segments

    packed = v["layout"] != "padded"
    attn = register_segments() if v["layout"] == "segments" else "sdpa"
    trainer.model.set_attn_implementation(attn)
    trainer.packing = packed
    trainer.forward_spec = dataclasses.replace(
        trainer.forward_spec,
        autocast=torch.bfloat16 if v["bf16"] else None,
        varlen=v["layout"] == "segments",
    )
    loss = trainer.cfg.loss.model_copy(
        update={"old_logprobs": "recompute" if v.get("recompute") else "rollout"}
    )
    model = trainer.cfg.model.model_copy(update={"entropy_every": v.get("entropy_every", 1)})
    trainer.cfg = trainer.cfg.model_copy(update={"loss": loss, "model": model})


def loss_and_grad(trainer: Any, batch: Any) -> tuple[float, Any]:
    """The RL loss of `batch` and the flat gradient, no update (zeroed after)."""
    import torch

    trainer.model.train()
    micro = trainer._micro_batches(trainer._rl_rows(batch))
    total = 0.0
    for mb in micro:
        out = trainer._rl_loss(mb, batch.temperature, False)
        out.loss.backward()
        total += float(out.loss.detach())
    grads = [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
    g = torch.cat(grads).clone()
    trainer.optimizer.zero_grad(set_to_none=True)
    return total, g


def agreement(trainer: Any, batch: Any) -> list[str]:

    lines = ["| configuration | loss | rel. loss diff | grad cosine | rel. grad-norm diff |"]
    lines.append("|---|---|---|---|---|")
    base_loss, base_g = None, None
    for name, v in VARIANTS.items():
        if v.get("recompute") or "entropy_every" in v:
            continue
        configure(trainer, v)
        loss, g = loss_and_grad(trainer, batch)
        if base_g is None:
            base_loss, base_g = loss, g
        assert base_loss is not None
        g64, b64 = g.double(), base_g.double()  # float32 sums over 135M terms drift by %
        cos = float(g64 @ b64 / (g64.norm() * b64.norm()))
        dn = abs(float(g64.norm() - b64.norm())) / max(float(b64.norm()), 1e-30)
        dl = abs(loss - base_loss) / max(abs(base_loss), 1e-12)
        lines.append(f"| {name} | {loss:.6f} | {dl:.2e} | {cos:.6f} | {dn:.2e} |")
        print(lines[-1], flush=True)
    return lines


def timing(trainer: Any, batch: Any, rounds: int) -> tuple[list[str], list[str]]:
    times: dict[str, list[dict[str, float]]] = {k: [] for k in VARIANTS}
    loads = []
    for v in VARIANTS.values():  # warm-up: every layout's first-call costs, allocator
        configure(trainer, v)
        trainer.train_step(batch)
    for r in range(rounds):
        for name, v in VARIANTS.items():
            configure(trainer, v)
            t = time.perf_counter()
            m = trainer.train_step(batch)
            m["total"] = time.perf_counter() - t
            times[name].append(m)
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1} {name}: {m['total']:.2f} s", flush=True)
    base_name = next(iter(times))
    base = statistics.median(x["total"] for x in times[base_name])
    head = "| configuration | step s | " + " | ".join(STAGES) + f" | vs {base_name} |"
    lines = [head, "|---" * (len(STAGES) + 3) + "|"]
    for name, ms in times.items():
        total = statistics.median(x["total"] for x in ms)
        cells = " | ".join(
            f"{statistics.median(x.get(f'time_{s}_s', 0.0) for x in ms):.2f}" for s in STAGES
        )
        each = ", ".join(f"{x['total']:.1f}" for x in ms)
        lines.append(f"| {name} | {total:.2f} ({each}) | {cells} | {base / total:.2f}x |")
    load = [f"load (1-min) during timing: min {min(loads):.1f}, max {max(loads):.1f}"]
    return lines, load


def weights_io(trainer: Any, model_dir: Path, rounds: int) -> list[str]:
    """Snapshot, save (float32 as before, the model dtype now), the engine load of each."""

    from services.engine.runner import ModelRunner
    from services.trainer.state import snapshot

    rows: dict[str, list[float]] = {}

    def timed(key: str, fn: Any, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args, **kw)
        rows.setdefault(key, []).append(time.perf_counter() - t)
        return out

    runner = ModelRunner(model_dir, num_threads=1)
    sizes = {}
    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as tmp:
        for r in range(rounds):
            snap = timed(
                "snapshot (weights + optimizer state copied out)", lambda: snapshot(trainer)
            )
            fp = Path(tmp) / f"fp-{r}"
            bf = Path(tmp) / f"bf-{r}"
            stored = trainer.publish_dtype
            trainer.publish_dtype = None  # before: the float32 masters as they are
            save = trainer.save_weights
            timed("save_weights from the snapshot, float32 (before)", save, fp,
                  overwrite=True, state_dict=snap.weights)  # fmt: skip
            trainer.publish_dtype = stored  # now: the model's own dtype (bf16 here)
            timed(f"save_weights from the snapshot, {stored} (now)", save, bf,
                  overwrite=True, state_dict=snap.weights)  # fmt: skip
            for d in (fp, bf):
                sizes[d.name[:2]] = sum(f.stat().st_size for f in d.glob("*.safetensors"))
            timed("engine load_weights (sha256 check), float32 dir", runner.load_weights, fp)
            timed("engine load_weights (sha256 check), bf16 dir", runner.load_weights, bf)
    lines = ["| what | median s | each |", "|---|---|---|"]
    for k, v in rows.items():
        lines.append(f"| {k} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    lines.append("")
    lines.append(
        f"safetensors bytes: float32 {sizes['fp'] / 1e6:.0f} MB, bf16 {sizes['bf'] / 1e6:.0f} MB"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/work/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: agree,time,io")
    ap.add_argument("--variants", help="comma list of configurations to time (default: all)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.variants:
        keep = [v.strip() for v in args.variants.split(",")]
        for name in list(VARIANTS):
            if name not in keep:
                del VARIANTS[name]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
    from services.trainer.trainer import Trainer

    torch.set_num_threads(1)
    skip = set(filter(None, args.skip.split(",")))
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load0 = os.getloadavg()
    tok = AutoTokenizer.from_pretrained(args.model)
    t = time.perf_counter()
    gen = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    batch = sample_batch(gen, tok, args.groups, args.per, args.max_new, seed=0)
    gen_s = time.perf_counter() - t
    del gen
    lens = [
        p.numel() + r.numel() for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)
    ]
    ntok = sum(lens)
    cfg = TrainConfig(optim=OptimConfig(lr=1e-5), model=ModelConfig(cpu_threads=1))
    trainer = Trainer.from_pretrained(args.model, cfg)
    out = [
        f"Started {started}; {os.cpu_count()} CPUs, load (1/5/15-min) at start "
        f"{load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}; torch threads 1; model {args.model}.",
        "",
        f"Batch: {len(batch)} samples ({args.groups} prompts x {args.per}), {ntok} tokens "
        f"(longest {max(lens)}), "
        f"mean reward {float(batch.rewards.mean()):.2f}; sampled with transformers generate "
        f"in {gen_s:.1f} s (model load included).",
        "",
    ]
    if "agree" not in skip:
        out += [
            "## Agreement before any update (vs fp32 padded)",
            "",
            *agreement(trainer, batch),
            "",
        ]
    if "time" not in skip:
        lines, load = timing(trainer, batch, args.rounds)
        out += [
            f"## Step time, {args.rounds} interleaved rounds (median; each run in brackets)",
            "",
        ]
        out += [*lines, "", *load, ""]
    if "io" not in skip:
        out += ["## Weights out and in", "", *weights_io(trainer, args.model, args.rounds), ""]
    md = "\n".join(out)
    print("\n" + md)
    if args.out:
        cmd = " ".join(
            ["OMP_NUM_THREADS=1 .venv/bin/python bench/real_step.py", *(argv or sys.argv[1:])]
        )
        args.out.write_text(f"<!-- generated by: {cmd} -->\n\n{md}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
