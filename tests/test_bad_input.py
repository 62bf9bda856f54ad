"""Bad input: damaged, edited, forged and foreign checkpoints are refused with a clear CheckpointError that names
the file, never loaded as wrong data, never crash the process, never run code.

Property-based (hypothesis) over edits of the checkpoint's index (metadata.json, the one file a load reads), random
JSON and bytes, truncation offsets and bit-flip positions. Forged indexes (edited *and* re-signed with a valid
checksum, i.e. a hostile file) run in a child process so that a memory-safety failure is reported as a failing
test instead of killing the test session.
"""
import collections
import copy
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from datastates import CheckpointCorruptError, CheckpointEngine, PosixOptions, CheckpointError
from datastates import format as fmt
from datastates import paths

_np_reconstruct = (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct
HERE = os.path.dirname(os.path.abspath(__file__))
FAST = settings(max_examples=int(os.environ.get("BAD_INPUT_EXAMPLES", 60)), deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
def make_state():
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 32, generator=gen),                      # one chunk
            "big": torch.arange(60000, dtype=torch.float32),              # several chunks (small slots)
            "half": torch.randn(7, 3, generator=gen).to(torch.bfloat16),  # padded to 4 KiB
            "step": torch.tensor(11),
            "cfg": {"lr": 0.1, "name": "gpt", "layers": [1, 2, 3]}}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    with CheckpointEngine(host_buffer_bytes=256 << 10, storage=PosixOptions(writer_threads=2)) as eng:
        eng.save(make_state(), str(root / "iter_0000001"))
        eng.wait()
    return root


@pytest.fixture(scope="module")
def engine():
    with CheckpointEngine(host_buffer_bytes=256 << 10, storage=PosixOptions(writer_threads=2)) as eng:
        yield eng


@pytest.fixture
def work(saved, tmp_path):
    """A fresh copy of the saved checkpoint root."""
    dst = tmp_path / "ck"
    shutil.copytree(saved, dst)
    return dst


def _paths(root):
    d = root / "iter_0000001"
    return d, d / paths.manifest_file(0), d / paths.data_file(0), d / paths.METADATA


def _load_both(engine, root):
    """Load without and with a template; return both results (or raise)."""
    plain = engine.load(str(root))
    template = make_state()
    for v in template.values():
        if isinstance(v, torch.Tensor):
            v.zero_()
    return plain, engine.load(str(root), template=template)


def _refused(engine, root, names, kind=CheckpointError):
    """The load raises `kind` whose message names one of `names`; any other exception type fails the test."""
    with pytest.raises(kind) as info:
        _load_both(engine, root)
    assert any(str(n) in str(info.value) for n in names), f"message does not name the file: {info.value}"
    return info.value


# ----- the index -----

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) |
                    st.text(max_size=8), lambda kids: st.lists(kids, max_size=4) |
                    st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=12)
ITEM_FIELDS = ["id", "kind", "scope", "name", "dtype", "shape", "global_shape", "global_offset", "write",
               "offset", "nbytes", "chunk_bytes", "crcs"]
FIELDS = {"top": ["world_size", "schema_version", "format", "iteration", "bytes", "manifests", "ranks"],
          "rank": ["data_file", "data_bytes", "items"], "item": ITEM_FIELDS}


@st.composite
def index_edits(draw):
    """A list of (target, index, field, action, value): field changes, deletions, type swaps, numeric nudges of
    the metadata, of rank 0's entry in the index, or of one of its items."""
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(sorted(FIELDS)))
        field = draw(st.sampled_from(FIELDS[target]))
        action = draw(st.sampled_from(["delete", "replace", "nudge", "swap_type"]))
        value = draw(JSON) if action == "replace" else draw(st.integers(-8192, 8192))
        edits.append((target, draw(st.integers(0, 10)), field, action, value))
    return edits


def _target(doc, target, index):
    """The dict an edit applies to, or the metadata itself once earlier edits broke the path to it."""
    rank = doc.get("ranks", {}).get("0") if isinstance(doc.get("ranks"), dict) else None
    if target == "top" or not isinstance(rank, dict):
        return doc
    items = rank.get("items")
    if target == "rank" or not (isinstance(items, list) and items and isinstance(items[0], dict)):
        return rank
    return items[index % len(items)]


