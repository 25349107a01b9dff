"""Sampling on the engines: a sampler's adapter served by SGLang (or the CPU engine) by name.

With `[tinker] engines` set, a sampler snapshot (save_weights_and_get_sampling_client,
save_weights_for_sampler) is written as a PEFT adapter directory and loaded into every
engine through SGLang's `/load_lora_adapter` under a name of its own; a `sample` is one
`/generate` on one engine with `lora_path` = that name (no `lora_path`: the base
model). The Tinker server's model thread then only trains: samples from any number of
samplers run concurrently on the engines, which batch them, instead of one by one
between two training steps.

Why a directory on disk and not tensors over HTTP: `/load_lora_adapter` is what
SGLang serves, and it reads a path. The engines must therefore see the server's
`sampler_dir` (the same machine, or a shared volume on Kubernetes).

The mapping, pure and tested on its own (`generate_body`, `sequences_from`):

- Tinker's `max_tokens`, `temperature`, `top_p` are SGLang's `max_new_tokens`,
  `temperature`, `top_p`; a `top_k` of 0 or below is SGLang's -1 (off).
- `stop=None` stops at the model's EOS (SGLang's default); stop token ids stop at
  those ids only (`stop_token_ids` with `ignore_eos`, as the in-process sampler does);
  `stop=[]` never stops early (`ignore_eos`); stop strings are SGLang's `stop`.
- A `seed` is SGLang's `sampling_seed`, which seeds each completion's own generator:
  n completions with one seed would all be the same draw, so a seeded request is n
  prompts with seeds seed, seed+1, ... in one /generate (distinct, reproducible).
- `prompt_logprobs` (what the SDK's compute_logprobs asks) is `logprob_start_len` 0:
  SGLang's `input_token_logprobs`, whose first logprob is null (NaN here, as in-process).
- The answer's `output_ids` and `output_token_logprobs` are the sequence's tokens and
  logprobs (the stop token included, as Tinker gives it); finish `stop`/`length` the
  SDK's stop reason; an `abort` fails the request.

Errors: an engine's 400 (an adapter rank over its `--max-lora-rank`, a module it was
not started to target, a prompt past its context) is the client's `user` error with
the engine's text; an engine that cannot be reached is a server error. Either fails
that request's future alone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import shutil
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.engine_api.engine_client import (
    EngineClient,
    EngineError,
    EngineHTTPError,
    EngineUnavailable,
)
from services.tinker.core import SampleSpec, TinkerUserError
from services.tinker.model import Sequence

if TYPE_CHECKING:
    import torch

log = logging.getLogger("flywheel.tinker")

NOT_ENABLED = "LoRA is not enabled"  # the start of SGLang's text when --enable-lora is off


class EngineFault(RuntimeError):
    """An engine failed a request for a reason that is not the client's (down, not
    started with --enable-lora, an answer that does not parse): a server error."""


class AdapterMissing(EngineFault):
    """The engine does not have the sampler's adapter (restarted since it was loaded)."""

    def __init__(self, message: str, engine: _Engine) -> None:
        super().__init__(message)
        self.engine = engine


def adapter_missing(message: str, name: str | None) -> bool:
    """Whether /generate's 400 says `name` is not loaded (SGLang's texts: "... are not
    loaded: <name>", "... that has never been loaded: <name>")."""
    return name is not None and name in message and "loaded" in message


# -- pure: the request and the answer ------------------------------------------------------


def sampling_params(spec: SampleSpec) -> dict[str, Any]:
    """SGLang's `sampling_params` for a Tinker sample request (without n or seed)."""
    params: dict[str, Any] = {
        "max_new_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": spec.top_k if spec.top_k > 0 else -1,
    }
    if spec.stop_tokens is not None:  # these ids only (none: never early), not the EOS
        params["ignore_eos"] = True
        if spec.stop_tokens:
            params["stop_token_ids"] = list(spec.stop_tokens)
    if spec.stop_strings:
        params["stop"] = list(spec.stop_strings)
    return params


