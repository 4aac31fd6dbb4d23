"""The chat collator: exact prompt/assistant spans (real SmolLM2-Instruct tokenizer and a tiny word-level one),
multi-turn, padding, truncation, packing, both span methods, bad input, and the bundled chat set."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from unifusion.chat import (
    ChatBatch,
    ChatCollator,
    collate_chats,
    load_python_docs_chats,
    tokenize_conversation,
)

ROOT = Path(__file__).resolve().parent.parent
DATA, TOOLS = ROOT / "unifusion" / "data", ROOT / "tools"

CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Tell me more."},
    {"role": "assistant", "content": " Sure.\nTwo lines."},
]
SYSTEM_CHAT = [{"role": "system", "content": "Be brief."}, *CHAT[:2]]

# ChatML as SmolLM2-Instruct writes it, with the assistant text (content + <|im_end|>) in {% generation %} tags.
CHATML_GENERATION = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smol():
    from unifusion.hf import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


TINY_WORDS = ["hello", "world", "hi", "how", "are", "you", "fine", "thanks", "be", "brief", "ok", "more", "yes"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {% if m.role == 'assistant' %}{% generation %}{{ m.content }} <eot>"
    "{% endgeneration %}{% else %}{{ m.content }} <eot>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_tokenizer(template: str = TINY_TEMPLATE):
    """A word-level fast tokenizer: one token per whitespace-separated word, role tags and <eot> special."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *TINY_WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eot>")
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"]})
    tok.chat_template = template
    return tok


def _words(tok, ids):
    return [tok.convert_ids_to_tokens(i) for i in ids]


# ------------------------------------------------------------------------------------------------ spans
def test_smollm2_scores_each_assistant_content_and_its_end_token(smol):
    ids, scored = tokenize_conversation(smol, CHAT)
    assert ids == list(smol.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"])
    # the tokens before each assistant span are exactly the generation prompt the model gets at sampling time
    spans, start = [], None
    for i, s in enumerate([*scored, False]):
        if s and start is None:
            start = i
        elif not s and start is not None:
            spans.append((start, i))
            start = None
    assert len(spans) == 2
    for (a, b), turn in zip(spans, (1, 3)):
        prompt = smol.apply_chat_template(CHAT[:turn], add_generation_prompt=True, tokenize=False)
        assert ids[:a] == smol(prompt, add_special_tokens=False)["input_ids"]
        assert smol.decode(ids[a:b]) == CHAT[turn]["content"] + "<|im_end|>"
        assert ids[b - 1] == smol.eos_token_id and smol.decode(ids[b:b + 1]) == "\n"  # the newline after is prompt


def test_smollm2_default_system_prompt_and_headers_are_prompt(smol):
    ids, scored = tokenize_conversation(smol, CHAT[:2])
    prompt_text = smol.decode([i for i, s in zip(ids, scored) if not s])
    assert prompt_text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert prompt_text.endswith("<|im_start|>assistant\n\n")
    ids_sys, scored_sys = tokenize_conversation(smol, SYSTEM_CHAT)
    assert "Be brief." in smol.decode([i for i, s in zip(ids_sys, scored_sys) if not s])
    assert smol.decode([i for i, s in zip(ids_sys, scored_sys) if s]) == "Hello!<|im_end|>"


def test_generation_tags_and_prefix_rendering_agree(smol):
    tagged = copy.deepcopy(smol)
    tagged.chat_template = CHATML_GENERATION
    for chat in (CHAT, SYSTEM_CHAT):
        ids_p, scored_p = tokenize_conversation(smol, chat, method="prefix")
        ids_g, scored_g = tokenize_conversation(tagged, chat)  # auto → generation
        ids_g2, scored_g2 = tokenize_conversation(tagged, chat, method="prefix")
        assert ids_p == ids_g == ids_g2
        assert scored_p == scored_g == scored_g2
    with pytest.raises(ValueError, match="method"):
        tokenize_conversation(smol, CHAT, method="generation")


def test_tiny_tokenizer_spans_are_exact_for_both_methods():
    tok = tiny_tokenizer()
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "fine thanks"}]
    expected_words = ["<|system|>", "be", "brief", "<eot>", "<|user|>", "hello", "world", "<eot>", "<|assistant|>",
                      "hi", "<eot>", "<|user|>", "how", "are", "you", "<eot>", "<|assistant|>", "fine", "thanks",
                      "<eot>"]
    expected_scored = [w_i in (9, 10, 17, 18, 19) for w_i in range(len(expected_words))]
    for method in ("prefix", "generation", "auto"):
        ids, scored = tokenize_conversation(tok, chat, method=method)
        assert _words(tok, ids) == expected_words, method
        assert scored == expected_scored, method


