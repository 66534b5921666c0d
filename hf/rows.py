"""Which rows of a ``generate`` call share a prompt: a fingerprint of every per-row model input.

A correlated group must hold copies of one prompt only. The decoder ``input_ids``
do not say which rows those are: for an encoder-decoder model every row starts as
the decoder start token, with ``inputs_embeds`` the ids are empty, and
vision-language prompts may differ in their images only. :func:`prompt_keys`
therefore fingerprints (BLAKE2b, on the host, once per ``generate`` call, one
representative row per prompt) every model input that can differ between prompts:

* the decoder ``input_ids`` and the unexpanded main input ``generate`` hands a
  ``custom_generate`` callable as ``inputs_tensor`` (encoder input ids or features,
  or ``inputs_embeds``);
* every tensor in ``model_kwargs`` (``attention_mask``, ``inputs_embeds``,
  ``token_type_ids``, ``pixel_values`` where the model keeps them, …), along its first
  dimension — the convention of transformers' own ``_expand_inputs_for_generation``,
  which repeats every such tensor along dim 0 — except ``cache_position``
  (batch-level) and 3-D ``position_ids`` (batch at dim 1, also as transformers has it);
  mappings (``ModelOutput``), lists and tuples are searched for tensors; a pre-filled
  key-value cache through its layers' ``keys``/``values`` (an empty one holds nothing);
* the *inputs* of the activations transformers computes before the decoding loop,
  not the activations: ``encoder_outputs`` and the image/video features
  ``mm_encoder_outputs`` are not bit-for-bit reproducible across batch positions
  (identical rows of one batch can differ in the last bits), so when ``raw_inputs``
  (the keyword arguments given to ``generate``) show that transformers computed them,
  they are skipped: the encoder's inputs are hashed anyway, and the inputs the image
  encoder consumed (``pixel_values``, ``image_grid_thw``, …, one entry per image or
  patch, not per row) are attributed to prompts by counting each prompt's placeholder
  tokens (``config.image_token_id`` / ``video_token_id``) exactly as transformers'
  ``_expand_multimodal_outputs`` does — per image when the tensor has one entry per
  image, per patch through ``<modality>_grid_thw`` when it has one per patch. Without
  ``raw_inputs``, or when the user passed them, the activations themselves are hashed
  (bit for bit: identical prompts given separately may then form separate groups,
  never the reverse).

Scalars (``use_cache``, ``logits_to_keep``, generation options, …) are the same for
every row. Tensors are hashed bit for bit (dtype, per-row shape, bytes): prompts
whose inputs differ in any bit are different prompts. Rows are read in blocks of
``copies`` (transformers' ``num_return_sequences`` expansion, ``repeat_interleave``:
row r is prompt r // copies).

An input that cannot be split by prompt (an unknown object, a tensor whose first
dimension is not the batch, image inputs that do not match the placeholders) is
reported in :attr:`PromptKeys.unattributed`, and then no two prompts share a key:
each prompt's ``copies`` rows are one group on their own. That can only lose
correlation between identical prompts given separately, never put two different
prompts in one group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

__all__ = ["PromptKeys", "prompt_keys"]

#: Keys of ``model_kwargs`` that are the same for every row whatever their type.
BATCH_LEVEL = frozenset({"cache_position"})
#: Activations transformers computes before the decoding loop from other (hashed) inputs.
DERIVED = ("encoder_outputs", "mm_encoder_outputs")
#: ``generate`` keyword arguments that become ``input_ids`` / ``inputs_tensor`` (hashed as such).
MAIN_INPUTS = frozenset({"input_ids", "inputs_embeds", "decoder_input_ids", "inputs"})

_SCALARS = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, Enum, type(None))
_MODALITIES = ("image", "video")


@dataclass(frozen=True)
class PromptKeys:
    """The prompts of one ``generate`` call and their fingerprints.

    Attributes:
        keys: one fingerprint per prompt (``rows // copies`` of them); prompts with equal keys
            had identical model inputs. Without any unattributed input, keys are 16-byte
            BLAKE2b digests; otherwise each prompt's key is unique to it.
        copies: rows per prompt (``num_return_sequences``); prompt p is rows ``p·copies … p·copies + copies − 1``.
        unattributed: ``"name: why"`` for each input that could not be split by prompt (empty when
            every input was fingerprinted).
    """

    keys: tuple[bytes, ...]
    copies: int
    unattributed: tuple[str, ...] = ()


def prompt_keys(
    input_ids: torch.Tensor,
    model_kwargs: Mapping[str, Any],
    inputs_tensor: torch.Tensor | None = None,
    copies: int = 1,
    model: Any = None,
    raw_inputs: Mapping[str, Any] | None = None,
) -> PromptKeys:
    """Fingerprint each prompt of a ``generate`` call from all its per-row model inputs.

    Args:
        input_ids: ``[rows, length]`` decoder input ids as the decoding loop gets them
            (``length`` may be 0 with ``inputs_embeds``).
        model_kwargs: the decoding loop's model keyword arguments, already expanded to
            ``rows`` by transformers (``attention_mask``, ``encoder_outputs``, ``inputs_embeds``,
            ``mm_encoder_outputs``, ``past_key_values``, …).
        inputs_tensor: ``[rows // copies, …]`` the main model input before expansion, as
            ``generate`` passes it to a ``custom_generate`` callable; None if unknown.
        copies: rows per prompt (``num_return_sequences`` ≥ 1); ``rows`` must be a multiple of it.
        model: the model, for the placeholder token ids (``config.<modality>_token_id``),
            input embeddings and generation options; None treats image/video inputs as
            unattributed.
        raw_inputs: the keyword arguments given to ``generate`` (unexpanded, one entry per
            prompt, image or patch), or None if unknown (then derived activations are hashed).

    Returns:
        :class:`PromptKeys` (see the module docstring for what is hashed and how).

    Raises:
        ValueError: ``copies`` is not a positive int dividing the number of rows, or
            ``input_ids`` is not 2-D.
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies={copies!r} is not a row count; use num_return_sequences, an int >= 1")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; expected [rows, length]")
    rows = int(input_ids.shape[0])
    if rows % copies:
        raise ValueError(f"copies={copies} does not divide the {rows} rows of input_ids; use num_return_sequences")
    hasher = _Hasher(rows, copies)
    hasher.add("input_ids", input_ids)
    if inputs_tensor is not None:
        hasher.add("inputs_tensor", inputs_tensor, unexpanded=True)
    derived = {name for name in DERIVED if raw_inputs is not None and name in model_kwargs and name not in raw_inputs}
    embeds = model_kwargs.get("inputs_embeds")
    for name, value in model_kwargs.items():
        if name in BATCH_LEVEL or name in derived:
            continue
        if name == "mm_encoder_outputs":
            _add_multimodal_outputs(hasher, value, input_ids, embeds, model)
        elif name == "position_ids" and isinstance(value, torch.Tensor) and value.dim() == 3:
            hasher.add(name, value.transpose(0, 1))
        else:
            hasher.add(name, value)
    if raw_inputs is not None:
        options = getattr(model, "generation_config", None)
        consumed = {
            name: value
            for name, value in raw_inputs.items()
            if name not in model_kwargs and name not in MAIN_INPUTS and name not in DERIVED
            and not (options is not None and hasattr(options, name))
        }  # fmt: skip
        if consumed:
            items = _items_per_prompt(hasher, model_kwargs.get("mm_encoder_outputs"), input_ids, embeds, model)
            for name, value in consumed.items():
                _add_consumed(hasher, name, value, items, raw_inputs)
    prompts = rows // copies
    if hasher.unattributed:
        keys = tuple(b"prompt %d" % p for p in range(prompts))
    else:
        keys = tuple(h.digest() for h in hasher.hashers)
    return PromptKeys(keys, copies, tuple(hasher.unattributed))


class _Hasher:
    """One BLAKE2b state per prompt; the ``add*`` methods feed it each prompt's part of an input."""

    def __init__(self, rows: int, copies: int) -> None:
        self.rows = rows
        self.copies = copies
        self.prompts = rows // copies
        self.hashers = [hashlib.blake2b(digest_size=16) for _ in range(self.prompts)]
        self.unattributed: list[str] = []

    def add(self, name: str, value: Any, unexpanded: bool = False) -> None:
        """Feed an input of any type: tensors by row, containers recursively, scalars not at all."""
        if isinstance(value, torch.Tensor):
            self._tensor(name, value, unexpanded)
        elif isinstance(value, _SCALARS):
            return  # no row dimension: the same for every row
        elif callable(getattr(value, "get_seq_length", None)):
            self._cache(name, value)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                self.add(f"{name}.{key}", item, unexpanded)
        elif isinstance(value, Sequence):
            if len(value) in (self.rows, self.prompts) and not any(isinstance(v, torch.Tensor) for v in value):
                self.unattributed.append(f"{name}: a {type(value).__name__} of {len(value)} non-tensor items")
                return
            for i, item in enumerate(value):
                self.add(f"{name}[{i}]", item, unexpanded)
        else:
            self.unattributed.append(f"{name}: {type(value).__module__}.{type(value).__qualname__} is not a tensor")

    def add_parts(self, name: str, parts: Sequence[Sequence[torch.Tensor]]) -> None:
        """Feed prompt p the tensors ``parts[p]`` (its own images, patches, …), in order."""
        for p, items in enumerate(parts):
            self._update(p, f"{name}#{len(items)}")
            for i, item in enumerate(items):
                self._slices(f"{name}[{i}]", item.unsqueeze(0), [p])

    def _tensor(self, name: str, value: torch.Tensor, unexpanded: bool) -> None:
        if value.dim() == 0:
            return  # a batch-level scalar
        first = int(value.shape[0])
        if first == self.rows:
            self._slices(name, value[:: self.copies], range(self.prompts))
        elif unexpanded and first == self.prompts:
            self._slices(name, value, range(self.prompts))
        else:
            expected = f"{self.rows} (rows)" + (f" or {self.prompts} (prompts)" if unexpanded else "")
            self.unattributed.append(f"{name}: shape {tuple(value.shape)}, first dimension is not {expected}")

    def _slices(self, name: str, value: torch.Tensor, targets: Sequence[int]) -> None:
        # value: [len(targets), …]; slice j goes to prompt targets[j].
        try:
            host = value.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
            flat = host.reshape(host.shape[0], -1)
            data = flat.view(torch.uint8).numpy() if flat.numel() else None
        except (RuntimeError, TypeError, NotImplementedError) as err:
            self.unattributed.append(f"{name}: {value.dtype} tensor with layout {value.layout} cannot be read ({err})")
            return
        header = f"{name}|{value.dtype}|{tuple(value.shape[1:])}"
        for j, p in enumerate(targets):
            self._update(p, header)
            if data is not None:
                self.hashers[p].update(data[j])

    def _update(self, p: int, text: str) -> None:
        self.hashers[p].update(text.encode() + b"\0")

    def _cache(self, name: str, cache: Any) -> None:
        try:
            if int(cache.get_seq_length()) == 0:
                return  # transformers' fresh cache: no input in it yet
        except (AttributeError, TypeError, RuntimeError, ValueError, IndexError):
            pass
        found = False
        for sub in ("self_attention_cache", "cross_attention_cache"):
            if getattr(cache, sub, None) is not None:
                found = True
                self.add(f"{name}.{sub}", getattr(cache, sub))
        for i, layer in enumerate(getattr(cache, "layers", None) or ()):
            for part in ("keys", "values"):
                tensor = getattr(layer, part, None)
                if isinstance(tensor, torch.Tensor) and tensor.numel():
                    found = True
                    self._tensor(f"{name}.layers[{i}].{part}", tensor, unexpanded=False)
        if not found:
            self.unattributed.append(f"{name}: a filled {type(cache).__qualname__} exposes no per-layer keys/values")


def _pooled(output: Any) -> Any:
    return output.get("pooler_output") if isinstance(output, Mapping) else getattr(output, "pooler_output", None)


def _row_items(model: Any, modality: str, pooled: Any, input_ids: torch.Tensor, embeds: Any) -> list[list] | None:
    """Each row's items (images/videos) of an expanded ``pooler_output``, by placeholder counts; None if they
    do not match (transformers' rule: an item's length is the number of placeholder tokens it fills)."""
    token_id = getattr(getattr(model, "config", None), f"{modality}_token_id", None)
    if token_id is None:
        return None
    if input_ids.numel() == 0 and isinstance(embeds, torch.Tensor):
        token = torch.full((), int(token_id), dtype=torch.long, device=embeds.device)
        placeholder = model.get_input_embeddings()(token)
        counts = (embeds == placeholder).all(-1).sum(-1).tolist()
    else:
        counts = (input_ids == int(token_id)).sum(-1).tolist()
    items = list(pooled)
    out: list[list] = []
    i = 0
    for count in counts:
        row: list = []
        filled = 0
        while filled < count and i < len(items):
            row.append(items[i])
            filled += len(items[i])
            i += 1
        if filled != count:
            return None
        out.append(row)
    return out if i == len(items) else None


def _add_multimodal_outputs(hasher: _Hasher, outputs: Any, input_ids: torch.Tensor, embeds: Any, model: Any) -> None:
    """Hash each modality's ``pooler_output`` items per prompt (the features the decoder consumes; the
    modality output's other fields are the vision tower's own states, which transformers does not
    expand per row and the decoder does not read)."""
    if not isinstance(outputs, Mapping):
        hasher.add("mm_encoder_outputs", outputs)
        return
    for modality, output in outputs.items():
        name = f"mm_encoder_outputs.{modality}"
        if output is None:
            continue
        pooled = _pooled(output)
        if pooled is None:
            hasher.add(name, output)
            continue
        per_row = _row_items(model, modality, pooled, input_ids, embeds)
        if per_row is None:
            hasher.unattributed.append(f"{name}: its items do not match the rows' {modality} placeholder tokens")
            continue
        hasher.add_parts(f"{name}.pooler_output", per_row[:: hasher.copies])


def _items_per_prompt(
    hasher: _Hasher, outputs: Any, input_ids: torch.Tensor, embeds: Any, model: Any
) -> dict[str, list[int] | None]:
    """modality → number of items (images/videos) of each prompt, from the expanded features
    (None for a modality whose items do not match the placeholder tokens)."""
    found: dict[str, list[int] | None] = {}
    if not isinstance(outputs, Mapping):
        return found
    for modality in _MODALITIES:
        pooled = None if outputs.get(modality) is None else _pooled(outputs[modality])
        if pooled is None:
            continue
        per_row = _row_items(model, modality, pooled, input_ids, embeds)
        found[modality] = None if per_row is None else [len(items) for items in per_row[:: hasher.copies]]
    return found


def _add_consumed(
    hasher: _Hasher, name: str, value: Any, items: dict[str, list[int] | None], raw_inputs: Mapping[str, Any]
) -> None:
    """Hash a ``generate`` argument transformers consumed before the loop (``pixel_values``, …) per prompt:
    one entry per image/video, per patch (``<modality>_grid_thw``), or per prompt."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        hasher.add(name, value, unexpanded=True)
        return
    modality = "video" if "video" in name else "image"
    first = int(value.shape[0])
    if modality in items and items[modality] is None:
        hasher.unattributed.append(f"{name}: the {modality} features do not match the rows' placeholder tokens")
        return
    counts = items.get(modality)
    patches = None if counts is None else _patches(raw_inputs.get(f"{modality}_grid_thw"), counts, first)
    if counts is not None and first == sum(counts):
        sizes = counts  # one entry per image/video
    elif patches is not None:
        sizes = patches  # one entry per patch
    elif first == hasher.prompts:
        sizes = [1] * hasher.prompts  # one entry per prompt
    else:
        why = f"shape {tuple(value.shape)}: first dimension is not one entry per prompt ({hasher.prompts})"
        if counts is not None:
            why += f", per {modality} ({sum(counts)}) or per patch"
        hasher.unattributed.append(f"{name}: {why}")
        return
    parts, start = [], 0
    for size in sizes:
        parts.append([value[start : start + size]])
        start += size
    hasher.add_parts(name, parts)


def _patches(grid: Any, counts: list[int], first: int) -> list[int] | None:
    """Patches per prompt from ``[items, 3]`` (t, h, w) grids, if they add up to ``first``."""
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or int(grid.shape[0]) != sum(counts):
        return None
    per_item = grid.prod(-1).tolist()
    if sum(per_item) != first:
        return None
    out, i = [], 0
    for count in counts:
        out.append(int(sum(per_item[i : i + count])))
        i += count
    return out