def generate_body(spec: SampleSpec, lora_name: str | None) -> dict[str, Any]:
    """One /generate body that answers the whole request (`num_samples` completions)."""
    params = sampling_params(spec)
    body: dict[str, Any] = {"return_logprob": True}
    if spec.seed is None:
        body["input_ids"] = list(spec.prompt)
        body["sampling_params"] = {**params, "n": spec.num_samples}
    else:  # one prompt per sample, each its own seed (see the module's docstring)
        body["input_ids"] = [list(spec.prompt)] * spec.num_samples
        body["sampling_params"] = [
            {**params, "sampling_seed": spec.seed + i} for i in range(spec.num_samples)
        ]
    if spec.prompt_logprobs:
        body["logprob_start_len"] = 0
    if lora_name is not None:
        body["lora_path"] = lora_name
    return body


def sequences_from(reply: Any, spec: SampleSpec) -> tuple[list[Sequence], list[float] | None]:
    """The SDK's sequences (and the prompt's logprobs, if asked) from /generate's answer."""
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != spec.num_samples or not all(isinstance(d, dict) for d in items):
        raise EngineFault(f"the engine answered {len(items)} completions for "
                          f"{spec.num_samples} samples")  # fmt: skip
    seqs = []
    for d in items:
        meta = d.get("meta_info") or {}
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type")
        if kind not in ("stop", "length"):
            raise EngineFault(f"the engine ended a sample with {reason!r}")
        triples = meta.get("output_token_logprobs") or []
        tokens = [int(t) for t in d.get("output_ids") or [t for _, t, _ in triples]]
        logprobs = [float(lp) for lp, _, _ in triples]
        if len(logprobs) != len(tokens):
            raise EngineFault(f"{len(tokens)} tokens but {len(logprobs)} logprobs from the engine")
        seqs.append(Sequence(tokens, logprobs, kind))
    prompt_lp = None
    if spec.prompt_logprobs:
        triples = (items[0].get("meta_info") or {}).get("input_token_logprobs") or []
        if [int(t) for _, t, _ in triples] != list(spec.prompt):
            raise EngineFault("the engine's input_token_logprobs do not cover the prompt")
        prompt_lp = [math.nan if lp is None else float(lp) for lp, _, _ in triples]
    return seqs, prompt_lp


def peft_files(
    tensors: dict[str, torch.Tensor], rank: int, alpha: float, base: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """PEFT's adapter layout from PEFT parameter names with the adapter's name taken out
    (`base_model.model.<module>.lora_A.weight`): the tensors and adapter_config.json."""
    targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "use_dora": False,
        "use_rslora": False,
    }
    return {k: v.detach().contiguous() for k, v in tensors.items()}, config


