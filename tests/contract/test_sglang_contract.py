"""The SGLang contract: the CPU engine and the engine client against the same fixtures.

See contract_support.py for the fixture format. The CPU engine runs in this
process (one per engine configuration a case needs, sharing one tiny model)
on a real port; the client talks to a real HTTP server that replays the
fixture's answer and records what the client sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from services.engine_api.engine_client import EngineClient, EngineHTTPError
from services.models.tiny_model import TinyModelSpec, write_tiny_model
from services.weights import write_weights_dir
from tests.contract.contract_support import Case, check_body, compare, load_cases, substitute
from tests.harness.engines import serving
from tests.harness.lora import write_adapter

CASES = load_cases()
ENGINE_CASES = [c for c in CASES if c.engine]
CLIENT_CASES = [c for c in CASES if c.client is not None]


# ── the CPU engine, in this process ───────────────────────────────────────────
class Engines:
    """One CPU engine state (model + scheduler thread) per configuration, made on demand."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.states: dict[tuple[Any, ...], Any] = {}

    def get(self, case: Case) -> Any:
        from services.engine.app import create_state
        from services.engine.settings import EngineSettings
        from services.runtime.settings import load_settings

        g = case.given
        model = self.variant(g["generation_config"]) if "generation_config" in g else self.model
        options: dict[str, Any] = {"model": model, "weight_version": case.weight_version,
                                   "sglang_version": case.version}  # fmt: skip
        for key in ("api_key", "health_generation", "health_check_timeout_s"):
            if key in g:
                options[key] = g[key]
        options.update(g.get("lora", {}))
        key = tuple(sorted((k, str(v)) for k, v in options.items()))
        if "lora" in g or "adapters" in g:
            key += (("case", case.id),)  # SGLang remembers every name it loaded
        if key not in self.states:
            self.states[key] = create_state(load_settings(EngineSettings, **options))
        return self.states[key]

    def variant(self, generation_config: dict[str, Any]) -> Path:
        """A copy of the model whose generation_config.json has these keys too."""
        text = json.dumps(generation_config, sort_keys=True)
        out = self.model.parent / f"model-gc-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        if not out.exists():
            shutil.copytree(self.model, out)
            gen = out / "generation_config.json"
            gen.write_text(json.dumps({**json.loads(gen.read_text()), **generation_config}))
        return out

    def close(self) -> None:
        for state in self.states.values():
            state.scheduler.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("contract") / "model", TinyModelSpec())


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A valid update target: a weights directory with the manifest an update checks."""
    out = tmp_path_factory.mktemp("contract") / "v4"
    write_weights_dir(out, lambda tmp: write_tiny_model(tmp, TinyModelSpec(seed=4)))
    return str(out)


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, weights_dir: str) -> Any:
    """What the fixtures' placeholders stand for on this machine."""
    out = tmp_path_factory.mktemp("adapters")
    return {
        "{weights_dir}": weights_dir,
        "{adapter_dir}": str(write_adapter(out / "r4", model_dir, r=4)),
        "{big_adapter_dir}": str(write_adapter(out / "r16", model_dir, r=16)),
    }


CLIENT_PLACES = {"{weights_dir}": "/models/flywheel-v4", "{adapter_dir}": "/adapters/r4",
                 "{big_adapter_dir}": "/adapters/r16"}  # fmt: skip


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[Engines]:
    e = Engines(model_dir)
    yield e
    e.close()


