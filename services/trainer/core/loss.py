"""The policy loss: PPO-clip family, aggregation, KL, entropy, TIS.

Per token t of sample i (only tokens with loss mask 1 count):

    r_t     = exp(logp_t - old_t)                         (PPO, token ratio)
    r_t     = sg[exp(mean_{t∈i}(logp - old))] · exp(logp_t - sg[logp_t])
                                                           (GSPO, Zheng et al. 2025, §4:
                                                            sequence ratio, value s_i,
                                                            gradient s_i·∇logp_t)
    pg_t    = max(-A_i r_t, -A_i clip(r_t, 1 - eps_low, 1 + eps_high))
                                                           (Schulman et al. 2017, with
                                                            DAPO's decoupled clip,
                                                            Yu et al. 2025)
    pg_t    = min(pg_t, -c A_i)  if A_i < 0               (dual-clip, Ye et al. 2020)
    pg_t   *= min(exp(old_t - mu_t), C)                   (TIS, Yao et al. 2025; only
                                                            when `old` was recomputed by
                                                            the trainer and mu is the
                                                            engine's rollout logprob)
    pg_t   *= 1[lo <= rho_t <= hi]                        (MIS token mask, below)
    pg_t   *= 1[lo <= exp(mean_{t∈i} log rho_t) <= hi]    (MIS sequence mask, below)
    kl_t    = k(logp_t, ref_t)                            (k1/k2/k3 below)
    l_t     = pg_t + kl_coef · kl_t - c_k · H_t           (c_k: entropy_coef, or the
                                                            adaptive controller's, below)

Before TIS and MIS, the covariance controls (Cui et al. 2025, "The Entropy
Mechanism of RL for Reasoning LMs"; verl's policy_loss 'clip_cov' /
'kl_cov') act on the tokens whose logprob moves most with their advantage,
the ones whose update drains the policy's entropy fastest:

    cov_t   = (A_t - mean A)(logp_t - mean logp)          (means over the micro-batch's
                                                            loss tokens; no gradient)
    Clip-Cov: pg_t *= 0 on n = max(1, floor(r·N)) tokens drawn at random (from the
              trainer's own generator, passed in: never torch's default one, which
              another thread may reseed; checkpoints keep it) among the loss tokens
              with lo < cov_t < hi whose PPO clip is not already active
    KL-Cov:   pg_t += beta · |logp_t - old_t| on the n = max(1, floor(k·N)) loss tokens
              of largest cov_t

N being the micro-batch's loss tokens (verl computes both per micro-batch
too). verl's KL-Cov drops the PPO clip altogether; here the clipped
surrogate stays on every token (samples here can be versions old) and the
penalty is added on top. Like the MIS masks, a dropped token keeps its
aggregation weight.

Adaptive entropy control (Skywork-OR1, §3.2; TRL's use_adaptive_entropy):
step k's bonus weight c_k, then its measured mean token entropy H_k moves
it for the next step,

    c_{k+1} = clip(c_k + lr · (target - H_k), 0, c_max)    (`next_entropy_coef`)

(Skywork steps c by a fixed ±delta on the sign of target - H_k; the step
here is proportional to the gap, so a policy near its target barely moves c.)

and the loss is sum_{i,t} w_{i,t} l_t with aggregation weights w (see
`sample_weights`). Writing aggregation as fixed per-token weights computed
from the *whole* batch is what makes gradient accumulation exact: a
micro-batch contributes sum(w · l) over its own tokens, and the sum over
micro-batches (and ranks) is the full-batch loss, for every mode.

KL estimators of KL(pi || ref) from samples of pi, with log ρ = ref - logp
(Schulman 2020, "Approximating KL Divergence"):
    k1 = -log ρ,   k2 = ½ (log ρ)²,   k3 = (ρ - 1) - log ρ   (unbiased, ≥ 0).

Train–inference mismatch. The engine's logprob mu_t of a sampled token and
the trainer's pi_t of the same token under the same weights differ (kernels,
precision, batch shapes). With pi_t the trainer's own logprob before this
step's update (`old` when recomputed, else the detached `logprobs` of the
first mini-batch) and log rho_t = pi_t - mu_t, each step reports, over the
loss tokens whose version is the trainer's (`same_version`):

    mismatch_abs_mean = mean |log rho_t|,  mismatch_abs_max = max |log rho_t|,
    mismatch_k3       = mean (rho_t - 1 - log rho_t)     (k3 estimate of
                                                          KL(mu || pi) from mu's samples)

and `behaviour_k3`, the same k3 over every loss token whatever its version
(mismatch plus the policy's drift since the token was sampled). The names
follow prime-rl (`mismatch_kl` = exp(log r) - log r - 1 with
log r = trainer - inference logprobs, src/prime_rl/trainer/rl/loss.py),
verl (`rollout_corr/*` metrics of algorithm.rollout_correction) and slime
(`--get-mismatch-metrics`, examples/train_infer_mismatch_helper: the same
gap measured without changing the loss).

Masked importance sampling (MIS), besides TIS: instead of reweighting, the
policy-gradient term of a token is dropped when its ratio rho_t leaves a band
(`mis_token_band` = [lo, hi]: slime's MIS, `--use-tis` with an RS config;
verl's rollout_rs="token" with
rollout_rs_threshold_lower / rollout_rs_threshold, prime-rl's token_mask_low /
token_mask_high, default 0.125 / 8; IcePop, the Ring-1T report, masks tokens
outside [0.5, 5]), and every token of a sequence is dropped when the
geometric mean of its ratios exp(mean_t log rho_t) leaves `mis_seq_band`
(verl's rollout_rs="geometric", prime-rl's geo_mask_low / geo_mask_high).
Masked tokens keep their aggregation weight (the denominator is unchanged,
as in prime-rl, where the sum over kept tokens is divided by all loss
tokens), so masking lowers the step's gradient rather than reweighting the
rest; KL and entropy terms are not masked.

Log-ratios are clamped to ±20 before exp so one wild token cannot overflow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.trainer.settings import AggregationMode, KlEstimator, LossConfig

LOG_RATIO_CLAMP = 20.0


def sample_weights(
    lengths: torch.Tensor, mode: AggregationMode, norm_tokens: int | None = None
) -> torch.Tensor:
    """Per-sample weight of each loss token, from loss-token counts `lengths` [N].

    token-mean:               w_i = 1 / sum_j L_j
    seq-mean-token-mean:      w_i = 1 / (L_i · S)
    seq-mean-token-sum-norm:  w_i = 1 / (norm · S)     (norm: `norm_tokens` or max_j L_j)

    S counts samples with at least one loss token; samples with none get 0.
    Returns [N] float64 (summing many small weights in float32 drifts).
    """
    lengths = lengths.double()
    active = lengths > 0
    num_seqs = active.sum().clamp(min=1)
    if mode == "token-mean":
        w = torch.full_like(lengths, 1.0) / lengths.sum().clamp(min=1)
    elif mode == "seq-mean-token-mean":
        w = 1.0 / (lengths.clamp(min=1) * num_seqs)
    elif mode == "seq-mean-token-sum-norm":
        norm = float(norm_tokens) if norm_tokens is not None else lengths.max().clamp(min=1)
        w = torch.full_like(lengths, 1.0) / (norm * num_seqs)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}")
    return torch.where(active, w, torch.zeros_like(w))


def token_weights(mask: torch.Tensor, per_sample: torch.Tensor) -> torch.Tensor:
    """Per-token weights [B, T] from a 0/1 mask [B, T] and sample weights [B]."""
    return mask.float() * per_sample.to(torch.float32).unsqueeze(-1)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode,
    norm_tokens: int | None = None,
) -> torch.Tensor:
    """Aggregate per-token `values` [B, T] over loss tokens `mask` [B, T] into a scalar."""
    w = token_weights(mask, sample_weights(mask.float().sum(-1), mode, norm_tokens))
    return (values * w).sum()


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) (shapes [B, T])."""
    log_rho = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho**2
    if estimator == "k3":
        return torch.exp(log_rho) - 1 - log_rho
    raise ValueError(f"unknown KL estimator {estimator!r}")


