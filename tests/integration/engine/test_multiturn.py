"""A multi-turn episode against a real engine: masks, observations and logprob fidelity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import AutoModelForCausalLM

from services.common.engine_client import EngineClient
from services.common.tiny_model import build_tokenizer
from services.rollout.envs.base import Problem, Turn
from services.rollout.envs.multiturn import rollout_multi_turn

TOK = build_tokenizer()


@dataclass
class EchoEnv:
    """Answers every turn with a fixed observation; done after `max_turns` turns."""

    name: str = "echo"
    multi_turn: ClassVar[bool] = True
    verifier: str = "services.common.tasks.rewards:exact_match"
    max_turns: int = 3
    stop: tuple[str, ...] = ()

    def problem(self, index: int) -> Problem:
        return Problem(prompt="1+2=", answer="3")

    def verifier_args(self, completion: str, problem: Problem) -> tuple[Any, ...]:
        return (completion, problem.answer)

    def initial_state(self, problem: Problem) -> int:
        return 0

    def step(self, state: int, turn_text: str) -> Turn:
        return Turn(state + 1, "<obs>", state + 1 >= self.max_turns)


def test_multi_turn_masks_and_logprobs(run_async: Any, engine: Any) -> None:
    env = EchoEnv()
    prompt = TOK.encode("1+2=")
    obs = TOK.encode("<obs>")

    async def body() -> Any:
        async with EngineClient(engine.url) as c:
            return await rollout_multi_turn(
                env, c, TOK.encode, env.problem(0), prompt,
                {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.8},
                max_response_tokens=100, rid="mt",
            )  # fmt: skip

    traj = run_async(body())
    assert traj.turns == 3 and traj.finish_type == "length"
    # 6 policy tokens, 5 observation tokens, 6, 5, 6 (no observation after the last turn).
    assert traj.loss_mask == [1] * 6 + [0] * 5 + [1] * 6 + [0] * 5 + [1] * 6
    assert traj.response_ids[6:11] == obs and traj.response_ids[17:22] == obs
    assert traj.text.count("<obs>") == 2 and len(traj.weight_versions) == 3

    model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + traj.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0] / 0.8, -1)[len(prompt) - 1 : -1]
    expected = logp.gather(-1, torch.tensor(traj.response_ids)[:, None]).squeeze(-1)
    policy = torch.tensor(traj.loss_mask, dtype=torch.bool)
    got = torch.tensor(traj.logprobs)
    assert torch.allclose(got[policy], expected[policy], atol=1e-4, rtol=0)
    assert (got[~policy] == 0).all()
