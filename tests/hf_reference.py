"""megatron-core's answer on the trainer's first micro-batch, for comparing a converted model with it.

    python tests/hf_reference.py CKPT OUT.pt <pretrain_gpt.py model flags>

Builds this repository's GPT model (pretrain_gpt.model_provider) on one rank, loads the model weights of the
datastates checkpoint CKPT as `--finetune` does, and saves to OUT.pt the first micro-batch's tokens and labels,
megatron-core's logits (fp32, padded vocabulary) and its per-token losses.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(ckpt: str, out: str, argv: list[str]) -> None:
    import pretrain_gpt
    from datastates import CheckpointEngine
    from datastates.megatron import load_sharded, make_registry
    from megatron.training.checkpointing import sharded_metadata
    from megatron.training import get_tokenizer
    from megatron.training.data import MicroBatches, build_train_valid_test_datasets
    from megatron.training.initialize import initialize_megatron

    args = initialize_megatron(argv=argv)
    model = pretrain_gpt.model_provider()
    with CheckpointEngine(registry=make_registry()) as engine:
        sd = model.sharded_state_dict(metadata=sharded_metadata(args))
        model.load_state_dict(load_sharded(engine, {"model": sd}, ckpt)["model"], strict=True)
    model.eval()
    batch = next(MicroBatches(build_train_valid_test_datasets(args)[0], 0, args.micro_batch_size, 0, 1,
                              vocab_size=get_tokenizer().vocab_size))
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    torch.save({"tokens": batch["tokens"], "labels": batch["labels"], "logits": logits.float(),
                "losses": losses.float()}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
