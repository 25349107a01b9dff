"""One GRPO task two ways, back to back: tinker-cookbook's RL loop on Flywheel's Tinker API
against Flywheel's own loop (issue #47, item 4).

    PYTHONPATH=$PWD .venv/bin/python bench/tinker_vs_builtin.py --steps 12 --out-dir /tmp/tvb
    PYTHONPATH=$PWD .venv/bin/python bench/tinker_vs_builtin.py --steps 2 --out-dir /tmp/tvb-smoke

The task is the review-sentiment example (is a product review positive or negative?) on
SmolLM2-135M-Instruct, the same prompts, reward, group size, groups per step, reply
length (16 tokens), temperature (0.7) and number of steps on both sides:

- **cookbook**: `flywheel up -c <configs/examples/tinker.toml with this run's paths>` (one
  CPU engine with LoRA, the Tinker server sampling on it; `[tinker] port = 0`, the URL read
  from the line `flywheel up` prints), then configs/examples/cookbook/rl.py against it
  (tinker-cookbook 0.6.1's `rl.train`, synchronous: sample every group, then one
  forward_backward + optim_step, then save a sampler; LoRA rank 8, `importance_sampling`,
  lr 4e-4). Per step, from the cookbook's metrics.jsonl: `time/total`, `time/sampling`,
  `time/train_step`, `env/all/reward/total` (the mean over all replies).
- **built-in**: `flywheel up -c <configs/examples/review-sentiment.toml with this run's
  paths> --steps N`, `[buffer] samples_per_prompt` set to the group size and `[trainer]
  eval_every = 0` (the cookbook side evaluates nothing either). Its learning keys are the
  run file's (full fine-tuning, lr "auto": a LoRA learning rate does not carry over).
  Per step, from the trainer's metrics.jsonl: seconds between consecutive rows' `time`
  (the first row: its `elapsed`, from the trainer's RL start) and `reward_mean` (the mean
  over the trained batch: the buffer drops groups whose replies all scored the same, so
  this mean is over groups with a spread, not over every reply).

What differs, and is not made equal (the loops are not the same algorithm):

- the built-in loop is asynchronous (`[buffer] max_staleness` 1: generation runs one
  version ahead of the trainer) and trains only groups whose replies' rewards differ (a
  flat group has no signal): it generates groups until a step has `--groups` with a
  spread. The cookbook's loop (`rl.train.Config`'s defaults) is synchronous (sample,
  train, save a sampler, sample again) and trains every group, flat ones included.
- the built-in trainer fine-tunes every weight (bf16 autocast, a group's replies packed
  into one row with the prompt computed once) with its PPO-clip loss and lr "auto"; the
  cookbook trains a LoRA adapter of rank 8 with `importance_sampling` at lr 4e-4, and
  the Tinker server runs forward_backward one datum at a time in float32.
- the prompts: each side shuffles the same training file with its own seed, so a
  step's reviews differ between the sides.

Both sides use the same threads: one engine of one torch thread, and one training
process of one thread (the Tinker server's `num_threads`, the trainer's `cpu_threads`).

**The API path's overhead.** The cookbook process runs rl.py under a hook on
`httpx.AsyncClient.send` (the SDK's HTTP client; the recipe and the cookbook are
unchanged) that records every request: its route, its seconds, and, for the SDK's
futures, each request id's POST, every `/api/v1/retrieve_future` poll of it (and how many
answered `try_again`, the server's long poll of up to 10 s ending with no result), and
when its result arrived. Per kind of request (sample, forward_backward, optim_step, the
sampler saves): count, POST round trip, time from POST to result, polls. The polls' own
HTTP cost is the time they spent that is not waiting on the model (a poll answered
at once with a result that was already there).

Written to DIR: comparison.md (the tables), comparison.json (every figure), and each
side's run directory and logs (cookbook/, builtin/). Prints the ratios built-in /
cookbook (seconds per step, whole run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# SIGINT to `flywheel up` (it stops its services in order), harder if it hangs
from bench.learning_side_by_side import stop  # noqa: E402

MODEL = Path("~/.cache/flywheel/models/SmolLM2-135M-Instruct").expanduser()
TINKER_RUN = ROOT / "configs" / "examples" / "tinker.toml"
BUILTIN_RUN = ROOT / "configs" / "examples" / "review-sentiment.toml"
RL_RECIPE = ROOT / "configs" / "examples" / "cookbook" / "rl.py"
URL_LINE = re.compile(r"Tinker API at (http://\S+)")


def env() -> dict[str, str]:
    """The repository importable in every subprocess (the reward is imported by path)."""
    parts = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in parts if p)}


def write_run(base: Path, run_dir: Path, model: Path, edit: dict[str, dict[str, Any]]) -> Path:
    """`base` with this run's directory, model and the `edit` tables' keys, in run_dir."""
    from services.stack.demo import dump_toml, fresh_run_dir

    fresh_run_dir(run_dir)
    doc: dict[str, Any] = tomllib.loads(base.read_text())
    doc["stack"]["run_dir"], doc["stack"]["model"] = str(run_dir), str(model)
    for table, keys in edit.items():
        doc.setdefault(table, {}).update(keys)
    out = run_dir / "run.toml"
    out.write_text(dump_toml(doc))
    return out


def drain(stream: Any, log: Any) -> None:
    for raw in stream:
        log.write(raw.decode(errors="replace"))


def load() -> float:
    return round(os.getloadavg()[0], 2)


# -- the cookbook side ------------------------------------------------------------------


def run_cookbook(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_dir = (out / "cookbook").resolve()
    rf = write_run(TINKER_RUN, run_dir, args.model, {"tinker": {"port": 0, "log_level": "DEBUG"}})
    side: dict[str, Any] = {"load_start": load()}
    t0 = time.monotonic()
    up_log = (out / "cookbook-up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "services", "up", "-c", str(rf)],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=up_log,
        start_new_session=True,
    )
    drainer = None
    try:
        url = None
        assert up.stdout is not None
        for raw in up.stdout:
            line = raw.decode(errors="replace")
            up_log.write(line)
            if m := URL_LINE.search(line):
                url = m.group(1)
                break
        if url is None:
            raise SystemExit(f"tinker_vs_builtin: flywheel up printed no URL; see {up_log.name}")
        # the rest of its output drained to the log, so a full pipe never blocks it
        drainer = threading.Thread(target=drain, args=(up.stdout, up_log), daemon=True)
        drainer.start()
        side["ready_s"] = round(time.monotonic() - t0, 1)
        log_path, timings = run_dir / "cookbook-log", run_dir / "http.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child-timings",
            str(timings),
            "--",
            "--model",
            str(args.model),
            "--base-url",
            url,
            "--log-path",
            str(log_path),
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.groups),
            "--group-size",
            str(args.group_size),
            "--max-tokens",
            str(args.max_tokens),
            "--temperature",
            str(args.temperature),
            "--learning-rate",
            str(args.learning_rate),
            "--seed",
            str(args.seed),
        ]
        t1 = time.monotonic()
        with (out / "cookbook-rl.log").open("w") as rl_log:
            rc = subprocess.run(
                cmd,
                env={**env(), "TINKER_TELEMETRY": "0"},
                stdout=rl_log,
                stderr=subprocess.STDOUT,
                timeout=args.side_timeout_s,
            ).returncode
        side["loop_s"] = round(time.monotonic() - t1, 1)
        side["rc"] = rc
    finally:
        stop(up)
        if drainer is not None:
            drainer.join(10)
        up_log.close()
    side["wall_s"] = round(time.monotonic() - t0, 1)
    side["load_end"] = load()
    rows = [json.loads(x) for x in (log_path / "metrics.jsonl").read_text().splitlines() if x]
    side["steps"] = [
        {
            "step": r["step"],
            "s": r["time/total"],
            "sampling_s": r["time/sampling"],
            "train_s": r["time/train_step"],
            "reward": r["env/all/reward/total"],
        }
        for r in rows
        if "time/total" in r
    ]
    server = model_thread_seconds(run_dir / "logs" / "tinker.log")
    side["http"] = (
        http_summary(json.loads(timings.read_text()), server) if timings.is_file() else {}
    )
    return side


MODEL_THREAD = re.compile(r"flywheel\.tinker: \w+ (\S+): ([\d.]+) s$", re.M)


def model_thread_seconds(log: Path) -> dict[str, float]:
    """Request id -> seconds its work ran on the server's model thread (the server's DEBUG
    line for each: services/tinker/app.py `submit`)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return {m.group(1): float(m.group(2)) for m in MODEL_THREAD.finditer(text)}


