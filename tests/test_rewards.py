"""Built-in rewards, the composer's failure rule and live weights, and candidate validation."""

import doctest
import math

import pytest

import forgelab.rewards as rewards_module
from forgelab.rewards import (
    REWARDS,
    RewardComposer,
    RewardFailure,
    WeightedReward,
    answer_format,
    exact_answer,
    validate,
)
from forgelab.types import Episode


def test_doctests_pass():
    result = doctest.testmod(rewards_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 5 and result.failed == 0


@pytest.mark.parametrize(
    "completion,target,want",
    [("357", "357", 1.0), (" 357\n", "357", 1.0), ("357", " 357 ", 1.0), ("-12", "-12", 1.0),
     ("358", "357", 0.0), ("357.", "357", 0.0), ("3 57", "357", 0.0), ("", "357", 0.0),
     ("The answer is 357", "357", 0.0), ("0357", "357", 0.0)],
)
def test_exact_answer(completion, target, want):
    assert exact_answer("Compute 12+345", completion, target) == want


@pytest.mark.parametrize(
    "completion,want", [("357", 1.0), ("  -4\n", 1.0), ("-", 0.0), ("4.0", 0.0), ("4 apples", 0.0), ("", 0.0), ("--4", 0.0)]
)
def test_answer_format_integer(completion, want):
    assert answer_format("p", completion, "t") == want


def test_answer_format_pattern_via_info_through_composer():
    c = RewardComposer({"format": (answer_format, 1.0)})
    assert c.score("p", " C ", "C", answer_pattern=r"[A-D]").total == 1.0
    assert c.score("p", "E", "C", answer_pattern=r"[A-D]").total == 0.0
    assert c.score("p", "C", "C").total == 0.0  # default pattern is an integer


def test_registry():
    assert REWARDS["exact_answer"] is exact_answer and REWARDS["answer_format"] is answer_format
    assert WeightedReward is RewardComposer


def test_score_is_weighted_sum_of_unweighted_parts():
    c = RewardComposer()
    c.add("correct", exact_answer, 2.0)
    c.add("format", answer_format, -0.25)
    c.add("length", lambda p, comp, t, **i: len(comp) / 10, 0.5)
    r = c.score("p", "35", "357")
    assert r.parts == {"correct": 0.0, "format": 1.0, "length": 0.2}
    assert r.total == pytest.approx(2.0 * 0.0 - 0.25 * 1.0 + 0.5 * 0.2)
    assert not r.failed and r.drop_reason is None and r.errors == []


def _boom(prompt, completion, target, **info):
    raise ZeroDivisionError("division by zero in my reward")


@pytest.mark.parametrize(
    "bad_fn,expected_text",
    [
        (_boom, "ZeroDivisionError: division by zero in my reward"),
        (lambda p, c, t, **i: float("nan"), "returned nan"),
        (lambda p, c, t, **i: float("-inf"), "returned -inf"),
        (lambda p, c, t, **i: None, "returned None"),
        (lambda p, c, t, **i: "1.0", "returned '1.0' of type str"),
        (lambda p, c, t, **i: True, "of type bool"),
        (lambda p, c: 1.0, "TypeError"),  # wrong signature
    ],
)
def test_failure_rule_marks_episode_failed_and_never_scores_zero(bad_fn, expected_text):
    c = RewardComposer({"correct": (exact_answer, 1.0), "bad": (bad_fn, 0.5)})
    r = c.score("Compute 2+2", "4", "4", extra=1)
    assert r.failed
    assert r.drop_reason == "reward_error:bad"
    assert "bad" not in r.parts and r.parts == {"correct": 1.0}
    assert math.isfinite(r.total) and r.total == 1.0  # NaN-free, from the parts that succeeded
    [failure] = r.errors
    assert isinstance(failure, RewardFailure)
    assert (failure.name, failure.prompt, failure.completion, failure.target) == ("bad", "Compute 2+2", "4", "4")
    assert expected_text in failure.error_text


def test_traceback_summary_names_the_raising_line():
    r = RewardComposer({"boom": (_boom, 1.0)}).score("p", "c", "t")
    assert "_boom" in r.errors[0].error_text and "Traceback" in r.errors[0].error_text


def test_zero_weight_reward_is_still_evaluated_and_still_fails_the_episode():
    c = RewardComposer({"correct": (exact_answer, 1.0), "watch": (answer_format, 0.0), "bad": (_boom, 0.0)})
    r = c.score("p", "4", "4")
    assert r.parts == {"correct": 1.0, "watch": 1.0}
    assert r.failed and r.drop_reason == "reward_error:bad"


def test_set_weights_validates_names_and_values_atomically():
    c = RewardComposer({"correct": (exact_answer, 1.0), "format": (answer_format, 0.5)})
    with pytest.raises(KeyError) as info:
        c.set_weights({"format": 0.1, "corect": 2.0})
    assert "corect" in str(info.value) and "correct" in str(info.value) and "format" in str(info.value)
    for bad in (float("nan"), float("inf"), "1", None, True):
        with pytest.raises(ValueError, match="format"):
            c.set_weights({"correct": 3.0, "format": bad})
    assert c.weights == {"correct": 1.0, "format": 0.5}  # nothing changed by the failed calls
    c.set_weights({"format": -2})
    assert c.weights == {"correct": 1.0, "format": -2.0}
    assert c.score("p", "4", "4").total == 1.0 - 2.0


def test_add_remove_replace():
    c = RewardComposer()
    c.add("r", exact_answer)
    with pytest.raises(KeyError, match="replace=True"):
        c.add("r", answer_format)
    c.add("r", answer_format, 3.0, replace=True)
    assert c.score("p", "x", "x").total == 0.0  # answer_format: "x" is not an integer
    with pytest.raises(TypeError):
        c.add("s", "not callable")
    c.remove("r")
    assert c.names == [] and c.score("p", "4", "4").total == 0.0
    with pytest.raises(KeyError, match="unknown reward 'r'"):
        c.remove("r")


def test_weight_swap_during_score_does_not_affect_the_episode_being_scored():
    c = RewardComposer()

    def swapping(prompt, completion, target, **info):
        c.set_weights({"a": 100.0, "b": 100.0})  # simulates a concurrent change mid-score
        return 1.0

    c.add("a", swapping, 1.0)
    c.add("b", lambda p, comp, t, **i: 1.0, 2.0)
    assert c.score("p", "c", "t").total == 3.0
    assert c.score("p", "c", "t").total == 200.0


def test_call_raises_on_failure_for_use_as_a_plain_reward():
    c = RewardComposer({"bad": (_boom, 1.0)})
    with pytest.raises(ValueError, match="reward_error:bad"):
        c("p", "c", "t")
    assert RewardComposer({"ok": (exact_answer, 2.0)})("p", "1", "1") == 2.0


def test_validate_reports_without_changing_anything():
    c = RewardComposer({"correct": (exact_answer, 1.0)})
    calls = []

    def candidate(prompt, completion, target, **info):
        calls.append(info)
        return 1.0 / int(completion)

    samples = [
        ("p", "2", "2", {"k": 1}),
        ("p", "0", "0", None),
        Episode(id=0, group_id=0, prompt_ids=[1], completion_ids=[2], generator_logprobs=[0.0], policy_version=0,
                prompt="p", completion="4", target="4", info={"k": 2}),
        ("p", "5", "5"),
    ]
    report = validate(candidate, samples, name="inverse")
    assert report.n_samples == 4 and report.values == [0.5, 0.25, 0.2] and not report.ok
    [failure] = report.failures
    assert failure.name == "inverse" and failure.completion == "0" and "ZeroDivisionError" in failure.error_text
    assert calls == [{"k": 1}, {}, {"k": 2}, {}]
    assert "3/4 samples ok" in str(report) and "'0'" in str(report)
    assert c.names == ["correct"] and c.weights == {"correct": 1.0}


def test_validate_with_no_samples_is_not_ok():
    report = validate(exact_answer, [])
    assert not report.ok and "no samples" in str(report)
    assert validate(exact_answer, [("p", "1", "1")]).ok
