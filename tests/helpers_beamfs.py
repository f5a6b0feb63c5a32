"""A real Beam FileSystem for a test-only URL scheme: ``rrtest:///abs/path`` is the local file ``/abs/path``.

Beam picks a FileSystem by the path's scheme among all subclasses of ``apache_beam.io.filesystem.FileSystem``
(``FileSystems.get_filesystem`` -> ``FileSystem.get_all_subclasses()``), so defining this class registers it.
It lets tests drive the pipelines' URL code paths (gs:// on Dataflow) without a cloud bucket: the paths are
URLs to every caller, and Beam's own ``FileSystem.match`` does the globbing. Only what reading inputs
and writing/deleting files needs is implemented.
"""
from __future__ import annotations

import os

from apache_beam.io.filesystem import BeamIOError, FileMetadata
from apache_beam.io.localfilesystem import LocalFileSystem

PREFIX = "rrtest://"


def url(local_path) -> str:
    """The rrtest URL of an absolute local path."""
    path = os.path.abspath(os.fspath(local_path))
    return PREFIX + path


class RRTestFileSystem(LocalFileSystem):
    @classmethod
    def scheme(cls):
        return "rrtest"

    @staticmethod
    def _local(path: str) -> str:
        if not path.startswith(PREFIX):
            raise BeamIOError(f"not an {PREFIX} path: {path}")
        return path[len(PREFIX):]

    def join(self, basepath, *paths):
        return PREFIX + os.path.join(self._local(basepath), *paths)

    def split(self, path):
        head, tail = os.path.split(self._local(path))
        return PREFIX + head, tail

    def _url_dirname(self, url_or_path):
        return PREFIX + os.path.dirname(self._local(url_or_path))

    def mkdirs(self, path):
        super().mkdirs(self._local(path))

    def _list(self, dir_or_prefix):
        root = self._local(dir_or_prefix)
        for dirpath, _, names in os.walk(root):
            for name in names:
                p = os.path.join(dirpath, name)
                yield FileMetadata(PREFIX + p, os.path.getsize(p), os.path.getmtime(p))

    def create(self, path, *args, **kwargs):
        return super().create(self._local(path), *args, **kwargs)

    def open(self, path, *args, **kwargs):
        return super().open(self._local(path), *args, **kwargs)

    def exists(self, path):
        # files only, as on GCS, where a "directory" is a prefix and no object: code that asks whether a folder
        # exists gets the answer it would get there
        return os.path.isfile(self._local(path))

    def size(self, path):
        return os.path.getsize(self._local(path))

    def last_updated(self, path):
        return os.path.getmtime(self._local(path))

    def checksum(self, path):
        return str(self.size(path))

    def metadata(self, path):
        if not self.exists(path):
            raise BeamIOError(f"Path does not exist: {path}")
        return FileMetadata(path, self.size(path), self.last_updated(path))

    def copy(self, source_file_names, destination_file_names):
        super().copy([self._local(p) for p in source_file_names], [self._local(p) for p in destination_file_names])

    def rename(self, source_file_names, destination_file_names):
        super().rename([self._local(p) for p in source_file_names],
                       [self._local(p) for p in destination_file_names])

    def delete(self, paths):
        for p in paths:
            local = self._local(p)
            if not os.path.exists(local):
                raise BeamIOError("Delete operation failed", {p: FileNotFoundError(p)})
            os.remove(local)
