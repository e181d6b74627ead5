"""Every transformers-version detail the HF engine depends on, in one place.

Supported: transformers 5.x (tested on 5.24; the pin in pyproject is ``>=5,<6``). The engine
relies on three things that are stable across 5.x:

* ``AttentionInterface.register(name, fn)``: the engine's paged attention is registered
  under ATTENTION_NAME and selected per model with ``set_attn_implementation`` (or the
  config attribute on versions that lack it); no model code is patched;
* forward keyword arguments reach the attention function (``**kwargs`` all the way down),
  which is how the step's AttentionPlan travels;
* a 4D ``attention_mask`` is returned as-is by the mask builders, so passing a tiny 4D
  placeholder skips mask construction (the plan carries the real masks);
* ``logits_to_keep`` accepts a tensor of row indices (4.50+; ``num_logits_to_keep`` before).

Embeddings run the decoder outside the engine's steps, with a DynamicCache between the
chunks of a long input (``decoder_hidden_states``): its keyword is looked up per class.

The engine passes no Cache object (``use_cache=False``): transformers' Cache API changed
kwarg names twice in 4.5x-5.2x (``past_key_value`` -> ``past_key_values`` -> ``cache``) and
none of that matters when K/V never go through it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import transformers
from transformers import AttentionInterface

from kvstream.hf.attention import AttentionPlan, paged_attention

ATTENTION_NAME = "kvstream_paged"

_registered = False


def register_attention() -> None:
    """Register the paged attention function with transformers (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        _registered = True


def use_paged_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the engine's attention function."""
    register_attention()
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(ATTENTION_NAME)
            return
        except (ValueError, KeyError, TypeError):
            pass  # older checks reject unknown names; the config attribute still works
    model.config._attn_implementation = ATTENTION_NAME


@functools.cache
def _logits_kwarg(model_class: type) -> str:
    """Resolved once per model class: inspect.signature is too slow for every step."""
    params = inspect.signature(model_class.forward).parameters
    return "logits_to_keep" if "logits_to_keep" in params else "num_logits_to_keep"


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    plan: AttentionPlan,
    logits_rows: torch.Tensor,
) -> torch.Tensor:
    """One forward over a packed row ``[1, T]``; logits only at ``logits_rows`` -> ``[N, vocab]``."""
    placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=placeholder_mask,
        use_cache=False,
        kvstream_plan=plan,
        **{_logits_kwarg(type(model)): logits_rows},
    )
    return out.logits[0]


@functools.cache
def _cache_kwarg(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model: torch.nn.Module) -> Any:
    """A transformers DynamicCache for ``model`` (decoder_hidden_states keeps K/V in it)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def decoder_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
    """The decoder's last hidden states (after its final norm) for ``input_ids`` ``[1, T]``
    at positions ``start..start+T-1``, the positions before them held in ``cache``
    (new_cache), to which these are added: a long input taken in chunks. Not an engine
    step: attention is transformers' SDPA (paged_attention without a plan), given the
    causal mask explicitly, since a mask builder does not know the engine's attention name;
    the cache's keyword is ``cache`` on recent 5.x and ``past_key_values`` before."""
    decoder = model.get_decoder()
    length = input_ids.shape[1]
    device = input_ids.device
    mask = torch.ones(length, start + length, dtype=torch.bool, device=device).tril(diagonal=start)[None, None]
    positions = torch.arange(start, start + length, device=device)[None]
    out = decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  **{_cache_kwarg(type(decoder)): cache})
    return out.last_hidden_state[0]


def padded_hidden_states(model: torch.nn.Module, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row's last hidden states (after the decoder's final norm), ``[len(row), hidden]``,
    from one forward of the rows right-padded to the longest, each from position 0. The mask
    is causal and hides every row's padding from its own tokens (a padded position still
    sees its row's tokens, so no row of the softmax is empty); SDPA, as in
    decoder_hidden_states."""
    decoder = model.get_decoder()
    device = next(model.parameters()).device
    longest = max(map(len, rows))
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(row) for row in rows])
    valid = torch.arange(longest)[None] < lengths[:, None]  # [rows, longest]: a key that is a token
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    mask = (causal[None] & valid[:, None, :])[:, None].to(device)
    positions = torch.arange(longest, device=device)[None].expand(len(rows), -1)
    out = decoder(input_ids=ids.to(device), attention_mask=mask, position_ids=positions, use_cache=False)
    return [out.last_hidden_state[i, :len(row)] for i, row in enumerate(rows)]


def forward_first_layers(
    model: torch.nn.Module,
    layers: torch.nn.ModuleList,
    num_layers: int,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    plan: AttentionPlan,
) -> None:
    """Run only the first ``num_layers`` decoder layers (their K/V land in the pool through
    the plan); the Llama family iterates ``self.layers``, so a shorter list is a shorter
    model. The full list is always put back."""
    inner = model.model  # type: ignore[attr-defined]
    inner.layers = layers[:num_layers]
    try:
        forward_logits(model, input_ids, position_ids, plan, torch.zeros(1, dtype=torch.long, device=input_ids.device))
    finally:
        inner.layers = layers


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the Cache argument of ``model.forward``: ``cache`` from 5.2x on,
    ``past_key_values`` before (for baselines that run plain transformers with a Cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def version() -> str:
    return transformers.__version__
