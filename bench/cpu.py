"""Where the CPU goes at k = 1: per-process CPU seconds over a window of a running demo.

    .venv/bin/python bench/cpu.py --run-dir /tmp/cpuprof [--window 30] [--after-step 5]
        [--pyspy OUT_DIR --pyspy-seconds 20]

Runs `flywheel demo --run-dir DIR --quiet --keep --max-staleness 1 --rl-seconds S
--rl-steps 100000` as a subprocess (the first run builds the SFT model in DIR),
waits until the trainer has logged `--after-step` steps, then reads utime + stime
of every process the demo started (from /proc/<pid>/stat, so the other jobs on
the shared cores do not count) before and after `--window` seconds, and the rollout
workers' `flywheel_rollout_samples_total` at the same two moments. It prints, per
role, the cores used (CPU seconds / window) and the ms of CPU per generated sample
— the second is what the machine's load moves least: it counts work, not waiting.

Roles: the process's command line (`services.engine`, `services.rollout`, the
verifier/tool sandbox children `services.sandbox.zygote`, `services.buffer`,
`services.trainer`, `services.sync`, `nats-server`, and the demo/`up` supervisor).

`--pyspy`: after the CPU window, `py-spy record --nonblocking` one engine, one
rollout worker and the buffer for `--pyspy-seconds` into OUT_DIR (speedscope JSON;
summarise with `bench/cpu.py --top FILE`), outside the measured window.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
ROLES = [
    ("services.sandbox.zygote", "verifier sandbox"),
    ("services.engine", "engine"),
    ("services.rollout", "rollout worker"),
    ("services.buffer", "buffer"),
    ("services.trainer", "trainer"),
    ("services.sync", "sync"),
    ("nats-server", "nats-server"),
    ("services demo", "supervisor (demo/up)"),
]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime + stime seconds) of a live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def descendants(root: int) -> dict[int, float]:
    """CPU seconds of `root` and every process below it."""
    procs = {int(p): stat(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, st in procs.items():
        if st is not None:
            children[st[0]].append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        st = procs.get(pid)
        if st is not None:
            out[pid] = st[1]
        todo.extend(children.get(pid, []))
    return out


def role(pid: int) -> str:
    cmd = cmdline(pid)
    for needle, name in ROLES:
        if needle in cmd:
            return name
    return "other: " + cmd[:60]


def metrics_port(pid: int, prefix: str) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        k, _, v = kv.decode(errors="replace").partition("=")
        if k.endswith("METRICS_PORT") and k.startswith(prefix):
            return int(v)
    return None


def samples_total(pids: list[int]) -> float:
    """Sum of the rollout workers' flywheel_rollout_samples_total."""
    total = 0.0
    for pid in pids:
        port = metrics_port(pid, "FLYWHEEL_ROLLOUT")
        if port is None:
            continue
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if line.startswith("flywheel_rollout_samples_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def steps_logged(run_dir: Path, since: float) -> int:
    """Trainer steps in this run's metrics.jsonl (a --keep run deletes the last run's)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file() or path.stat().st_mtime < since:
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"samples"' in line)


def measure(
    demo: subprocess.Popen[bytes], run_dir: Path, after_step: int, window: float
) -> dict[str, object]:
    since, root = time.time(), demo.pid
    while steps_logged(run_dir, since) < after_step:
        if demo.poll() is not None:
            raise SystemExit(f"the demo ended (exit {demo.returncode}) before step {after_step}")
        time.sleep(0.5)
    workers = [p for p in descendants(root) if role(p) == "rollout worker"]
    cpu0, n0, t0 = descendants(root), samples_total(workers), time.monotonic()
    time.sleep(window)
    cpu1, n1, t1 = descendants(root), samples_total(workers), time.monotonic()
    by_role: dict[str, float] = defaultdict(float)
    for pid, secs in cpu1.items():
        by_role[role(pid)] += secs - cpu0.get(pid, 0.0)
    return {"seconds": t1 - t0, "samples": n1 - n0, "cpu": dict(by_role)}


def report(m: dict[str, object]) -> str:
    secs, samples = float(m["seconds"]), float(m["samples"])  # type: ignore[arg-type]
    cpu: dict[str, float] = m["cpu"]  # type: ignore[assignment]
    lines = [
        f"window {secs:.1f} s, {samples:.0f} samples generated ({samples / secs:.0f}/s)",
        "| process | cores | ms CPU / generated sample |",
        "|---|---:|---:|",
    ]
    for name, s in sorted(cpu.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {s / secs:.2f} | {1000 * s / max(samples, 1):.3f} |")
    total = sum(cpu.values())
    lines.append(f"| all | {total / secs:.2f} | {1000 * total / max(samples, 1):.3f} |")
    return "\n".join(lines)


def pyspy(root: int, out: Path, seconds: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pids = descendants(root)
    picks: dict[str, int] = {}
    for pid in sorted(pids):
        r = role(pid)
        if r in ("engine", "rollout worker", "buffer", "trainer") and r not in picks:
            picks[r] = pid
    spy = str(Path(sys.executable).with_name("py-spy"))
    procs = []
    for r, pid in picks.items():
        dest = str(out / f"{r.split()[0]}.json")
        argv = [spy, "record", "--pid", str(pid), "--duration", str(seconds), "--nonblocking",
                "--format", "speedscope", "--threads", "-o", dest]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in procs:
        p.wait()


def top(path: Path, n: int = 25) -> str:
    """Self and total sample shares of the hottest frames of a speedscope profile."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]
    self_c: dict[int, float] = defaultdict(float)
    total_c: dict[int, float] = defaultdict(float)
    all_w = 0.0
    for prof in doc["profiles"]:
        for stack, w in zip(prof["samples"], prof["weights"], strict=True):
            if stack and not re.search(r"idle", frames[stack[-1]]["name"]):
                all_w += w
                self_c[stack[-1]] += w
                for f in set(stack):
                    total_c[f] += w
    rows = sorted(total_c.items(), key=lambda kv: -kv[1])[:n]
    out = [f"{path.name}: {all_w:.0f} samples"]
    for f, w in rows:
        fr = frames[f]
        where = f"{Path(fr.get('file', '?')).name}:{fr.get('line', '?')}"
        out.append(f"{100 * w / all_w:5.1f}% total {100 * self_c[f] / all_w:5.1f}% self  "
                   f"{fr['name']} ({where})")  # fmt: skip
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/cpuprof"))
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--after-step", type=int, default=5)
    p.add_argument("--rl-seconds", type=float, default=90.0)
    p.add_argument("--pyspy", type=Path, help="also py-spy record into this directory")
    p.add_argument("--pyspy-seconds", type=int, default=20)
    p.add_argument("--top", type=Path, nargs="+", help="summarise speedscope files and exit")
    args = p.parse_args()
    if args.top:
        print("\n\n".join(top(f) for f in args.top))
        return 0
    keep = ["--keep"] if (args.run_dir / "model-sft").is_dir() else []
    cmd = [sys.executable, "-m", "services", "demo", "--run-dir", str(args.run_dir), "--quiet",
           *keep, "--max-staleness", "1", "--rl-seconds", str(args.rl_seconds),
           "--rl-steps", "100000"]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    log = open(args.run_dir.with_suffix(".log"), "w")  # lives as long as the demo
    demo = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        m = measure(demo, args.run_dir, args.after_step, args.window)
        print(report(m), flush=True)
        if args.pyspy:
            pyspy(demo.pid, args.pyspy, args.pyspy_seconds)
        demo.wait()
    finally:
        if demo.poll() is None:
            demo.terminate()
            demo.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
