"""Every setting of the trainer, in one place: `[trainer]` (RL) and `[sft]` of the run file.

The services' settings classes (`TrainerSettings`, `SftSettings`) embed
the training machinery's typed tables, which both share: `LossConfig`
(`[trainer.loss]`, the RL objective), `OptimConfig` (`[trainer.optim]`,
`[sft.optim]`) and `ModelConfig` (how the policy is loaded and run:
`[trainer.runtime]`, `[sft.model]`). Plain pydantic models, so the pure
core (services/trainer/core/) reads its knobs from the same declarations,
bounds checked where each field is declared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.runtime.cores import CoreLeaseSettings
from services.runtime.settings import RunPath
from services.tasks.settings import TaskServiceSettings
from services.trainer.loggers import LoggerName, WandbMode
from services.weights import TransportKind
from services.weights.adapter import LoraSettings, check_transport

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
PolicyLossKind = Literal["ppo", "gspo"]
AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KlEstimator = Literal["k1", "k2", "k3"]
OldLogprobSource = Literal["rollout", "recompute"]
EntropyControl = Literal["fixed", "adaptive"]
CovarianceControl = Literal["off", "clip_cov", "kl_cov"]
ScheduleKind = Literal["constant", "cosine"]  # core/schedule.py


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
        0.0,
        ge=0,
        description="Entropy bonus weight (loss -= coef · entropy); 0: metric only. With "
        "entropy_control = 'adaptive': the coefficient's value at step 0.",
    )
    entropy_control: EntropyControl = Field(
        "fixed",
        description="'fixed': the bonus weight is entropy_coef throughout; 'adaptive': after "
        "each step coef += entropy_coef_lr · (entropy_target - entropy), clipped to [0, "
        "entropy_coef_max], so the bonus grows while the policy's mean token entropy is "
        "below the target and fades above it (Skywork-OR1's adaptive entropy control; TRL's "
        "use_adaptive_entropy). The coefficient is trainer state: checkpoints keep it.",
    )
    entropy_target: float = Field(
        0.2,
        gt=0,
        description="'adaptive': the mean token entropy (nats, at the sampling temperature, "
        "over the batch's loss tokens) the coefficient moves to hold (Skywork-OR1: 0.2).",
    )
    entropy_coef_lr: float = Field(
        0.02,
        gt=0,
        description="'adaptive': the coefficient's step per nat of (target - entropy); at 0.02 "
        "a policy 0.15 nats below the target adds 0.003 per step.",
    )
    entropy_coef_max: float = Field(
        0.05,
        gt=0,
        description="'adaptive': the coefficient's ceiling (a bonus that grows without one "
        "can make the policy's entropy explode).",
    )
    covariance: CovarianceControl = Field(
        "off",
        description="Entropy-preserving control of the tokens whose logprob moves most with "
        "their advantage (Cui et al. 2025, verl's policy_loss 'clip_cov' / 'kl_cov'), from "
        "each token's centred covariance (A - mean A)(logp - mean logp) over the micro-batch: "
        "'clip_cov' drops the policy-gradient term of a random clip_cov_fraction of the loss "
        "tokens whose covariance lies in clip_cov_band; 'kl_cov' adds kl_cov_coef · |logp - "
        "old| to the top kl_cov_fraction of loss tokens by covariance; 'off': neither.",
    )
    clip_cov_fraction: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="'clip_cov': share of the micro-batch's loss tokens dropped (at least one "
        "when any token qualifies; verl's clip_cov_ratio).",
    )
    clip_cov_band: tuple[float, float] = Field(
        (1.0, 5.0),
        description="'clip_cov': [low, high]: only tokens with low < covariance < high are "
        "candidates (verl's clip_cov_lb / clip_cov_ub).",
    )
    kl_cov_fraction: float = Field(
        2e-3,
        gt=0,
        le=1,
        description="'kl_cov': share of the micro-batch's loss tokens, the largest "
        "covariances, that get the penalty (at least one; verl's kl_cov_ratio; the paper used "
        "2e-3 on a 7B model, 2e-4 on 32B).",
    )
    kl_cov_coef: float = Field(
        1.0,
        gt=0,
        description="'kl_cov': weight of the |logp - old| penalty on those tokens (verl's "
        "ppo_kl_coef).",
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
    mis_token_band: tuple[float, float] | None = Field(
        None,
        description="Masked importance sampling, per token: [low, high]; a token whose ratio "
        "pi_trainer / mu_engine (the trainer's logprob, recomputed before the update with "
        "old_logprobs='recompute', else the current one, over the engine's) leaves the band "
        "gets no policy-gradient term (verl rollout_rs='token', prime-rl "
        "token_mask_low/high 0.125/8, IcePop [0.5, 5]). None disables it.",
    )
    mis_seq_band: tuple[float, float] | None = Field(
        None,
        description="Masked importance sampling, per sequence: [low, high]; every token of a "
        "completion whose geometric-mean ratio exp(mean log(pi_trainer / mu_engine)) leaves "
        "the band gets no policy-gradient term (verl rollout_rs='geometric', prime-rl "
        "geo_mask_low/high). None disables it.",
    )
    drop_truncated: bool = Field(
        False, description="Give zero loss weight to completions cut off by the length limit."
    )

    @model_validator(mode="after")
    def _adaptive_start(self) -> LossConfig:
        if self.entropy_control == "adaptive" and self.entropy_coef > self.entropy_coef_max:
            raise ValueError(
                f"entropy_control = 'adaptive' starts at entropy_coef = {self.entropy_coef}, "
                f"above entropy_coef_max = {self.entropy_coef_max}"
            )
        return self

    @field_validator("clip_cov_band")
    @classmethod
    def _cov_band(cls, band: tuple[float, float]) -> tuple[float, float]:
        if not band[0] < band[1]:
            raise ValueError(f"clip_cov_band [low, high] needs low < high, got {band}")
        return band

    @field_validator("mis_token_band", "mis_seq_band")
    @classmethod
    def _band(cls, band: tuple[float, float] | None) -> tuple[float, float] | None:
        if band is not None and not 0 <= band[0] <= 1 <= band[1]:
            raise ValueError(f"a ratio band [low, high] needs 0 <= low <= 1 <= high, got {band}")
        return band


Precision = Literal["auto", "bf16", "fp32"]
LogprobImpl = Literal["chunked", "full"]


class OptimConfig(BaseModel):
    """AdamW and its learning-rate schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="Peak learning rate, or 'auto': from the policy's parameter count N "
        "(with LoRA, the base model's): clamp(4e-5 · sqrt(1.35e8 / N), 1e-6, 4e-5), 10x that "
        "for a LoRA adapter; 4e-5 on SmolLM2-135M, where it was measured to learn (1e-6 "
        "learned nothing), ~1.1e-5 at 1.7B, ~5.6e-6 at 7B (services/trainer/core/lr.py). "
        "The trainer logs what it resolved at start-up.",
    )
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup length in optimizer steps.")
    schedule: ScheduleKind = Field("constant", description="After warmup: constant or cosine.")
    total_steps: int = Field(
        1000, ge=1, description="Steps over which the cosine schedule decays (ignored if constant)."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per RL batch: its groups are split into this many "
        "mini-batches (PPO-style); 1 = one step per batch.",
    )
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this; None: no clipping."
    )


