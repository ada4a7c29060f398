"""Rewards for real math data (GSM8K / MATH style): answer tags, ``\\boxed{}``, think tags, overlong shaping.

Plain functions with the reward signature ``fn(prompt, completion, target, **info) -> float``,
registered in ``forgelab.rewards.library.REWARDS`` as ``math_answer``, ``think_format`` and ``overlong``.

``math_answer`` reads the completion's answer from the first ``<answer>...</answer>``
block, else the last ``\\boxed{...}``, else the whole completion when it is a bare
number, and compares it with the target *numerically*: ``$``, ``,``, ``%`` and
spaces are stripped, integers, decimals, fractions (``3/4``, ``\\frac{3}{4}``) and
scientific forms (``1.5e3``, ``1.5 \\times 10^{3}``) are understood. A GSM8K
target (``"... #### 1,000"``) counts by its part after ``####``. A target that is
not a number scores 0 for every completion (it cannot be checked).

    >>> math_answer("p", "<answer>42</answer>", "42"), math_answer("p", "$1,000", "1000")
    (1.0, 1.0)
    >>> math_answer("p", "so x = \\\\boxed{\\\\frac{1}{2}}", "0.5"), math_answer("p", "<answer>41</answer>", "42")
    (1.0, 0.0)
    >>> think_format("p", "<think>add 2 and 2</think> 4", ""), think_format("p", "<THINK>hm", "")
    (1.0, 0.25)
    >>> overlong("p", "x" * 10, "", max_tokens=16, overlong_cache=4), overlong("p", "x" * 14, "", max_tokens=16, overlong_cache=4)
    (0.0, -0.5)
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = [
    "parse_number",
    "extract_math_answer",
    "target_value",
    "math_answer",
    "think_format",
    "overlong",
    "make_overlong",
]

_ANSWER_RE = re.compile(r"<\s*answer\s*>(.*?)<\s*/\s*answer\s*>", re.IGNORECASE | re.DOTALL)
_THINK_OPEN_RE = re.compile(r"<\s*think\s*>", re.IGNORECASE)
_THINK_CLOSE_RE = re.compile(r"<\s*/\s*think\s*>", re.IGNORECASE)
_THINK_BLOCK_RE = re.compile(r"<\s*think\s*>(.*?)<\s*/\s*think\s*>", re.IGNORECASE | re.DOTALL)
_NUMBER_RE = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?%?|[-+]?\$?\.\d+%?")
_FRAC_RE = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TIMES_TEN_RE = re.compile(r"^(.+?)(?:\\times|\\cdot|\*|x|×)10\^\{?([-+]?\d+)\}?$")
_NUMERIC_RE = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


def parse_number(text: str) -> float | None:
    """The number ``text`` writes, or None if it is not one.

    Strips ``$``, ``,``, ``%``, spaces, ``\\!``, ``\\,``, ``\\$``, ``\\%``, a
    surrounding ``$...$`` or ``\\text{}`` wrapper and one trailing period.
    Fractions parse to their value (``3/4`` -> 0.75).

    >>> [parse_number(s) for s in ["1,234", " $5.50 ", "12%", "-3/4", "\\\\frac{3}{4}", "1.5e3", "2 \\\\times 10^{3}"]]
    [1234.0, 5.5, 12.0, -0.75, 0.75, 1500.0, 2000.0]
    >>> parse_number("twelve"), parse_number(""), parse_number("1/0")
    (None, None, None)
    """
    if text is None:
        return None
    s = str(text).strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right)", "", s)
    for junk in ("\\!", "\\,", "\\;", "\\$", "\\%", "$", ",", "%", " ", "\u00a0"):
        s = s.replace(junk, "")
    s = s.rstrip(".")
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    if not s:
        return None
    sign = 1.0
    if s[0] in "+-" and (_FRAC_RE.match(s[1:]) or "/" in s[1:]):
        sign, s = (-1.0 if s[0] == "-" else 1.0), s[1:]
    m = _FRAC_RE.match(s)
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        return None if num is None or not den else sign * num / den
    if s.count("/") == 1:
        num, den = (parse_number(part) for part in s.split("/"))
        return None if num is None or not den else sign * num / den
    m = _TIMES_TEN_RE.match(s)
    if m:
        mantissa = parse_number(m.group(1))
        return None if mantissa is None else sign * mantissa * 10.0 ** int(m.group(2))
    if not _NUMERIC_RE.match(s):
        return None
    value = sign * float(s)
    return value if math.isfinite(value) else None


def _last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer


def extract_math_answer(completion: str) -> str | None:
    """The answer text of a completion: the first ``<answer>`` block, else the last ``\\boxed{}``,
    else the stripped completion if it is a bare number; None if none of these.

    >>> extract_math_answer("<think>..</think><Answer> 7 </Answer>"), extract_math_answer("\\\\boxed{1} then \\\\boxed{2}")
    ('7', '2')
    >>> extract_math_answer("  42\\n"), extract_math_answer("I think it is 42")
    ('42', None)
    """
    m = _ANSWER_RE.search(completion)
    if m:
        inner = m.group(1)
        boxed = _last_boxed(inner)
        return (boxed if boxed is not None else inner).strip()
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    bare = completion.strip()
    return bare if parse_number(bare) is not None else None


def target_value(target: str) -> float | None:
    """The number a target states: a GSM8K answer counts by its part after ``####``; None if not a number.

    >>> target_value("Natalia sold 48/2 = 24 clips in May.\\n#### 72"), target_value("#### 1,000"), target_value("n/a")
    (72.0, 1000.0, None)
    """
    text = str(target)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return parse_number(text)


def _close(a: float, b: float, tolerance: float) -> bool:
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)


def math_answer(
    prompt: str, completion: str, target: str, *, tolerance: float = 1e-6, partial_credit: float = 0.0, **info
) -> float:
    """1.0 if the completion's answer (``extract_math_answer``) equals the target's number within ``tolerance``
    (relative and absolute), else 0.0; an unparsable target gives 0.0.

    With ``partial_credit > 0``: a completion whose tagged/boxed answer is
    missing or wrong but which writes the target's number somewhere outside
    the answer tags scores ``partial_credit`` (the model knew it but did not
    format it).

    >>> math_answer("", "The total is 18 eggs.", "18"), math_answer("", "The total is 18 eggs.", "18", partial_credit=0.2)
    (0.0, 0.2)
    >>> math_answer("", "<answer>18</answer>", "eighteen")
    0.0
    """
    want = target_value(target)
    if want is None:
        return 0.0
    answer = extract_math_answer(completion)
    got = parse_number(answer) if answer is not None else None
    if got is not None and _close(got, want, tolerance):
        return 1.0
    if partial_credit:
        outside = _ANSWER_RE.sub(" ", completion)
        for m in _NUMBER_RE.finditer(outside):
            value = parse_number(m.group(0))
            if value is not None and _close(value, want, tolerance):
                return float(partial_credit)
    return 0.0


def think_format(prompt: str, completion: str, target: str, *, partial: float = 0.25, **info) -> float:
    """1.0 for exactly one complete ``<think>...</think>`` block with non-empty content, else ``partial``
    for each of the opening and closing tags present (at most ``2 * partial``), else 0.0.

    Tags are case-insensitive and tolerate spaces inside the brackets
    (``< Think >``, ``</ think>``); text around the block is allowed.

    >>> think_format("", "  < Think >\\nstep 1\\n</ THINK >\\n42", ""), think_format("", "<think>  </think> 42", "")
    (1.0, 0.5)
    >>> think_format("", "<think>a</think><think>b</think>", ""), think_format("", "42", "")
    (0.5, 0.0)
    """
    blocks = _THINK_BLOCK_RE.findall(completion)
    opens, closes = len(_THINK_OPEN_RE.findall(completion)), len(_THINK_CLOSE_RE.findall(completion))
    if len(blocks) == 1 and opens == 1 and closes == 1 and blocks[0].strip():
        return 1.0
    return partial * (min(opens, 1) + min(closes, 1))


def overlong(
    prompt: str,
    completion: str,
    target: str,
    *,
    max_tokens: int | None = None,
    overlong_cache: int | None = None,
    completion_tokens: int | None = None,
    **info,
) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - overlong_cache`` tokens, then falling
    linearly to -1 at ``max_tokens``, and -1 beyond.

    ``R = 0`` if ``L <= max_tokens - cache``; ``(max_tokens - cache - L) / cache`` if
    ``max_tokens - cache < L <= max_tokens``; ``-1`` otherwise (Yu et al. 2025, arXiv:2503.14476, eq. 13).
    ``L`` is ``completion_tokens`` when given (e.g. in the episode's ``info``),
    else the completion's length in characters, which equals its token count
    with the shipped character tokenizer. ``max_tokens`` is the generation
    budget (``rollout.max_tokens``); the default cache is a quarter of it.
    Combine with a correctness reward; alone it only teaches brevity.

    >>> [overlong("", "x" * n, "", max_tokens=8, overlong_cache=4) for n in (4, 5, 6, 8, 9)]
    [0.0, -0.25, -0.5, -1.0, -1.0]
    """
    if max_tokens is None:
        raise ValueError(
            "overlong needs max_tokens (the generation budget): add it with "
            "run.add_reward('overlong', make_overlong(max_tokens=..., overlong_cache=...), weight) "
            "or put max_tokens in the problems' info"
        )
    cache = max(1, max_tokens // 4) if overlong_cache is None else overlong_cache
    if not 0 < cache <= max_tokens:
        raise ValueError(f"overlong: overlong_cache must be in 1..max_tokens={max_tokens}, got {cache}")
    length = len(completion) if completion_tokens is None else int(completion_tokens)
    safe = max_tokens - cache
    if length <= safe:
        return 0.0
    if length <= max_tokens:
        return (safe - length) / cache
    return -1.0


def make_overlong(max_tokens: int, overlong_cache: int | None = None):
    """``overlong`` with its budget bound, as a reward function to add to a run.

    >>> r = make_overlong(8, 4); r("", "x" * 7, "")
    -0.75
    """

    def overlong_reward(prompt: str, completion: str, target: str, **info) -> float:
        info.setdefault("max_tokens", max_tokens)
        info.setdefault("overlong_cache", overlong_cache)
        return overlong(prompt, completion, target, **info)

    overlong_reward.__name__ = f"overlong_{max_tokens}"
    return overlong_reward
