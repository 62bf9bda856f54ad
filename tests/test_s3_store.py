"""The SeaweedFS fixture that the object-store tests stand on: it stores, it refuses strangers, it survives a
kill, and the MSC config it writes reaches it."""
import os

import pytest
from botocore.exceptions import ClientError



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