def http_summary(records: list[dict[str, Any]], server: dict[str, float]) -> dict[str, Any]:
    """Per kind of request: how many, the POST's round trip, POST to result, the polls, and
    the seconds the server's model thread ran them (none for samples: the engine runs those)."""
    kinds: dict[str, dict[str, Any]] = {}
    futures: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["path"].endswith("/retrieve_future"):
            continue
        k = kinds.setdefault(r["path"], {"requests": 0, "http_s": 0.0})
        k["requests"] += 1
        k["http_s"] += r["s"]
        if r.get("request_id"):
            futures[r["request_id"]] = {
                "path": r["path"],
                "t": r["t"],
                "polls": 0,
                "try_again": 0,
                "poll_s": 0.0,
                "done": None,
                "server_s": server.get(r["request_id"]),
            }
    for r in records:
        f = futures.get(r.get("polled") or "")
        if not r["path"].endswith("/retrieve_future") or f is None:
            continue
        f["polls"] += 1
        f["poll_s"] += r["s"]
        if r.get("try_again"):
            f["try_again"] += 1
        else:
            f["done"] = r["t"] + r["s"]
    for f in futures.values():
        k = kinds[f["path"]]
        k.setdefault("futures", 0)
        k["futures"] += 1
        k["polls"] = k.get("polls", 0) + f["polls"]
        k["try_again"] = k.get("try_again", 0) + f["try_again"]
        k["poll_s"] = k.get("poll_s", 0.0) + f["poll_s"]
        if f["server_s"] is not None:
            k["model_thread_s"] = round(k.get("model_thread_s", 0.0) + f["server_s"], 3)
        if f["done"] is not None:
            k.setdefault("to_result_s", []).append(f["done"] - f["t"])
    for k in kinds.values():
        lat = k.pop("to_result_s", [])
        k["http_s"] = round(k["http_s"], 3)
        k["post_ms_mean"] = round(1000 * k["http_s"] / k["requests"], 2)
        if lat:
            k["to_result_s_median"] = round(statistics.median(lat), 3)
            k["to_result_s_sum"] = round(sum(lat), 2)
        if "poll_s" in k:
            k["poll_s"] = round(k["poll_s"], 2)
    return kinds


