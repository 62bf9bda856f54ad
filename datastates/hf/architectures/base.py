"""What an architecture module provides (datastates/hf/architectures/__init__.py registers one instance of each)."""
from __future__ import annotations

from ..geometry import Geometry
from ..mapping import Rule, linear_extra_state


class Architecture:
    """One transformers architecture that computes exactly what megatron-core computes for some saved flags.

    Export: `differences` says which saved flags it does not compute (none: it is the model's architecture),
    `geometry` reads the sizes, `config` writes config.json. Import: `from_config` reads config.json (refusing
    by key what pretrain_gpt.py does not compute), `flags` gives pretrain_gpt.py's flags for it. Both ways,
    `rules` name and split the tensors.
    """
    model_type: str  # config.json's model_type, the registry's key
    hf_class: str  # the transformers class, as config.json's `architectures` names it
    label: str  # how refusals name it
    kind: str  # the saved flags it competes for on export: "dense", "moe" or "mla" (multi-latent attention)

    def differences(self, args) -> list[str]:
        raise NotImplementedError

    def geometry(self, args, shapes: dict, where: str) -> Geometry:
        raise NotImplementedError

    def config(self, geo: Geometry, dtype: str) -> dict:
        raise NotImplementedError

    def from_config(self, config: dict, where: str) -> Geometry:
        raise NotImplementedError

    def flags(self, geo: Geometry) -> list:
        """The pretrain_gpt.py flags of this architecture beyond the sizes, vocabulary, query groups, biases and
        tied embedding every architecture prints (arch.megatron_flags)."""
        raise NotImplementedError

    def rules(self, geo: Geometry, present) -> list[Rule]:
        """The name mapping (`present`: the checkpoint's tensor names, where it depends on megatron-core's layout)."""
        raise NotImplementedError

    def extra_state(self, geo: Geometry) -> dict[str, tuple[int, ...]]:
        """The `_extra_state` objects an import writes: key -> its grid."""
        return linear_extra_state(geo)
