"""A `verifiers` environment as its users write one (a module with load_environment),
for tests/unit/tasks/test_verifiers.py: imported only when verifiers is installed."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 6, system_prompt: str = "Add the numbers.") -> vf.Environment:
    rows = [{"question": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(n)]
    parser = vf.Parser()

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def short(completion, **kwargs) -> float:
        return 1.0 if len(parser.parse_answer(completion) or "") <= 4 else 0.0

    rubric = vf.Rubric(funcs=[correct_answer, short], weights=[1.0, 0.5], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows[:2]),
        system_prompt=system_prompt,
        parser=parser,
        rubric=rubric,
    )


def load_tool_environment(n: int = 2) -> vf.Environment:
    """A ToolEnv: its rollout offers the model a calculator."""

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    rows = [{"question": f"What is {a}+{a + 1}?", "answer": str(2 * a + 1)} for a in range(n)]
    rubric = vf.Rubric(funcs=[lambda completion, answer, **kw: float(answer in str(completion))])
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], rubric=rubric, max_turns=2)
