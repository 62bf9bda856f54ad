"""The limit for s3:// checkpoints: a plain parallel multipart PUT and a parallel ranged GET of the same bytes,
with each candidate client, against one local SeaweedFS (tests/s3_store.py). What the backend's durable and
restore times are held to, and how the backend's client was chosen (benchmarks/README.md, "Object stores").

    python benchmarks/object_store_raw.py [--size-mib 256] [--part-mib 16] [--concurrency 8] [--reps 2]
    python benchmarks/object_store_raw.py --quick   # seconds: 16 MiB in parts of 8 MiB, 2 in flight, 1 rep
"""
import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3_store import REGION, S3Store  # noqa: E402


def ranges(size, part):
    return [(off, min(part, size - off)) for off in range(0, size, part)]


def boto3_raw(store, bucket, part, conc):
    """boto3's low-level calls, one thread per part in flight: the calls a backend would make itself."""
    from botocore.config import Config
    c = store.client(config=Config(s3={"addressing_style": "path"}, max_pool_connections=conc))

    def put(key, data):
        up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def one(i, off, n):
            return {"PartNumber": i + 1, "ETag": c.upload_part(Bucket=bucket, Key=key, UploadId=up,
                                                               PartNumber=i + 1, Body=data[off:off + n])["ETag"]}
        with ThreadPoolExecutor(conc) as ex:
            parts = list(ex.map(lambda a: one(*a), [(i, o, n) for i, (o, n) in enumerate(ranges(len(data), part))]))
        c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})

    def get(key, out):
        view = memoryview(out)

        def one(off, n):
            body = c.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + n - 1}")["Body"]
            got = 0
            while got < n:  # straight into the target buffer, no intermediate bytes
                k = body.readinto(view[off + got:off + n]) if hasattr(body, "readinto") else 0
                if not k:
                    chunk = body.read(n - got)
                    view[off + got:off + got + len(chunk)] = chunk
                    k = len(chunk)
                got += k
        with ThreadPoolExecutor(conc) as ex:
            list(ex.map(lambda a: one(*a), ranges(len(out), part)))
    return put, get


def s3transfer(store, bucket, part, conc):
    """boto3's managed transfer (s3transfer's TransferManager): upload_fileobj / download_fileobj."""
    import io

    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    c = store.client(config=Config(s3={"addressing_style": "path"}, max_pool_connections=conc))
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)

    def put(key, data):
        c.upload_fileobj(io.BytesIO(data), bucket, key, Config=cfg)

    def get(key, out):
        sink = io.BytesIO()
        c.download_fileobj(bucket, key, sink, Config=cfg)
        memoryview(out)[:] = sink.getbuffer()
    return put, get


def obstore_client(store, bucket, part, conc):
    """obstore (Rust object_store): put with chunk_size/max_concurrency, get_ranges for the parallel reads."""
    import obstore
    from obstore.store import S3Store as ObS3
    s = ObS3(bucket, endpoint=store.endpoint, access_key_id=store.access_key, secret_access_key=store.secret_key,
             region=REGION, client_options={"allow_http": True}, virtual_hosted_style_request=False)

    def put(key, data):
        obstore.put(s, key, memoryview(data), use_multipart=True, chunk_size=part, max_concurrency=conc)

    def get(key, out):
        rs = ranges(len(out), part)
        view = memoryview(out)
        with ThreadPoolExecutor(conc) as ex:
            for (off, n), buf in zip(rs, ex.map(lambda r: obstore.get_range(s, key, start=r[0], length=r[1]), rs)):
                view[off:off + n] = memoryview(buf)
    return put, get


def s3torchconnector(store, bucket, part, conc):
    """s3torchconnector's client (AWS CRT through mountpoint-s3-client): it splits and parallelises itself by
    part_size; conc is not its knob (throughput_target_gbps is)."""
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client
    c = MountpointS3Client(REGION, endpoint=store.endpoint, part_size=part, force_path_style=True)

    def put(key, data):
        w = c.put_object(bucket, key)
        w.write(data)
        w.close()

    def get(key, out):
        view, off = memoryview(out), 0
        for chunk in c.get_object(bucket, key):
            view[off:off + len(chunk)] = chunk
            off += len(chunk)
    return put, get


def msc(store, bucket, part, conc):
    """multi-storage-client's S3 provider (boto3 + s3transfer underneath), configured as an msc:// profile."""
    import json

    import multistorageclient as m
    path = store.write_msc_config(store.root / "msc.json", profile="bench", bucket=bucket)
    cfg = json.loads(path.read_text())
    cfg["profiles"]["bench"]["storage_provider"]["options"].update(
        multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc, max_pool_connections=conc)
    c = m.StorageClient(m.StorageClientConfig.from_dict(cfg, profile="bench"))

    def put(key, data):
        c.write(key, data)

    def get(key, out):
        memoryview(out)[:] = c.read(key)
    return put, get


CLIENTS = {"boto3": boto3_raw, "s3transfer": s3transfer, "obstore": obstore_client,
           "s3torchconnector": s3torchconnector, "msc": msc}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2, help="best of")
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--quick", action="store_true", help="seconds: 16 MiB in parts of 8 MiB, 2 in flight, 1 rep")
    a = ap.parse_args(argv)
    if a.quick:
        a.size_mib, a.part_mib, a.concurrency, a.reps = 16, 8, 2, 1
    size, part = a.size_mib << 20, a.part_mib << 20
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    out = bytearray(size)
    store = S3Store()
    try:
        store.start()
        os.environ.update(store.env())  # the clients that read only the environment (s3torchconnector)
        bucket = store.create_bucket()
        print(f"{a.size_mib} MiB, parts of {a.part_mib} MiB, concurrency {a.concurrency}, best of {a.reps}; "
              f"SeaweedFS weed mini at {store.endpoint}")
        print(f"{'client':<18}{'PUT GB/s':>10}{'GET GB/s':>10}")
        for name in a.clients.split(","):
            try:
                put, get = CLIENTS[name](store, bucket, part, a.concurrency)
                put(f"{name}/warm", data[:part])
                best_put = best_get = float("inf")
                for r in range(a.reps):
                    t = time.perf_counter()
                    put(f"{name}/obj{r}", data)
                    best_put = min(best_put, time.perf_counter() - t)
                    np.frombuffer(out, np.uint8).fill(0)  # so that the check below sees this GET's bytes
                    t = time.perf_counter()
                    get(f"{name}/obj{r}", out)
                    best_get = min(best_get, time.perf_counter() - t)
                    if out != data:
                        raise RuntimeError("read back differs")
                print(f"{name:<18}{size / best_put / 1e9:>10.2f}{size / best_get / 1e9:>10.2f}", flush=True)
            except Exception as e:  # a client that fails is reported, the others still run
                print(f"{name:<18} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    finally:
        store.close()


if __name__ == "__main__":
    main()
