"""Virtual pipeline stages (Megatron-LM's flags): several model chunks per pipeline rank, trained by megatron-core's
interleaved schedule and checkpointed as upstream keys them (`model0`, `model1`, ...).

Chunk i of pipeline rank r holds the layers of virtual stage i * PP + r; each chunk is its own `GPTModel` built with
`vp_stage=i` (megatron-core gives its layers their global numbers, so their checkpoint keys are the same whatever
the layout) and its own DistributedDataParallel. Flag handling imports neither torch nor megatron-core.
"""
from __future__ import annotations


def add_virtual_pipeline_args(parser) -> None:
    g = parser.add_argument_group("virtual pipeline")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk: each pipeline rank holds num-layers / PP / this chunks")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="model chunks per pipeline rank (instead of --num-layers-per-virtual-pipeline-stage)")


def validate_virtual_pipeline(args) -> None:
    """Set `args.virtual_pipeline_model_parallel_size` (None: one chunk per rank); ValueError naming the flag."""
    per_stage, stages = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    args.virtual_pipeline_model_parallel_size = None
    if per_stage is None and stages is None:
        return
    if per_stage is not None and stages is not None:
        raise ValueError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both "
                         "set the model chunks per rank: give one")
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        raise ValueError("virtual pipeline stages interleave pipeline ranks: they need "
                         "--pipeline-model-parallel-size > 1")
    layers_per_rank = args.num_layers // pp
    if per_stage is not None:
        if per_stage <= 0 or layers_per_rank % per_stage:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide the "
                             f"{layers_per_rank} layers of each pipeline rank")
        stages = layers_per_rank // per_stage
    elif stages <= 0 or layers_per_rank % stages:
        raise ValueError(f"--num-virtual-stages-per-pipeline-rank {stages} does not divide the {layers_per_rank} "
                         "layers of each pipeline rank")
    from .schedules import batch_sizes
    for gbs in batch_sizes(args):
        microbatches = gbs // (args.micro_batch_size * args.data_parallel_size)
        if microbatches % pp:
            raise ValueError(f"virtual pipeline stages: {microbatches} micro-batches per iteration (global batch "
                             f"{gbs}) is not a multiple of --pipeline-model-parallel-size {pp}, as megatron-core's "
                             "interleaved schedule needs")
    args.virtual_pipeline_model_parallel_size = stages if stages > 1 else None


def build_model_chunks(model_provider, vp_size) -> list:
    """This rank's model chunks: one per virtual stage (a single chunk without virtual pipeline stages)."""
    from megatron.core import parallel_state as ps
    if vp_size is None:
        return [model_provider(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())]
    return [model_provider(pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                           post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i), vp_stage=i)
            for i in range(vp_size)]


def chunk_keys(chunks: list) -> list[str]:
    """The state dict key of each chunk, as upstream Megatron-LM names them."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def chunks_sharded_state_dict(chunks: list, metadata: dict) -> dict:
    """megatron-core's sharded state dict of every chunk under its key (its layers keep their global numbers);
    FSDP2's parameters stay whole DTensors in it (`fsdp.whole_dtensors`)."""
    from .fsdp import whole_dtensors
    with whole_dtensors():
        return {key: chunk.sharded_state_dict(metadata=dict(metadata))
                for key, chunk in zip(chunk_keys(chunks), chunks)}


def load_chunks(chunks: list, loaded: dict) -> None:
    """Each chunk's loaded state into it, strictly."""
    for key, chunk in zip(chunk_keys(chunks), chunks):
        chunk.load_state_dict(loaded[key], strict=True)


def data_iterators(micro_batches: list, chunks: list):
    """megatron-core's schedules' `data_iterator`: one over the micro-batches, or with virtual stages one per chunk
    (every chunk reads each micro-batch; the first and last virtual stages use their parts of it)."""
    return iter(micro_batches) if len(chunks) == 1 else [iter(micro_batches) for _ in chunks]
