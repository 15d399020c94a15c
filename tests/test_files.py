"""Atomic writes (qwenft.files): whole or nothing, with the permissions of an ordinary file or folder."""

from __future__ import annotations

import os

import pytest

from qwenft.files import atomic_write_bytes, atomic_write_text, publish_tree, staging_dir, umask

@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)

def test_written_file_has_umask_permissions_and_no_temp_left(tmp_path, umask_022):
    path = atomic_write_text(tmp_path / "sub" / "out.json", "{}\n")
    assert path.read_text() == "{}\n"
    assert path.stat().st_mode & 0o777 == 0o644  # mkstemp's 0600 would fail this
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]
    os.umask(0o077)
    assert umask() == 0o077
    assert atomic_write_text(tmp_path / "private.txt", "x").stat().st_mode & 0o777 == 0o600

def test_failed_write_keeps_the_old_file(tmp_path, umask_022):
    path = atomic_write_bytes(tmp_path / "keep.bin", b"old")

    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")  # the write fails after the temp file exists
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.bin"]

def test_staging_dir_is_an_ordinary_folder(tmp_path, umask_022):
    work = staging_dir(tmp_path)
    assert work.parent == tmp_path and work.name.startswith(".tmp-")
    assert work.stat().st_mode & 0o777 == 0o755


def test_publish_tree_opens_private_files(tmp_path, umask_022):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "weights.safetensors").write_bytes(b"x")
    os.chmod(tmp_path / "a" / "b" / "weights.safetensors", 0o600)  # as safetensors writes them
    os.chmod(tmp_path / "a" / "b", 0o700)
    publish_tree(tmp_path / "a")
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "a" / "b" / "weights.safetensors").stat().st_mode & 0o777 == 0o644


def test_publish_dir_replaces_whole_or_keeps_the_first(tmp_path):
    from qwenft.files import publish_dir, staging_dir

    final = tmp_path / "adapter"
    for text in ("one", "two"):
        built = staging_dir(tmp_path)
        (built / "w.txt").write_text(text)
        assert publish_dir(built, final) == final and not built.exists()
        assert (final / "w.txt").read_text() == text  # the second replaced the first
    built = staging_dir(tmp_path)
    (built / "w.txt").write_text("three")
    publish_dir(built, final, replace=False)
    assert (final / "w.txt").read_text() == "two" and not built.exists()  # kept: finished first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # nothing left aside
