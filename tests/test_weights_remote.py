"""Readers on other nodes (datastates.weights.relay, remote, wire): the relay in a thread of the test process serving
a root of published versions over 127.0.0.1, remote readers in the test process and one in a subprocess.

A remote reader's tensors are the local reader's bit for bit, whole, packed and TP-sliced (fewer bytes: only the
rank's); one versions behind reaches the newest through the deltas with a fraction of the full version's bytes on
the wire, or gets the full version where its chain is gone. A reader stalled mid-transfer keeps its version leased
(retention passes over it) without holding up the relay's other readers; SIGKILLed, it leaves the relay serving and
the version freed. Bad requests, a torn connection and a damaged piece are clear errors on the reader alone.
"""
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

from megatron_helpers import ROOT
from rank_launcher import environment
from test_weights_versions import held, publish

from datastates import storage_for
from datastates.weights import Relay, RemoteReader, WeightsError, WeightsReader
from datastates.weights.relay import main as relay_main
from datastates.weights.wire import CHUNK, Receiver, send_header, send_tensor
from megatron.training.checkpointing.weights_versions import VersionRoot

QWEN2 = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2}

STALL = """
import sys, time
from datastates.weights import RemoteReader
version = RemoteReader("127.0.0.1", int(sys.argv[1])).open(1)
pairs = version.tensors()  # kept: a stream let go of closes its version
name, tensor = next(pairs)
print("GOT", name, float(tensor[0, 0]), flush=True)
time.sleep(600)
"""


@pytest.fixture
def served(tmp_path):
    """(a VersionRoot under tmp_path, its path, a relay serving it on 127.0.0.1: its port)."""
    path = str(tmp_path / "versions")
    os.makedirs(path)
    relay = Relay(path, ("127.0.0.1", 0), idle_timeout_s=60)
    thread = threading.Thread(target=relay.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield path, relay.server_address[1]
    relay.shutdown()
    relay.server_close()


def qwen2(g: torch.Generator) -> dict:
    """A small Qwen2-shaped model's Hugging Face tensors in bf16 (GQA: 4 query heads of 32, 2 key/value heads)."""
    h, kv, ffn, vocab = 128, 64, 256, 100
    layer = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h),
              f"{layer}self_attn.q_proj.weight": (h, h), f"{layer}self_attn.q_proj.bias": (h,),
              f"{layer}self_attn.k_proj.weight": (kv, h), f"{layer}self_attn.k_proj.bias": (kv,),
              f"{layer}self_attn.v_proj.weight": (kv, h), f"{layer}self_attn.v_proj.bias": (kv,),
              f"{layer}self_attn.o_proj.weight": (h, h), f"{layer}mlp.gate_proj.weight": (ffn, h),
              f"{layer}mlp.up_proj.weight": (ffn, h), f"{layer}mlp.down_proj.weight": (h, ffn),
              f"{layer}input_layernorm.weight": (h,)}
    return {n: torch.randn(s, generator=g).bfloat16() for n, s in shapes.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8),
                                                                                  b[k].view(torch.uint8)) for k in a)


def test_remote_tensors_are_the_local_readers_and_a_reader_behind_catches_up_through_deltas(served):
    path, port = served
    root = VersionRoot(storage_for(path), path, keep_last=1, deltas=2)
    g = torch.Generator().manual_seed(0)
    tensors = qwen2(g)
    publish(root, 1, tensors, QWEN2, files=2)
    local, remote = WeightsReader(path), RemoteReader("127.0.0.1", port)
    with local.newest() as version, remote.newest() as got:
        assert got.iteration == 1 and got.config == QWEN2
        whole = dict(got.tensors())
        assert same(whole, dict(version.tensors())) and same(whole, tensors)
        full_bytes = got.nbytes
        assert full_bytes > sum(t.numel() * t.element_size() for t in whole.values())  # and the frames' own
        for rank in (0, 1):  # the relay slices: only the rank's bytes cross, in vLLM's packed layout
            before = got.nbytes
            assert same(dict(got.tensors(packed=True, tp_rank=rank, tp_size=2)),
                        dict(version.tensors(packed=True, tp_rank=rank, tp_size=2)))
            assert got.nbytes - before < 0.6 * full_bytes
        with pytest.raises(WeightsError, match=r"the relay at 127.0.0.1:\d+: .*q_proj.bias: its 4 query heads do "
                                               r"not divide among 8 tensor-parallel ranks"):
            next(got.tensors(tp_rank=0, tp_size=8))
        assert same(dict(got.tensors()), whole)  # the connection goes on after a refused request
    with pytest.raises(WeightsError, match=r"the relay at 127.0.0.1:\d+: version 9 under .* is not held: it is not "
                                           r"published \(the versions held now: \[1\]\)"):
        remote.open(9)
    with socket.create_connection(("127.0.0.1", port)) as sock:  # a request of no kind the relay knows
        send_header(sock, {"op": "pickle"})
        assert Receiver(sock, "relay").header() == {"error": "unknown request 'pickle' (these are: newest, open, "
                                                             "next, tensors, deltas)"}
    mine = {k: v.clone() for k, v in whole.items()}  # a rollout engine's own copy of version 1
    for it in range(2, 5):  # about 1% of the elements change a version
        tensors = {k: v.clone() for k, v in tensors.items()}
        for t in tensors.values():
            flat = t.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 100)]] += 0.5
        publish(root, it, tensors, QWEN2, files=2)
        if it == 2:
            stale = {k: v.clone() for k, v in mine.items()}  # stays at 1: its delta to 2 is retired at 4
            assert remote.catch_up(mine, 1)[0] == 2 and same(mine, tensors)
    newest, nbytes = remote.catch_up(mine, 2)  # 2 versions behind: the deltas to 3 and 4
    assert newest == 4 and same(mine, tensors) and nbytes * 5 < full_bytes
    assert remote.catch_up(mine, 4)[0] == 4 and same(mine, tensors)  # the newest already: nothing changes
    with pytest.raises(WeightsError, match=r"no version newer than 4 under .* within 0.1 s \(the newest is 4\)"):
        remote.catch_up(mine, 4, timeout_s=0.1)
    newest, nbytes = remote.catch_up(stale, 1)  # deltas=2: no chain from 1 any more, the full version instead
    assert newest == 4 and same(stale, tensors) and nbytes >= full_bytes


