"""Wire → tensors: the wire's TrainBatch as the trainer core's TensorBatch. Pure."""

from __future__ import annotations

import torch

from proto.messages import FinishReason, Sample, TrainBatch, unpack_f32, unpack_i32, unpack_u8
from services.trainer.core.batching import BatchError, TensorBatch


def to_tensor_batch(batch: TrainBatch) -> TensorBatch:
    """Flatten groups into samples; samples of one group share a group id (0, 1, …)."""
    temps = {g.temperature for g in batch.groups}
    if len(temps) != 1:
        raise BatchError(
            f"batch {batch.batch_id} mixes temperatures {sorted(temps)}", field="temperature"
        )
    prompt, response, logprobs, masks, groups, truncated = [], [], [], [], [], []
    versions = []
    rewards: list[float] = []
    teacher: list[torch.Tensor | None] = []
    for gi, g in enumerate(batch.groups):
        for s in g.samples:
            if s.verifier_error is not None:  # the buffer keeps only scored samples (scored_part)
                raise BatchError(
                    f"batch {batch.batch_id}: sample {s.sample_id} has no reward "
                    f"({s.verifier_error}); an unscored sample is never trained on",
                    sample=len(rewards),
                    field="verifier_error",
                )
            prompt.append(torch.from_numpy(unpack_i32(s.prompt_ids).astype("int64")))
            response.append(torch.from_numpy(unpack_i32(s.response_ids).astype("int64")))
            logprobs.append(torch.from_numpy(unpack_f32(s.logprobs).copy()))
            masks.append(torch.from_numpy(unpack_u8(s.loss_mask).astype("int64")))
            rewards.append(s.reward)
            groups.append(gi)
            truncated.append(s.finish_reason == FinishReason.LENGTH)
            versions.append(token_versions(s))
            t = s.teacher_logprobs
            teacher.append(None if t is None else torch.from_numpy(unpack_f32(t).copy()))
    return TensorBatch(
        prompt_ids=prompt,
        response_ids=response,
        rollout_logprobs=logprobs,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(groups, dtype=torch.int64),
        truncated=torch.tensor(truncated, dtype=torch.bool),
        loss_mask=masks,
        temperature=temps.pop(),
        token_versions=versions,
        teacher_logprobs=teacher if any(t is not None for t in teacher) else None,
    )


def token_versions(s: Sample) -> torch.Tensor:
    """The version of each response token [R] int64, -1 where the sample does not say.

    From the spans when the engine reports them; otherwise every token is the
    sample's one version when the first and last tokens agree, else unknown.
    """
    n = s.num_response_tokens
    if s.weight_version_spans:
        out = torch.empty(n, dtype=torch.int64)
        for sp in s.weight_version_spans:
            out[sp.start : sp.end] = sp.version
        return out
    known = s.weight_version == s.weight_version_last
    return torch.full((n,), s.weight_version if known else -1, dtype=torch.int64)


def batch_stats(batch: TrainBatch) -> dict[str, float]:
    """What the batch itself says: reward, lengths, staleness (for metrics)."""
    samples = [s for g in batch.groups for s in g.samples]
    n = len(samples)
    return {
        **teacher_stats(samples),
        "reward_mean": sum(s.reward for s in samples) / n,
        "response_tokens_mean": sum(s.num_response_tokens for s in samples) / n,
        "truncated_frac": sum(s.finish_reason == FinishReason.LENGTH for s in samples) / n,
        "staleness_max": float(max(batch.step - s.weight_version for s in samples)),
        "samples": float(n),
        "tokens": float(sum(len(s.prompt_ids) // 4 + s.num_response_tokens for s in samples)),
    }


def teacher_stats(samples: list[Sample]) -> dict[str, float]:
    """Distillation's measure: the mean per-token reverse KL estimate (rollout logprob -
    teacher logprob) over the policy's tokens of the samples a teacher scored; 0 when
    the student matches the teacher. {} when no sample carries teacher logprobs."""
    total, tokens = 0.0, 0
    for s in samples:
        if s.teacher_logprobs is None:
            continue
        m = unpack_u8(s.loss_mask).astype(bool)
        gap = unpack_f32(s.logprobs).astype("float64") - unpack_f32(s.teacher_logprobs)
        total += float(gap[m].sum())
        tokens += int(m.sum())
    return {"teacher_kl": total / tokens} if tokens else {}
