"""Built-in rewards, the composer's failure rule and live weights, and candidate validation."""

import doctest
import math

import pytest

import forgelab.rewards.library as rewards_module
from forgelab.rewards.library import (
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


# --- rewards for real data (forgelab.rewards.math_answers) --------------------------------------

import forgelab.rewards.math_answers as rewards_math_module  # noqa: E402
from forgelab.rewards.math_answers import (  # noqa: E402
    extract_math_answer,
    make_overlong,
    math_answer,
    overlong,
    parse_number,
    think_format,
)


def test_math_doctests_pass():
    result = doctest.testmod(rewards_math_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 10 and result.failed == 0


def test_math_rewards_are_registered():
    assert REWARDS["math_answer"] is math_answer
    assert REWARDS["think_format"] is think_format
    assert REWARDS["overlong"] is overlong


@pytest.mark.parametrize(
    "completion,target,want",
    [
        # the cases: exact_answer gives 0.0 on both
        ("<answer>42</answer>", "42", 1.0),
        ("$1,000", "1000", 1.0),
        # answer tags: case, spaces, first block wins, reasoning around it
        ("<think>6*7</think>\n<answer> 42 </answer>", "42", 1.0),
        ("<ANSWER>42</Answer>", "42", 1.0),
        ("< answer >42</ answer >", "42", 1.0),
        ("<answer>41</answer> <answer>42</answer>", "42", 0.0),
        ("<answer>\\boxed{42}</answer>", "42", 1.0),
        ("<answer></answer>", "42", 0.0),
        # \boxed{}: the last one wins, nested braces
        ("first \\boxed{41}, corrected: \\boxed{42}", "42", 1.0),
        ("\\boxed{42} no wait \\boxed{41}", "42", 0.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("\\boxed{\\text{42}}", "42", 1.0),
        ("\\boxed{42", "42", 0.0),  # unbalanced: no answer
        # $ , % spaces
        ("<answer>$1,234.50</answer>", "1234.5", 1.0),
        ("<answer>12 %</answer>", "12", 1.0),
        ("<answer>1 000 000</answer>", "1000000", 1.0),
        ("<answer>\\$5</answer>", "5", 1.0),
        ("<answer>5.</answer>", "5", 1.0),
        # decimals
        ("<answer>0.50</answer>", ".5", 1.0),
        ("<answer>2.0</answer>", "2", 1.0),
        ("<answer>2.01</answer>", "2", 0.0),
        ("<answer>-3.25</answer>", "-3.25", 1.0),
        # fractions
        ("<answer>3/4</answer>", "0.75", 1.0),
        ("<answer>-1/2</answer>", "-0.5", 1.0),
        ("<answer>\\frac{1}{3}</answer>", "0.3333333333", 1.0),
        ("<answer>\\dfrac{6}{4}</answer>", "3/2", 1.0),
        ("<answer>1/0</answer>", "0", 0.0),
        # scientific
        ("<answer>1.5e3</answer>", "1500", 1.0),
        ("<answer>2.5E-2</answer>", "0.025", 1.0),
        ("<answer>3 \\times 10^{4}</answer>", "30000", 1.0),
        ("<answer>3\\cdot10^5</answer>", "3e5", 1.0),
        # targets: GSM8K solutions, unparsable ones
        ("<answer>72</answer>", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
        ("<answer>1000</answer>", "#### 1,000", 1.0),
        ("<answer>42</answer>", "forty-two", 0.0),
        ("<answer>x</answer>", "x", 0.0),
        ("", "", 0.0),
        # no tags, no box: only a bare number counts
        ("42", "42", 1.0),
        (" -7\n", "-7", 1.0),
        ("The answer is 42", "42", 0.0),
        ("42 apples", "42", 0.0),
    ],
)
def test_math_answer_cases(completion, target, want):
    assert math_answer("p", completion, target) == want
    assert exact_answer("p", completion, target) <= 1.0  # the old reward is unaffected


def test_math_answer_tolerance():
    assert math_answer("", "<answer>3.1416</answer>", "3.14159", tolerance=1e-3) == 1.0
    assert math_answer("", "<answer>3.1416</answer>", "3.14159") == 0.0
    assert math_answer("", "<answer>1000000.5</answer>", "1000000") == 1.0  # relative 5e-7 < 1e-6
    assert math_answer("", "<answer>0.0000001</answer>", "0") == 1.0  # absolute 1e-7 < 1e-6


@pytest.mark.parametrize(
    "completion,target,credit",
    [
        ("I get 18 eggs.", "18", 0.3),  # right number, no tags
        ("<think>so 18</think><answer>17</answer>", "18", 0.3),  # right in the reasoning, wrong in the tags
        ("it is $1,000 total", "1000", 0.3),
        ("<answer>18</answer>", "18", 1.0),  # full credit stays full
        ("<think>17</think><answer>17</answer>", "18", 0.0),  # nowhere right
        ("<answer>18</answer>", "eighteen", 0.0),  # unparsable target: nothing, not even partial
        ("I get 180 eggs.", "18", 0.0),  # a number containing the digits is not the number
    ],
)
def test_math_answer_partial_credit(completion, target, credit):
    assert math_answer("", completion, target, partial_credit=0.3) == credit
    assert math_answer("", completion, target) == (1.0 if credit == 1.0 else 0.0)  # off by default


def test_parse_number_and_extract():
    assert parse_number("1,234,567.89") == pytest.approx(1234567.89)
    assert parse_number("$-5") == parse_number("-$5") == -5.0
    assert parse_number("1e400") is None  # overflow is not a number
    assert parse_number("abc") is None and parse_number("1.2.3") is None and parse_number("--1") is None
    assert extract_math_answer("<answer>a</answer> \\boxed{b}") == "a"  # tags take precedence over a box
    assert extract_math_answer("no answer here") is None


@pytest.mark.parametrize(
    "completion,want",
    [
        ("<think>carry the one</think> 42", 1.0),
        ("<THINK>carry</THINK>42", 1.0),
        ("<Think >\n  carry\n</ think>42", 1.0),
        ("   \n<think>x</think>", 1.0),
        ("<think>\n \n</think> 42", 0.5),  # empty block: tags only
        ("<think>carry the one 42", 0.25),  # unclosed
        ("carry the one</think> 42", 0.25),  # unopened
        ("<think>a</think><think>b</think>", 0.5),  # two blocks are not one
        ("</think>a<think>", 0.5),  # wrong order: both tags, no block
        ("<thinking>a</thinking>", 0.0),
        ("42", 0.0),
    ],
)
def test_think_format_cases(completion, want):
    assert think_format("p", completion, "42") == want


def test_think_format_partial_is_configurable():
    assert think_format("", "<think>x", "", partial=0.1) == 0.1
    assert think_format("", "<think>x</think>", "", partial=0.1) == 1.0


def test_overlong_soft_penalty_matches_dapo():
    # DAPO eq. 13 written out: L_max = 20, L_cache = 5 -> 0 up to 15, linear to -1 at 20, -1 beyond.
    def dapo(length, l_max=20, l_cache=5):
        if length <= l_max - l_cache:
            return 0.0
        if length <= l_max:
            return ((l_max - l_cache) - length) / l_cache
        return -1.0

    for n in range(0, 26):
        assert overlong("", "x" * n, "", max_tokens=20, overlong_cache=5) == pytest.approx(dapo(n)), n
        assert overlong("", "", "", max_tokens=20, overlong_cache=5, completion_tokens=n) == pytest.approx(dapo(n))
    assert overlong("", "x" * 16, "", max_tokens=16) == -1.0  # default cache = max_tokens // 4 = 4
    assert overlong("", "x" * 12, "", max_tokens=16) == 0.0
    assert overlong("", "x" * 14, "", max_tokens=16) == pytest.approx(-0.5)
    r = make_overlong(20, 5)
    assert r("", "x" * 18, "") == pytest.approx(dapo(18)) and r.__name__ == "overlong_20"
    with pytest.raises(ValueError, match="max_tokens"):
        overlong("", "x", "")
    with pytest.raises(ValueError, match="overlong_cache"):
        overlong("", "x", "", max_tokens=4, overlong_cache=9)


def test_math_rewards_compose_and_fail_by_the_rule():
    c = RewardComposer({"correct": (math_answer, 1.0), "format": (think_format, 0.1)})
    r = c.score("q", "<think>6 times 7</think><answer>42</answer>", "#### 42")
    assert r.parts == {"correct": 1.0, "format": 1.0} and r.total == pytest.approx(1.1)
    r = RewardComposer({"len": (overlong, 1.0)}).score("q", "abc", "1")  # no budget: the episode fails, not 0
    assert r.failed and r.drop_reason == "reward_error:len" and "max_tokens" in r.errors[0].error_text
