"""A retried request is answered once and never applied twice: the SDK's own request
bodies (its protobuf for forward_backward, its JSON for the rest) posted twice with
the same seq_id, as its retry loop does after a lost response, against the real server."""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest

from tests.integration.tinker.conftest import Server

HEADERS = {"X-API-Key": "tml-flywheel-test"}


class Raw:
    """The SDK's wire, by hand: so a test can send one request twice."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(f"/api/v1/{path}", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def result(self, request_id: str) -> Any:
        from tinker.proto.response_conv import deserialize_forward_backward_output

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            if "protobuf" in r.headers["content-type"]:
                return deserialize_forward_backward_output(r.content)
            body = r.json()
            if body.get("type") != "try_again":
                assert "error" not in body, body
                return body
        raise AssertionError(f"{request_id} still pending after 60 s")

    def session(self) -> str:
        body = {"tags": [], "user_metadata": None, "sdk_version": "test"}
        return str(self.post("create_session", body)["session_id"])

    def create_model(self, session_id: str) -> tuple[str, str]:
        body = {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": self.server.model_name,
            "lora_config": {"rank": 4, "seed": 11},
        }
        future = self.post("create_model", body)
        return future["request_id"], self.result(future["request_id"])["model_id"]

    def forward_backward(self, model_id: str, seq_id: int, forward_only: bool = False) -> str:
        from tinker import types
        from tinker.proto.request_conv import forward_backward_request_to_proto

        tokens = self.server.tokens("the cat sat on the mat")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)},
        )
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=[datum], loss_fn="cross_entropy"
            ),
            model_id=model_id,
            seq_id=seq_id,
        )
        msg = forward_backward_request_to_proto(request)
        msg.forward_only = forward_only
        r = self.http.post(
            "/api/v1/forward_backward",
            content=msg.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert r.status_code == 200, r.text
        return str(r.json()["request_id"])

    def optim_step(self, model_id: str, seq_id: int) -> str:
        body = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 0.01}}
        return str(self.post("optim_step", body)["request_id"])

    def loss(self, model_id: str, seq_id: int) -> float:
        out = self.result(self.forward_backward(model_id, seq_id, forward_only=True))
        return float(out.metrics["loss:sum"])


def test_a_retried_request_is_answered_once_and_applied_once(tinker_server: Server) -> None:
    raw = Raw(tinker_server)
    # Twice the same create_model: one request, one model.
    session = raw.session()
    first, model = raw.create_model(session)
    again, same = raw.create_model(session)
    assert (again, same) == (first, model)
    start = raw.loss(model, 1)
    # forward_backward and optim_step each sent twice (a lost response, the SDK retries).
    fb = raw.forward_backward(model, 2)
    assert raw.forward_backward(model, 2) == fb
    step = raw.optim_step(model, 3)
    assert raw.optim_step(model, 3) == step
    grad_norm = raw.result(step)["metrics"]["grad_norm:mean"]
    retried = raw.loss(model, 4)
    # A twin sends each once and lands where the retried one did: nothing ran twice. A
    # second backward would have doubled the gradient (its norm, which optim_step reports:
    # Adam's first step alone is blind to the gradient's scale), a second step moved on.
    twin_session = raw.session()
    _, twin = raw.create_model(twin_session)
    assert raw.loss(twin, 1) == pytest.approx(start, rel=1e-6)
    raw.forward_backward(twin, 2)
    twin_step = raw.result(raw.optim_step(twin, 3))
    assert twin_step["metrics"]["grad_norm:mean"] == pytest.approx(grad_norm, rel=1e-6)
    assert raw.loss(twin, 4) == pytest.approx(retried, rel=1e-6)
    assert retried < start
    # A retried request that already has its answer gets the same answer.
    assert raw.result(step) == raw.result(step)