def apply_edits(doc, edits):
    doc = copy.deepcopy(doc)
    for target, index, field, action, value in edits:
        obj = _target(doc, target, index)
        if action == "delete":
            obj.pop(field, None)
        elif action == "replace":
            obj[field] = value
        elif action == "nudge":
            old = obj.get(field)
            if isinstance(old, bool) or not isinstance(old, int):
                obj[field] = value
            else:
                obj[field] = old + (value or 1)
        else:  # the same value as another JSON type
            old = obj.get(field)
            obj[field] = str(old) if not isinstance(old, str) else [old]
    return doc


def _resign(meta_path, doc):
    """What a hostile tool would do: a valid checksum over the edited index."""
    body = {k: v for k, v in doc.items() if k != "metadata_crc32c"}
    meta_path.write_text(json.dumps(dict(doc, metadata_crc32c=fmt._body_crc(body))))


# what a refusal of an edited field names: the field, in these words for some
FIELD_WORDS = {"schema_version": ["schema version"], "format": ["datastates checkpoint"],
               "manifests": ["manifests", "manifest"], "ranks": ["ranks", "rank"], "data_file": ["data file"],
               "data_bytes": ["truncated", "longer than recorded"], "items": ["item"]}


def _named(doc, edits) -> list[str]:
    """What a refusal of `edits` may name (regular expressions): an edited field; for an edit of rank 0's entry
    or of one of its items, that entry as malformed; for an item edit, the item (its bytes read elsewhere fail
    its data checksum; a broken shape or extent is reported with the item)."""
    words = []
    items = doc["ranks"]["0"]["items"]
    for target, index, field, _, _ in edits:
        words += [fr"\b{field}\b"] + [fr"\b{w}\b" for w in FIELD_WORDS.get(field, [])]
        if target != "top":
            words.append(r"\(rank 0\) is malformed")
        if target == "item":
            words.append(re.escape(repr(items[index % len(items)]["id"])))
    return words


