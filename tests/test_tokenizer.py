"""Character tokenizer: one token per character, exact round trips, chat template."""

import json

import pytest
from transformers import AutoTokenizer

from forgelab.data import format_prompt
from forgelab.data.tasks import TASKS
from forgelab.data.tokenizer import CHARS, END, SPECIAL_TOKENS, build_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def saved_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_tokenizer(), str(d))
    return d, AutoTokenizer.from_pretrained(str(d))


def _task_texts():
    problems = [p for t in TASKS.values() for s in ("train", "test") for p in t.make(s, 500, 0)]
    return [p.prompt for p in problems] + [p.target for p in problems]


def test_every_task_character_round_trips_as_one_token(tok):
    texts = _task_texts()
    chars = set("".join(texts))
    for c in sorted(chars):
        ids = tok.encode(c, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, repr(c)
        assert tok.decode(ids) == c
    for s in texts:
        ids = tok.encode(s, add_special_tokens=False)
        assert len(ids) == len(s)
        assert tok.decode(ids) == s


@pytest.mark.parametrize(
    "s", ["", " ", "a b", "  leading and trailing  ", "x\ny\n\n", "tabs\tare unk", "a . b , c ! ?"]
)
def test_round_trip_with_spaces_and_newlines(tok, s):
    ids = tok.encode(s, add_special_tokens=False)
    if "\t" in s:  # outside the vocabulary: one <|unk|> per character
        assert tok.unk_token_id in ids and len(ids) == len(s)
        return
    assert tok.convert_ids_to_tokens(ids) == list(s)
    assert tok.decode(ids) == s


def test_all_vocabulary_characters_round_trip(tok):
    s = "".join(CHARS)
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS)


def test_chat_template_multi_turn(tok):
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "12+345="},
        {"role": "assistant", "content": "call add(12, 345)"},
        {"role": "tool", "content": "357\n"},
        {"role": "assistant", "content": "357"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|bos|><|system|>Answer with a number.<|end|><|user|>12+345=<|end|>"
        "<|assistant|>call add(12, 345)<|end|><|tool|>357\n<|end|><|assistant|>357<|end|>"
    )
    with_prompt = tok.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True)
    assert with_prompt.endswith("<|tool|>357\n<|end|><|assistant|>")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids(END)) == 5
    assert tok.decode(ids, skip_special_tokens=True) == "".join(m["content"] for m in messages)


def test_chat_template_rejects_unknown_role(tok):
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_format_prompt(tok):
    assert format_prompt(tok, "2+2=") == "<|bos|><|user|>2+2=<|end|><|assistant|>"


def test_saved_tokenizer_loads_with_autotokenizer(saved_tok):
    d, loaded = saved_tok
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert loaded.eos_token == END and loaded.pad_token == "<|pad|>"
    s = "<|bos|><|user|>(7+5)*3=<|end|><|assistant|>36<|end|>"
    ids = loaded.encode(s, add_special_tokens=False)
    assert ids == build_tokenizer().encode(s, add_special_tokens=False)
    assert loaded.decode(ids) == s
    assert loaded.decode(loaded.encode("a . b\n c", add_special_tokens=False)) == "a . b\n c"
