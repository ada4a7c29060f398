"""Toy tasks: determinism, disjoint splits, rewards against an independent check."""

import re

import pytest

from forgelab.data.tasks import TASKS, Problem, Task, get_task, safe_eval_int, split_of


def _independent_answer(p: Problem) -> int:
    """The true answer, recomputed from the prompt text without forgelab's evaluator."""
    expr = p.prompt.removesuffix("=")
    assert re.fullmatch(r"[0-9+\-*()]+", expr), expr  # only digits, + - * and brackets
    return eval(expr, {"__builtins__": {}}, {})  # safe: the regex admits no names


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_from_seed(name):
    task = get_task(name)
    assert task.make("train", 300, seed=3) == task.make("train", 300, seed=3)
    assert task.make("test", 100, seed=3) == task.make("test", 100, seed=3)
    assert task.make("train", 300, seed=3) != task.make("train", 300, seed=4)
    # a prefix of a longer draw is the shorter draw
    assert task.make("test", 200, seed=3)[:100] == task.make("test", 100, seed=3)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_test_are_disjoint(name):
    task = get_task(name)
    train = {p.prompt for seed in (0, 1) for p in task.make("train", 3000, seed)}
    test = {p.prompt for seed in (0, 1) for p in task.make("test", 500, seed)}
    assert not train & test
    assert all(split_of(name, p.removesuffix("=")) == "test" for p in test)
    assert len(test) > 500  # different seeds give (mostly) different test problems
    problems = task.make("test", 500, 0)
    assert len({p.prompt for p in problems}) == 500  # distinct within a split


@pytest.mark.parametrize("name", sorted(TASKS))
def test_targets_and_rewards_match_an_independent_check(name):
    task = get_task(name)
    for p in task.make("train", 300, 0) + task.make("test", 300, 0):
        truth = _independent_answer(p)
        assert p.task == name and p.target == str(truth)
        assert task.reward(p.prompt, str(truth), p.target, **p.info) == 1.0
        assert task.reward(p.prompt, f" {truth}\n", p.target, **p.info) == 1.0
        assert task.reward(p.prompt, str(truth + 1), p.target, **p.info) == 0.0
        assert task.reward(p.prompt, f"{truth} {truth}", p.target, **p.info) == 0.0
        assert task.reward(p.prompt, f"answer: {truth}", p.target, **p.info) == 0.0
        assert task.reward(p.prompt, "", p.target, **p.info) == 0.0


def test_addition_operands_have_1_to_2_digits():
    problems = get_task("addition").make("train", 2000, 0)
    lengths = {len(str(p.info[k])) for p in problems for k in ("a", "b")}
    assert lengths == {1, 2}


def test_extract_answer():
    task = get_task("addition")
    assert task.extract_answer("357") == "357"
    assert task.extract_answer("-12") == "-12"
    assert task.extract_answer("007") == "7"
    assert task.extract_answer("3 57") is None
    assert task.extract_answer("357.") is None
    assert task.extract_answer("") is None


def test_safe_eval_rejects_code():
    assert safe_eval_int("(7+5)*3-4") == 32
    for bad in ("__import__('os')", "2**10", "1/2", "x+1", "[1][0]"):
        with pytest.raises(ValueError):
            safe_eval_int(bad)


def test_unknown_task_error_names_known_tasks():
    with pytest.raises(KeyError) as e:
        get_task("sudoku")
    assert "sudoku" in str(e.value) and "addition" in str(e.value)


def test_bad_split_and_impossible_request():
    with pytest.raises(ValueError, match="split"):
        get_task("addition").make("validation", 1, 0)
    tiny = Task(name="tiny", sample=lambda rng: (str(k := rng.randint(0, 9)), f"{k}=", str(k), {}))
    with pytest.raises(ValueError, match="distinct"):
        tiny.make("train", 100, 0)
