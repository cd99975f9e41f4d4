"""S3 through moto's ThreadedMotoServer and GCS through the loopback fake, with the real client libraries."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import boto3
import pytest
from transfer_fake_gcs import FakeGcs

from gpumigrate.errors import IntegrityError, InvalidInputError, NotFoundError
from gpumigrate.interfaces import RegionInfo
from gpumigrate.transfer import open_reader, open_writer, pack_paths, push, store_region, unpack, verify
from gpumigrate.transfer.stores import chunk_key, open_store
from gpumigrate.transfer.stores.s3 import S3Store


@pytest.fixture
def packed(tmp_path: Path, key: bytes) -> tuple[str, str, Path]:
    src = tmp_path / "in"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(5 << 20))
    (src / "b").write_bytes(b"abc" * 100_000)
    local = f"file://{tmp_path / 'local'}"
    return local, pack_paths([src], local, key=key).id, src


def test_s3_push_verify_unpack_and_resume(
    packed: tuple[str, str, Path], key: bytes, s3_bucket: str, moto_endpoint: str, tmp_path: Path
) -> None:
    local, image_id, src = packed
    url = f"s3://{s3_bucket}/images/run1"
    first = push(local, url, image_id, key=key, endpoint_url=moto_endpoint)
    assert first.chunks_sent == first.chunks_total > 1
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert f"images/run1/manifests/{image_id}" in keys
    # lose one chunk at the destination: a re-run moves exactly that one
    victim = next(k for k in keys if "/chunks/" in k)
    s3.delete_object(Bucket=s3_bucket, Key=victim)
    again = push(local, url, image_id, key=key, endpoint_url=moto_endpoint)
    assert again.chunks_sent == 1 and again.chunks_skipped == first.chunks_total - 1
    assert verify(url, image_id, key=key, endpoint_url=moto_endpoint).chunks_total == first.chunks_total
    unpack(url, image_id, tmp_path / "out", key=key, endpoint_url=moto_endpoint)
    assert (tmp_path / "out" / "in" / "a").read_bytes() == (src / "a").read_bytes()
    assert store_region(url, endpoint_url=moto_endpoint) == "eu-central-1"


def test_s3_corrupt_object_is_detected(
    packed: tuple[str, str, Path], key: bytes, s3_bucket: str, moto_endpoint: str
) -> None:
    local, image_id, _ = packed
    url = f"s3://{s3_bucket}/x"
    push(local, url, image_id, key=key, endpoint_url=moto_endpoint)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    victim = next(o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="x/chunks/")["Contents"])
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=victim)["Body"].read())
    body[-3] ^= 0x10
    s3.put_object(Bucket=s3_bucket, Key=victim, Body=bytes(body))
    with pytest.raises(IntegrityError, match="failed authentication"):
        verify(url, image_id, key=key, endpoint_url=moto_endpoint)


def test_s3_multipart_upload_of_a_large_chunk(key: bytes, s3_bucket: str, moto_endpoint: str) -> None:
    store = S3Store(f"s3://{s3_bucket}/mp?multipart_threshold=6000000", endpoint_url=moto_endpoint)
    data = os.urandom(12 << 20)
    w = open_writer(store, key=key, chunk_size=12 << 20, compression="none")
    w.add_region(RegionInfo(name="big", nbytes=len(data), kind="blob"))
    cid = w.put_chunk("big", 0, memoryview(data))
    ref = w.commit()
    head = boto3.client("s3", endpoint_url=moto_endpoint).head_object(Bucket=s3_bucket, Key=f"mp/{chunk_key(cid)}")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5 + 5 + 2 MiB
    assert bytes(open_reader(store, ref.id, key=key).read_region("big")) == data


def test_s3_missing_image_and_bucket(key: bytes, s3_bucket: str, moto_endpoint: str) -> None:
    with pytest.raises(NotFoundError):
        open_reader(f"s3://{s3_bucket}/none", "ab" * 32, key=key, endpoint_url=moto_endpoint)
    with pytest.raises(InvalidInputError, match="does not exist"):
        open_store("s3://gm-no-such-bucket/x", endpoint_url=moto_endpoint).put_manifest("ab" * 32, b"{}")


def test_gcs_pack_push_verify_unpack(
    packed: tuple[str, str, Path], key: bytes, fake_gcs: FakeGcs, tmp_path: Path
) -> None:
    local, image_id, src = packed
    url = "gs://gm-bucket/images"
    first = push(local, url, image_id, key=key, endpoint_url=fake_gcs.endpoint)
    assert first.chunks_sent == first.chunks_total
    assert push(local, url, image_id, key=key, endpoint_url=fake_gcs.endpoint).chunks_sent == 0
    assert verify(url, image_id, key=key, endpoint_url=fake_gcs.endpoint).chunks_total == first.chunks_total
    unpack(url, image_id, tmp_path / "out", key=key, endpoint_url=fake_gcs.endpoint)
    assert (tmp_path / "out" / "in" / "b").read_bytes() == (src / "b").read_bytes()
    assert store_region(url, endpoint_url=fake_gcs.endpoint) == "europe-west4"
    # pack straight into GCS, with the local image's chunks deduplicated against what is there
    ref = pack_paths([src], url, key=key, endpoint_url=fake_gcs.endpoint)
    assert ref.bytes_sent < 4096
    # a damaged object in GCS is caught
    name = next(n for (_, n) in fake_gcs.objects if "/chunks/" in n)
    data = bytearray(fake_gcs.objects[("gm-bucket", name)])
    data[70] ^= 1
    fake_gcs.objects[("gm-bucket", name)] = bytes(data)
    with pytest.raises(IntegrityError):
        verify(url, image_id, key=key, endpoint_url=fake_gcs.endpoint)


def test_bad_store_urls_are_clear_errors() -> None:
    for url in ("ftp://x/y", "/plain/path", "file://", "s3:///prefix-only"):
        with pytest.raises(InvalidInputError):
            open_store(url)


def test_file_store_chunk_mode_names_a_chunk_only_once_its_data_is_synced(tmp_path: Path) -> None:
    """Default sync mode: put_chunk returns before the disk flush; flush() waits, and afterwards every
    chunk is whole under its name and no temp file is left. Before flush a chunk is either absent or whole."""
    store = open_store(f"file://{tmp_path / 's'}")
    blobs = {f"{n:02x}" + "ab" * 31: os.urandom(200_000 + n) for n in range(24)}
    for cid, blob in blobs.items():
        store.put_chunk(cid, blob)
        size = store.chunk_size(cid)
        assert size in (None, len(blob))  # never a visible, partly written chunk
    store.flush()
    assert store.list_chunks() == {cid: len(b) for cid, b in blobs.items()}
    assert all(store.get_chunk(cid) == b for cid, b in blobs.items())
    assert not [p for p in (tmp_path / "s").rglob(".*") if p.is_file()]
    store.close()


def test_a_file_store_in_memory_skips_preallocation_and_stores_the_same_bytes(tmp_path: Path) -> None:
    """tmpfs zeroes what fallocate reserves, then write() fills it again: a store there writes without it."""
    from gpumigrate.transfer.stores.file import MEMORY_FILESYSTEMS, FileStore, filesystem_of

    shm = Path("/dev/shm")
    if filesystem_of(shm) not in MEMORY_FILESYSTEMS:
        pytest.skip("no tmpfs at /dev/shm here")
    blob = os.urandom(1 << 20)
    stores = {}
    with tempfile.TemporaryDirectory(dir=shm) as root:
        for where in (Path(root), tmp_path):
            store = FileStore(where / "s", f"file://{where / 's'}")
            store.put_chunk("ab" * 32, blob)
            if where == Path(root):  # in memory: renamed on the caller's thread, no sync threads
                assert store.get_chunk("ab" * 32) == blob and not store._syncer.running
            store.flush()
            stores[where] = (store, store.get_chunk("ab" * 32))
        in_memory = stores[Path(root)][0]
        assert not in_memory._preallocate
        assert stores[tmp_path][0]._preallocate == (filesystem_of(tmp_path) not in MEMORY_FILESYSTEMS)
        assert all(got == blob for _, got in stores.values())


def test_the_sync_threads_run_every_job_and_a_wait_reports_what_failed() -> None:
    """The file store's fdatasync-and-rename jobs (``stores/syncing.py``): ``wait`` returns once every job submitted
    ran, failed ones included, with their errors in order; ``close`` ends the threads and a later job starts them."""
    from gpumigrate.transfer.stores.syncing import SyncThreads

    done: list[int] = []
    lock = threading.Lock()
    release = threading.Event()

    def job(i: int) -> None:
        release.wait(30)
        if i % 10 == 3:
            raise OSError(f"disk full at {i}")
        with lock:
            done.append(i)

    sync = SyncThreads(4, "test-sync")
    assert sync.running == 0 and sync.wait() == []
    for i in range(40):
        sync.submit(lambda i=i: job(i))
    assert sync.running == 4
    release.set()
    errors = sync.wait()
    assert sorted(done) == [i for i in range(40) if i % 10 != 3]
    assert sorted(str(e) for e in errors) == sorted(f"disk full at {i}" for i in (3, 13, 23, 33))
    assert sync.wait() == []  # reported once
    sync.close()
    assert sync.running == 0
    sync.submit(lambda: done.append(99))
    assert sync.wait() == [] and done[-1] == 99
    sync.close()


def test_a_file_store_let_go_without_close_gives_back_its_directories_and_threads(tmp_path: Path) -> None:
    """A store nobody closes (a reader opened for one image, an agent's store after a migration) is collected with
    its directory fds and sync threads: a long-lived process that opens store after store must not run out of file
    descriptors (CI once did, after 1,000 of them: select() then refused every socket)."""
    import gc

    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    def sync_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("gm-fsync")]

    before, threads_before = fds(), len(sync_threads())
    store = open_store(f"file://{tmp_path / 's'}")
    for n in range(16):
        store.put_chunk(f"{n:02x}" + "cd" * 31, os.urandom(4096))
    store.flush()
    assert len(fds() - before) >= 16  # a directory fd per fan-out directory, held while the store lives
    del store
    gc.collect()
    assert not fds() - before, "the collected store's directory fds are still open"
    for t in sync_threads()[threads_before:]:
        t.join(timeout=30)
        assert not t.is_alive(), f"{t.name} still runs after its store was collected"
