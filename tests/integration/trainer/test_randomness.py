"""The trainer's randomness is its own: Clip-Cov steps beside evaluations, and resumed.

A `clip_cov` step drops a random share of its tokens; the draw comes from the
trainer's generator (services/trainer/randomness.py), never torch's default
one, which the held-out evaluation's thread used to reseed
(`torch.manual_seed` in services/tasks/evaluate.py) at a moment that
depended on timing. Real tiny model, real steps, real `generate`; every
comparison is bit for bit.
"""

import threading

import torch

from services.tasks.evaluate import generate, load_model
from services.trainer.settings import LossConfig, ModelConfig, OptimConfig, TrainConfig
from services.trainer.state import latest_checkpoint, load_checkpoint, snapshot
from services.trainer.step import save_version
from services.trainer.trainer import Trainer
from tests.integration.trainer.trainer_helpers import random_batch


def config(seed: int = 3) -> TrainConfig:
    # every loss token a candidate, 30% of them dropped: which ones is the random part
    loss = LossConfig(covariance="clip_cov", clip_cov_band=(-1e9, 1e9), clip_cov_fraction=0.3)
    model = ModelConfig(micro_batch_tokens=100_000, seed=seed)
    return TrainConfig(loss=loss, optim=OptimConfig(lr=1e-2), model=model)


def train(t: Trainer, steps: int, first: int = 0) -> list[dict[str, float]]:
    return [t.train_step(random_batch(seed=40 + i)) for i in range(first, first + steps)]


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def outcome(rows: list[dict[str, float]]) -> list[tuple[float, float, float]]:
    """What a step's draw decides: its share dropped, its loss, its gradient."""
    return [(r["clip_cov_frac"], r["loss"], r["grad_norm"]) for r in rows]


def test_clip_cov_steps_follow_the_trainer_seed_alone(tiny_model_dir):
    a, b = Trainer.from_pretrained(tiny_model_dir, config()), None
    rows_a = train(a, 3)
    assert all(0 < r["clip_cov_frac"] < 1 for r in rows_a), rows_a  # it drops, not all
    torch.manual_seed(1234)  # the process's generator elsewhere: no bearing on the steps
    b = Trainer.from_pretrained(tiny_model_dir, config())
    torch.manual_seed(99)
    assert outcome(train(b, 3)) == outcome(rows_a) and same(weights(a), weights(b))
    # another seed, other tokens dropped: the draw matters, so the equalities above say something
    c = Trainer.from_pretrained(tiny_model_dir, config(seed=4))
    rows_c = train(c, 3)
    assert outcome(rows_c) != outcome(rows_a) and not same(weights(a), weights(c))


def test_an_evaluation_beside_the_steps_does_not_move_their_draws(tiny_model_dir):
    alone = Trainer.from_pretrained(tiny_model_dir, config())
    want = outcome(train(alone, 3))
    model, tok = load_model(tiny_model_dir)
    prompts = [tok.encode("12+3="), tok.encode("4+4=")]

    def evaluate(seed: int) -> list[list[tuple[str, int]]]:
        return generate(model, tok, prompts, max_new_tokens=6, k=3, temperature=1.0, seed=seed)

    # the evaluation's sampling leaves torch's default generator where it was
    torch.manual_seed(5)
    before = torch.get_rng_state()
    sampled = evaluate(seed=11)
    assert torch.equal(torch.get_rng_state(), before)
    assert evaluate(seed=11) == sampled  # its own generator: the same seed, the same samples
    assert len({text for row in sampled for text, _ in row}) > 1  # it samples, not greedy

    beside = Trainer.from_pretrained(tiny_model_dir, config())
    stop = threading.Event()
    evaluations = 0

    def evaluating() -> None:  # what the trainer's evaluation thread does, and worse
        nonlocal evaluations
        while not stop.is_set():
            evaluate(seed=evaluations)
            torch.manual_seed(evaluations)  # anything else on another thread, at any moment
            torch.rand(8)
            evaluations += 1

    thread = threading.Thread(target=evaluating, daemon=True)
    thread.start()
    try:
        rows = []
        for i in range(3):
            evaluate(seed=100 + i)  # and between the steps, on the trainer's own thread
            rows += train(beside, 1, first=i)
    finally:
        stop.set()
        thread.join(60)
    assert evaluations > 0
    assert outcome(rows) == want
    assert same(weights(beside), weights(alone))


def test_a_resumed_trainer_draws_on_from_its_checkpoint(tiny_model_dir, tmp_path):
    live = Trainer.from_pretrained(tiny_model_dir, config())
    train(live, 2)
    live.weight_version = live.step
    save_version(live, tmp_path / "w" / "v2", tmp_path / "ckpt", {"seq": 2}, snapshot(live))
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None

    fresh = Trainer.from_pretrained(tiny_model_dir, config())
    # two steps drew from the live generator: a restart that kept its fresh one would differ
    assert not torch.equal(fresh.generator.get_state(), live.generator.get_state())
    torch.manual_seed(4321)
    load_checkpoint(fresh, ckpt)
    assert torch.equal(fresh.generator.get_state(), live.generator.get_state())
    assert outcome(train(fresh, 2, first=2)) == outcome(train(live, 2, first=2))
    assert same(weights(fresh), weights(live))