def child(timings: Path, argv: list[str]) -> None:
    """rl.py in this process, every HTTP request of the SDK timed (the recipe untouched)."""
    import httpx

    records: list[dict[str, Any]] = []
    send = httpx.AsyncClient.send

    async def timed(self: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> httpx.Response:
        t, c = time.time(), time.perf_counter()
        response = await send(self, request, **kw)
        await response.aread()  # the body is what the SDK waits for
        rec: dict[str, Any] = {
            "path": request.url.path,
            "t": t,
            "s": time.perf_counter() - c,
            "status": response.status_code,
        }
        if "json" in response.headers.get("content-type", ""):
            body = response.json()
            if isinstance(body, dict):
                rec["request_id"] = (
                    body.get("request_id") if request.url.path.find("retrieve_future") < 0 else None
                )
                rec["try_again"] = body.get("type") == "try_again"
        if request.url.path.endswith("/retrieve_future"):
            rec["polled"] = json.loads(request.content or b"{}").get("request_id")
        records.append(rec)
        return response

    httpx.AsyncClient.send = timed  # type: ignore[method-assign]
    import runpy

    sys.argv = [str(RL_RECIPE), *argv]
    try:
        runpy.run_path(str(RL_RECIPE), run_name="__main__")
    finally:
        timings.write_text(json.dumps(records))


# -- the built-in side ------------------------------------------------------------------


def run_builtin(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_dir = (out / "builtin").resolve()
    edit = {
        "buffer": {
            "samples_per_prompt": args.group_size,
            "groups_per_step": args.groups,
            "max_new_tokens": args.max_tokens,
        },
        "trainer": {"eval_every": 0, "metrics_file": str(run_dir / "metrics.jsonl")},
    }
    rf = write_run(BUILTIN_RUN, run_dir, args.model, edit)
    if args.seed is not None:
        from services.stack.demo import dump_toml, with_seed

        doc = tomllib.loads(rf.read_text())
        with_seed(doc, args.seed)
        rf.write_text(dump_toml(doc))
    side: dict[str, Any] = {"load_start": load()}
    cmd = [
        sys.executable,
        "-m",
        "services",
        "up",
        "-c",
        str(rf),
        "--steps",
        str(args.steps),
        "--quiet",
        "--no-check",
    ]
    t0 = time.monotonic()
    with (out / "builtin-up.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, env=env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(args.side_timeout_s)
        except subprocess.TimeoutExpired:
            side["timed_out"] = True
        stop(proc)
    side["wall_s"] = round(time.monotonic() - t0, 1)
    side["load_end"] = load()
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []
    rows = [r for r in rows if "batch_id" in r]
    side["steps"], prev = [], None
    for r in rows:
        s = float(r["elapsed"]) if prev is None else float(r["time"]) - prev
        prev = float(r["time"])
        side["steps"].append(
            {
                "step": r["step"],
                "s": round(s, 2),
                "reward": r["reward_mean"],
                "train_s": round(r.get("compute_s", 0.0), 2),
                "wait_s": round(r.get("wait_s", 0.0), 2),
                "staleness_max": r.get("staleness_max"),
            }
        )
    side.update(status_figures(run_dir / "status.log"))
    if rows:
        side["loop_s"] = round(
            float(rows[-1]["time"]) - float(rows[0]["time"]) + float(rows[0]["elapsed"]), 1
        )
    return side


STATUS = {"filtered_groups": r"filtered (\d+)", "flat_pct": r"flat (\d+)%",
          "generated_samples_per_s": r"samples/s ([\d.]+)"}  # fmt: skip


def status_figures(status_log: Path) -> dict[str, float]:
    """From the last status line: the groups the buffer filtered out (flat: every reply
    scored the same, so no signal), the flat share and the generated samples/s; what the
    built-in loop generated beyond the groups it trained."""
    lines = status_log.read_text().splitlines() if status_log.is_file() else []
    last = next((x for x in reversed(lines) if "filtered" in x), "")
    return {k: float(m.group(1)) for k, pat in STATUS.items() if (m := re.search(pat, last))}


# -- the report -------------------------------------------------------------------------


def summary(side: dict[str, Any]) -> dict[str, Any]:
    steps = side.get("steps", [])
    if not steps:
        return {}
    rewards = [s["reward"] for s in steps]
    k = min(3, len(rewards))
    return {
        "steps": len(steps),
        "median_s": round(statistics.median(s["s"] for s in steps), 2),
        "sum_s": round(sum(s["s"] for s in steps), 1),
        "loop_s": side.get("loop_s"),
        "wall_s": side["wall_s"],
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_first3": round(statistics.mean(rewards[:k]), 3),
        "reward_last3": round(statistics.mean(rewards[-k:]), 3),
    }


def overhead(side: dict[str, Any]) -> list[str]:
    """The cookbook's training seconds against the server's model thread's, and its HTTP."""
    http, steps = side.get("http", {}), side.get("steps", [])
    if not http or not steps:
        return []
    train = sum(s["train_s"] for s in steps)
    model = sum(http.get(f"/api/v1/{r}", {}).get("model_thread_s", 0.0)
                for r in ("forward_backward", "optim_step"))  # fmt: skip
    sampling = sum(s["sampling_s"] for s in steps)
    posts = sum(k["requests"] for p, k in http.items())
    post_s = sum(k["http_s"] for k in http.values())
    polls = sum(k.get("polls", 0) for k in http.values())
    again = sum(k.get("try_again", 0) for k in http.values())
    return [
        "## the API path's overhead",
        "",
        f"- training (the cookbook's time/train_step, summed): {train:.1f} s; of it the "
        f"server's model thread ran forward_backward + optim_step {model:.1f} s "
        f"({model / train:.0%}); the rest, {train - model:.1f} s, is the API path (the "
        "cookbook's batch assembly, HTTP, the futures' polls) and the loop's own work",
        f"- sampling (time/sampling, summed): {sampling:.1f} s, on the engine",
        f"- {posts} requests other than polls, {post_s:.2f} s of HTTP round trips together; "
        f"{polls} retrieve_future polls, {again} of them answered try_again (a 10-s long "
        "poll that ended before the result)",
    ]


def args_groups(res: dict[str, Any]) -> int:
    return res.get("groups", 4) * len(res["builtin"].get("steps", []))


def report(res: dict[str, Any]) -> str:
    cb, bi = summary(res["cookbook"]), summary(res["builtin"])
    lines = [
        f"# tinker_vs_builtin: {res['args']}",
        "",
        "| | cookbook on Flywheel's Tinker API | Flywheel built-in | built-in / cookbook |",
        "|---|---|---|---|",
    ]
    for key, what in (
        ("median_s", "s / step, median"),
        ("sum_s", "steps' seconds, summed"),
        ("loop_s", "the loop (rl.py start to exit; the trainer's RL start to last step)"),
        ("wall_s", "whole run, `flywheel up` start to stop"),
        ("reward_first3", "reward, mean of the first 3 steps"),
        ("reward_last3", "reward, mean of the last 3 steps"),
    ):
        a, b = cb.get(key), bi.get(key)
        ratio = f"{b / a:.2f}x" if a and b and key.endswith("_s") else ""
        lines.append(f"| {what} | {a} | {b} | {ratio} |")
    b = res["builtin"]
    if "filtered_groups" in b:
        lines += ["", f"The built-in loop's buffer filtered out {b['filtered_groups']:.0f} flat "
                  f"groups beside the {args_groups(res)} it trained (flat {b.get('flat_pct')}% "
                  f"at the end), generating {b.get('generated_samples_per_s')} samples/s "
                  "(its last status line)."]  # fmt: skip
    for name in ("cookbook", "builtin"):
        side = res[name]
        lines += ["", f"## {name} per step (load {side['load_start']} -> {side['load_end']})", ""]
        cols = [k for k in side["steps"][0] if k != "step"] if side.get("steps") else []
        lines += ["| step | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for s in side.get("steps", []):
            lines.append(
                f"| {s['step']} | "
                + " | ".join(
                    str(round(s[c], 3)) if isinstance(s[c], float) else str(s[c]) for c in cols
                )
                + " |"
            )
    http = res["cookbook"].get("http", {})
    lines += ["", *overhead(res["cookbook"])]
    if http:
        cols = [
            "requests",
            "http_s",
            "post_ms_mean",
            "futures",
            "polls",
            "try_again",
            "poll_s",
            "to_result_s_median",
            "to_result_s_sum",
            "model_thread_s",
        ]
        lines += [
            "",
            "## the cookbook's HTTP requests, by route",
            "",
            "| route | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
        ]
        for path, k in sorted(http.items(), key=lambda kv: -kv[1]["http_s"]):
            lines.append(f"| {path} | " + " | ".join(str(k.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child-timings"]:
        return child(Path(argv[1]), argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--groups", type=int, default=4, help="prompts (groups) per step")
    p.add_argument("--group-size", type=int, default=4, help="replies per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--learning-rate", type=float, default=4e-4, help="the cookbook side's (LoRA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first", choices=("cookbook", "builtin"), default="cookbook")
    p.add_argument("--side-timeout-s", type=float, default=900)
    args = p.parse_args(argv)
    args.model = args.model.expanduser().resolve()
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "args": " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    res["groups"] = args.groups
    order = ["cookbook", "builtin"] if args.first == "cookbook" else ["builtin", "cookbook"]
    for name in order:
        print(f"tinker_vs_builtin: {name} ({time.strftime('%H:%M:%S')})", flush=True)
        res[name] = (run_cookbook if name == "cookbook" else run_builtin)(args, out)
    (out / "comparison.json").write_text(json.dumps(res, indent=1))
    text = report(res)
    (out / "comparison.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
