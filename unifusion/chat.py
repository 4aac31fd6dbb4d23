"""Chat data for supervised fine-tuning: conversations → ``input_ids``, ``prompt_mask``, ``attention_mask``.

A conversation is a list of messages ``{"role": "system" | "user" | "assistant", "content": str}`` (or a mapping
with a ``"messages"`` list, the Hugging Face dataset layout). It is rendered by the tokenizer's own chat template
(``tokenizer.apply_chat_template``) and tokenised without adding special tokens (the template writes them), exactly
as ``apply_chat_template(..., tokenize=True)`` does.

**What is scored.** For every assistant message, the text the template emits for it *after* the generation prompt —
the message's content and the template's end-of-turn text — up to and including the last non-whitespace character
of that turn. With ChatML (SmolLM2-Instruct) the turn ``<|im_start|>assistant\\n{content}<|im_end|>\\n`` scores
``{content}<|im_end|>``: the header ``<|im_start|>assistant\\n`` (what ``add_generation_prompt=True`` appends) and the
newline after ``<|im_end|>`` are prompt. A token is scored when any of its characters lies in a scored span.
Everything else — system prompt (also one the template inserts by default), user turns, assistant headers, the
template's separators — is prompt: ``prompt_mask`` is True there. Padding is neither: ``attention_mask`` is 0 and
``prompt_mask`` False, so the scored positions are exactly ``attention_mask & ~prompt_mask``.

**How the spans are found.** ``method="prefix"`` renders the conversation prefix by prefix: ``P`` = the messages
before assistant turn ``i`` with ``add_generation_prompt=True``, ``Q`` = the messages up to and including it; the
turn's text is ``Q[len(P):]`` (trailing whitespace removed), and every ``Q`` must be a prefix of the whole rendering
(otherwise the template rewrites history, e.g. drops earlier reasoning, and a ``ValueError`` says to use
``"generation"``). ``method="generation"`` uses ``return_assistant_tokens_mask=True``, which needs a template that
marks assistant text with ``{% generation %}`` … ``{% endgeneration %}``; it scores exactly what the template marks.
``"auto"`` (default) takes ``"generation"`` when the template has that tag, else ``"prefix"`` (SmolLM2's has none).
Both need a fast (Rust) tokenizer: the character spans are mapped to tokens with its offsets.

**Padding and truncation** (``packing=False``): one conversation per row, right padding (``tokenizer.pad_token_id``,
else its eos) to the longest row or, with ``max_length``, to exactly ``max_length``, rounded up to a multiple of
``pad_to_multiple_of`` (a block size, say). A conversation longer than ``max_length`` keeps its first ``max_length``
tokens; if no scored token is left, that is a ``ValueError`` naming it (filter by :func:`tokenize_conversation`
lengths beforehand).

**Packing** (``packing=True``, needs ``max_length``): conversations are laid end to end, in the order given, into
rows of ``max_length`` tokens; one that does not fit in the rest of the current row starts a new row (a conversation
is never split across rows), one longer than ``max_length`` is truncated as above and fills a row alone, and each
row is right-padded. ``conversation_ids`` tells which input conversation each position holds (-1 on padding).
Attention: without more, the model sees a packed row as one sequence — its conversations **see each other** and
position ids run on across them. Pass ``conversation_ids`` as the document ids of a block model
(``diffusion_loss(..., document_ids=batch.conversation_ids)``, :meth:`DiffusionLM.forward
<unifusion.hf.DiffusionLM.forward>`): no token then attends to another conversation, each gets its own BOS and
position ids, and a conversation that starts at a block boundary scores exactly as it would alone (one that starts
inside a block has its first token — a template token, so prompt — predicted at the previous one's last position).

Example::

    batch = ChatCollator(tokenizer, max_length=256)(conversations)
    out = uf.diffusion_loss(model, batch.input_ids, kernel, attention_mask=batch.attention_mask,
                            prompt_mask=batch.prompt_mask)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from . import _validation as V

__all__ = ["ROLES", "ChatBatch", "ChatCollator", "tokenize_conversation", "collate_chats", "load_python_docs_chats"]

ROLES = ("system", "user", "assistant")
Method = Literal["auto", "prefix", "generation"]
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_BUNDLED = Path(__file__).parent / "data" / "chat_python_docs.jsonl"


@dataclass(frozen=True)
class ChatBatch:
    """A collated batch; every field is ``(B, L)``.

    Attributes:
        input_ids: int64 token ids (padding: the pad id).
        prompt_mask: bool, True on prompt tokens (seen, never scored); False on scored tokens and on padding.
        attention_mask: int64, 1 on tokens, 0 on padding (right padding only).
        conversation_ids: int64, the index of the input conversation each position belongs to; -1 on padding.
    """

    input_ids: torch.Tensor
    prompt_mask: torch.Tensor
    attention_mask: torch.Tensor
    conversation_ids: torch.Tensor

    def to(self, device: torch.device | str) -> ChatBatch:
        """The same batch on ``device``."""
        return ChatBatch(*(t.to(device) for t in (self.input_ids, self.prompt_mask, self.attention_mask,
                                                   self.conversation_ids)))

    @property
    def loss_mask(self) -> torch.Tensor:
        """``(B, L)`` bool: the scored positions, ``attention_mask & ~prompt_mask``."""
        return self.attention_mask.bool() & ~self.prompt_mask


def _messages(conversation: object, name: str) -> list[dict[str, str]]:
    """The checked message list of one conversation (``name`` is how errors refer to it)."""
    if isinstance(conversation, Mapping):
        if "messages" not in conversation:
            raise ValueError(f"{name}: expected a list of messages or a mapping with a 'messages' list, got a mapping "
                             f"with keys {sorted(conversation)[:8]}")
        conversation = conversation["messages"]
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
        raise TypeError(f"{name}: expected a list of {{'role', 'content'}} messages, got {type(conversation).__name__}")
    if len(conversation) == 0:
        raise ValueError(f"{name}: expected at least one message, got an empty conversation")
    messages = []
    for j, message in enumerate(conversation):
        where = f"{name}[{j}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{where}: expected a mapping with 'role' and 'content', got {type(message).__name__}")
        missing = [key for key in ("role", "content") if key not in message]
        if missing:
            raise ValueError(f"{where}: expected keys 'role' and 'content', missing {missing}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise TypeError(f"{where}: expected 'content' to be a str, got {type(content).__name__}")
        if role == "system" and j > 0:
            raise ValueError(f"{where}: a system message may only come first, got one at position {j}")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{name}: no assistant turn; a chat needs at least one assistant message to be scored")
    if messages[0]["role"] == "assistant" or (messages[0]["role"] == "system" and messages[1:2]
                                              and messages[1]["role"] == "assistant"):
        raise ValueError(f"{name}: the first assistant turn answers nothing; put a user message before it")
    return messages


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return str(text)


def _template_has_generation_tag(tokenizer: Any) -> bool:
    template = tokenizer.get_chat_template() if hasattr(tokenizer, "get_chat_template") else tokenizer.chat_template
    return bool(template) and _GENERATION_TAG.search(template) is not None


def _check_tokenizer(tokenizer: Any) -> None:
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(f"tokenizer: expected a Hugging Face tokenizer, got {type(tokenizer).__name__}")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"tokenizer: expected a fast tokenizer (its offsets locate the assistant spans), got "
                        f"{type(tokenizer).__name__}; load it with use_fast=True")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer: has no chat template (tokenizer.chat_template is empty)")


def _assistant_char_spans(tokenizer: Any, messages: list[dict[str, str]], text: str, name: str
                          ) -> list[tuple[int, int]]:
    """``[(start, end))`` character spans of ``text`` scored for each assistant turn (the prefix method)."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[:i + 1])
        if not through.startswith(before) or not text.startswith(through):
            raise ValueError(f"{name}: the chat template does not render this conversation prefix by prefix (the "
                             f"rendering up to message {i} is not a prefix of the whole); use method='generation' "
                             "with a template that marks assistant text with {% generation %}")
        spans.append((len(before), len(through.rstrip())))
    return spans