def test_a_template_that_rewrites_history_is_refused_by_the_prefix_method():
    # drops the content of every assistant turn but the last (as reasoning templates drop earlier thoughts)
    template = ("{% for m in messages %}<|{{ m.role }}|> {% if m.role != 'assistant' or loop.last %}{{ m.content }}"
                " {% endif %}<eot> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    tok = tiny_tokenizer(template)
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "yes"}]
    with pytest.raises(ValueError, match="generation"):
        tokenize_conversation(tok, chat)


# ------------------------------------------------------------------------------------------------ collation
def test_padding_to_the_longest_and_to_max_length():
    tok = tiny_tokenizer()
    long = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "fine thanks"}]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    batch = collate_chats([long, short], tok)
    assert isinstance(batch, ChatBatch)
    assert batch.input_ids.shape == (2, 8) and batch.input_ids.dtype == torch.long
    assert batch.attention_mask.tolist() == [[1] * 8, [1] * 6 + [0] * 2]
    pad = tok.pad_token_id
    assert batch.input_ids[1, 6:].tolist() == [pad, pad]
    # prompt: tags, user words and separators; scored: assistant words + <eot>; padding neither
    assert batch.prompt_mask.tolist() == [[True, True, True, True, True, False, False, False],
                                          [True, True, True, True, False, False, False, False]]
    assert batch.loss_mask.sum(1).tolist() == [3, 2]
    assert batch.conversation_ids.tolist() == [[0] * 8, [1] * 6 + [-1] * 2]
    fixed = collate_chats([long, short], tok, max_length=12)
    assert fixed.input_ids.shape == (2, 12) and torch.equal(fixed.input_ids[:, :8], batch.input_ids)
    rounded = collate_chats([long, short], tok, pad_to_multiple_of=5)
    assert rounded.input_ids.shape == (2, 10)


def test_truncation_keeps_the_start_and_refuses_rows_left_without_an_answer():
    tok = tiny_tokenizer()
    chat = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "fine thanks"}]
    batch = collate_chats([chat], tok, max_length=6)  # <|user|> hello world <eot> <|assistant|> fine
    assert _words(tok, batch.input_ids[0].tolist()) == ["<|user|>", "hello", "world", "<eot>", "<|assistant|>", "fine"]
    assert batch.loss_mask[0].tolist() == [False] * 5 + [True]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError, match=r"conversations\[1\].*max_length=5"):  # its answer starts at token 6
        collate_chats([short, chat], tok, max_length=5)


def test_packing_fills_rows_in_order_without_splitting_a_conversation():
    tok = tiny_tokenizer()
    a = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]  # 6 tokens
    b = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "fine thanks"}]  # 8 tokens
    batch = ChatCollator(tok, max_length=16, packing=True)([a, a, b, a])
    # row 0: a a (12) — b does not fit (20) → row 1: b a (14)
    assert batch.input_ids.shape == (2, 16)
    assert batch.conversation_ids.tolist() == [[0] * 6 + [1] * 6 + [-1] * 4, [2] * 8 + [3] * 6 + [-1] * 2]
    assert batch.attention_mask.sum(1).tolist() == [12, 14]
    single = [collate_chats([c], tok) for c in (a, a, b, a)]
    for k, one in enumerate(single):  # each conversation's slice is its own padded row, masks included
        rows, cols = (batch.conversation_ids == k).nonzero(as_tuple=True)
        assert torch.equal(batch.input_ids[rows, cols], one.input_ids[0])
        assert torch.equal(batch.prompt_mask[rows, cols], one.prompt_mask[0])
    assert batch.loss_mask.sum().item() == sum(s.loss_mask.sum().item() for s in single)


