"""What an upstream user hands over for fine-tuning: a GPTModel saved by stock megatron-core, model weights only.

    python tests/stock_gpt.py OUT_DIR --init-seed N <pretrain_gpt.py flags>

Builds this repository's GPT model (pretrain_gpt.model_provider) with weights drawn from --init-seed, saves
`model.sharded_state_dict()` with megatron-core's own `dist_checkpointing.save` (torch_dist) into OUT_DIR,
and prints `STOCK-LOSS <repr>`: the model's loss on the trainer's first global batch (the same data,
micro-batches and forward step as the trainer's first iteration, one rank).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out_dir: str, init_seed: int, argv: list[str]) -> None:
    from megatron.core import dist_checkpointing

    import pretrain_gpt
    from megatron.training import get_tokenizer
    from megatron.training.data import MicroBatches, build_train_valid_test_datasets
    from megatron.training.initialize import initialize_megatron

    args = initialize_megatron(argv=argv)
    torch.manual_seed(init_seed)
    model = pretrain_gpt.model_provider()
    model.train()  # as the trainer's first iteration (run with dropout 0 to compare)
    batches = MicroBatches(build_train_valid_test_datasets(args)[0], 0, args.micro_batch_size, 0, 1, vocab_size=get_tokenizer().vocab_size)
    losses = []
    with torch.no_grad():
        for m in range(args.num_microbatches):
            output, loss_func = pretrain_gpt.forward_step(batches, model)
            losses.append(loss_func(output)[1]["lm loss"])
    os.makedirs(out_dir)
    dist_checkpointing.save(model.sharded_state_dict(), out_dir)
    print(f"STOCK-LOSS {torch.stack([x.float().reshape(()) for x in losses]).mean().item()!r}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--init-seed":
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[3]), sys.argv[4:])