def test_a_stalled_reader_keeps_its_version_and_once_killed_leaves_the_relay_serving(served):
    """Version 1 of 24 MB (more than the sockets' buffers): a reader process takes its first tensor and stalls,
    the relay's thread for it blocked in the middle of the version; retention passes over it, another reader is
    served meanwhile; SIGKILLed, it leaves the relay serving and version 1 freed."""
    path, port = served
    root = VersionRoot(storage_for(path), path, keep_last=1)
    big = {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(6)}
    publish(root, 1, big)
    stall = subprocess.Popen([sys.executable, "-c", STALL, str(port)], cwd=ROOT, env=environment(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert stall.stdout.readline().split() == ["GOT", "w0", "0.0"]
        for it in (2, 3):
            publish(root, it)
        assert held(path) == ["iter_0000001", "iter_0000003"]  # 1 leased by the relay for the stalled reader
        with RemoteReader("127.0.0.1", port).newest() as version:
            assert version.iteration == 3 and same(dict(version.tensors()), {"w": torch.full((4, 4), 3.0)})
    finally:
        stall.send_signal(signal.SIGKILL)
        stall.wait()
    deadline = time.monotonic() + 60  # the relay's thread learns of the death at its next send
    while held(path) != ["iter_0000003"] and time.monotonic() < deadline:
        root.retire_unleased()
        time.sleep(0.05)
    assert held(path) == ["iter_0000003"]
    with RemoteReader("127.0.0.1", port).newest() as version:
        assert version.iteration == 3


def fake_relay(answer) -> int:
    """A port where one connection is answered by `answer(sock)` after its first request (a relay gone wrong)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        sock, _ = server.accept()
        with sock, server:
            Receiver(sock, "reader").header()
            send_header(sock, {"iteration": 1, "config": {}})
            Receiver(sock, "reader").header()
            answer(sock)
    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def test_a_torn_connection_and_a_damaged_piece_are_clear_errors_on_the_reader():
    def torn(sock):  # two pieces announced, one sent, then the connection closes
        send_header(sock, {"name": "w", "dtype": "float32", "shape": [CHUNK // 2]})
        sock.sendall(struct.pack("!III", 0, CHUNK, zlib.crc32(bytes(CHUNK))) + bytes(CHUNK))

    def damaged(sock):
        tensor = torch.arange(8, dtype=torch.float32)
        send_tensor(sock, {"name": "w"}, tensor)
        send_header(sock, {"name": "v", "dtype": "float32", "shape": [8]})
        data = tensor.numpy().tobytes()
        sock.sendall(struct.pack("!III", 0, len(data), zlib.crc32(data) ^ 1) + data)  # its crc32 one bit off

    with RemoteReader("127.0.0.1", fake_relay(torn)).newest() as version:
        with pytest.raises(WeightsError, match=r"the relay at 127.0.0.1:\d+: the connection closed in the middle of "
                                               r"'w' at byte 1048576 of 2097152"):
            dict(version.tensors())
    with RemoteReader("127.0.0.1", fake_relay(damaged)).newest() as version:
        pairs = version.tensors()
        assert torch.equal(next(pairs)[1], torch.arange(8, dtype=torch.float32))
        with pytest.raises(WeightsError, match=r"the relay at 127.0.0.1:\d+: 'v': the piece of bytes 0 to 32 failed "
                                               r"its crc32"):
            next(pairs)


def test_the_relay_command_refuses_a_port_it_cannot_listen_on(served):
    path, port = served  # taken by the fixture's relay
    with pytest.raises(SystemExit, match=rf"relay: cannot listen on 127.0.0.1:{port}: .*Address already in use"):
        relay_main(["--dir", path, "--host", "127.0.0.1", "--port", str(port)])
