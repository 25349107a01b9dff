"""`[stack] engine = "sglang"` and the GPU map: what `flywheel up` would start, and where.

`flywheel up --dry-run` prints every process with its GPUs, command and
environment without starting anything, so the 8-GPU example is checked here
on a machine without a GPU.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from services.cli import main as flywheel
from services.runtime.errors import ConfigError
from services.runtime.settings import load_settings
from services.stack.plan import plan
from services.stack.settings import StackSettings
from tests.harness import REPO

GPU_EXAMPLE = REPO / "configs" / "gpu-example.toml"
PORTS = itertools.count(21000)


def blocks(text: str) -> dict[str, str]:
    """The dry run's output, one block of lines per process name."""
    out: dict[str, str] = {}
    for block in re.split(r"\n(?=\S)", text):
        out[block.split(" ", 1)[0]] = block
    return out


def test_dry_run_of_the_gpu_example_places_every_process(capsys: pytest.CaptureFixture) -> None:
    assert flywheel(["up", "--dry-run", "-c", str(GPU_EXAMPLE)]) == 0
    procs = blocks(capsys.readouterr().out)
    for i in range(4):
        engine = procs[f"engine-{i}"]
        assert f"[engine] GPUs {4 + i}\n" in engine
        assert f"CUDA_VISIBLE_DEVICES={4 + i} " in engine
        for flag in ("-m sglang.launch_server", "--model-path /models/Qwen2.5-0.5B-Instruct",
                     "--weight-version 0", "--mem-fraction-static 0.85", "--tp-size 1",
                     "--enable-metrics"):  # fmt: skip
            assert flag in engine, (flag, engine)
        assert re.search(r"ready: http://127\.0\.0\.1:\d+/health_generate", engine)
        worker = procs[f"rollout-{i}"]
        assert f"beside engine-{i} (GPUs {4 + i})" in worker
        assert "CUDA_VISIBLE_DEVICES= " in worker  # the worker itself takes no GPU
        port = re.search(r"--port (\d+)", engine)
        assert port and f"FLYWHEEL_ROLLOUT_ENGINE_URL=http://127.0.0.1:{port[1]} " in worker
    trainer = procs["trainer"]
    assert "[trainer] GPUs 0,1,2,3" in trainer and "CUDA_VISIBLE_DEVICES=0,1,2,3" in trainer
    assert "--nproc_per_node=4" in trainer
    for name in ("sync", "buffer"):
        assert "no GPU" in procs[name] and "CUDA_VISIBLE_DEVICES= " in procs[name]
    assert procs["nats:"].startswith("nats: embedded nats-server")


def test_dry_run_hides_the_engine_api_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "run.toml"
    config.write_text(GPU_EXAMPLE.read_text().replace(
        'engine = "sglang"', 'engine = "sglang"\nengine_api_key = "sk-hidden"'))  # fmt: skip
    assert flywheel(["up", "--dry-run", "-c", str(config)]) == 0
    out = capsys.readouterr().out
    assert "sk-hidden" not in out
    assert "--api-key ***" in out and "FLYWHEEL_ROLLOUT_ENGINE_API_KEY=***" in out
    assert "FLYWHEEL_SYNC_ENGINE_API_KEY=***" in out


def test_sglang_engines_get_the_run_files_lora_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The [engine] LoRA keys the CPU engine reads become SGLang's four flags."""
    config = tmp_path / "run.toml"
    lora = ('\n[engine]\nenable_lora = true\nmax_lora_rank = 16\n'
            'lora_target_modules = ["q_proj", "v_proj"]\nmax_loras_per_batch = 4\n')  # fmt: skip
    config.write_text(GPU_EXAMPLE.read_text() + lora)
    assert flywheel(["up", "--dry-run", "-c", str(config)]) == 0
    engine = blocks(capsys.readouterr().out)["engine-0"]
    want = ("--enable-lora --max-lora-rank 16 --lora-target-modules q_proj v_proj "
            "--max-loras-per-batch 4")  # fmt: skip
    assert want in engine, engine
    assert flywheel(["up", "--dry-run", "-c", str(GPU_EXAMPLE)]) == 0
    assert "--enable-lora" not in capsys.readouterr().out