DELETE = object()
# One re-signed edit per structural check of the index (datastates/schema.py; open_checkpoint.py for the saved structure's
# leaves), and the refusal it must produce:
# (what is edited: "top", "rank" (rank 0's entry) or an item id; the changes: a value, DELETE, or a function of the
# old value; the message). Random edits reach most checks only by chance; this reaches each one.
STRUCTURAL = [
    ("top", {"world_size": 0}, r"has no valid world_size"),
    ("top", {"schema_version": 3}, r"has schema version 3; this datastates reads versions 1 to 2"),
    ("top", {"format": "torch_dist"}, r"is not a datastates checkpoint file \(format='torch_dist'\)"),
    ("top", {"iteration": "1"}, r"is malformed: iteration '1'"),
    ("top", {"bytes": -1}, r"is malformed: iteration 1, bytes -1"),
    ("top", {"manifests": []}, r"'manifests' is not a mapping of rank to crc32c"),
    ("top", {"ranks": []}, r"'ranks' is not a mapping of rank to its items"),
    ("top", {"ranks": {}}, r"\(rank 0\) is missing or not a JSON object"),
    ("rank", {"data_file": 5}, r"\(rank 0\) is malformed: TypeError: items must be a list and data_file a string"),
    ("rank", {"items": {}}, r"\(rank 0\) is malformed: TypeError: items must be a list and data_file a string"),
    ("rank", {"data_bytes": -1}, r"\(rank 0\) is malformed: ValueError: data_bytes -1"),
    ("rank", {"data_bytes": DELETE}, r"\(rank 0\) is malformed: KeyError: 'data_bytes'"),
    ("rank", {"data_bytes": lambda n: n + 1}, r"rank_00000.data' is truncated: (\d+) bytes, the checkpoint's index "
                                              r"says (?!\1)\d+"),
    ("w", {"extra": 1}, r"item 'w': ValueError: unknown item fields \['extra'\]"),
    ("w", {"kind": "blob"}, r"item 'w': ValueError: kind 'blob' is not one of tensor, object"),
    ("w", {"scope": "everywhere"}, r"item 'w': ValueError: scope 'everywhere' is not one of local, global"),
    ("w", {"id": 5}, r"ValueError: id and \(for global items\) name must be strings"),
    ("w", {"scope": "global"}, r"item 'w': ValueError: id and \(for global items\) name must be strings"),
    ("w", {"nbytes": "8192"}, r"item 'w': ValueError: nbytes must be an int"),
    ("w", {"write": 1}, r"item 'w': ValueError: write must be a bool, got 1"),
    ("w", {"dtype": "float99"}, r"item 'w': ValueError: unknown dtype 'float99'"),
    ("w", {"shape": [64, -32]}, r"item 'w': ValueError: shape must be a list of non-negative ints"),
    ("w", {"shape": [64, 33]}, r"item 'w': ValueError: nbytes 8192 does not match float32 \(64, 33\)"),
    ("w", {"chunk_bytes": 3}, r"item 'w': ValueError: chunk_bytes 3 splits float32 elements"),
    ("w", {"scope": "global", "name": "w", "global_shape": [64, 32], "global_offset": [1, 0]},
     r"item 'w': ValueError: box \(1, 0\)\+\(64, 32\) exceeds \(64, 32\)"),
    ("cfg/lr", {"chunk_bytes": 0}, r"item 'cfg/lr': ValueError: nbytes 21 / chunk_bytes 0"),
    ("w", {"offset": -1}, r"item 'w': ValueError: extent -1\+8192 is outside the data file \(\d+ bytes\)"),
    ("w", {"offset": 1 << 40}, r"item 'w': ValueError: extent 1099511627776\+8192 is outside the data file"),
    ("w", {"crcs": []}, r"item 'w': ValueError: crcs must be a list of non-negative ints, got \[\]"),
    ("w", {"crcs": [1 << 32]}, r"item 'w': ValueError: a crc32c is out of range"),
    ("big", {"id": "w"}, r"item 'w': ValueError: duplicate item id 'w'"),
    ("w", {"id": "renamed"}, r"\(rank 0\) is malformed: its saved state structure \('__skeleton__'\) refers to item "
                             r"'w', which its index does not list"),
]


def _structural_edit(doc, where, changes):
    doc = copy.deepcopy(doc)
    obj = doc if where == "top" else doc["ranks"]["0"]
    if where not in ("top", "rank"):
        obj = next(it for it in obj["items"] if it["id"] == where)
    for field, value in changes.items():
        if value is DELETE:
            del obj[field]
        elif callable(value):
            obj[field] = value(obj[field])
        else:
            obj[field] = value
    return doc


FORGE_CHILD = os.environ.get("DS_FORGE_CHILD") == "1"


