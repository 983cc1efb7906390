"""cuda-ipc's protocol with CPU memory, so the machine without a GPU tests it across processes.

`SharedFilePull` is `CudaIpcTransfer` with its five CUDA pieces replaced: the regions move into files under
/dev/shm that both processes map (in place of CUDA IPC handles), and the copy is a plain synchronous torch
copy (in place of a side stream and events). Everything else, the pull, the sender's confirmation, aborts,
deadlines and the control socket, is the cuda-ipc code the GPU runs.
"""

from __future__ import annotations

import os
import json
import shutil
import tempfile

import torch

from moeplex.interfaces import KVTransferCaps
from moeplex.plugins.kv_transfer.common import flat
from moeplex.plugins.kv_transfer.cuda_ipc import CudaIpcTransfer


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class SharedFilePull(CudaIpcTransfer):
    caps = KVTransferCaps(devices=frozenset({"cpu"}), cross_host=False)
    name = "cpu-pull"

    def _export(self) -> bytes:
        self._folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._backing, files = [], []
        for i, region in enumerate(self.regions):
            path, nbytes = os.path.join(self._folder, f"region{i}"), region.tensor.numel() * region.tensor.element_size()
            backing = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            backing.copy_(flat(region))
            t = region.tensor
            t.set_(backing.untyped_storage(), 0, t.shape, t.stride())  # the pool now lives in the shared file
            self._backing.append(backing)
            files.append((path, nbytes))
        return json.dumps(files).encode()

    def _map(self, handles: bytes) -> list[torch.Tensor]:
        return [torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8) for path, nbytes in json.loads(handles)]

    def _mark_written(self) -> bytes:
        return b""

    def _start_thread(self) -> None:
        pass

    def _copy_after(self, written: bytes, source, runs) -> _Done:
        self._copy(source, runs)
        return _Done()

    def close(self) -> None:
        super().close()
        shutil.rmtree(getattr(self, "_folder", ""), ignore_errors=True)