def write_adapter(
    directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> None:
    """adapter_model.safetensors and adapter_config.json, written whole before the name
    is loaded anywhere (an engine reading a half-written file would refuse it)."""
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(directory)


# -- the engines ---------------------------------------------------------------------------


@dataclass
class _Engine:
    client: EngineClient
    in_flight: int = 0


class EnginePool:
    """The engines of `[tinker] engines`: every sampler's adapter is loaded on each, and a
    sample goes to the one with the fewest of this server's requests in flight."""

    def __init__(self, urls: Seq[str], timeout_s: float, retries: int = 3) -> None:
        if not urls:
            raise ValueError("an EnginePool needs at least one engine URL")
        self.engines = [
            _Engine(EngineClient(u, timeout_s=timeout_s, retries=retries)) for u in urls
        ]
        self._turn = itertools.count()

    async def load(self, name: str, directory: Path) -> None:
        """Load the adapter at `directory` as `name` on every engine (all, or an error)."""
        results = await asyncio.gather(
            *(self.load_on(e.client, name, directory) for e in self.engines),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r

    @staticmethod
    async def load_on(client: EngineClient, name: str, directory: Path) -> None:
        try:
            await client.load_lora_adapter(name, str(directory))
        except EngineHTTPError as e:
            if e.status == 400 and NOT_ENABLED not in e.message:
                raise TinkerUserError(
                    f"engine {client.url} refused the sampler's adapter: {e.message} (the "
                    "engines serve adapters up to their --max-lora-rank, on the modules "
                    "of their --lora-target-modules)"
                ) from e
            raise EngineFault(f"engine {client.url} could not load the adapter: {e}") from e
        except EngineError as e:
            raise EngineFault(f"engine {client.url} could not load the adapter: {e}") from e

    def _pick(self) -> _Engine:
        turn = next(self._turn)
        n = len(self.engines)
        order = [self.engines[(turn + i) % n] for i in range(n)]  # ties rotate
        return min(order, key=lambda e: e.in_flight)

    async def sample(
        self, lora_name: str | None, spec: SampleSpec, engine: _Engine | None = None
    ) -> tuple[list[Sequence], list[float] | None]:
        """On `engine`, or the least busy one; AdapterMissing if it lacks the adapter."""
        engine = engine or self._pick()
        engine.in_flight += 1
        try:
            reply = await engine.client.request("POST", "/generate", generate_body(spec, lora_name))
        except EngineHTTPError as e:
            if e.status == 400 and adapter_missing(e.message, lora_name):
                raise AdapterMissing(f"engine {engine.client.url}: {e.message}", engine) from e
            if e.status == 400:
                raise TinkerUserError(f"engine {engine.client.url} refused the sample: "
                                      f"{e.message}") from e  # fmt: skip
            raise EngineFault(f"engine {engine.client.url} failed the sample: {e}") from e
        except EngineError as e:
            raise EngineFault(f"engine {engine.client.url} failed the sample: {e}") from e
        finally:
            engine.in_flight -= 1
        return sequences_from(reply, spec)

    async def close(self) -> None:
        for e in self.engines:
            await e.client.close()


class EngineSampling:
    """The samplers this server has put on the engines: snapshot key -> adapter name.

    Names carry a token per server start, so a restarted server's adapters never
    collide with names an earlier one left loaded. The adapter directories live under
    `<root>/<token>/` and go, with the engines' copies, when the server stops.
    """

    def __init__(self, pool: EnginePool, root: Path, token: str, lora_alpha: float) -> None:
        self.pool = pool
        self.dir = root / token
        self.token = token
        self.lora_alpha = lora_alpha
        self.names: dict[str, str] = {}  # snapshot key -> the adapter's name on the engines
        self._count = itertools.count(1)

    async def publish(
        self, key: str, tensors: dict[str, torch.Tensor], rank: int, base: str
    ) -> str:
        """Write the snapshot as a PEFT directory, load it on every engine as a new name."""
        name = f"tinker-{self.token}-{next(self._count)}"
        files, config = peft_files(tensors, rank, self.lora_alpha, base)
        directory = self.dir / name
        await asyncio.to_thread(write_adapter, directory, files, config)
        await self.pool.load(name, directory)
        self.names[key] = name
        log.info("sampler %s on %d engine(s) as adapter %s", key, len(self.pool.engines), name)
        return name

    async def sample(
        self, snapshot: str | None, spec: SampleSpec
    ) -> tuple[list[Sequence], list[float] | None]:
        """A base-model sampler (None) samples with no adapter. An engine restarted since
        the adapter was loaded has lost it: it is loaded there again from its directory
        (still on disk) and the sample retried there, once."""
        name = None if snapshot is None else self.names[snapshot]
        try:
            return await self.pool.sample(name, spec)
        except AdapterMissing as e:
            assert name is not None
            log.warning("%s; loading %s there again", e, name)
            try:
                await self.pool.load_on(e.engine.client, name, self.dir / name)
            except TinkerUserError as again:
                if "already loaded" not in str(again):  # a concurrent sample reloaded it
                    raise
            return await self.pool.sample(name, spec, e.engine)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Unload this server's adapters from the engines (best effort: an engine that is
        gone has nothing left to free) and delete their directories."""
        gone: set[str] = set()  # engines that did not answer: not asked again
        for name in self.names.values():
            for e in self.pool.engines:
                if e.client.url in gone:
                    continue
                try:
                    await e.client.unload_lora_adapter(name, timeout_s=timeout_s)
                except EngineUnavailable as err:
                    gone.add(e.client.url)
                    log.warning("engine %s gone; its adapters stay: %s", e.client.url, err)
                except EngineError as err:
                    log.warning("could not unload %s from %s: %s", name, e.client.url, err)
        await self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)