def importance_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    sequence_level: bool,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """pi / pi_old per token [B, T]; GSPO's sequence ratio when `sequence_level`.

    A sequence is a row, or, for packed rows, the positions sharing a
    `segment_ids` value [B, T].
    """
    log_ratio = logprobs - old_logprobs  # [B, T]
    if sequence_level:
        m = mask.float()
        if segment_ids is None:
            seq = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        else:
            seq = _segment_mean(log_ratio * m, m, segment_ids)
        log_ratio = seq.detach() + logprobs - logprobs.detach()  # value s_i, grad s_i·∇logp
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _segment_mean(values: torch.Tensor, weights: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """sum(values) / sum(weights) over each segment, broadcast back to [B, T]."""
    flat = seg.reshape(-1).long()
    n = flat.numel()  # an upper bound on the segment count that needs no device sync
    num = values.new_zeros(n).index_add_(0, flat, values.reshape(-1))
    den = weights.new_zeros(n).index_add_(0, flat, weights.reshape(-1))
    return (num / den.clamp(min=1))[flat].view_as(values)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> torch.Tensor:
    """Per-token PPO-clip loss (to minimise) with clip-higher and optional dual-clip."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        capped = torch.minimum(loss, -advantages * dual_clip_c)
        loss = torch.where(advantages < 0, capped, loss)
    return loss


def clip_active(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """[B, T] bool: where PPO's clipped term is the larger one (the token has no gradient)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return clipped > unclipped


def token_covariance(
    logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp) [B, T], means over the loss tokens of
    `mask` [B, T]; 0 off the mask; no gradient."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    lp = logprobs.detach()
    a_mean = (advantages * m).sum() / n
    lp_mean = (lp * m).sum() / n
    return (advantages - a_mean) * (lp - lp_mean) * m


def covariance_count(fraction: float, tokens: int) -> int:
    """How many tokens a covariance control acts on: max(1, floor(fraction · tokens))."""
    return max(1, int(fraction * tokens))


def clip_cov_drop(
    cov: torch.Tensor,
    mask: torch.Tensor,
    clipped: torch.Tensor,
    cfg: LossConfig,
    generator: torch.Generator,
) -> torch.Tensor:
    """Clip-Cov's drop mask [B, T] (1: the token's policy-gradient term is dropped).

    Candidates: loss tokens with low < cov < high whose PPO clip is not active;
    `covariance_count(clip_cov_fraction, N)` of them drawn uniformly at random
    (all of them when fewer qualify) from `generator`, a CPU generator: the
    draw is the same on any device, and only its owner's state moves.
    """
    lo, hi = cfg.clip_cov_band
    on = mask > 0
    candidates = (on & ~clipped & (cov > lo) & (cov < hi)).reshape(-1).nonzero().squeeze(1)
    n = min(covariance_count(cfg.clip_cov_fraction, int(on.sum())), candidates.numel())
    drop = torch.zeros(cov.numel(), dtype=cov.dtype, device=cov.device)
    if n > 0:
        order = torch.randperm(candidates.numel(), generator=generator)
        chosen = candidates[order[:n].to(candidates.device)]
        drop[chosen] = 1.0
    return drop.view_as(cov)


def kl_cov_select(cov: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """KL-Cov's selection [B, T] (1: penalised): the `covariance_count(kl_cov_fraction, N)`
    loss tokens of largest covariance (ties broken by position, as torch.topk does)."""
    on = (mask > 0).reshape(-1)
    idx = on.nonzero().squeeze(1)  # [N] flat positions of loss tokens
    pick = torch.zeros(cov.numel(), dtype=cov.dtype, device=cov.device)
    if idx.numel() == 0:
        return pick.view_as(cov)
    k = covariance_count(cfg.kl_cov_fraction, idx.numel())
    top = torch.topk(cov.reshape(-1).index_select(0, idx), k, largest=True).indices
    pick[idx[top]] = 1.0
    return pick.view_as(cov)


def covariance_control(
    pg: torch.Tensor,
    logprobs: torch.Tensor,
    old: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    m: torch.Tensor,
    cfg: LossConfig,
    sums: dict[str, torch.Tensor],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`pg` [B, T] after Clip-Cov or KL-Cov (module docstring); the share acted on into
    `sums` (`clip_cov_frac` / `kl_cov_frac`). Clip-Cov draws from `generator`."""
    if cfg.covariance == "off":
        return pg
    cov = token_covariance(logprobs, advantages, m)
    if cfg.covariance == "clip_cov":
        if generator is None:  # torch's default generator is nobody's own: no fallback
            raise ValueError("covariance = 'clip_cov' draws at random: pass its `generator`")
        active = clip_active(ratio.detach(), advantages, cfg.eps_low, cfg.eps_high)
        drop = clip_cov_drop(cov, m, active, cfg, generator)
        sums["clip_cov_frac"] = drop.sum()
        return pg * (1 - drop)
    pick = kl_cov_select(cov, m, cfg)
    sums["kl_cov_frac"] = pick.sum()
    return pg + pick * cfg.kl_cov_coef * (logprobs - old).abs()


def next_entropy_coef(coef: float, entropy: float | None, cfg: LossConfig) -> float:
    """The entropy bonus weight of the next step, after a step that used `coef` and
    measured mean token entropy `entropy` (None: not measured, nothing moves).

    'fixed': `coef` as it is. 'adaptive':
    clip(coef + entropy_coef_lr · (entropy_target - entropy), 0, entropy_coef_max).
    """
    if cfg.entropy_control == "fixed" or entropy is None or entropy != entropy:  # NaN
        return coef
    moved = coef + cfg.entropy_coef_lr * (cfg.entropy_target - entropy)
    return min(max(moved, 0.0), cfg.entropy_coef_max)


@dataclass
class LossOutput:
    """One micro-batch's loss and its metric contributions.

    `loss` is already weighted for the whole batch (sum it over micro-batches
    and ranks). `sums` are sums over loss tokens (divide by the batch's total
    `tokens`), `parts` are weighted loss components (sum them), `maxes` are
    maxima (max them).
    """

    loss: torch.Tensor
    tokens: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)


def ratio_sums(
    r: torch.Tensor, m: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> dict[str, torch.Tensor]:
    """Sums over loss tokens of the (detached) ratio and of where the clips bit."""
    on = m > 0
    return {
        "ratio": (r * m).sum(),
        "clip_frac_low": ((r < 1 - cfg.eps_low) & (advantages < 0) & on).float().sum(),
        "clip_frac_high": ((r > 1 + cfg.eps_high) & (advantages > 0) & on).float().sum(),
    }


def truncated_is(
    old: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    m: torch.Tensor,
    cap: float,
    sums: dict[str, torch.Tensor],
) -> torch.Tensor:
    """TIS weights min(pi_old / mu_rollout, cap) [B, T], no gradient; their sums into `sums`."""
    if rollout_logprobs is None:
        raise ValueError("TIS needs rollout_logprobs when old_logprobs='recompute'")
    log_w = (old - rollout_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tis = torch.exp(log_w).clamp(max=cap)
    sums["tis_weight"] = (tis * m).sum()
    sums["tis_clip_frac"] = ((torch.exp(log_w) > cap) & (m > 0)).float().sum()
    return tis


def mismatch_stats(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    m: torch.Tensor,
    same_version: torch.Tensor | None,
    sums: dict[str, torch.Tensor],
    maxes: dict[str, torch.Tensor],
) -> None:
    """The train–inference gap's sums (and max) into `sums` / `maxes` (module docstring).

    `same_version` [B, T] is 1 on tokens the engine generated with the weights
    the trainer's logprobs come from; None: no token is known to be (then only
    `behaviour_k3`). `mismatch_*` sums are divided by `mismatch_tokens` when
    the batch's metrics are finalised (core/batching.MEAN_OVER).
    """
    # float64: k3 of gaps near float32's resolution (~1e-7) rounds to small negatives
    log_rho = (trainer_logprobs.double() - rollout_logprobs.double()).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    m = m.double()
    k3 = torch.exp(log_rho) - 1 - log_rho  # ≥ 0
    sums["behaviour_k3"] = (k3 * m).sum()
    if same_version is None:
        return
    on = m * same_version.double()
    gap = log_rho.abs()
    sums["mismatch_tokens"] = on.sum()
    sums["mismatch_abs_mean"] = (gap * on).sum()
    sums["mismatch_k3"] = (k3 * on).sum()
    maxes["mismatch_abs_max"] = (gap * on).max() if on.numel() else on.new_zeros(())


def mis_masks(
    log_rho: torch.Tensor,
    m: torch.Tensor,
    cfg: LossConfig,
    segment_ids: torch.Tensor | None,
    sums: dict[str, torch.Tensor],
) -> torch.Tensor | None:
    """The MIS keep mask [B, T] (1 keep, 0 drop) from log rho = pi - mu; None: no band set.

    Token band: rho_t in [lo, hi]. Sequence band: the geometric-mean ratio
    exp(mean over the sequence's loss tokens of log rho) in [lo, hi], a
    sequence being a row or, in packed rows, a `segment_ids` value. The
    shares of loss tokens each mask drops go into `sums`.
    """
    keep = torch.ones_like(m)
    token, seq = cfg.mis_token_band, cfg.mis_seq_band
    if token is None and seq is None:
        return None
    if token is not None:
        rho = torch.exp(log_rho)
        inside = ((rho >= token[0]) & (rho <= token[1])).float()
        sums["mis_token_masked_frac"] = ((1 - inside) * m).sum()
        keep = keep * inside
    if seq is not None:
        if segment_ids is None:
            mean = (log_rho * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        else:
            mean = _segment_mean(log_rho * m, m, segment_ids)
        geo = torch.exp(mean).expand_as(m)
        inside = ((geo >= seq[0]) & (geo <= seq[1])).float()
        sums["mis_seq_masked_frac"] = ((1 - inside) * m).sum()
        keep = keep * inside
    return keep


def penalties(
    pg: torch.Tensor,
    logprobs: torch.Tensor,
    weights: torch.Tensor,
    m: torch.Tensor,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    sums: dict[str, torch.Tensor],
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss with the KL penalty and entropy bonus (weight `entropy_coef`)
    added, and each part."""
    total = pg
    parts = {"pg_loss": (pg * weights).sum().detach()}
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs.detach(), cfg.kl_estimator)
        total = total + cfg.kl_coef * kl
        parts["kl_loss"] = (kl * weights).sum().detach()
        sums["kl_ref"] = (kl.detach() * m).sum()
    if entropy is not None:
        sums["entropy"] = (entropy.detach() * m).sum()
        if entropy_coef > 0:
            total = total - entropy_coef * entropy
            parts["entropy_bonus"] = (entropy * weights).sum().detach()
    return total, parts


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    same_version: torch.Tensor | None = None,
    entropy_coef: float | None = None,
    generator: torch.Generator | None = None,
) -> LossOutput:
    """The RL loss of one micro-batch. All tensors are [B, T] over target positions.

    logprobs: current policy (requires grad); old_logprobs: the ratio's
    denominator; advantages: per-sample advantage broadcast over tokens;
    mask: 1 on loss tokens; weights: aggregation weights (`token_weights`),
    0 off the mask; rollout_logprobs: the engine's logprobs (TIS when
    cfg.old_logprobs == 'recompute'); ref_logprobs: the frozen reference
    (needed when cfg.kl_coef > 0); entropy: per-token entropy (metric; a
    bonus when cfg.entropy_coef > 0, then it must carry gradient);
    segment_ids: the sequence of each position in packed rows (GSPO's
    sequence ratio; None: one sequence per row); same_version: 1 on tokens the
    engine generated with the weights of the trainer's pre-update logprobs
    (the train–inference mismatch metrics; None: not measured); entropy_coef:
    this step's bonus weight (the adaptive controller's; None: cfg.entropy_coef);
    generator: where the step's random draws come from (Clip-Cov's; the trainer's own,
    never torch's default generator; required with covariance = 'clip_cov').
    """
    m = mask.float()
    old = old_logprobs.detach()
    gspo = cfg.policy_loss == "gspo"
    ratio = importance_ratio(logprobs, old, m, sequence_level=gspo, segment_ids=segment_ids)
    pg = clipped_surrogate(ratio, advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)
    r = ratio.detach()
    on = m > 0
    sums = ratio_sums(r, m, advantages, cfg)
    # k3 of the update itself: how far pi moved from pi_old on these tokens.
    sums["approx_kl"] = (kl_penalty(logprobs.detach(), old, "k3") * m).sum()
    if cfg.dual_clip_c is not None:
        sums["dual_clip_frac"] = ((r > cfg.dual_clip_c) & (advantages < 0) & on).float().sum()
    pg = covariance_control(pg, logprobs, old, ratio, advantages, m, cfg, sums, generator)
    if cfg.old_logprobs == "recompute" and cfg.tis_cap is not None:
        pg = pg * truncated_is(old, rollout_logprobs, m, cfg.tis_cap, sums)
    masked_ratio = torch.where(on, r, torch.zeros_like(r))
    maxes = {"ratio_max": masked_ratio.max() if r.numel() else r.new_zeros(())}
    if rollout_logprobs is not None:
        # The trainer's pre-update logprobs: recomputed `old`, or this forward's own.
        trainer_lp = old if cfg.old_logprobs == "recompute" else logprobs.detach()
        mu = rollout_logprobs.detach()
        mismatch_stats(trainer_lp, mu, m, same_version, sums, maxes)
        log_rho = (trainer_lp - mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        keep = mis_masks(log_rho, m, cfg, segment_ids, sums)
        if keep is not None:
            pg = pg * keep
    elif cfg.mis_token_band is not None or cfg.mis_seq_band is not None:
        raise ValueError("MIS (mis_token_band / mis_seq_band) needs rollout_logprobs")
    coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
    total, parts = penalties(pg, logprobs, weights, m, cfg, ref_logprobs, entropy, sums, coef)
    return LossOutput(
        loss=(total * weights).sum(), tokens=m.sum(), sums=sums, parts=parts, maxes=maxes
    )