class ModelConfig(BaseModel):
    """How the policy is loaded, sharded and run (precision, layout, logprobs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="Tokens per micro-batch: packed, the sum of the sequence lengths; "
        "padded, rows × longest row. A longer sequence gets a micro-batch of its own.",
    )
    packing: bool | Literal["auto"] = Field(
        "auto",
        description="Pack sequences into one row per micro-batch (position ids restart per "
        "sequence; attention never crosses sequences). False: one padded row per sequence. "
        "'auto': pack where it was measured faster: a GPU in bf16/fp16 (the varlen kernel) "
        "and a CPU in bf16 (`flywheel_segments`, services/trainer/attention.py); a CPU in "
        "float32 pads (its packed step measured slower, bench/results_real_profile.md), and "
        "so does a GPU in float32 (a dense block-diagonal mask).",
    )
    share_prefix: bool = Field(
        True,
        description="Where rows are packed (see `packing`), compute each RL group's common "
        "prefix (its prompt, and more where its samples start alike) once: the group is one "
        "tree whose replies attend to the shared prefix and to themselves "
        "(services/trainer/core/prefix.py). Same logprobs, losses and gradients as "
        "unshared rows, within float rounding; fewer tokens computed.",
    )
    precision: Precision = Field(
        "auto",
        description="'bf16': bf16 compute with float32 master weights, gradients and "
        "optimizer state (autocast in one process, FSDP2 mixed precision with float32 "
        "gradient reduction under torchrun); 'fp32': float32 throughout; 'auto': bf16 on a "
        "GPU that supports it and on a CPU with native bf16 (AVX512-BF16 or AMX: 1.3-1.9x "
        "faster on SmolLM2-135M's step, bench/results_real_profile.md), fp32 elsewhere "
        "(emulated bf16 is no faster, bench/results_trainer.md).",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute decoder-layer activations in backward (saves memory)."
    )
    logprobs: LogprobImpl = Field(
        "chunked",
        description="'chunked': logprobs/entropy from the hidden states and the LM head a "
        "chunk of tokens at a time, never materialising [tokens × vocab] logits (verified "
        "for Qwen2/Qwen3/Llama/Mistral heads); 'full': the model's own logits (any model).",
    )
    logits_chunk_mib: float = Field(
        256.0,
        gt=0,
        description="'chunked' logprobs: MiB of float32 logits held at once (forward: "
        "rows = this / (4 · vocab); backward: the same number of elements, sliced over the "
        "vocabulary). Smaller saves memory, larger runs fewer, larger matmuls.",
    )
    entropy_every: int = Field(
        1,
        ge=0,
        description="Compute the token entropy metric every this many steps (0: never). "
        "With loss.entropy_coef > 0 or entropy_control = 'adaptive' it is computed on every "
        "step regardless.",
    )
    seed: int = Field(
        0,
        description="Seed of torch's RNG at start-up and of the trainer's own generator, "
        "which every random draw of a step takes (Clip-Cov; dropout is reseeded from it "
        "each step); checkpoints keep its state (services/trainer/randomness.py).",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU (process-wide); None: torch's default. "
        "Small models on a shared CPU run far faster with 1.",
    )


class DistillConfig(BaseModel):
    """`[trainer.distill]`: the reverse-KL advantage against the samples' teacher logprobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coef: float = Field(
        1.0, gt=0, le=100, description="Weight of the reverse-KL advantage (tinker's kl coef)."
    )
    reward_weight: float = Field(
        0.0,
        ge=0,
        le=100,
        description="Weight of the task reward's group-relative advantage beside it: 0 is "
        "distillation alone, 1 mixes it with RL.",
    )
    discount: float = Field(
        0.0,
        ge=0,
        le=1,
        description="0: each token's own reverse KL (the recipe's default); > 0: plus the "
        "later tokens', discounted by this per token.",
    )


