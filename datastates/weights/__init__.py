"""Policy weights handed to the inference side (docs/rl-weights.md): the versions the trainer publishes with
`--publish-weights-dir` into node-local shared memory, and the readers' library. It needs torch and safetensors,
never megatron-core.

    root/iter_0000007/   one version: the Hugging Face model's tensors (safetensors files, their index written last)
    root/latest          `iter_0000007`: the newest whole version, replaced in one step after it
    root/deltas/         each version's changed elements against the one before (--publish-weights-deltas)

leases.py   a reader's hold on a version (a shared flock), and the publisher's test that none holds one
reader.py   open the newest version or wait for the next; (name, tensor) pairs; load into a transformers model;
            catch a copy up to the newest through the deltas
layouts.py  what one rank of an inference engine holds: packed (qkv_proj, gate_up_proj, stacked experts) and
            sliced for its tensor parallelism, as vLLM's and SGLang's parallel layers hold them
deltas.py   a delta between two versions: written by the trainer, applied by a reader
relay.py    a process on the trainer's node serving its versions over TCP to readers on other nodes
            (`python -m datastates.weights.relay --dir /dev/shm/policy --port 7070`)
remote.py   a reader on another node: the local reader's calls, over the relay, in bounded pieces
wire.py     their protocol: frames of a small JSON header and raw bytes, each checked with a crc32
"""
from .deltas import retire_deltas, write_delta
from .leases import lease, unleased
from .reader import Version, WeightsError, WeightsReader
from .relay import Relay
from .remote import RemoteReader, RemoteVersion

__all__ = ["Version", "WeightsError", "WeightsReader", "Relay", "RemoteReader", "RemoteVersion", "lease", "unleased",
           "write_delta", "retire_deltas"]  # the publishing side's (the trainer's --publish-weights-deltas)
