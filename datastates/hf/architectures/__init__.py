"""The registry of transformers architectures: one module each, registered here in one line.

An architecture module defines an `Architecture` (base.py) and its instance ARCHITECTURE: how saved flags become
its config.json and back, its tensor names, splits and merges, and what it refuses. Export tries every registered
architecture of the checkpoint's kind (dense, MoE, multi-latent attention); import takes config.json's model_type.
"""
from __future__ import annotations

from . import deepseek_v3, gpt2, llama, mixtral, qwen2, qwen3, qwen3_moe

REGISTERED = {module.ARCHITECTURE.model_type: module.ARCHITECTURE
              for module in (llama, gpt2, mixtral, deepseek_v3, qwen2, qwen3, qwen3_moe)}