def tokenize_conversation(tokenizer: Any, conversation: object, *, method: Method = "auto",
                          name: str = "conversation") -> tuple[list[int], list[bool]]:
    """One conversation's token ids and, per token, whether it is scored (see the module docstring for the rule).

    Args:
        tokenizer: a fast Hugging Face tokenizer with a chat template.
        conversation: a list of ``{"role", "content"}`` messages, or a mapping with a ``"messages"`` list.
        method: ``"prefix"``, ``"generation"`` or ``"auto"``.
        name: how error messages refer to the conversation.

    Returns:
        ``(ids, scored)``, two lists of the same length; ``prompt_mask`` is ``not scored``.

    Raises:
        ValueError: a message without ``role``/``content``, an unknown role, a system message after the first
            position, no assistant turn, an assistant turn before any user message, or a template the method cannot
            read. TypeError: a conversation or content of the wrong type, a slow tokenizer.
    """
    if method not in ("auto", "prefix", "generation"):
        raise ValueError(f"method: expected 'auto', 'prefix' or 'generation', got {method!r}")
    _check_tokenizer(tokenizer)
    messages = _messages(conversation, name)
    if method == "auto":
        method = "generation" if _template_has_generation_tag(tokenizer) else "prefix"
    if method == "generation":
        if not _template_has_generation_tag(tokenizer):
            raise ValueError("method: 'generation' needs a chat template with {% generation %} tags; this one has "
                             "none (use 'prefix')")
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, marks = list(out["input_ids"]), list(out["assistant_masks"])
        if not any(marks):
            raise ValueError(f"{name}: the template's {{% generation %}} blocks mark no token")
        return ids, [bool(m) for m in marks]
    text = _render(tokenizer, messages)
    spans = _assistant_char_spans(tokenizer, messages, text, name)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    scored = []
    for start, end in encoding["offset_mapping"]:
        scored.append(any(end > s and start < e for s, e in spans))
    return ids, scored


