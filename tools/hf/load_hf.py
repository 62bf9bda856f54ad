"""A transformers model directory -> megatron-core's global tensors, objects and saved flags, for a checkpoint
`pretrain_gpt.py --finetune --load` takes into any TP/PP layout.

Planned from the safetensors headers alone (every shape checked against config.json, every tensor mapped, before
anything is written); the values of each layer of each megatron-core tensor are built when the writer needs them
(tools/hf/lazy.py). The word embedding and output layer are padded to Megatron's padded vocabulary.
"""
from __future__ import annotations

import itertools
import json
import logging
import os

import torch

from datastates.hf import HFError
from datastates.hf.arch import extra_state_objects, geometry_from_config, megatron_flags, rules_for
from datastates.hf.geometry import Geometry
from datastates.hf.mapping import pad_rows, padded_vocab, unit_indices, unit_sizes
from datastates.hf.writer import SAFETENSORS_DTYPES

from .lazy import LazyTensors

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# buffers some transformers versions saved with the weights; recomputed by every model, not weights
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items() if dtype.is_floating_point}

log = logging.getLogger(__name__)


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
        from safetensors import SafetensorError, safe_open
        path = os.path.join(directory, SINGLE)
        try:
            with safe_open(path, framework="pt") as f:
                return {name: path for name in f.keys()}
        except (OSError, SafetensorError) as e:
            raise HFError(f"cannot read {path!r}: {e}") from None
    raise HFError(f"{directory!r} has neither {INDEX} nor {SINGLE}: only safetensors weights are read "
                  f"(re-save a pytorch_model.bin model with save_pretrained(safe_serialization=True))")


class _Weights:
    """Reads named tensors from the model's safetensors files, one at a time, and notes which were taken."""

    def __init__(self, files: dict[str, str]):
        self.files, self.taken, self._open = files, set(), {}

    def _file(self, path: str):
        from safetensors import safe_open
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def meta(self, name: str) -> torch.Tensor:
        """A shape-only tensor of `name`, from its file's header (nothing read); the tensor counts as taken."""
        from safetensors import SafetensorError
        path = self._path(name)
        try:
            piece = self._file(path).get_slice(name)
            shape, code = piece.get_shape(), piece.get_dtype()
        except (OSError, SafetensorError) as e:
            raise HFError(f"cannot read {name!r} from {path!r}: {e}") from None
        if code not in DTYPES:
            raise HFError(f"{name!r} in {path!r} has dtype {code}, not a floating point one this trainer loads")
        self.taken.add(name)
        return torch.empty(shape, dtype=DTYPES[code], device="meta")

    def _path(self, name: str) -> str:
        if name not in self.files:
            raise HFError(f"the model has no tensor {name!r} (its config.json says it should)")
        return self.files[name]

    def get(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open
        path = self._path(name)
        try:  # opened for this read alone: closing unmaps the file, whose pages would stay in the RSS
            with safe_open(path, framework="pt") as f:
                return f.get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise HFError(f"cannot read {name!r} from {path!r}: {e}") from None

    def untaken(self) -> list[str]:
        return sorted(n for n in self.files if n not in self.taken and not n.endswith(BUFFER_SUFFIXES))


def _converted(rule, pieces: list[torch.Tensor], geo: Geometry, rows: int) -> torch.Tensor:
    """One layer (or the whole) of a megatron-core tensor from its transformers pieces, real or meta."""
    t = rule.merge(pieces)
    if rule.vocab:
        if t.shape[0] != geo.vocab:
            raise HFError(f"{rule.hf[0]} has {t.shape[0]} rows, config.json says vocab_size {geo.vocab}")
        t = pad_rows(t, rows)
    return t.contiguous()


def _planned(rule, weights: _Weights, geo: Geometry, rows: int) -> torch.Tensor:
    """The shape-only megatron-core tensor of `rule`, every unit's pieces checked against the config."""
    units = unit_indices(rule, geo)
    metas = [_converted(rule, [weights.meta(n) for n in rule.names(i)], geo, rows) for i in units]
    if any(m.shape != metas[0].shape for m in metas):
        raise HFError(f"{', '.join(rule.hf)}: the layers' (or experts') shapes differ")
    return metas[0].expand(*unit_sizes(rule, geo), *metas[0].shape).contiguous()


def plan_import(directory: str, geo: Geometry, rows: int) -> LazyTensors:
    """Every megatron-core tensor as a meta tensor and how to build its layers; refuses, before anything is
    read or written, a model whose tensors do not fit its config or that holds tensors no rule takes."""
    weights = _Weights(_weight_files(directory))
    lazy = LazyTensors()
    for rule in rules_for(geo):
        try:
            meta = _planned(rule, weights, geo, rows)
        except RuntimeError as e:  # a reshape or cat of tensors whose shapes do not fit the config
            raise HFError(f"{directory}: {', '.join(rule.hf)} do not fit its config.json: {e}") from None
        except HFError as e:
            raise HFError(f"{directory}: {e}") from None

        def build(index, rule=rule):
            return _converted(rule, [weights.get(n) for n in rule.names(index)], geo, rows)
        lazy.add(rule.megatron, meta, build, rule.lead)
    left = weights.untaken()
    if left:
        raise HFError(f"{directory}: tensors with no megatron-core equivalent (refused rather than dropped): "
                      f"{', '.join(left)}")
    return lazy


def read_hf(directory: str, divisible_by: int, tensor_parallel: int):
    """(LazyTensors, objects, object shapes, common state, pretrain_gpt.py flags) of the model in `directory`."""
    from megatron.training.arguments import parse_args
    if not os.path.isdir(directory):
        raise HFError(f"input {directory!r} is not a directory")
    geo = geometry_from_config(_read_config(directory), directory)
    rows = padded_vocab(geo.vocab, divisible_by, tensor_parallel)
    lazy = plan_import(directory, geo, rows)
    shapes = extra_state_objects(geo)
    objects = {(key, tuple(at)): None for key, grid in shapes.items()
               for at in itertools.product(*(range(n) for n in grid))}
    flags = megatron_flags(geo, divisible_by)
    dtype = lazy.tensors["embedding.word_embeddings.weight"].dtype
    flags += {torch.bfloat16: ["--bf16"], torch.float16: ["--fp16"]}.get(dtype, [])
    args = parse_args(argv=flags + ["--seq-length", str(geo.max_positions),
                                    "--tensor-model-parallel-size", str(tensor_parallel)])
    fits = [tp for tp in (1, 2, 4, 8, 16) if padded_vocab(geo.vocab, divisible_by, tp) == rows]
    log.info("pretrain_gpt.py flags of this model: %s (padded vocabulary %d rows: loads at TP %s)",
             " ".join(flags), rows, ", ".join(map(str, fits)))
    return lazy, objects, shapes, {"args": args}, flags