def test_packing_truncates_a_too_long_conversation_into_its_own_row():
    tok = tiny_tokenizer()
    a = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    b = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "fine thanks"}]
    batch = collate_chats([a, b, a], tok, max_length=7, packing=True)
    assert batch.conversation_ids.tolist() == [[0] * 6 + [-1], [1] * 7, [2] * 6 + [-1]]
    with pytest.raises(ValueError, match="max_length"):
        collate_chats([a], tok, packing=True)


def test_smollm2_batch_round_trips_through_decode(smol):
    batch = ChatCollator(smol, max_length=128, pad_to_multiple_of=32)([CHAT, SYSTEM_CHAT])
    assert batch.input_ids.shape == (2, 128)
    scored = [smol.decode(batch.input_ids[1][batch.loss_mask[1]])]
    assert scored == ["Hello!<|im_end|>"]
    assert (batch.input_ids[batch.attention_mask == 0] == smol.pad_token_id).all()
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("chat", "error", "match"), [
    ([{"role": "user", "content": "hi"}], ValueError, r"conversations\[0\]: no assistant turn"),
    ([{"role": "user", "content": "hi"}, {"content": "ok"}], ValueError, r"conversations\[0\]\[1\].*'role'"),
    ([{"role": "user"}, {"role": "assistant", "content": "ok"}], ValueError, r"conversations\[0\]\[0\].*'content'"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "ok"}], ValueError, r"\[0\]\[1\]: unknown role"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], TypeError, r"\[0\]\[1\].*str"),
    ([{"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}], ValueError, "answers nothing"),
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}, {"role": "assistant", "content": "o"}],
     ValueError, "system message may only come first"),
    ([], ValueError, "at least one message"),
    ("hello", TypeError, r"conversations\[0\]: expected a list"),
    ([("user", "hi")], TypeError, r"conversations\[0\]\[0\]: expected a mapping"),
    ({"text": "hi"}, ValueError, "'messages'"),
])
def test_bad_conversations_name_the_argument(chat, error, match):
    with pytest.raises(error, match=match):
        collate_chats([chat], tiny_tokenizer())


def test_bad_arguments_name_the_argument():
    tok = tiny_tokenizer()
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError, match="max_length"):
        collate_chats([chat], tok, max_length=0)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        collate_chats([chat], tok, pad_to_multiple_of=-2)
    with pytest.raises(ValueError, match="max_length: expected a multiple"):
        collate_chats([chat], tok, max_length=10, pad_to_multiple_of=4)
    with pytest.raises(ValueError, match="conversations: expected at least one"):
        collate_chats([], tok)
    with pytest.raises(ValueError, match="method"):
        collate_chats([chat], tok, method="offsets")
    with pytest.raises(TypeError, match="tokenizer"):
        ChatCollator(object())
    no_template = tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        collate_chats([chat], no_template)
    # the Hugging Face dataset layout {"messages": [...]} is accepted as it is
    assert torch.equal(collate_chats([{"messages": chat}], tok).input_ids, collate_chats([chat], tok).input_ids)


# ------------------------------------------------------------------------------------------------ bundled data
def test_bundled_chat_set_is_valid_deterministic_and_licensed(smol):
    spec = importlib.util.spec_from_file_location("build_chat_data", TOOLS / "build_chat_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    path = DATA / "chat_python_docs.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert 200 <= len(lines) <= 1000 and path.stat().st_size < 400_000
    assert "\n".join(json.dumps(r, ensure_ascii=False) for r in script.build()) == "\n".join(lines)
    records = [json.loads(line) for line in lines]
    assert {r["split"] for r in records} == {"train", "test"}
    assert all(r["source"].startswith("python_docs_prose.txt:") for r in records)
    assert "chat_python_docs.jsonl" in (DATA / "LICENSE-python-docs.txt").read_text(encoding="utf-8")
    train, test = load_python_docs_chats("train"), load_python_docs_chats("test")
    assert len(train) + len(test) == len(records) == len(load_python_docs_chats("all")) and len(test) >= 10
    batch = collate_chats(train[:16], smol)
    assert (batch.loss_mask.sum(1) > 0).all()
    with pytest.raises(ValueError, match="split"):
        load_python_docs_chats("validation")