class TrainConfig(BaseModel):
    """Everything `Trainer` needs besides the model directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraSettings | None = None  # None: full fine-tuning
    distill: DistillConfig | None = None  # None: no teacher (core/distill.py)

    @model_validator(mode="after")
    def _lora_head_logprobs(self) -> TrainConfig:
        lora = self.lora
        chunked = self.model.logprobs == "chunked"
        if lora and "lm_head" in lora.heads and lora.dropout > 0 and chunked:
            raise ValueError(
                "[lora] dropout > 0 with heads = ['lm_head'] needs logprobs = 'full': the "
                "chunked logprobs run the adapted head as one merged matrix, without dropout"
            )
        return self


class TrainerSettings(TaskServiceSettings):
    section: ClassVar[str] = "trainer"
    needs_task: ClassVar[bool] = True

    model: RunPath = Field(Path("runs/demo/model"), description="Initial policy (HF directory).")
    weights_root: RunPath = Field(
        Path("runs/weights"), description="Published weights go to <root>/<run>/v000012/."
    )
    weights_transport: TransportKind = Field(
        "disk",
        description="How engines get weights: 'disk' announces the shared directory; 'nats' "
        "also sends it as chunks into JetStream (no shared storage needed); 'nats-delta' "
        "sends per version only the elements whose published bits changed (lossless, "
        "rebuilt and verified beside each engine) plus a full snapshot every "
        "weights_snapshot_every versions; 'disk-delta' writes that delta beside each full "
        "directory and each engine's worker rebuilds its own copy from it; 'distributed' "
        "has sync broadcast each version from the shared directory into every engine over "
        "SGLang's torch.distributed protocol (one gloo/NCCL group per engine, sync rank 0).",
    )
    weights_snapshot_every: int = Field(
        10,
        ge=1,
        description="nats-delta: send a full snapshot every this many published versions (a "
        "late engine catches up from the last one plus the deltas after it; 1: every version "
        "whole as well).",
    )
    weights_upload_window: int = Field(
        16, ge=1, le=1024, description="NATS transport: chunk publishes in flight at once."
    )
    checkpoint_dir: RunPath = Field(Path("runs/checkpoints"), description="Trainer checkpoints.")
    publish_every: int = Field(1, ge=1, description="Publish weights every this many steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many steps (None: run until stopped)."
    )
    replay: bool = Field(
        False,
        description="Re-train a recorded run (`flywheel replay train` sets it): read the run's "
        "BATCHES stream from the start as recorded (services/trainer/replay.py), stop after "
        "its last batch, announce nothing (no WeightsPublished, no dead letters, no streams "
        "created). Point weights_root, checkpoint_dir and metrics_file elsewhere.",
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    runtime: ModelConfig = Field(default_factory=ModelConfig)
    cores: CoreLeaseSettings = Field(
        default_factory=CoreLeaseSettings,
        description="[trainer.cores]: the machine's core lease (services/runtime/cores.py), "
        "set by `flywheel up` when [stack] placement is colocated: a one-process CPU trainer "
        "computes with every core while the engines are idle and lends them while it waits "
        "for a batch. Off (no dir) otherwise.",
    )
    lora: LoraSettings | None = Field(
        None,
        description="[trainer.lora]: train a LoRA adapter (PEFT) instead of every weight, and "
        "publish only the adapter per version (weights transports 'disk' or 'nats'); "
        "absent: full fine-tuning.",
    )
    distill: DistillConfig | None = Field(
        None,
        description="[trainer.distill]: on-policy distillation, each token's advantage the "
        "reverse KL to the teacher's logprobs the samples carry ([teacher], "
        "docs/distillation.md), plus reward_weight times the task's; absent: RL alone.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Evaluate the task's held-out split ([task] eval: pass@1, pass@k) every "
        "this many steps, and at step 0 (0: never).",
    )
    eval_max_share: float | None = Field(
        0.05,
        gt=0,
        le=1,
        description="The share of RL wall time the held-out evaluations may cost the training: "
        "the trainer measures how much longer the steps trained beside an evaluation took "
        "than the median step trained with none, summed; a due evaluation is deferred (that "
        "version not evaluated, counted in evals_deferred) while that cost is over this share "
        "of the RL seconds so far. The step-0 evaluation and a run's last step's are never "
        "deferred. Counted: the greedy pass@1, and the pass@k samples only where they run at "
        "the greedy pass's priority (eval_nice not above eval_greedy_nice). 1.0 or None: "
        "evaluate at every eval_every (docs/learning.md).",
    )
    eval_max_age_s: float | None = Field(
        600.0,
        gt=0,
        description="A due evaluation runs, whatever eval_max_share says, once the newest "
        "one started this many seconds of RL ago: the status line's held-out figure is never "
        "older than this plus one evaluation. None: eval_max_share alone decides.",
    )
    eval_on: Literal["engines", "trainer"] = Field(
        "trainer",
        description="Who generates the held-out evaluations: 'engines' asks sync to run each "
        "due version on an engine serving exactly that version (held there until it ran; "
        "each answer's version checked), and records the result it sends back: no model "
        "copy in the trainer, the result known seconds after the version is on an engine. "
        "'trainer' loads the version here and generates on threads at eval_greedy_nice and "
        "eval_nice (the path before; tasks with [task.episode] need it).",
    )
    eval_result_timeout_s: float = Field(
        300.0,
        gt=0,
        description="eval_on = 'engines': how long a run that ended by itself waits for the "
        "results still out (then it ends, saying which versions were never reported).",
    )
    eval_nice: int = Field(
        19,
        ge=0,
        le=19,
        description="CPU priority (Linux nice) of the thread that draws the held-out "
        "evaluations' pass@k samples (eval.k > 1: k times the greedy pass's generations): 19 "
        "runs them in the time the cores are idle, so on a busy CPU they take longer instead "
        "of slowing the steps and engines beside them; 0: the same priority as training.",
    )
    eval_greedy_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="CPU priority (Linux nice) of the thread that loads a version and runs its "
        "greedy pass@1, the figure its best-weights choice and a run's target are judged on: "
        "0 (the training's own) so that it is known seconds after the version, at the cost of "
        "one greedy pass over [task.eval] size prompts beside the steps (eval_max_share "
        "bounds it); 19: it waits for idle cores like the samples.",
    )
    sandbox_socket: RunPath | None = Field(
        None,
        description="Unix socket of a `flywheel sandbox` server: rewards and tools run in "
        "its children (a sidecar without this service's credentials or volumes) instead of "
        "this service's. None: this service starts the sandboxed children itself.",
    )
    metrics_file: RunPath | None = Field(None, description="Append one JSON line per step here.")
    loggers: list[LoggerName] = Field(
        ["jsonl"],
        description="Where each step's metrics row goes: 'jsonl' (metrics_file), "
        "'tensorboard' (event files), 'wandb' (a W&B run). The last two are extras: "
        "pip install 'flywheel[tensorboard]' / 'flywheel[wandb]'.",
    )
    log_dir: RunPath | None = Field(
        None,
        description="TensorBoard event files (<dir>/tensorboard/<run>/) and W&B runs "
        "(<dir>/wandb/) go here; None: beside metrics_file, else runs/logs.",
    )
    wandb_project: str = Field("flywheel", min_length=1, description="W&B project name.")
    wandb_mode: WandbMode = Field(
        "offline",
        description="'offline': W&B writes locally, no network ('wandb sync' uploads later); "
        "'online': streams to the W&B server.",
    )

    @model_validator(mode="after")
    def _adapters_travel(self) -> TrainerSettings:
        if self.lora is not None:
            check_transport(self.weights_transport)  # a ConfigError (a ValueError) says why
        return self

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            loss=self.loss,
            optim=self.optim,
            model=self.runtime,
            lora=self.lora,
            distill=self.distill,
        )


class SftSettings(TaskServiceSettings):
    """`[sft]` of the run file; env overrides FLYWHEEL_SFT_<FIELD>."""

    section: ClassVar[str] = "sft"

    model_dir: RunPath = Field(Path("model"), description="Local HF model directory to start from.")
    train_file: RunPath = Field(Path("train.jsonl"), description="Training JSONL (chat or p/c).")
    eval_file: RunPath | None = Field(None, description="Held-out JSONL for the eval loss.")
    output_dir: RunPath = Field(Path("sft-out"), description="Where the trained HF dir is written.")
    overwrite: bool = Field(False, description="Replace output_dir if it exists.")
    epochs: float = Field(1.0, gt=0, description="Passes over the data (ignored if steps set).")
    steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides epochs.")
    max_time_s: float | None = Field(
        None, gt=0, description="Stop early (then save) after this much wall time."
    )
    batch_size: int = Field(64, ge=1, description="Examples per optimizer step (all ranks).")
    max_seq_len: int = Field(2048, ge=2, description="Truncate examples to this many tokens.")
    eval_every: int = Field(0, ge=0, description="Eval loss every N steps; 0: only at the end.")
    log_every: int = Field(10, ge=1, description="Log metrics every N steps (no TTY).")
    progress: bool | None = Field(None, description="Progress bar; None: when stderr is a TTY.")
    seed: int = Field(0, description="Seed of the data order.")
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10, schedule="cosine"),
        description="Optimizer and LR schedule (total_steps is set to the run's steps). "
        "Without an [sft.optim] table lr is 1e-4; a table that sets no lr gets the field's "
        "default, 'auto', resolved and logged as the RL trainer's.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraSettings | None = Field(
        None,
        description="[sft.lora]: train a LoRA adapter instead of every weight; output_dir then "
        "holds the adapter (PEFT's layout; `flywheel eval --weights` takes it).",
    )
