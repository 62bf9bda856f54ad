"""The Hugging Face command lines of `convert_checkpoint.py` (--to hf / --from hf, docs/huggingface.md) over the
library `datastates.hf` (architectures, mappings, the export plan and writer).

cli.py          the options and the calls the converter dispatches to
load_hf.py      transformers model directory -> megatron-core's tensors and the trainer's flags (builds its args)
lazy.py         the import's tensors, each unit built when the engine's copier reaches it
import_ckpt.py  the imported model written as a datastates or torch_dist checkpoint
"""
