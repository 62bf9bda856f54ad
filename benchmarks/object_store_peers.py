"""The peers of benchmarks/object_store.py, on the same SeaweedFS: PyTorch DCP's async_save through fsspec (s3fs)
and through s3torchconnector's DCP writer, and megatron-core's torch_dist through multi-storage-client (msc://),
synchronous and asynchronous.

Each is a checkpointer of one fixed state (a dict of CPU tensors) at keys of one bucket, as object_store.py drives
it: save(key) returns when the training loop may go on, wait() once the last save is durable, load(key) restores
into the preallocated `target` (checked against the state by the caller). An asynchronous peer's save first waits
for the previous one: DCP and megatron-core keep one checkpoint in flight.
"""
import os

import torch
import torch.distributed as dist

from common import install_cpu_guard
from s3_store import REGION


def init_single_rank():
    """A one-rank gloo process group: megatron-core's save asks the rank of it, DCP plans through it. Its store
    is in this process: no port to pick."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class DcpAsync:
    """dcp.async_save with its default stager: the call copies the state into host memory and returns, DCP's
    thread uploads; dcp.load reads into the target in place. `writer`/`reader` make the storage ends for a key."""

    def __init__(self, state, writer, reader):
        self.state, self.writer, self.reader = state, writer, reader
        self.target = {k: torch.empty_like(v) for k, v in state.items()}
        self.future = None

    def save(self, key):
        import torch.distributed.checkpoint as dcp
        self.wait()
        self.future = dcp.async_save(self.state, storage_writer=self.writer(key))

    def wait(self):
        if self.future is not None:
            self.future.result()
            self.future = None

    def load(self, key):
        import torch.distributed.checkpoint as dcp
        dcp.load(self.target, storage_reader=self.reader(key))

    def close(self):
        self.wait()


def dcp_fsspec(store, bucket, state, threads):
    """DCP's FsspecWriter/FsspecReader on s3fs. sync_files=False: an object is durable once its upload completes,
    and DCP's fsync of a stream without a file descriptor falls back to os.sync() of the whole machine."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    kw = dict(key=store.access_key, secret=store.secret_key,
              client_kwargs={"endpoint_url": store.endpoint, "region_name": REGION})
    return DcpAsync(state, lambda key: FsspecWriter(f"s3://{bucket}/{key}", sync_files=False, thread_count=threads,
                                                    **kw),
                    lambda key: FsspecReader(f"s3://{bucket}/{key}", **kw))


def dcp_s3torchconnector(store, bucket, state, threads):
    """s3torchconnector's S3StorageWriter/S3StorageReader (the AWS CRT). They take no endpoint: the CRT client reads
    AWS_ENDPOINT_URL, which the caller sets from the store; path-style, the bucket being no host name here."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    cfg = S3ClientConfig(force_path_style=True)
    return DcpAsync(state, lambda key: S3StorageWriter(REGION, f"s3://{bucket}/{key}", cfg, thread_count=threads),
                    lambda key: S3StorageReader(REGION, f"s3://{bucket}/{key}", cfg))


class TorchDistMsc:
    """megatron-core's dist_checkpointing.save with TorchDistSaveShardedStrategy to msc://bench/<key>: with
    multi-storage-client installed, megatron-core writes every file through msc.open (FileSystemWriterAsync's
    use_msc) and loads through MSC's MultiStorageFileSystemReader. Asynchronous: async_sharded_save and an
    AsyncCallsQueue, as Megatron-LM's --async-save (the writes run in a forked process). On a CPU-only torch,
    megatron-core's save calls torch.cuda.synchronize: common.install_cpu_guard answers it."""

    def __init__(self, store, bucket, state, threads, asynchronous):
        install_cpu_guard()
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
        os.environ["MSC_CONFIG"] = str(store.write_msc_config(store.root / "msc.json", profile="bench",
                                                              bucket=bucket))
        self.state = state
        self.target = {k: torch.empty_like(v) for k, v in state.items()}
        self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=threads)
        self.queue = AsyncCallsQueue() if asynchronous else None

    @staticmethod
    def sharded(tensors):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}

    def save(self, key):
        from megatron.core import dist_checkpointing as dc
        self.wait()
        req = dc.save(self.sharded(self.state), f"msc://bench/{key}", sharded_strategy=self.strategy,
                      async_sharded_save=self.queue is not None)
        if self.queue is not None:
            self.queue.schedule_async_request(req)

    def wait(self):
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)

    def load(self, key):
        from megatron.core import dist_checkpointing as dc
        loaded = dc.load(self.sharded(self.target), f"msc://bench/{key}")
        for k, t in self.target.items():
            if loaded[k].data_ptr() != t.data_ptr():
                t.copy_(loaded[k])

    def close(self):
        if self.queue is not None:
            self.wait()
            self.queue.close()


def torch_dist_msc_sync(store, bucket, state, threads):
    return TorchDistMsc(store, bucket, state, threads, asynchronous=False)


def torch_dist_msc_async(store, bucket, state, threads):
    return TorchDistMsc(store, bucket, state, threads, asynchronous=True)


PEERS = {"DCP async_save, fsspec (s3fs)": dcp_fsspec,
         "DCP async_save, s3torchconnector": dcp_s3torchconnector,
         "mcore torch_dist via MSC (sync)": torch_dist_msc_sync,
         "mcore torch_dist via MSC (async)": torch_dist_msc_async}
