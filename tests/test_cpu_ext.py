"""The builder of moeplex's C++ CPU kernels: a kernel that cannot build is not offered (a reason, never an error),
and a lock left by a killed build does not make every later process wait."""

import logging
import os
import time

from moeplex.kernels import cpu_ext


def test_a_kernel_that_cannot_build_gives_a_reason_not_an_error(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="moeplex.kernels.cpu_ext"):
        assert not cpu_ext.load_kernel("no_such_kernel")
    assert cpu_ext.why_not("no_such_kernel")
    assert "no_such_kernel not built" in caplog.text and "not offered" in caplog.text


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    cpu_ext._clear_stale_lock(str(tmp_path))
    assert lock.exists()  # a build in progress
    old = time.time() - cpu_ext.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cpu_ext._clear_stale_lock(str(tmp_path))
    assert not lock.exists()


def test_the_build_folder_names_the_processor_torch_and_sources():
    folder = cpu_ext.build_directory("paged_decode")
    assert os.path.basename(folder).startswith("paged_decode-") and folder.startswith(cpu_ext.machine_cache_dir())
    assert cpu_ext.build_directory("expert_gemm") != folder


def test_build_all_starts_one_process_per_kernel_not_built_yet(tmp_path, monkeypatch):
    """Each unbuilt kernel compiles in its own process at once; a built one (its library there) starts none, and a
    lone unbuilt one is left to its first load."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    started = []

    class Build:
        def __init__(self, command, **_):
            started.append(command[-1])

        def wait(self):
            return 0

    monkeypatch.setattr(cpu_ext.subprocess, "Popen", Build)
    assert cpu_ext.kernel_names() == ["expert_gemm", "paged_decode"]
    cpu_ext.build_all()
    assert started == ["expert_gemm", "paged_decode"]
    built = cpu_ext._library("expert_gemm")
    os.makedirs(os.path.dirname(built))
    open(built, "w").close()
    started.clear()
    cpu_ext.build_all()
    assert started == []