def test_edited_index_is_refused(tmp_path):
    """Edits of the index (field changes, deletions, type swaps, nudges). As written, the index's own checksum
    refuses them. Re-signed with a valid checksum (a hostile file), structural validation alone must hold: the
    load is refused with a CheckpointError naming the checkpoint and what is wrong (not the checksum), or, for
    the few edits that change nothing a load uses, it loads the very same data.

    Runs the property in a child process: were validation to let a read overrun its tensor, memory would be
    corrupted (a crash), not an exception raised."""
    if not FORGE_CHILD:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            f"{os.path.abspath(__file__)}::test_edited_index_is_refused"],
                           env=dict(os.environ, DS_FORGE_CHILD="1"), capture_output=True, text=True, timeout=600,
                           cwd=os.path.dirname(HERE))
        assert r.returncode == 0, (f"child exit {r.returncode} (-11/139 = segfault)\n" + r.stdout[-6000:]
                                   + r.stderr[-3000:])
        return
    base = tmp_path / "base"
    outcomes = collections.Counter()
    with CheckpointEngine(host_buffer_bytes=256 << 10, storage=PosixOptions(writer_threads=2)) as eng:
        eng.save(make_state(), str(base / "iter_0000001"))
        eng.wait()
        doc0 = json.loads(_paths(base)[3].read_text())

        for where, changes, expected in STRUCTURAL:  # every check, each by an edit only it refuses
            root = tmp_path / "s"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(base, root)
            _resign(_paths(root)[3], _structural_edit(doc0, where, changes))
            try:
                _load_both(eng, root)
            except CheckpointError as e:
                msg = str(e)
            else:
                pytest.fail(f"re-signed edit {where} {changes} was loaded: no check refused it")
            assert re.search(expected, msg) and str(root) in msg, \
                f"re-signed edit {where} {changes}: expected /{expected}/, got: {msg}"

        @FAST
        @given(edits=index_edits())
        def prop(edits):
            root = tmp_path / "f"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(base, root)
            meta = _paths(root)[3]
            edited = apply_edits(doc0, edits)
            if edited == doc0:
                assert all(same(x, make_state()) for x in _load_both(eng, root))
                return
            meta.write_text(json.dumps(edited))  # as edited: refused (by the checksum, or first by the schema)
            _refused(eng, root, [meta])
            _resign(meta, edited)
            try:
                loaded = _load_both(eng, root)
            except CheckpointError as e:
                msg = str(e)
                assert "fails its checksum" not in msg, f"re-signed index {edits} refused by its checksum: {msg}"
                assert str(root) in msg, f"message does not name the checkpoint: {msg}"
                assert any(re.search(w, msg) for w in _named(doc0, edits)), \
                    f"refusal of {edits} does not name what is wrong: {msg}"
                outcomes["refused"] += 1
                return
            assert all(same(x, make_state()) for x in loaded), f"re-signed index {edits} loaded as different data"
            outcomes["loaded, unchanged"] += 1
        prop()
    # the structural checks are what this exercises: most edits break the index
    assert outcomes["refused"] >= 2 * outcomes["loaded, unchanged"], outcomes


@FAST
@given(raw=st.one_of(st.binary(max_size=64), JSON.map(lambda doc: json.dumps(doc).encode())))
def test_random_bytes_or_json_as_index_are_refused(saved, engine, tmp_path_factory, raw):
    """Also bytes that are not UTF-8."""
    root = tmp_path_factory.mktemp("bytes")
    shutil.copytree(saved, root, dirs_exist_ok=True)
    _, _, _, meta = _paths(root)
    meta.write_bytes(raw)
    _refused(engine, root, [meta, root])
    shutil.rmtree(root)


def test_damaged_manifest_does_not_matter_to_a_load(work, engine):
    """A rank's manifest is its written proof, not something a load reads: the index alone is."""
    _, manifest, _, meta = _paths(work)
    manifest.write_bytes(b"\xff\xfe{\"format\": 1}")
    assert all(same(x, make_state()) for x in _load_both(engine, work))
    meta.write_bytes(b"\xff\xfe{\"format\": 1}")
    _refused(engine, work, [meta], CheckpointCorruptError)


def test_newer_schema_and_foreign_format_are_refused(work, engine):
    _, _, _, meta = _paths(work)
    doc = json.loads(meta.read_text())
    _resign(meta, dict(doc, schema_version=fmt.SCHEMA_VERSION + 1))
    err = _refused(engine, work, [meta])
    assert "schema version" in str(err) and "upgrade" in str(err)
    _resign(meta, dict(doc, format="torch_dist"))
    assert "not a datastates checkpoint" in str(_refused(engine, work, [meta]))
    meta.write_text(json.dumps(dict(doc, schema_version=fmt.SCHEMA_VERSION + 7)))
    assert "schema version" in str(_refused(engine, work, [meta]))
    for older in (1, False):  # a checksummed index edited to look older still has to match its checksum
        meta.write_text(json.dumps(dict(doc, schema_version=older)))
        _refused(engine, work, [meta])