async def send(
    s: aiohttp.ClientSession, url: str, req: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with s.request(req["method"], url + req["path"], json=req.get("body"),
                         headers={**(headers or {}), **req.get("headers", {})}) as r:  # fmt: skip
        text = await r.text()
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, text


async def until(cond: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def prepare(
    s: aiohttp.ClientSession,
    url: str,
    case: Case,
    auth: dict[str, str],
    state: Any,
    places: dict[str, str],
) -> Any:
    """`given`: adapters, released memory, requests answered before, a slowed in-flight
    generation, then a pause; returns the in-flight task."""
    task = None
    g = case.given
    if "released" in g:
        status, answer = await send(s, url, {"method": "POST", "path": "/release_memory_occupation",
                                             "body": {"tags": g["released"]}}, auth)  # fmt: skip
        assert status == 200, answer
    for name in g.get("adapters", []):
        body = {"lora_name": name, "lora_path": places["{adapter_dir}"]}
        status, answer = await send(s, url, {"method": "POST", "path": "/load_lora_adapter",
                                             "body": body}, auth)  # fmt: skip
        assert status == 200, answer
    for name in g.get("unloaded", []):
        status, answer = await send(s, url, {"method": "POST", "path": "/unload_lora_adapter",
                                             "body": {"lora_name": name}}, auth)  # fmt: skip
        assert status == 200, answer
    for req in g.get("before", []):
        status, answer = await send(s, url, substitute(req, places), auth)
        assert status == 200, f"given.before {req['path']}: {status}: {answer!r}"
    if "in_flight" in g:
        await send(s, url, {"method": "POST", "path": "/slow_down",
                            "body": {"forward_sleep_time": 0.05}}, auth)  # fmt: skip
        task = asyncio.create_task(send(s, url, {"method": "POST", "path": "/generate",
                                                 "body": g["in_flight"]}, auth))  # fmt: skip
        # Read in-process: /v1/loads is not served before 0.5.8.
        await until(lambda: state.scheduler.load()["num_running_reqs"] >= 1,
                    "in-flight request never started")  # fmt: skip
    if "paused" in g:
        status, _ = await send(s, url, {"method": "POST", "path": "/pause_generation",
                                        "body": {"mode": g["paused"]}}, auth)  # fmt: skip
        assert status == 200
    return task


async def cleanup(
    s: aiohttp.ClientSession, url: str, task: Any, auth: dict[str, str], state: Any
) -> None:
    for path, body in (("/slow_down", {"forward_sleep_time": None}),
                       ("/abort_request", {"abort_all": True}),
                       ("/continue_generation", {})):  # fmt: skip
        await send(s, url, {"method": "POST", "path": path, "body": body}, auth)
    if state.released:  # the next case starts with everything resumed, as SGLang would
        body = {"tags": sorted(state.released)}
        await send(s, url, {"method": "POST", "path": "/resume_memory_occupation", "body": body},
                   auth)  # fmt: skip
    if task is not None:
        await asyncio.wait_for(task, 20)


async def send_during(
    s: aiohttp.ClientSession,
    url: str,
    case: Case,
    auth: dict[str, str],
    state: Any,
    asked: asyncio.Task[Any],
) -> list[asyncio.Task[Any]]:
    """`given.during`: generations sent once the case's request waits in the engine."""
    bodies = case.given.get("during", [])
    if not bodies:
        return []
    await until(lambda: state.scheduler.load()["update_pending"] or asked.done(),
                "the update never reached the engine")  # fmt: skip
    assert not asked.done(), f"{case.id}: answered before the in-flight request finished"
    tasks = [asyncio.create_task(send(s, url, {"method": "POST", "path": "/generate", "body": b},
                                      auth)) for b in bodies]  # fmt: skip
    await until(lambda: state.scheduler.load()["num_held_reqs"] == len(bodies) or asked.done(),
                "the generations sent during the update never arrived")  # fmt: skip
    return tasks


@pytest.mark.parametrize("case", ENGINE_CASES, ids=[c.id for c in ENGINE_CASES])
def test_cpu_engine_answers_like_sglang(
    case: Case, engines: Engines, places: dict[str, str], run_async: Any
) -> None:
    from services.engine.app import build_app

    state = engines.get(case)
    key = case.given.get("api_key")
    auth = {"Authorization": f"Bearer {key}"} if key else {}

    async def body() -> None:
        async with serving(build_app(state)) as url, aiohttp.ClientSession() as s:
            task = await prepare(s, url, case, auth, state, places)
            try:
                t0 = time.monotonic()
                asked = asyncio.create_task(send(s, url, substitute(case.request, places)))
                during = await send_during(s, url, case, auth, state, asked)
                status, answer = await asked
                took = time.monotonic() - t0
                during_answers = await asyncio.gather(*during)
            finally:
                await cleanup(s, url, task, auth, state)
        where = f"{case.id} ({case.source})"
        assert status == case.response["status"], f"{where}: status {status}: {answer!r}"
        problems = check_body(case, answer)
        assert not problems, f"{where}: " + "; ".join(problems) + f"\nanswer: {answer!r}"
        if case.min_seconds is not None:
            assert took >= case.min_seconds, f"{where}: answered in {took:.2f}s"
        if case.max_seconds is not None:
            assert took <= case.max_seconds, f"{where}: took {took:.2f}s"
        for d_status, d_answer in during_answers:
            want = case.given["during_response"]
            assert d_status == want["status"], f"{where}: during: {d_status}: {d_answer!r}"
            problems = compare(case, want.get("body", {}), d_answer)
            assert not problems, f"{where}: during: " + "; ".join(problems) + f"\n{d_answer!r}"

    run_async(body(), timeout_s=60)


# ── the client, against the fixture replayed ──────────────────────────────────
def replay_app(case: Case, seen: list[tuple[str, str, Any]]) -> web.Application:
    """Answers the case's request with its example, and detection with the release's own."""
    same_release = [c for c in CASES if c.version == case.version and not c.given]
    info = {c.request["path"]: c for c in same_release
            if c.request["path"] in ("/server_info", "/get_server_info")}  # fmt: skip

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        seen.append((request.method, request.path, body))
        chosen = case if request.path == case.request["path"] else info.get(request.path)
        if chosen is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        resp = chosen.response
        if "body" not in resp:
            return web.json_response({"detail": "Not Found"}, status=resp["status"])
        if isinstance(resp["body"], str):
            return web.Response(text=resp["body"], status=resp["status"])
        return web.json_response(resp["body"], status=resp["status"])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def check_sent(case: Case, seen: list[tuple[str, str, Any]], places: dict[str, str]) -> None:
    want = substitute(case.request, places)
    sent = [b for m, p, b in seen if (m, p) == (want["method"], want["path"])]
    assert sent, f"{case.id}: the client never sent {want['method']} {want['path']}: {seen}"
    for k, v in (want.get("body") or {}).items():
        assert sent[-1].get(k) == v, f"{case.id}: sent {k}={sent[-1].get(k)!r}, fixture {v!r}"
    for k in case.absent_in_request:
        assert k not in sent[-1], f"{case.id}: sent {k}, which SGLang {case.version} lacks"


def version_in(body: dict[str, Any]) -> int | None:
    """The version the client is asked to send: the request body has it as SGLang's text."""
    text = body.get("weight_version")
    return None if text is None else int(text)


async def run_client_call(c: EngineClient, case: Case, places: dict[str, str]) -> None:
    spec = case.client or {}
    call = spec["call"]
    req = substitute(case.request, places)
    body = req.get("body") or {}
    if call == "detect":
        caps = await c.detect()
        assert list(caps.version) == spec["version"]
    elif call == "weight_version":
        assert await c.weight_version() == spec["weight_version"]
    elif call == "loads":
        load = await c.loads()
        assert (load.running, load.queued) == (spec["running"], spec["queued"])
    elif call == "generate":
        results = await c.generate(
            body["input_ids"], sampling_params=body["sampling_params"], rid=body["rid"],
            return_logprob=body.get("return_logprob", True), lora_path=body.get("lora_path"),
        )  # fmt: skip
        assert len(results) == len(spec["results"])
        for r, want in zip(results, spec["results"], strict=True):
            assert r.rid == want["rid"]
            assert len(r.output_ids) == len(r.logprobs) == want["n_tokens"]
            assert r.finish_type == want["finish_type"]
            assert r.weight_version == want["weight_version"]
            assert [[s.version, s.start, s.end] for s in r.weight_versions] == want["spans"]
    elif call == "prompt_logprobs":
        got = await c.prompt_logprobs(body["input_ids"], spec["start"], rid=body.get("rid"))
        assert got == spec["logprobs"]
    elif call in ("generate_error", "detect_error", "update_error", "lora_error"):
        with pytest.raises(EngineHTTPError) as err:
            if call == "generate_error":
                await c.generate(body["input_ids"], sampling_params=body["sampling_params"],
                                 rid=body.get("rid"), lora_path=body.get("lora_path"))  # fmt: skip
            elif call == "detect_error":
                await c.detect()
            elif call == "lora_error" and req["path"] == "/load_lora_adapter":
                await c.load_lora_adapter(body["lora_name"], body["lora_path"])
            elif call == "lora_error":
                await c.unload_lora_adapter(body["lora_name"])
            else:
                await c.update_weights_from_disk(body["model_path"], version_in(body))
        assert err.value.status == spec["status"]
        if "message" in spec:
            assert err.value.message == spec["message"]
        if "message_prefix" in spec:
            assert err.value.message.startswith(spec["message_prefix"])
    elif call == "load_lora":
        await c.load_lora_adapter(body["lora_name"], body["lora_path"])
    elif call == "unload_lora":
        await c.unload_lora_adapter(body["lora_name"])
    elif call == "health":
        assert await c.health() is spec["ok"]
    elif call == "release":
        await c.release_memory_occupation(spec["tags"])
    elif call == "resume":
        await c.resume_memory_occupation(spec["tags"])
    elif call == "pause":
        await c.pause_generation(spec["mode"])
    elif call == "continue":
        await c.continue_generation()
    elif call == "update":
        res = await c.update_weights_from_disk(body["model_path"], version_in(body),
                                               update_mode=spec["mode"])  # fmt: skip
        assert res.success is spec["success"]
        assert res.num_paused_requests == spec["num_paused_requests"]
    else:
        raise AssertionError(f"unknown client call {call!r}")


@pytest.mark.parametrize("case", CLIENT_CASES, ids=[c.id for c in CLIENT_CASES])
def test_client_reads_sglang_answers(case: Case, run_async: Any) -> None:
    async def body() -> None:
        seen: list[tuple[str, str, Any]] = []
        async with serving(replay_app(case, seen)) as url, EngineClient(url, retries=0) as c:
            await run_client_call(c, case, CLIENT_PLACES)
        if (case.client or {}).get("call") not in ("detect", "detect_error"):
            check_sent(case, seen, CLIENT_PLACES)

    run_async(body(), timeout_s=30)


def test_every_case_names_its_source_and_release() -> None:
    assert {c.version for c in CASES} >= {"0.5.4", "0.5.23"}
    for c in CASES:
        assert "::" in c.source or ":" in c.source, c.id
        assert c.engine or c.client is not None, f"{c.id} checks nothing"
