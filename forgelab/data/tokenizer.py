"""Character-level tokenizer for the tiny model, built with ``tokenizers``.

One token per character: a WordLevel vocabulary over printable ASCII and
``"\\n"``, plus special tokens. The pre-tokenizer ``Split(pattern="",
behavior="isolated")`` cuts text into single characters (spaces and newlines
included) and ``decoders.Fuse()`` joins them back, so
``decode(encode(s)) == s`` for any ASCII-printable text with newlines.

Chat format (the ``chat_template``), for roles system/user/assistant/tool::

    <|bos|><|user|>2+2=<|end|><|assistant|>4<|end|>

``<|end|>`` ends every turn and is the tokenizer's ``eos_token``, so generation
(HF ``generate`` or vLLM) stops at the end of the assistant's turn.
``add_generation_prompt=True`` appends ``<|assistant|>``.

Build and save: ``build_tokenizer().save_pretrained(dir)``.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
USER, ASSISTANT, SYSTEM, TOOL, END = "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, USER, ASSISTANT, SYSTEM, TOOL, END]
ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}

# Printable ASCII without \t \r \x0b \x0c, plus newline: 95 + 1 characters.
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
assert set(CHARS) <= set(string.printable)

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown chat role ' ~ message['role'] ~ '; expected system, user, assistant or tool') -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer: ids 0..8 are the special tokens, then "\\n" and ASCII 32..126."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=END,
        unk_token=UNK,
        additional_special_tokens=[EOS, USER, ASSISTANT, SYSTEM, TOOL],
        chat_template=CHAT_TEMPLATE,
        # The default cleanup would turn "a ." into "a." and break round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        padding_side="left",
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str) -> None:
    """``save_pretrained``, then name the class ``PreTrainedTokenizerFast`` in tokenizer_config.json.

    transformers 5 writes ``TokenizersBackend`` (its new name for the same class);
    older transformers and other loaders know only ``PreTrainedTokenizerFast``.
    """
    import json
    import os

    tokenizer.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def tokenizer_mismatch(student_dir: str, teacher_dir: str) -> str | None:
    """Why two HF model directories do not share a tokenizer (None: they do): the same vocabulary (token ->
    id), the same special tokens and the same chat template. A teacher scoring a student's token ids is only
    meaningful when an id means the same text to both (on-policy distillation)."""
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(student_dir), AutoTokenizer.from_pretrained(teacher_dir)
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only_a = sorted(set(va) - set(vb))[:5]
        only_b = sorted(set(vb) - set(va))[:5]
        moved = sorted(k for k in set(va) & set(vb) if va[k] != vb[k])[:5]
        return (f"vocabularies differ ({len(va)} vs {len(vb)} tokens; only the student's: {only_a}, only the "
                f"teacher's: {only_b}, other ids: {moved})")
    sa, sb = a.special_tokens_map, b.special_tokens_map
    if sa != sb:
        return f"special tokens differ ({sa} vs {sb})"
    if getattr(a, "chat_template", None) != getattr(b, "chat_template", None):
        return "chat templates differ (the prompts the teacher scores would not be the ones it was trained on)"
    return None
