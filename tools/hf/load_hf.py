"""A transformers model directory -> megatron-core's global tensors, objects and saved flags (the convert tool's
in-memory checkpoint), for a checkpoint `pretrain_gpt.py --finetune --load` takes into any TP/PP layout.

The model is read tensor by tensor with safetensors and held once in host memory (the engine saves a state whose
tensors all exist); the word embedding and output layer are padded to Megatron's padded vocabulary.
"""
from __future__ import annotations

import json
import logging
import os

import torch

from . import HFError
from .arch import Geometry, geometry_from_config, megatron_flags
from .mapping import extra_state_keys, pad_rows, padded_vocab, rules_for

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# buffers some transformers versions saved with the weights; recomputed by every model, not weights
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")

log = logging.getLogger("tools.hf.load_hf")


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise HFError(f"{directory!r} is not a transformers model directory: {path!r} is missing") from None
    except (OSError, ValueError) as e:
        raise HFError(f"cannot read {path!r}: {e}") from None


def _weight_files(directory: str) -> dict[str, str]:
    """tensor name -> the safetensors file holding it."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFError(f"cannot read {index!r}: {type(e).__name__}: {e}") from None
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    if os.path.isfile(os.path.join(directory, SINGLE)):
        from safetensors import safe_open
        path = os.path.join(directory, SINGLE)
        with safe_open(path, framework="pt") as f:
            return {name: path for name in f.keys()}
    raise HFError(f"{directory!r} has neither {INDEX} nor {SINGLE}: only safetensors weights are read "
                  f"(re-save a pytorch_model.bin model with save_pretrained(safe_serialization=True))")


class _Weights:
    """Reads named tensors from the model's safetensors files, one at a time, and notes which were taken."""

    def __init__(self, files: dict[str, str]):
        self.files, self.taken, self._open = files, set(), {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open
        if name not in self.files:
            raise HFError(f"the model has no tensor {name!r} (its config.json says it should)")
        path = self.files[name]
        try:
            if path not in self._open:
                self._open[path] = safe_open(path, framework="pt")
            t = self._open[path].get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise HFError(f"cannot read {name!r} from {path!r}: {e}") from None
        self.taken.add(name)
        return t

    def untaken(self) -> list[str]:
        return sorted(n for n in self.files if n not in self.taken and not n.endswith(BUFFER_SUFFIXES))


def _megatron_tensors(weights: _Weights, geo: Geometry, rows: int, where: str) -> dict[str, torch.Tensor]:
    out = {}
    for rule in rules_for(geo):
        try:
            if rule.layered:
                t = torch.stack([rule.merge([weights.get(n) for n in rule.names(i)]) for i in range(geo.layers)])
            else:
                t = rule.merge([weights.get(n) for n in rule.names(None)])
        except RuntimeError as e:  # a reshape or cat of tensors whose shapes do not fit the config
            raise HFError(f"{where}: {', '.join(rule.hf)} do not fit its config.json: {e}") from None
        if rule.vocab:
            if t.shape[0] != geo.vocab:
                raise HFError(f"{where}: {rule.hf[0]} has {t.shape[0]} rows, config.json says vocab_size {geo.vocab}")
            t = pad_rows(t, rows)
        out[rule.megatron] = t.contiguous()
    return out


def read_hf(directory: str, divisible_by: int, tensor_parallel: int):
    """(tensors, objects, object shapes, common state, pretrain_gpt.py flags) of the model in `directory`."""
    from megatron.training.arguments import parse_args
    if not os.path.isdir(directory):
        raise HFError(f"input {directory!r} is not a directory")
    geo = geometry_from_config(_read_config(directory), directory)
    weights = _Weights(_weight_files(directory))
    rows = padded_vocab(geo.vocab, divisible_by, tensor_parallel)
    tensors = _megatron_tensors(weights, geo, rows, directory)
    left = weights.untaken()
    if left:
        raise HFError(f"{directory}: tensors with no megatron-core equivalent (refused rather than dropped): "
                      f"{', '.join(left)}")
    objects = {(key, (i,)): None for key in extra_state_keys() for i in range(geo.layers)}
    shapes = {key: (geo.layers,) for key in extra_state_keys()}
    flags = megatron_flags(geo, divisible_by)
    dtype = tensors["embedding.word_embeddings.weight"].dtype
    flags += {torch.bfloat16: ["--bf16"], torch.float16: ["--fp16"]}.get(dtype, [])
    args = parse_args(argv=flags + ["--seq-length", str(geo.max_positions),
                                    "--tensor-model-parallel-size", str(tensor_parallel)])
    fits = [tp for tp in (1, 2, 4, 8, 16) if padded_vocab(geo.vocab, divisible_by, tp) == rows]
    log.info("pretrain_gpt.py flags of this model: %s (padded vocabulary %d rows: loads at TP %s)",
             " ".join(flags), rows, ", ".join(map(str, fits)))
    return tensors, objects, shapes, {"args": args}, flags
