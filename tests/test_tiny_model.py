"""The shipped tiny model: loads with HF, generates well-formed answers, maps onto torchtitan,
and its base accuracy is the one its model card states."""

import json
import os
from pathlib import Path

import pytest
import torch

from forgelab.data import format_prompt
from forgelab.controller.evaluate import greedy_accuracy_hf, greedy_generate_hf
from forgelab.recipes.tiny_model import DEFAULT_OUT, IGNORE, encode_sft
from forgelab.data.tasks import TASKS, Problem, get_task
from forgelab.data.tokenizer import END, build_tokenizer
from numerics import check, max_abs, max_abs_diff, model_tol

MODEL_DIR = Path(DEFAULT_OUT)
ACCURACY_TOLERANCE = 0.02  # card numbers are reproduced exactly on the machine that made them


@pytest.fixture(scope="module")
def card():
    return json.loads((MODEL_DIR / "model_card.json").read_text())


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(MODEL_DIR)


def test_checkpoint_files_and_config(card):
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "README.md", "model_card.json"):
        assert (MODEL_DIR / name).is_file(), name
    assert os.path.getsize(MODEL_DIR / "model.safetensors") <= 20 * 2**20
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (256, 4, 4, 2, 768)
    readme = (MODEL_DIR / "README.md").read_text()
    assert f"{card['n_params']:,}" in readme and card["command"] in readme


def test_eos_is_the_end_of_turn_token(hf):
    model, tok = hf
    end_id = tok.convert_tokens_to_ids(END)
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert tok.eos_token_id == end_id == model.config.eos_token_id
    assert gen["eos_token_id"] == end_id


def test_loads_and_generates_well_formed_answers(hf, card):
    model, tok = hf
    assert sum(p.numel() for p in model.parameters()) == card["n_params"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    problems = [p for t in TASKS.values() for p in t.make("test", 32, 0)]
    prompts = [format_prompt(tok, p.prompt) for p in problems]
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**batch, do_sample=False, max_new_tokens=8)
    new = out[:, batch["input_ids"].shape[1]:]
    end_id = tok.convert_tokens_to_ids(END)
    ended = [(row == end_id).any().item() for row in new]
    assert sum(ended) >= 0.95 * len(ended)  # stops at the end token nearly always
    texts = tok.batch_decode(new, skip_special_tokens=True)
    well_formed = [get_task(p.task).extract_answer(t) is not None for p, t in zip(problems, texts)]
    assert sum(well_formed) >= 0.95 * len(problems)


def test_sft_labels_cover_only_the_answer_and_end_token():
    tok = build_tokenizer()
    p = Problem(prompt="12+345=", target="357", task="addition", info={})
    ids, labels = encode_sft(tok, [p, Problem(prompt="1+2=", target="3", task="addition", info={})])
    supervised = labels[0][labels[0] != IGNORE].tolist()
    assert tok.decode(supervised) == "357" + END
    prompt_len = len(tok.encode(format_prompt(tok, p.prompt), add_special_tokens=False))
    assert (labels[0, :prompt_len] == IGNORE).all()
    assert (labels[1][labels[1] != IGNORE]).tolist() == tok.encode("3" + END, add_special_tokens=False)


def test_base_accuracy_matches_model_card(hf, card):
    model, tok = hf
    ev = card["eval"]
    assert ev["function"] == "forgelab.controller.evaluate.greedy_accuracy_hf"
    for name, expected in ev["accuracy"].items():
        problems = get_task(name).make("test", ev["n_per_task"], ev["seed"])
        acc = greedy_accuracy_hf(model, tok, problems, max_new_tokens=ev["max_new_tokens"])
        assert abs(acc - expected) <= ACCURACY_TOLERANCE, (name, acc, expected)
    # the model is deliberately weak but not useless: room for RL on both tasks
    assert 0.15 <= ev["accuracy"]["addition"] <= 0.5
    assert 0.02 <= ev["accuracy"]["multistep"] < ev["accuracy"]["addition"]


def test_greedy_accuracy_hf_loads_from_a_directory(hf):
    model, tok = hf
    problems = get_task("addition").make("test", 16, 1)
    assert greedy_accuracy_hf(str(MODEL_DIR), None, problems) == greedy_accuracy_hf(model, tok, problems)
    outs = greedy_generate_hf(model, tok, [format_prompt(tok, p.prompt) for p in problems])
    expected = sum(o.strip() == p.target for o, p in zip(outs, problems)) / len(problems)
    assert greedy_accuracy_hf(model, tok, problems) == expected


@pytest.mark.numerics
def test_torchtitan_llama3_adapter_maps_every_key_and_matches_logits(hf):
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    from forgelab.engines.titan import titan_llama3_config_from_hf

    model, tok = hf
    config = json.loads((MODEL_DIR / "config.json").read_text())
    titan_cfg = titan_llama3_config_from_hf(config)
    with torch.device("meta"):
        titan = titan_cfg.build()
    titan.to_empty(device="cpu")
    with torch.no_grad():
        titan.init_weights(buffer_device=torch.device("cpu"))
    hf_sd = {k: v.clone() for k, v in model.state_dict().items()}
    titan_sd = Llama3StateDictAdapter(titan_cfg, str(MODEL_DIR)).from_hf(hf_sd)
    expected = titan.state_dict()
    assert set(titan_sd) == set(expected)
    assert len(titan_sd) == len(hf_sd)  # every HF key maps to exactly one titan key
    for k, v in titan_sd.items():
        assert v.shape == expected[k].shape, k
    titan.load_state_dict(titan_sd, strict=True)
    titan.eval()
    prompts = [format_prompt(tok, p.prompt) + p.target for p in get_task("addition").make("test", 4, 0)]
    ids = [tok.encode(s, add_special_tokens=False) for s in prompts]
    T = min(map(len, ids))
    tokens_B_T = torch.tensor([row[:T] for row in ids])
    with torch.no_grad():
        ref = model(input_ids=tokens_B_T).logits
        got = titan(tokens_B_T)
    assert got.shape == ref.shape
    # two float32 forwards of the same weights: the model's forward bound at the logits' scale (numerics.py)
    check(max_abs_diff(got, ref), model_tol(config, max_abs(ref)), "titan vs HF logits")