def _pad_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError("tokenizer: has neither a pad nor an eos token to pad with")


def _round_up(n: int, multiple: int | None) -> int:
    return n if multiple is None else -(-n // multiple) * multiple


def _positive(name: str, value: object) -> None:
    if value is not None:
        V.check_positive_int(name, value)


def collate_chats(conversations: Sequence[object], tokenizer: Any, *, max_length: int | None = None,
                  packing: bool = False, pad_to_multiple_of: int | None = None, method: Method = "auto"
                  ) -> ChatBatch:
    """Tokenise and collate conversations into a :class:`ChatBatch` (rules in the module docstring).

    Args:
        conversations: a non-empty list of conversations (lists of ``{"role", "content"}`` messages).
        tokenizer: a fast Hugging Face tokenizer with a chat template.
        max_length: row length; required with ``packing``; without packing ``None`` pads to the longest row.
        packing: lay several conversations end to end in each row.
        pad_to_multiple_of: round the row length up to a multiple of this (e.g. the block size); with ``max_length``
            it must divide it.
        method: how the assistant spans are found (``"auto"``, ``"prefix"``, ``"generation"``).

    Raises:
        ValueError: bad arguments, a conversation that :func:`tokenize_conversation` rejects (named by its index),
            or one that keeps no scored token after truncation to ``max_length``.
    """
    _positive("max_length", max_length)
    _positive("pad_to_multiple_of", pad_to_multiple_of)
    if packing and max_length is None:
        raise ValueError("max_length: packing=True needs a row length, got None")
    if max_length is not None and pad_to_multiple_of is not None and max_length % pad_to_multiple_of:
        raise ValueError(f"max_length: expected a multiple of pad_to_multiple_of={pad_to_multiple_of}, got "
                         f"{max_length}")
    if isinstance(conversations, (str, bytes, Mapping)) or not isinstance(conversations, Sequence):
        raise TypeError(f"conversations: expected a list of conversations, got {type(conversations).__name__}")
    if len(conversations) == 0:
        raise ValueError("conversations: expected at least one conversation, got none")
    pieces = []
    for k, conversation in enumerate(conversations):
        name = f"conversations[{k}]"
        ids, scored = tokenize_conversation(tokenizer, conversation, method=method, name=name)
        if max_length is not None and len(ids) > max_length:
            ids, scored = ids[:max_length], scored[:max_length]
            if not any(scored):
                raise ValueError(f"{name}: no assistant token within max_length={max_length} (the prompt alone is "
                                 "longer); drop or shorten this conversation")
        pieces.append((k, ids, scored))
    rows = list(_pack(pieces, max_length)) if packing else [[piece] for piece in pieces]
    width = max_length if max_length is not None else max(len(ids) for _, ids, _ in pieces)
    width = _round_up(width, pad_to_multiple_of)
    B, L = len(rows), width
    input_ids = torch.full((B, L), _pad_id(tokenizer), dtype=torch.long)
    prompt_mask = torch.zeros((B, L), dtype=torch.bool)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    conversation_ids = torch.full((B, L), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        pos = 0
        for k, ids, scored in row:
            n = len(ids)
            input_ids[b, pos:pos + n] = torch.tensor(ids, dtype=torch.long)
            prompt_mask[b, pos:pos + n] = ~torch.tensor(scored, dtype=torch.bool)
            attention_mask[b, pos:pos + n] = 1
            conversation_ids[b, pos:pos + n] = k
            pos += n
    return ChatBatch(input_ids, prompt_mask, attention_mask, conversation_ids)


def _pack(pieces: list[tuple[int, list[int], list[bool]]], max_length: int | None
          ) -> Iterator[list[tuple[int, list[int], list[bool]]]]:
    """Greedy, in order: a piece that does not fit in the current row starts the next one."""
    assert max_length is not None
    row: list[tuple[int, list[int], list[bool]]] = []
    used = 0
    for piece in pieces:
        if row and used + len(piece[1]) > max_length:
            yield row
            row, used = [], 0
        row.append(piece)
        used += len(piece[1])
    if row:
        yield row


@dataclass(frozen=True)
class ChatCollator:
    """:func:`collate_chats` with its options bound: a ``collate_fn`` for a ``torch.utils.data.DataLoader``.

    ``ChatCollator(tokenizer, max_length=256, packing=True)(conversations)`` → :class:`ChatBatch`.
    """

    tokenizer: Any
    max_length: int | None = None
    packing: bool = False
    pad_to_multiple_of: int | None = None
    method: Method = "auto"

    def __post_init__(self) -> None:
        _check_tokenizer(self.tokenizer)
        _positive("max_length", self.max_length)
        _positive("pad_to_multiple_of", self.pad_to_multiple_of)
        if self.packing and self.max_length is None:
            raise ValueError("max_length: packing=True needs a row length, got None")

    def __call__(self, conversations: Sequence[object]) -> ChatBatch:
        return collate_chats(conversations, self.tokenizer, max_length=self.max_length, packing=self.packing,
                             pad_to_multiple_of=self.pad_to_multiple_of, method=self.method)


def load_python_docs_chats(split: Literal["train", "test", "all"] = "train") -> list[list[dict[str, str]]]:
    """The bundled chat set (``unifusion/data/chat_python_docs.jsonl``, built by ``tools/build_chat_data.py`` from
    the Python documentation prose shipped with the package, PSF licence; see ``LICENSE-python-docs.txt``).

    Args:
        split: ``"train"``, ``"test"`` (every 20th conversation, held out) or ``"all"``.

    Returns:
        Conversations as lists of ``{"role", "content"}`` messages, in file order.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"split: expected 'train', 'test' or 'all', got {split!r}")
    chats = []
    with _BUNDLED.open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if split == "all" or record["split"] == split:
                chats.append(record["messages"])
    return chats