def test_forged_item_larger_than_its_tensor_is_refused(tmp_path):
    """A re-signed index whose small tensor item claims a big item's bytes must be refused before any read
    (unchecked, the native pread would write past the end of the 40-byte tensor: heap overflow, SIGSEGV)."""
    script = f"""
import json, os, torch
from datastates import CheckpointEngine, PosixOptions, CheckpointError, format as fmt
root = {str(tmp_path)!r}
with CheckpointEngine(host_buffer_bytes=1 << 20, storage=PosixOptions(writer_threads=2)) as eng:
    eng.save({{"a": torch.zeros(10), "big": torch.arange(200000, dtype=torch.float32)}}, root + "/iter_0000001")
    eng.wait()
    d = root + "/iter_0000001"
    meta = json.load(open(d + "/metadata.json"))
    a, b = (next(i for i in meta["ranks"]["0"]["items"] if i["id"] == k) for k in ("a", "big"))
    a.update(offset=b["offset"], nbytes=b["nbytes"], chunk_bytes=b["chunk_bytes"], crcs=b["crcs"])
    meta["metadata_crc32c"] = fmt._body_crc({{k: v for k, v in meta.items() if k != "metadata_crc32c"}})
    json.dump(meta, open(d + "/metadata.json", "w"))
    for template in (None, {{"a": torch.zeros(10), "big": torch.zeros(200000)}}):
        try:
            eng.load(root, template=template)
            print("LOADED")
        except CheckpointError as e:
            print("REFUSED", e)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode} (-11 = SIGSEGV): {r.stderr[-2000:]}"
    assert r.stdout.count("REFUSED") == 2 and "rank 0" in r.stdout, r.stdout


# ----- data files -----

@FAST
@given(frac=st.floats(0, 1, exclude_max=True))
def test_truncated_data_file_is_refused(saved, engine, tmp_path_factory, frac):
    root = tmp_path_factory.mktemp("trunc")
    shutil.copytree(saved, root, dirs_exist_ok=True)
    _, _, data, _ = _paths(root)
    size = data.stat().st_size
    os.truncate(data, int(frac * size))
    assert "truncated" in str(_refused(engine, root, [data], CheckpointCorruptError))
    shutil.rmtree(root)


def _covered(meta_path):
    """Byte ranges of rank 0's data file that hold written item bytes (the rest is alignment padding)."""
    items = json.loads(meta_path.read_text())["ranks"]["0"]["items"]
    return [(it["offset"], it["offset"] + it["nbytes"], it["id"]) for it in items
            if it.get("write", True) and it["nbytes"]]


