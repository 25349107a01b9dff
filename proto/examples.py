"""One fixed, fully populated example of every message type.

The golden byte fixtures in tests/fixtures/golden/ are these, encoded; a
test re-encodes them, so any change to the wire format shows up as a diff.
Regenerate deliberately (and bump SCHEMA_VERSION when readers must notice):

    python -m proto.examples tests/fixtures/golden
"""

from __future__ import annotations

import sys
from pathlib import Path

from proto.codec import encode
from proto.messages import (
    Chunk,
    DeadLetter,
    EngineHeartbeat,
    EvalRequest,
    EvalResult,
    Message,
    PromptTask,
    Sample,
    SampleGroup,
    SamplingParams,
    TaskEvalResult,
    TeacherId,
    TrainBatch,
    VersionSpan,
    WeightsChunk,
    WeightsPublished,
    WeightsReady,
    pack_f32,
    pack_i32,
    pack_u8,
)

RUN = "golden"
TASK_ID = f"{RUN}:e0:i7"
GROUP_ID = f"{TASK_ID}:a0"
SHA = "0123456789abcdef" * 4


def sample(index: int = 0) -> Sample:
    return Sample(
        sample_id=f"{GROUP_ID}:s{index}",
        group_id=GROUP_ID,
        task_id=TASK_ID,
        index=index,
        prompt_ids=pack_i32([4, 5, 75, 6, 7, 83]),
        response_ids=pack_i32([8, 3 + index, 1]),
        logprobs=pack_f32([-0.5, -1.25, -0.125]),
        loss_mask=pack_u8([1, 1, 1]),
        reward=float(index % 2),
        reward_parts={"exact": float(index % 2)},
        finish_reason="stop",
        weight_version=3,
        weight_version_last=3 + index,
        # sample 1's last two tokens came after an update to v4 (SGLang's weight_versions)
        weight_version_spans=(
            (VersionSpan(version=3, start=0, end=1), VersionSpan(version=4, start=1, end=3))
            if index
            else ()
        ),
        engine_id="engine-0",
        # sample 1 was scored by a teacher (on-policy distillation, schema 1.2)
        teacher_logprobs=pack_f32([-0.25, -2.0, -0.5]) if index else None,
        teacher=TeacherId(name="smollm2-rl", model="/models/smollm2-rl", version=7)
        if index
        else None,
        queued_at=1700000000.0,
        started_at=1700000000.25,
        finished_at=1700000001.5,
    )


def group() -> SampleGroup:
    return SampleGroup(
        run=RUN,
        group_id=GROUP_ID,
        task_id=TASK_ID,
        task_name="arithmetic",
        worker_id="rollout-0",
        samples=(sample(0), sample(1)),
        temperature=0.7,
        created_at=1700000002.0,
    )


EXAMPLES: dict[str, Message] = {
    "PromptTask": PromptTask(
        run=RUN,
        task_id=TASK_ID,
        epoch=0,
        index=7,
        task_name="arithmetic",
        prompt="12+34=",
        answer="46",
        n=2,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=8, stop=("\n",)),
        min_weight_version=2,
        created_at=1700000000.0,
    ),
    "Sample": sample(0),
    "SampleGroup": group(),
    "TrainBatch": TrainBatch(
        run=RUN, batch_id=f"{RUN}:step3", step=3, groups=(group(),), created_at=1700000003.0
    ),
    "WeightsPublished": WeightsPublished(
        run=RUN,
        version=4,
        step=4,
        uri="file:///weights/golden/v000004",
        sha256=SHA,
        size_bytes=2153472,
        published_at=1700000004.0,
    ),
    "WeightsReady": WeightsReady(
        run=RUN, version=4, engines=("engine-0", "engine-1"), ready_at=1700000005.0
    ),
    "EvalRequest": EvalRequest(run=RUN, version=4, requested_at=1700000004.5),
    "EvalResult": EvalResult(
        run=RUN,
        version=4,
        outcome="evaluated",
        tasks=(
            TaskEvalResult(
                name="arith", total=50, pass_at_1=0.62, mean_reward=0.7, k=4, pass_at_k=0.81
            ),
        ),
        engines=("engine-0",),
        requested_at=1700000004.5,
        started_at=1700000005.0,
        finished_at=1700000007.25,
    ),
    "EngineHeartbeat": EngineHeartbeat(
        run=RUN,
        engine_id="engine-0",
        url="http://127.0.0.1:30000",
        worker_id="rollout-0",
        weight_version=4,
        running=3,
        queued=1,
        sent_at=1700000006.0,
        local_weights_dir="/var/lib/flywheel/weights/golden/engine-0",
        downloaded_version=4,
    ),
    "DeadLetter": DeadLetter(
        run=RUN,
        reason="malformed",
        error="SampleGroup: not MessagePack",
        subject=f"flywheel.{RUN}.samples",
        message_type="?",
        payload=b"\xc1garbage",
        service="buffer",
        delivered=1,
        at=1700000007.0,
    ),
    "Chunk": Chunk(
        of=f"{RUN}:step3", index=1, count=3, total_size=10, sha256=SHA, data=b"\x00\x01"
    ),
    "WeightsChunk": WeightsChunk(
        run=RUN,
        version=4,
        sha256=SHA,
        file="model.safetensors",
        offset=1048576,
        index=2,
        count=3,
        data=b"\x00\x01\x02\x03",
    ),
}


def write(folder: str | Path) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, msg in EXAMPLES.items():
        (out / f"{name}.msgpack").write_bytes(encode(msg))


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/golden")
