"""The SeaweedFS fixture that the object-store tests stand on: it stores, it refuses strangers, it survives a
kill, its ports cannot be taken from it, and the MSC config it writes reaches it."""
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError
from s3_store import ClaimedPorts, PortTaken, S3Store



def test_put_get_round_trip_multipart_and_ranged(s3_server):
    c = s3_server.client()
    bucket = s3_server.create_bucket()
    parts = [os.urandom(5 << 20), os.urandom(1 << 20)]  # S3's smallest non-last part, then a short last one
    up = c.create_multipart_upload(Bucket=bucket, Key="ckpt/rank0")
    done = [{"PartNumber": i + 1, "ETag": c.upload_part(Bucket=bucket, Key="ckpt/rank0", UploadId=up["UploadId"],
                                                        PartNumber=i + 1, Body=p)["ETag"]}
            for i, p in enumerate(parts)]
    c.complete_multipart_upload(Bucket=bucket, Key="ckpt/rank0", UploadId=up["UploadId"],
                                MultipartUpload={"Parts": done})
    whole = b"".join(parts)
    assert c.get_object(Bucket=bucket, Key="ckpt/rank0")["Body"].read() == whole
    start = (5 << 20) - 10
    got = c.get_object(Bucket=bucket, Key="ckpt/rank0", Range=f"bytes={start}-{start + 99}")["Body"].read()
    assert got == whole[start:start + 100]


def test_wrong_credentials_are_refused(s3_server):
    bucket = s3_server.create_bucket()
    for key_id, secret, code in [(s3_server.access_key, "not-the-secret", "SignatureDoesNotMatch"),
                                 ("AKNOBODY", s3_server.secret_key, "InvalidAccessKeyId")]:
        c = s3_server.client(aws_access_key_id=key_id, aws_secret_access_key=secret)
        with pytest.raises(ClientError) as e:
            c.put_object(Bucket=bucket, Key="x", Body=b"x")
        assert e.value.response["Error"]["Code"] == code
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert "Contents" not in s3_server.client().list_objects_v2(Bucket=bucket)


def test_killed_store_comes_back_with_its_data_on_the_same_endpoint(s3_server):
    c = s3_server.client()
    bucket = s3_server.create_bucket()
    c.put_object(Bucket=bucket, Key="published/index", Body=b"v1")
    endpoint = s3_server.endpoint
    s3_server.restart()
    assert s3_server.endpoint == endpoint
    assert c.get_object(Bucket=bucket, Key="published/index")["Body"].read() == b"v1"  # the client made before
    c.put_object(Bucket=bucket, Key="after", Body=b"v2")


def test_msc_config_points_a_profile_at_the_store(s3_server, tmp_path):
    msc = pytest.importorskip("multistorageclient")
    bucket = s3_server.create_bucket()
    path = s3_server.write_msc_config(tmp_path / "msc.json", profile="seaweed", bucket=bucket, prefix="runs")
    client = msc.StorageClient(msc.StorageClientConfig.from_file([str(path)], profile="seaweed"))
    client.write("ckpt/tracker", b"7")
    assert s3_server.client().get_object(Bucket=bucket, Key="runs/ckpt/tracker")["Body"].read() == b"7"
    assert client.read("ckpt/tracker") == b"7"


def round_trip(store):
    bucket = store.create_bucket()
    store.client().put_object(Bucket=bucket, Key="k", Body=b"v")
    return store.client().get_object(Bucket=bucket, Key="k")["Body"].read()


def test_a_port_taken_after_it_was_picked_is_given_up_before_serving_and_kept_after(tmp_path):
    """A program that binds one of the store's ports between the pick and weed's bind: the first start moves to
    fresh ports; a restart keeps its ports (its clients know them) and fails naming the one taken."""
    store = S3Store(root=tmp_path)
    picked = store.ports["s3"]
    try:
        with socket.create_server(("127.0.0.1", picked)):
            store.start()
            assert picked not in store.ports.values()
        assert round_trip(store) == b"v"
        store.stop()
        with socket.create_server(("127.0.0.1", store.ports["s3"])), pytest.raises(PortTaken) as e:
            store.start()
        assert f"port {store.ports['s3']} " in str(e.value)
        assert round_trip(store.start()) == b"v"
    finally:
        store.close()


def test_two_stores_started_at_once_serve_on_distinct_ports():
    stores = [S3Store(), S3Store()]
    with ThreadPoolExecutor(2) as pool:  # weed dies with the thread that started it: both outlive the checks
        try:
            list(pool.map(S3Store.start, stores))
            assert not set(stores[0].ports.values()) & set(stores[1].ports.values())
            assert [round_trip(s) for s in stores] == [b"v", b"v"]
        finally:
            for s in stores:
                s.close()


def test_a_claimed_port_is_refused_to_another_process_until_released():
    """What keeps a second suite's store off this one's ports, even while this one is down for a restart."""
    claim = "from s3_store import ClaimedPorts; print(ClaimedPorts(1, candidates=[{}], tries=3).numbers)"
    here = os.path.dirname(__file__)
    with ClaimedPorts(1) as held:
        (port,) = held.numbers
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        assert not low <= port <= high  # no connect() or port-0 bind is given it
        other = subprocess.run([sys.executable, "-c", claim.format(port)], cwd=here, capture_output=True, text=True)
        assert other.returncode != 0 and "no 1 free ports" in other.stderr
    again = subprocess.run([sys.executable, "-c", claim.format(port)], cwd=here, capture_output=True, text=True)
    assert again.stdout.strip() == f"[{port}]", again.stderr
