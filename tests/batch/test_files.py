"""The batch file store on a real directory: retention, size limit, ids."""

import io
import os

import pytest

from lorapool.batch.files import FileStore, FileTooLarge


def test_files_live_until_their_retention(tmp_path):
    store = FileStore(tmp_path, retention_s=60)
    info = store.put(io.BytesIO(b'{"a": 1}\n{"b": 2}\n'), "in.jsonl")
    assert info["bytes"] == 18 and info["expires_at"] == info["created_at"] + 60
    assert list(store.lines(info["id"])) == [b'{"a": 1}', b'{"b": 2}']
    stale = store.writer("out.jsonl")  # a collector that died mid-file
    stale.write({"x": 1})
    stale.file.close()
    os.utime(stale.partial, (0, 0))
    assert store.sweep(now=info["expires_at"] - 1) == 0 and store.info(info["id"])
    assert store.sweep(now=info["expires_at"]) == 1
    assert not stale.partial.exists()
    with pytest.raises(KeyError):
        store.info(info["id"])


def test_an_upload_over_the_limit_leaves_nothing(tmp_path):
    store = FileStore(tmp_path, max_bytes=100)
    with pytest.raises(FileTooLarge):
        store.put(io.BytesIO(b"x" * 101), "big.jsonl")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", ["", "file-../../etc/passwd", "file-" + "0" * 31, "../x"])
def test_malformed_ids_are_unknown(tmp_path, bad):
    with pytest.raises(KeyError):
        FileStore(tmp_path).path(bad)
