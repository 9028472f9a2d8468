"""Learning is checked by measurement: the mean reward over the last steps must rise clearly
above the first steps, for every seed, on a task where random behaviour scores ~0.1."""
import pytest

from bandit import bandit_run

SEEDS = (0, 1, 2)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_reward_rises_over_seeds(algo):
    gains = []
    for seed in SEEDS:
        curve = bandit_run(algo, seed, steps=40)
        first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
        assert first < 0.25, f"{algo} seed {seed}: the task should start hard ({first:.2f})"
        gains.append(last - first)
    assert min(gains) > 0.3, f"{algo}: reward gains per seed {gains}"
