"""The one resolution of a model reference: a local directory, or a hub id from the local cache.

    resolve_model("runs/demo/model")                         # a directory: itself
    resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")     # its snapshot in ~/.cache/huggingface

Offline by construction (the machines this runs on reach no hub): a hub id
is looked up with `huggingface_hub.snapshot_download(local_files_only=True)`,
never fetched. A reference that is neither a model directory nor cached is a
`ModelNotFoundError` (a ConfigError) whose message is one line naming the
setting and how to get a model, so a newcomer who forgot one reads that and
not a transformers traceback ("Repo id must be in the form 'repo_name'…").
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from services.runtime.errors import ConfigError
from services.weights.adapter import ADAPTER_CONFIG

# How the hub spells a model id: one namespace, one name (huggingface_hub's validator's rule).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")

HOW_TO_GET_ONE = (
    "get one with `flywheel init-model -c run.toml` (a tiny model for the task), "
    "`flywheel import-model FILE.gguf` (a GGUF into a Hugging Face directory), "
    "or `make smollm2` (SmolLM2-135M-Instruct)"
)


S = TypeVar("S", bound=Any)


def model_settings(load: Callable[[], S], *, print_config: bool, section: str) -> S | int:
    """A model-serving service's start (the engine's, tinker's): its settings from `load`,
    with `model` resolved to a directory; or the exit code, its reason printed: 2 for a bad
    run file, no model or one that does not resolve, 0 once `print_config` printed them."""
    from services.runtime.settings import render

    try:
        settings = load()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if print_config:
        print(render(settings))
        return 0
    if settings.model is None:
        print(f"error: no model directory (--model or [{section}] model)", file=sys.stderr)
        return 2
    try:  # a hub id becomes its snapshot in the local cache
        model = resolve_model(settings.model, key=f"[{section}] model")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return settings.model_copy(update={"model": model})


class ModelNotFoundError(ConfigError):
    """A model reference that is neither a model directory nor a hub id in the local cache."""

    def __init__(self, message: str, *, key: str, ref: str) -> None:
        super().__init__(message)
        self.key, self.ref = key, ref


def is_hub_id(ref: str) -> bool:
    """`org/name` as the hub spells it (a path such as `./x/y` or `/models/x` is not one)."""
    return bool(_HUB_ID.match(ref)) and ".." not in ref


def resolve_model(ref: str | Path, *, key: str = "[stack] model") -> Path:
    """The model directory `ref` names; ModelNotFoundError (one line naming `key`) if none.

    A directory wins over a hub id of the same spelling (`models/x` next to
    the run file is that directory). A directory must hold a `config.json` (a model) or an
    `adapter_config.json` (a LoRA adapter: services/models/adapters.py loads it on its base).
    """
    text = str(ref)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / ADAPTER_CONFIG).is_file():
            raise ModelNotFoundError(
                f"{key} = {text!r} has no config.json: not a Hugging Face model directory; "
                f"{HOW_TO_GET_ONE}",
                key=key,
                ref=text,
            )
        return path
    if is_hub_id(text) and not path.exists():
        cached = cached_snapshot(text)
        if cached is not None:
            return cached
        raise ModelNotFoundError(
            f"{key} = {text!r}: no such directory, and not in the local Hugging Face cache "
            f"({hub_cache()}; nothing is downloaded); {HOW_TO_GET_ONE}",
            key=key,
            ref=text,
        )
    raise ModelNotFoundError(
        f"{key} = {text!r}: no such model directory; {HOW_TO_GET_ONE}", key=key, ref=text
    )


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of `repo_id` (its `main` revision) holding a config.json, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        found = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        return None
    path = Path(str(found))
    return path if (path / "config.json").is_file() else None


def hub_cache() -> str:
    """Where the local Hugging Face cache is (HF_HUB_CACHE / HF_HOME honoured)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
