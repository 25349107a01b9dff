"""The run's task in every service's settings: the `[task]` / `[tasks.<name>]` tables.

The runtime's settings loader knows no task (services/runtime/settings.py);
this is where the tasks domain adds its tables to a service's settings.
Every service's settings derive from `TaskServiceSettings`, so every
service validates the same spec at start-up; the ones that cannot run
without a task (`needs_task`) refuse to start without one.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from services.runtime.errors import ConfigError
from services.runtime.settings import ServiceSettings
from services.tasks.judge import JudgeSettings
from services.tasks.spec import TaskSpec
from services.tasks.taskset import TaskSet


class TaskServiceSettings(ServiceSettings):
    """A service's settings with the run's task spec. Subclass per service, as ServiceSettings."""

    needs_task: ClassVar[bool] = False  # the service cannot run without a task spec
    shared_tables: ClassVar[frozenset[str]] = ServiceSettings.shared_tables | {
        "task",
        "tasks",
        "judge",
    }
    own_tables: ClassVar[dict[str, bool]] = {"task": False, "tasks": True, "judge": False}

    task: TaskSpec | None = Field(
        None,
        description="The run's task ([task] table: source, reward, prompt format, eval); "
        "every service validates the same spec (services/tasks/spec.py).",
    )
    tasks: dict[str, TaskSpec] = Field(
        default_factory=dict,
        description="A mixture instead of [task]: [tasks.<name>] tables, mixed by weight.",
    )
    judge: JudgeSettings = Field(
        default_factory=JudgeSettings,
        description="The LLM judge's engines, for reward parts of type 'judge' ([judge] "
        "table: urls, concurrency, timeout_s, retries, cache; `flywheel up`: engines, model).",
    )

    @model_validator(mode="after")
    def _has_task(self) -> TaskServiceSettings:
        if self.needs_task:
            self.task_set()  # a ConfigError (a ValueError) names what is missing
        return self

    def task_set(self) -> TaskSet:
        """The run's tasks by name; ConfigError when the run file names none (or both forms)."""
        return TaskSet.from_fields(self.task, self.tasks)

    def judged(self) -> bool:
        """Whether any task has a reward part an LLM judge scores."""
        if self.task is None and not self.tasks:
            return False
        return any(p.external for s in self.task_set().specs.values() for p in s.reward)

    def judge_urls(self) -> tuple[str, ...]:
        """The judge engines' URLs; ConfigError when a task needs a judge and none is given."""
        if not self.judge.urls:
            raise ConfigError(
                "[judge] urls: a task has a reward of type 'judge' but no judge engine is "
                "given (flywheel up sets them from [judge] engines; else list the engines' "
                "base URLs)"
            )
        return self.judge.urls
