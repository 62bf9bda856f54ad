"""msc:// paths: multi-storage-client's configuration (MSC_CONFIG, or its default search paths) read for one
profile, and the profile's S3-compatible store reached through the S3 backend (`s3.py`): msc://profile/key names
s3://<base_path>/key at the profile's endpoint, with its region and credentials. Profiles of other providers
(Azure, GCS's own API, OCI, a local file system) are refused by name: this engine drives S3's multipart and
ranged-GET calls itself, and MSC's own clients expose neither a part uploaded from a given buffer nor an abort."""
from __future__ import annotations

from .. import paths
from ..errors import CheckpointError
from .s3 import S3Options, S3Storage, client

S3_PROVIDERS = ("s3", "s8k")  # MSC's providers that speak the S3 API
STATIC_CREDENTIALS = "S3Credentials"


def profile_of(url: str) -> tuple[str, str]:
    """msc://profile/key -> (profile, key)."""
    profile, _, key = paths.normalize(url)[len("msc://"):].partition("/")
    if not profile:
        raise CheckpointError(f"{url!r}: an msc:// path names a profile: msc://profile/prefix")
    return profile, key


def read_profile(profile: str, url: str) -> dict:
    """The profile's configuration, from the file multi-storage-client itself would read."""
    try:
        from multistorageclient import StorageClientConfig
    except ImportError:
        raise ImportError("msc:// checkpoints need multi-storage-client: pip install multi-storage-client") from None
    config, where = StorageClientConfig.read_msc_config()
    profiles = (config or {}).get("profiles", {})
    if profile not in profiles:
        raise CheckpointError(f"{url!r}: no MSC profile {profile!r} in {where or 'any MSC config (set MSC_CONFIG)'}"
                         f"{' (it has ' + ', '.join(sorted(profiles)) + ')' if profiles else ''}")
    return profiles[profile]


def msc_storage(url: str, options: S3Options = S3Options()) -> S3Storage:
    """The S3 backend for the profile `url` names; every URL under that profile is located by its base path."""
    profile, _ = profile_of(url)
    config = read_profile(profile, url)
    provider = config.get("storage_provider", {})
    if provider.get("type") not in S3_PROVIDERS:
        raise CheckpointError(f"{url!r}: MSC profile {profile!r} uses the {provider.get('type')!r} provider; checkpoints "
                         f"reach only S3-compatible ones ({', '.join(S3_PROVIDERS)}) through msc://")
    opts = provider.get("options", {})
    bucket, _, base = opts.get("base_path", "").strip("/").partition("/")
    if not bucket:
        raise CheckpointError(f"{url!r}: MSC profile {profile!r} has no base_path (bucket[/prefix])")
    credentials = config.get("credentials_provider")
    keys = None
    if credentials is not None:
        if credentials.get("type") != STATIC_CREDENTIALS:
            raise CheckpointError(f"{url!r}: MSC profile {profile!r} uses the {credentials.get('type')!r} credentials "
                             f"provider; only {STATIC_CREDENTIALS} is read (else the standard AWS chain)")
        c = credentials.get("options", {})
        keys = tuple(v for v in (c.get("access_key"), c.get("secret_key"), c.get("session_token")) if v)

    def locate(path: str) -> tuple[str, str]:
        named, key = profile_of(path)
        if named != profile:
            raise CheckpointError(f"{path!r} is not under MSC profile {profile!r}")
        return bucket, "/".join(p for p in (base, key) if p)

    return S3Storage(locate, client(opts.get("endpoint_url"), opts.get("region_name"), None,
                                    max(options.writer_threads, options.read_threads) + 2, keys), options)
