"""The RL objective's knobs, as one typed, documented model.

A pydantic model (not a settings class) so the later trainer service can
embed it as a nested table (`[trainer.loss]`) of its own settings, and so
that bounds are checked where the field is declared.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
PolicyLossKind = Literal["ppo", "gspo"]
AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KlEstimator = Literal["k1", "k2", "k3"]
OldLogprobSource = Literal["rollout", "recompute"]


class LossConfig(BaseModel):
    """Advantages, policy loss, aggregation, KL, entropy and off-policy correction."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    advantage: AdvantageEstimator = Field(
        "grpo",
        description="Group baseline: 'grpo' (mean, divided by std + eps), 'dr_grpo' "
        "(mean only), 'rloo' (leave-one-out mean).",
    )
    advantage_eps: float = Field(1e-6, gt=0, description="eps added to the std in GRPO.")
    batch_normalize_advantages: bool = Field(
        False, description="After the group baseline, whiten advantages over the whole batch."
    )
    policy_loss: PolicyLossKind = Field(
        "ppo",
        description="'ppo': token-level ratio; 'gspo': sequence-level ratio "
        "(geometric mean of token ratios, Zheng et al. 2025).",
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="Clip the ratio below at 1 - eps_low.")
    eps_high: float = Field(
        0.2, ge=0, description="Clip the ratio above at 1 + eps_high (DAPO clip-higher: 0.28)."
    )
    dual_clip_c: float | None = Field(
        None,
        gt=1,
        description="Dual-clip constant c (> 1): for negative advantages the loss is capped "
        "at -c·A. None disables it.",
    )
    aggregation: AggregationMode = Field(
        "token-mean",
        description="How per-token losses become one number: 'token-mean' over all loss "
        "tokens of the batch, 'seq-mean-token-mean' (mean per sequence, then over "
        "sequences), 'seq-mean-token-sum-norm' (sum per sequence / norm_tokens, then mean "
        "over sequences: Dr.GRPO).",
    )
    norm_tokens: int | None = Field(
        None,
        gt=0,
        description="Constant normaliser of 'seq-mean-token-sum-norm' (Dr.GRPO uses the "
        "generation budget). None: the longest loss-token count in the batch.",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the KL penalty to the frozen reference; 0 disables."
    )
    kl_estimator: KlEstimator = Field(
        "k3", description="KL(pi || ref) estimator: 'k1', 'k2' or 'k3' (Schulman 2020)."
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus weight (loss -= coef · entropy); 0: metric only."
    )
    old_logprobs: OldLogprobSource = Field(
        "rollout",
        description="The 'old' policy of the ratio: the engine's 'rollout' logprobs, or "
        "'recompute'd by the trainer before the update (decoupled PPO), which enables TIS.",
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0,
        description="Truncated importance sampling cap C of min(pi_old / mu_rollout, C); "
        "used only with old_logprobs='recompute'. None disables the correction.",
    )
    drop_truncated: bool = Field(
        False, description="Give zero loss weight to completions cut off by the length limit."
    )