def test_cpu_engines_take_no_gpu_and_get_the_key(tmp_path: Path) -> None:
    s = StackSettings(run_dir=tmp_path, model=tmp_path / "m", engines=1, engine_api_key="k",
                      trainer_gpus=[0])  # fmt: skip
    specs = {p.name: p for p in plan(s, tmp_path / "run.toml", "nats://x:1", lambda: next(PORTS))}
    assert "services.engine" in specs["engine-0"].argv
    assert specs["engine-0"].argv[-2:] == ("--api-key", "k")
    assert specs["engine-0"].env["CUDA_VISIBLE_DEVICES"] == ""  # a GPU map exists
    assert specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize(
    ("stack", "message"),
    [
        ({"engine": "sglang", "engines": 2, "engine_gpus": [[0]]}, "1 GPU lists for 2"),
        ({"engine": "sglang", "engines": 2, "engine_gpus": [[0], [0]]}, r"GPU\(s\) \[0\] given"),
        ({"engine": "sglang", "engines": 1, "engine_gpus": [[1]], "trainer_gpus": [1]},
         r"GPU\(s\) \[1\] given twice"),
        ({"trainer_nproc": 2, "trainer_gpus": [0]}, "1 GPUs for trainer_nproc = 2"),
        ({"engine": "cpu", "engine_gpus": [[0], [1]]}, "only SGLang engines use GPUs"),
        ({"engine": "sglang", "engines": 1, "engine_gpus": [[]]}, "empty GPU list"),
    ],
)  # fmt: skip
def test_a_gpu_map_that_cannot_work_is_refused_naming_the_key(
    stack: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(StackSettings, **stack)


def test_cpus_pin_each_role_and_set_its_torch_threads(tmp_path: Path) -> None:
    s = StackSettings(
        run_dir=tmp_path, model=tmp_path, engines=2,
        cpus={"trainer": [0], "engine": [1], "engine-1": [0, 1]},
    )  # fmt: skip
    specs = {p.name: p for p in plan(s, tmp_path / "run.toml", "nats://x", lambda: next(PORTS))}
    assert specs["trainer"].cpus == (0,)
    assert specs["trainer"].env["FLYWHEEL_TRAINER_RUNTIME__CPU_THREADS"] == "1"
    assert specs["engine-0"].cpus == (1,) and specs["engine-1"].cpus == (0, 1)  # a name wins
    assert specs["engine-1"].env["FLYWHEEL_ENGINE_NUM_THREADS"] == "2"
    assert specs["engine-1"].env["OMP_NUM_THREADS"] == "2"
    assert specs["buffer"].cpus == () and "OMP_NUM_THREADS" not in specs["buffer"].env


def test_cpus_this_machine_lacks_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cpus\.trainer: core\(s\) \[4096\]"):
        StackSettings(run_dir=tmp_path, model=tmp_path, cpus={"trainer": [4096]})
    with pytest.raises(ValueError, match=r"cpus\.engine: no cores"):
        StackSettings(run_dir=tmp_path, model=tmp_path, cpus={"engine": []})


def test_the_demo_passes_placement_into_its_run_file(tmp_path: Path) -> None:
    import argparse

    from services.stack.demo import DEFAULT_CONFIG, role_cores, run_file

    cpus = [role_cores("trainer=0"), role_cores("engine=0")]
    rf = run_file(DEFAULT_CONFIG, tmp_path, tmp_path / "model", None, cpus)
    assert load_settings(StackSettings, rf).cpus == {"trainer": [0], "engine": [0]}
    with pytest.raises(argparse.ArgumentTypeError, match="ROLE=CORES"):
        role_cores("engine=one")