@FAST
@given(pos=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_every_bit_flip_in_item_bytes_is_detected(saved, engine, tmp_path_factory, pos, bit):
    root = tmp_path_factory.mktemp("flip")
    shutil.copytree(saved, root, dirs_exist_ok=True)
    _, _, data, meta = _paths(root)
    raw = bytearray(data.read_bytes())
    at = int(pos * len(raw))
    raw[at] ^= 1 << bit
    data.write_bytes(bytes(raw))
    hit = [i for lo, hi, i in _covered(meta) if lo <= at < hi]
    if hit:
        err = _refused(engine, root, [data], CheckpointCorruptError)
        assert "checksum mismatch" in str(err) and repr(hit[0]) in str(err), err
    else:  # alignment padding: never read, harmless
        assert all(same(x, make_state()) for x in _load_both(engine, root))
    shutil.rmtree(root)


def test_flip_in_every_item_and_padding_exhaustive_edges(work, engine):
    """The first and last byte of every item are covered; the byte right after an item (padding) is not read."""
    _, _, data, meta = _paths(work)
    original = data.read_bytes()
    for lo, hi, item_id in _covered(meta):
        for at, inside in ((lo, True), (hi - 1, True), (hi, False)):
            if at >= len(original) or (not inside and any(a <= at < b for a, b, _ in _covered(meta))):
                continue
            raw = bytearray(original)
            raw[at] ^= 0x80
            data.write_bytes(bytes(raw))
            if inside:
                err = _refused(engine, work, [data], CheckpointCorruptError)
                assert repr(item_id) in str(err)
            else:
                assert all(same(x, make_state()) for x in _load_both(engine, work))
    data.write_bytes(original)


def test_appended_bytes_are_harmless(work, engine):
    _, _, data, _ = _paths(work)
    with open(data, "ab") as f:
        f.write(os.urandom(5000))
    assert all(same(x, make_state()) for x in _load_both(engine, work))


# ----- a checkpoint of another model -----

@pytest.mark.parametrize("change", ["shape", "transposed", "dtype", "missing_key", "extra_key", "object_vs_tensor"])
def test_checkpoint_of_another_model_shape_is_refused(work, engine, change):
    template = make_state()
    if change == "shape":
        template["w"] = torch.zeros(64, 48)
    elif change == "transposed":
        template["w"] = torch.zeros(32, 64)
    elif change == "dtype":
        template["big"] = torch.zeros(60000, dtype=torch.float64)
    elif change == "missing_key":
        template["extra_layer"] = torch.zeros(3)
    elif change == "extra_key":
        template = {"w": template["w"], "renamed": template["big"]}
    else:
        template["cfg"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as info:
        engine.load(str(work), template=template)
    msg = str(info.value)
    assert str(work / "iter_0000001") in msg
    key = {"shape": "'w'", "transposed": "'w'", "dtype": "'big'", "missing_key": "'extra_layer'",
           "extra_key": "'renamed'", "object_vs_tensor": "cfg"}[change]
    assert key in msg, msg


# ----- objects: restricted unpickling -----

class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _evil_payloads(marker):
    import builtins
    cmd = f"touch {marker}"
    return {
        "os.system": _Reduce(os.system, (cmd,)),
        "nested in a list": [1, {"x": [_Reduce(os.system, (cmd,))]}],
        "builtins.eval": _Reduce(builtins.eval, (f"__import__('os').system({cmd!r})",)),
        "builtins.exec": _Reduce(builtins.exec, (f"import os; os.system({cmd!r})",)),
        "getattr chain": _Reduce(builtins.getattr, (_Reduce(builtins.__import__, ("os",)), "system")),
        "subprocess": _Reduce(subprocess.call, (["sh", "-c", cmd],)),
        "torch.load": _Reduce(torch.load, (marker,)),
        "numpy object array from raw bytes": _Reduce(
            _np_reconstruct, (np.ndarray, (0,), b"b")),
        "in a dict value of allowed type": {"ok": 1, "bad": _Reduce(os.system, (cmd,))},
    }


@pytest.mark.parametrize("name", list(_evil_payloads("/nonexistent").keys()))
def test_malicious_pickle_is_refused(tmp_path, engine, name):
    marker = tmp_path / "pwned"
    payload = _evil_payloads(str(marker))[name]
    if name == "numpy object array from raw bytes":  # an object array whose "pointers" come from bytes
        payload = _ForgedObjectArray()
    engine.save({"w": torch.ones(3), "x": payload}, str(tmp_path / "iter_0000001"))
    engine.wait()
    with pytest.raises(CheckpointError) as info:
        engine.load(str(tmp_path))
    assert "rank_00000.data" in str(info.value)
    assert not marker.exists(), "the checkpoint ran code"
    # a whole pickle stream handed to the unpickler directly is refused as well
    with pytest.raises(CheckpointError, match="^cannot load object x: "):
        fmt.loads(pickle.dumps(payload, protocol=4), "x")
    assert not marker.exists()


class _ForgedObjectArray:
    def __reduce__(self):
        return (_np_reconstruct, (np.ndarray, (0,), b"b"),
                (1, (1,), np.dtype("O"), False, b"\x41" * 8))


def test_allowed_objects_still_load(tmp_path, engine):
    import argparse
    import collections
    import datetime
    objs = {"ns": argparse.Namespace(a=1), "od": collections.OrderedDict(a=1), "dt": datetime.datetime(2024, 1, 1),
            "np": np.arange(5), "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "set": {1, 2},
            "rng": np.random.RandomState(0).get_state()}
    engine.save(objs, str(tmp_path / "iter_0000001"))
    engine.wait()
    out = engine.load(str(tmp_path))
    assert vars(out["ns"]) == {"a": 1} and out["od"] == objs["od"] and out["dtype"] is torch.bfloat16
    assert np.array_equal(out["np"], objs["np"]) and out["size"] == objs["size"]
