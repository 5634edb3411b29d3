"""The kernel cache is this user's, runs only code this user built, and no build waits forever.

Where (`burstcu.build.compile.cache_dir`): $BURSTCU_CACHE_DIR, else a node-local folder of this
user's under $TMPDIR that only this user may enter (the emulator's under it in ``emu/``).
Trust (`trusted_dir`): a cache folder, or a folder burstcu uses under it (``emu/``, ``emu/pch-*``),
that another user owns, that group or others may write, or that is a symbolic link is refused.
Digests (`verified_entry`): a cached ``.so``, ``.cubin``, ``.json``, ``.gch`` or runtime ``.o`` (the
emulator's runtime object, linked into every module) whose sha256 does not match its manifest (or
has none) is rebuilt with a warning, never used. Deadlines (`build_timeout`): a build lock held
elsewhere, a g++ that hangs and an NVRTC compile that hangs all end in BuildTimeoutError after
$BURSTCU_BUILD_TIMEOUT seconds. Sources saved during a build are not cached under the key of the
text before; a read-only cache serves what it holds and names what it lacks; the emulator's folder
on a noexec file system is refused before anything is built.

Every test has its own cache folder. Emulator builds use a two-kernel source written here (about
a second each, without the precompiled header unless the test is about it); NVRTC needs no GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from filelock import FileLock

import burstcu
from burstcu.build import compile
from burstcu.build import emulate

TINY_CU = """
__global__ void tiny_a(int* p) { p[threadIdx.x] = 1; }
__global__ void tiny_b(int* p) { p[threadIdx.x] = 2; }
"""
# One warp-collective sm_90 primitive (elect.sync) behind a block barrier: it runs only where the
# module's runtime object installed the sm_90 hooks, and its fibers switch at the barrier.
ELECT_CU = """
#include "hopper.cuh"
__global__ void tiny_elect(int* p) {
  const bool one = elect_one();
  __syncthreads();
  p[threadIdx.x] = one;
}
"""
NVRTC_CU = 'template <int N> __global__ void tiny(int* p) { p[threadIdx.x] = N; }\n'
NVRTC_NAME = "tiny<3>"
# A stand-in compiler: answers --version (unless told to hang there too), then hangs; it writes
# the pid of the process it waits on, to check that the deadline killed it as well.
HANGING_CXX = """#!/bin/sh
if [ "$1" = "--version" ] && [ "$HANG_ON_VERSION" != 1 ]; then echo "hanging-c++ 1.0"; exit 0; fi
sleep 10 &
echo $! > "$SLEEPER_PID"
wait
"""


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """A fresh cache folder (BURSTCU_CACHE_DIR), no modules loaded yet, no precompiled header."""
    root = tmp_path / "cache"
    monkeypatch.setenv("BURSTCU_CACHE_DIR", str(root))
    monkeypatch.setenv("BURSTCU_EMU_PCH", "0")
    monkeypatch.delenv("BURSTCU_BUILD_TIMEOUT", raising=False)
    monkeypatch.setattr(emulate, "_LOADED", {})
    monkeypatch.setattr(emulate, "_PCH_WARNED", threading.Event(), raising=False)
    return root


@pytest.fixture
def tiny(tmp_path) -> Path:
    """The emulator's test source (kernels tiny_a and tiny_b)."""
    path = tmp_path / "tiny.cu"
    path.write_text(TINY_CU)
    return path


def predicted_so(source: Path, name: str) -> Path:
    """Where the emulator caches the module of `source` with the one kernel `name`."""
    kdir = emulate.kernel_dir().resolve()
    paths = emulate._source_paths([source], kdir)
    text = emulate._generated_source(paths, [name])
    return emulate.cache_dir() / f"{emulate._cache_key(paths, text, [], kdir)}.so"


def replace_bytes(path: Path, data: bytes) -> None:
    """Give `path` new content as a new file: a loaded library keeps its old pages."""
    tmp = path.with_name(path.name + ".test")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def needs_nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    pytest.importorskip("cuda.pathfinder")


# ------------------------------------------------------------------------------------------------
# where: node-local and per user


def test_cache_dir_defaults_to_a_private_folder_under_tmpdir(monkeypatch, tmp_path):
    monkeypatch.delenv("BURSTCU_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    path = compile.cache_dir()
    assert path == tmp_path / f"burstcu-{os.getuid()}" and path.is_dir()
    assert path.stat().st_mode & 0o777 == 0o700
    assert emulate.cache_dir() == path / "emu"


def test_cache_dir_override_and_foreign_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("BURSTCU_CACHE_DIR", str(tmp_path / "shared"))
    assert compile.cache_dir() == tmp_path / "shared" and (tmp_path / "shared").is_dir()
    monkeypatch.delenv("BURSTCU_CACHE_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)  # the folder is not "ours"
    with pytest.raises(RuntimeError, match="BURSTCU_CACHE_DIR"):
        compile.cache_dir()


# ------------------------------------------------------------------------------------------------
# trust: folders


def folder(cache: Path, where: str) -> Path:
    """The cache folder itself (".") or its emu/ subfolder, created."""
    path = cache / where
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.parametrize("where", [".", "emu"])
def test_folder_of_another_user_is_refused(cache, tiny, where):
    path = folder(cache, where)
    try:
        os.chown(path, 65534, 65534)
    except PermissionError:
        pytest.skip("chown to another uid needs root")
    with pytest.raises(RuntimeError, match="belongs to uid 65534.*run code.*chown") as err:
        emulate.build_module([tiny], ["tiny_a"])
    assert "BURSTCU_CACHE_DIR" in str(err.value)


@pytest.mark.parametrize("where", [".", "emu"])
@pytest.mark.parametrize("mode,who", [(0o777, "group and others"), (0o770, "group"),
                                      (0o1777, "group and others")])
def test_folder_others_can_write_is_refused(cache, tiny, where, mode, who):
    path = folder(cache, where)
    os.chmod(path, mode)
    with pytest.raises(RuntimeError, match=f"{re.escape(str(path))} is writable by {who} .*chmod go-w"):
        emulate.build_module([tiny], ["tiny_a"])
    assert not list(cache.rglob("*.so"))


@pytest.mark.parametrize("where", [".", "emu"])
def test_symlinked_folder_is_refused(cache, tiny, tmp_path, monkeypatch, where):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = cache / where if where != "." else tmp_path / "link"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(real)
    if where == ".":
        monkeypatch.setenv("BURSTCU_CACHE_DIR", str(link))
    with pytest.raises(RuntimeError, match="symbolic link"):
        emulate.build_module([tiny], ["tiny_a"])
    assert not list(real.rglob("*.so"))


def test_folders_are_created_private(cache, tiny):
    emulate.build_module([tiny], ["tiny_a"])
    for path in (cache, cache / "emu"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


# ------------------------------------------------------------------------------------------------
# digests: the emulator's .so


def test_planted_so_is_not_loaded(cache, tiny):
    """A valid library of other kernels at the key path of tiny_a (no manifest vouches for it)."""
    foreign = emulate.build_module([tiny], ["tiny_b"]).path
    target = predicted_so(tiny, "tiny_a")
    replace_bytes(target, foreign.read_bytes())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = emulate.build_module([tiny], ["tiny_a"])
    assert mod.path == target
    assert mod.kernel_names() == ["tiny_a"]
    said = f"{re.escape(target.name)}: no manifest.*rebuilt"
    assert [w for w in caught if re.search(said, str(w.message))], [str(w.message) for w in caught]
    assert compile.manifest_problem(target.parent, target.stem, [target.name]) is None


def runtime_objects(cache: Path) -> list[Path]:
    return sorted((cache / "emu").glob("runtime-*.o"))


def test_modules_link_one_runtime_object_per_option_set(cache, tiny):
    """The emulator's runtime (kernels/emu/emu_entry.h) is compiled once and linked into every
    module built with the same options; other options get a runtime object of their own. Each
    module answers through its own entry points and runs its kernel."""
    a, b = (emulate.build_module([tiny], [name]) for name in ("tiny_a", "tiny_b"))
    (shared,) = runtime_objects(cache)
    c = emulate.build_module([tiny], ["tiny_a"], options=("-DTINY_OPTION=1",))
    assert len(runtime_objects(cache)) == 2 and shared in runtime_objects(cache)
    assert len({a.path, b.path, c.path}) == 3
    for mod, name, value in ((a, "tiny_a", 1), (b, "tiny_b", 2), (c, "tiny_a", 1)):
        assert mod.kernel_names() == [name]
        out = np.zeros(32, np.int32)
        mod.get_function(name)((1,), (32,), (out,))
        assert (out == value).all(), (name, out)


@pytest.mark.parametrize("options", [(), ("-DBURSTCU_EMU_UCONTEXT",)])
def test_a_module_runs_the_sm90_hooks_of_its_runtime_object(cache, tmp_path, options):
    """elect.sync runs through the hooks that the runtime object installs, in a module built with
    the same options: -DBURSTCU_EMU_UCONTEXT changes the fibers' context on both sides of the
    link (a module and a runtime object of different options would disagree on its layout)."""
    source = tmp_path / "elect.cu"
    source.write_text(ELECT_CU)
    mod = emulate.build_module([source], ["tiny_elect"], options=options)
    (runtime,) = runtime_objects(cache)
    out = np.zeros(96, np.int32)
    mod.get_function("tiny_elect")((1,), (96,), (out,))
    assert out.reshape(3, 32).sum(axis=1).tolist() == [1, 1, 1], out   # one lane of each warp


def test_emulator_headers_include_no_other_local_header():
    """The precompiled header and the runtime object are keyed by the headers in kernels/emu/
    alone (`emulate._emulator_digest`): those may include system headers and each other only."""
    emu = emulate.kernel_dir() / "emu"
    for header in emu.glob("*.h"):
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', header.read_text(), re.M):
            assert (emu / name).is_file() and "/" not in name, (header.name, name)


def test_runtime_object_deleted_before_the_link_is_made_again(cache, tiny, monkeypatch):
    """A runtime object removed (clear_cache, another process's cleanup) after it was checked and
    before the module's link is built again; the module builds and runs."""
    real = emulate._runtime_object
    calls = []

    def checked_then_removed(kdir, flags, pch):
        path = real(kdir, flags, pch)
        calls.append(path)
        if len(calls) == 1:
            path.unlink()
        return path

    monkeypatch.setattr(emulate, "_runtime_object", checked_then_removed)
    with pytest.warns(UserWarning, match=r"runtime-\w+\.o cannot be read.*rebuilt"):
        mod = emulate.build_module([tiny], ["tiny_a"])
    assert len(calls) == 2 and calls[1].is_file()
    out = np.zeros(32, np.int32)
    mod.get_function("tiny_a")((1,), (32,), (out,))
    assert (out == 1).all()


def test_builds_of_other_versions_unused_for_a_day_are_removed(cache, tiny):
    """Precompiled headers and runtime objects that no build made or used for a day go (with
    their manifests); newer ones, and the ones this build uses, stay."""
    emulate.build_module([tiny], ["tiny_a"])
    (mine,) = runtime_objects(cache)
    emu = cache / "emu"
    day_old = time.time() - 86400 - 60
    old_pch, new_pch = emu / "pch-0ld", emu / "pch-new"
    old_rt, new_rt = emu / "runtime-0ld.o", emu / "runtime-new.o"
    for folder in (old_pch, new_pch):
        folder.mkdir(mode=0o700)
    for obj in (old_rt, new_rt):
        obj.write_bytes(b"\0")
        obj.with_suffix(".manifest").write_text("{}")
    for path in (old_pch, old_rt, old_rt.with_suffix(".manifest"), mine):
        os.utime(path, (day_old, day_old))
    emulate.build_module([tiny], ["tiny_b"])   # uses `mine`, which counts as a use
    assert not old_pch.exists() and not old_rt.exists() and not old_rt.with_suffix(".manifest").exists()
    assert new_pch.is_dir() and new_rt.is_file() and new_rt.with_suffix(".manifest").is_file()
    assert mine.is_file() and time.time() - mine.stat().st_mtime < 600


def test_what_killed_builds_left_is_removed_once_a_day_old(cache, tiny):
    """A build killed midway (its rank aborted with the job) leaves its `.build-*` folder and its
    `*.tmp` files (a precompiled header's is ~65 MB): once a day old they go with the next build;
    younger ones (a build of another process may be running) stay."""
    emulate.build_module([tiny], ["tiny_a"])
    emu = cache / "emu"
    pch = emu / "pch-new"          # a precompiled header's folder in use (none here: see `cache`)
    pch.mkdir(mode=0o700)
    day_old = time.time() - 86400 - 60
    old = [emu / ".build-0ld", emu / "x.so.0ld.tmp", pch / "emu_pch.h.gch.0ld.tmp"]
    new = [emu / ".build-new", emu / "x.so.new.tmp", pch / "emu_pch.h.gch.new.tmp"]
    for folder in (old[0], new[0]):
        folder.mkdir(mode=0o700)
        (folder / "unit.cpp").write_text("//")
    for path in old[1:] + new[1:]:
        path.write_bytes(b"\0")
    for path in old:
        os.utime(path, (day_old, day_old))
    emulate.build_module([tiny], ["tiny_b"])
    assert not any(path.exists() for path in old), old
    assert all(path.exists() for path in new), new


def test_damaged_runtime_object_is_rebuilt(cache, tiny):
    emulate.build_module([tiny], ["tiny_a"])
    (runtime,) = runtime_objects(cache)
    whole = runtime.read_bytes()
    replace_bytes(runtime, whole[: len(whole) // 2])
    with pytest.warns(UserWarning, match=f"{re.escape(runtime.name)} does not match its sha256.*rebuilt"):
        mod = emulate.build_module([tiny], ["tiny_b"])
    assert mod.kernel_names() == ["tiny_b"]
    assert runtime.read_bytes() == whole
    assert compile.manifest_problem(runtime.parent, runtime.stem, [runtime.name]) is None


def test_planted_runtime_object_is_not_linked(cache, tiny):
    """A runtime object with no manifest (put there by someone else) is rebuilt, never linked."""
    emulate.build_module([tiny], ["tiny_a"])
    (runtime,) = runtime_objects(cache)
    whole = runtime.read_bytes()
    runtime.with_suffix(".manifest").unlink()
    replace_bytes(runtime, b"\x7fELF planted")
    with pytest.warns(UserWarning, match=f"{re.escape(runtime.name)}.*rebuilt"):
        mod = emulate.build_module([tiny], ["tiny_b"])
    assert mod.kernel_names() == ["tiny_b"] and runtime.read_bytes() == whole


def test_truncated_so_is_rebuilt(cache, tiny):
    target = emulate.build_module([tiny], ["tiny_a"]).path
    whole = target.read_bytes()
    replace_bytes(target, whole[: len(whole) // 2])
    emulate._LOADED.clear()  # as a new process would
    with pytest.warns(UserWarning, match=f"{re.escape(target.name)} does not match its sha256.*rebuilt"):
        mod = emulate.build_module([tiny], ["tiny_a"])
    assert mod.kernel_names() == ["tiny_a"]
    assert target.stat().st_size == len(whole)


def test_a_fifo_in_place_of_an_entry_is_rebuilt_not_waited_on(cache, tiny):
    """A FIFO where a manifest or a module stood blocked a plain open() with no deadline."""
    target = emulate.build_module([tiny], ["tiny_a"]).path
    for victim in (target.with_suffix(".manifest"), target):
        victim.unlink()
        os.mkfifo(victim)
        emulate._LOADED.clear()
        with pytest.warns(UserWarning, match=f"{re.escape(victim.name)}.*not a regular file.*rebuilt"):
            assert emulate.build_module([tiny], ["tiny_a"]).kernel_names() == ["tiny_a"]
        assert victim.is_file()


# ------------------------------------------------------------------------------------------------
# digests: NVRTC's .cubin and .json


def test_nvrtc_takes_its_headers_from_the_kernel_folder_not_the_working_directory(cache, tmp_path,
                                                                                  monkeypatch):
    """A quoted #include was looked for in the working directory first (the program had a bare
    name): a common.cuh there was compiled in and cached under the kernel folder's key."""
    needs_nvrtc()
    kdir, elsewhere = tmp_path / "kernels", tmp_path / "elsewhere"
    kdir.mkdir(), elsewhere.mkdir()
    (kdir / "nvrtc.cu").write_text('#include "common.cuh"\n' + NVRTC_CU)
    (kdir / "common.cuh").write_text("#define FROM_THE_KERNEL_FOLDER 1\n")
    (elsewhere / "common.cuh").write_text('#error "the working directory\'s common.cuh"\n')
    monkeypatch.chdir(elsewhere)
    compiled = compile.nvrtc_compile("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=kdir)
    assert compiled.lowered[NVRTC_NAME].startswith("_Z4tiny")


def test_the_cuda_headers_are_part_of_an_nvrtc_key(cache, tmp_path, monkeypatch):
    needs_nvrtc()
    (tmp_path / "nvrtc.cu").write_text(NVRTC_CU)
    key = compile.cache_key("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)
    monkeypatch.setattr(compile, "cuda_headers_digest", lambda: "another headers wheel")
    assert compile.cache_key("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path) != key


def test_the_cuda_headers_digest_reads_what_cuda_fp16_includes_through_a_link(tmp_path, monkeypatch):
    """The headers cuda_fp16.h and cuda_bf16.h reach are hashed, the others not; an include folder
    reached through a symbolic link (/usr/local/cuda/include) hashes alike (it gave "")."""
    real, linked = tmp_path / "targets" / "include", tmp_path / "include"
    (real / "crt").mkdir(parents=True)
    linked.symlink_to(real, target_is_directory=True)
    (real / "cuda_fp16.h").write_text('#include "cuda_fp16.hpp"\n#include <crt/host_defines.h>\n')
    (real / "cuda_fp16.hpp").write_text("// fp16\n")
    (real / "cuda_bf16.h").write_text("// bf16\n")
    (real / "crt" / "host_defines.h").write_text("// defines\n")
    (real / "unrelated.h").write_text("// another wheel's\n")

    def digest(folder) -> str:
        monkeypatch.setattr(compile, "cuda_include_dir", lambda: str(folder))
        compile.cuda_headers_digest.cache_clear()
        return compile.cuda_headers_digest()
    try:
        before = digest(real)
        assert before and digest(linked) == before
        (real / "unrelated.h").write_text("// changed\n")
        assert digest(linked) == before
        (real / "crt" / "host_defines.h").write_text("// changed\n")
        assert digest(linked) != before
    finally:
        compile.cuda_headers_digest.cache_clear()


@pytest.mark.parametrize("damage", ["truncated .cubin", "corrupt .json", "corrupt manifest"])
def test_damaged_nvrtc_entry_is_rebuilt(cache, tmp_path, damage):
    needs_nvrtc()
    (tmp_path / "nvrtc.cu").write_text(NVRTC_CU)
    cubin, lowered = compile.cached_cubin("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)
    whole = cubin.read_bytes()
    if damage == "truncated .cubin":
        victim, data = cubin, whole[: len(whole) // 2]
    elif damage == "corrupt .json":
        victim, data = cubin.with_suffix(".json"), b'{"lowered": '
    else:
        victim, data = cubin.with_suffix(".manifest"), b"[]"
    replace_bytes(victim, data)
    with pytest.warns(UserWarning, match=f"{re.escape(victim.name)}.*rebuilt"):
        again, lowered_again = compile.cached_cubin("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)
    assert again == cubin and lowered_again == lowered and lowered[NVRTC_NAME].startswith("_Z4tiny")
    assert cubin.stat().st_size == len(whole)
    assert json.loads(cubin.with_suffix(".manifest").read_text())["sha256"][cubin.name] == \
        compile.file_sha256(cubin)


# ------------------------------------------------------------------------------------------------
# a source saved during its build; folders that cannot be written or run code


def saved_during_the_build(real, source: Path, contents: list[str], when) -> Callable:
    """`real` (a compile function) that first writes the next of `contents`, while some are
    left, into `source` each time `when(args)` holds: an editor saving the kernel after its key
    was computed, before the compiler read it."""
    edits = iter(contents)

    def compile_after_a_save(*args, **kwargs):
        text = next(edits, None) if when(args) else None
        if text is not None:
            source.write_text(text)
        return real(*args, **kwargs)

    return compile_after_a_save


def test_a_source_saved_during_its_build_is_not_cached_under_the_old_key(cache, tiny, monkeypatch):
    """The key was computed from the sources, then the build (seconds: the precompiled header, the
    runtime object) read them later: a save in between was cached under the old key, so going back
    to the old text loaded the new kernel, for good. Now the sources are hashed again after the
    build: on a change the build is dropped and made again under the key of what was compiled."""
    old_key_so = predicted_so(tiny, "tiny_a")
    edited, real = TINY_CU.replace("= 1;", "= 7;"), emulate._gxx
    monkeypatch.setattr(emulate, "_gxx", saved_during_the_build(
        real, tiny, [edited], lambda args: args[3].suffix == ".so"))
    mod = emulate.build_module([tiny], ["tiny_a"])
    out = np.zeros(32, np.int32)
    mod.get_function("tiny_a")((1,), (32,), (out,))
    assert (out == 7).all()                              # what is there now, under its own key
    assert mod.path == predicted_so(tiny, "tiny_a") != old_key_so
    assert not old_key_so.exists() and not old_key_so.with_suffix(".manifest").exists()
    tiny.write_text(TINY_CU)                             # back to the old text: its own kernel
    monkeypatch.setattr(emulate, "_gxx", real)
    back = emulate.build_module([tiny], ["tiny_a"])
    back.get_function("tiny_a")((1,), (32,), (out,))
    assert back.path == old_key_so and (out == 1).all()


def test_sources_that_change_in_every_build_are_an_error_and_nothing_is_cached(cache, tiny,
                                                                              monkeypatch):
    texts = [TINY_CU.replace("= 1;", f"= {n};") for n in (3, 4, 5)]
    monkeypatch.setattr(emulate, "_gxx", saved_during_the_build(
        emulate._gxx, tiny, texts, lambda args: args[3].suffix == ".so"))
    with pytest.raises(compile.SourcesChangedError,
                       match=r"sources changed while \w+\.so was built.*in each of 3 builds in a row"):
        emulate.build_module([tiny], ["tiny_a"])
    assert not list((cache / "emu").glob("*.so")) and not list((cache / "emu").glob("[0-9a-f]*.manifest"))


def test_an_emulator_header_saved_during_the_runtime_objects_build_is_not_cached(cache, tmp_path,
                                                                                 tiny, monkeypatch):
    """The runtime object is keyed by kernels/emu/*.h: a header saved while it compiles (here
    a copy of the kernel folder, BURSTCU_KERNEL_DIR) leaves no object under the old digest."""
    kdir = tmp_path / "kernels"
    shutil.copytree(emulate.kernel_dir(), kdir)
    monkeypatch.setenv("BURSTCU_KERNEL_DIR", str(kdir))
    header = kdir / "emu" / "emu_runtime.h"
    old_digest = emulate._emulator_digest(kdir.resolve())
    monkeypatch.setattr(emulate, "_gxx", saved_during_the_build(
        emulate._gxx, header, [header.read_text() + "\n// saved\n"],
        lambda args: args[3].name.startswith("runtime-")))
    emulate.build_module([tiny], ["tiny_a"])
    (runtime,) = runtime_objects(cache)
    assert runtime.name == f"runtime-{emulate._emulator_digest(kdir.resolve())[:32]}.o"
    assert not runtime.name.startswith(f"runtime-{old_digest[:32]}")


def test_an_nvrtc_source_saved_during_its_compile_is_not_cached_under_the_old_key(cache, tmp_path,
                                                                                  monkeypatch):
    needs_nvrtc()
    old_entry = nvrtc_entry(tmp_path)                    # writes nvrtc.cu
    edited = NVRTC_CU.replace("= N;", "= N + 1;")
    monkeypatch.setattr(compile, "nvrtc_compile", saved_during_the_build(
        compile.nvrtc_compile, tmp_path / "nvrtc.cu", [edited], lambda args: True))
    cubin, meta, built = compile.cubin_entry("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)
    new_key = compile.cache_key("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)
    assert built and cubin == compile.cache_dir() / f"{new_key}.cubin" != old_entry.with_suffix(".cubin")
    assert compile.manifest_problem(cubin.parent, new_key, [cubin.name, meta.name]) is None
    assert not old_entry.with_suffix(".cubin").exists() and not old_entry.with_suffix(".manifest").exists()


@pytest.fixture
def read_only(monkeypatch):
    """read_only(folder): make `folder` one this process cannot write. As root, whom modes do not
    stop, os.access answers as it does for a read-only mount (checked by hand on a tmpfs mounted
    ro: the same messages, and no other write is tried before the check)."""
    made = []

    def make(folder: Path) -> None:
        if os.geteuid() != 0:
            folder.chmod(0o500)
            made.append(folder)
            return
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if (
            Path(path) == folder and mode & os.W_OK) else real(path, mode, **kw))

    yield make
    for folder in made:
        folder.chmod(0o700)


def test_a_read_only_cache_serves_what_it_holds_and_names_what_it_lacks(cache, tiny, read_only):
    """A read-only cache (a shared image, a read-only mount) that lacks one kernel failed with a bare
    'OSError: [Errno 30]' from a timestamp update; now what it holds loads, and the missing kernel
    is an error naming the folder and the fix."""
    held = emulate.build_module([tiny], ["tiny_a"])
    read_only(cache / "emu")
    emulate._LOADED.clear()                     # a new process: from the folder, not memory
    again = emulate.build_module([tiny], ["tiny_a"])
    assert again.path == held.path
    with pytest.raises(compile.CacheNotWritableError, match=(
            rf"kernel cache folder {re.escape(str(cache / 'emu'))} cannot be written \(read-only\), and it "
            rf"does not hold \w+\.so yet. Fix: set BURSTCU_CACHE_DIR to a folder you can write")):
        emulate.build_module([tiny], ["tiny_b"])


def test_a_read_only_cache_names_a_cubin_it_lacks(cache, tmp_path, read_only):
    needs_nvrtc()
    nvrtc_entry(tmp_path)
    compile.cache_dir()
    read_only(cache)
    with pytest.raises(compile.CacheNotWritableError, match=r"\w+\.cubin, \w+\.json yet"):
        compile.cubin_entry("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)


def test_a_cache_on_a_noexec_file_system_is_refused_before_anything_is_built(cache, tiny, monkeypatch):
    """/tmp is often mounted noexec: the emulator compiled its modules there, then failed to load
    them with the loader's 'failed to map segment from shared object'. Now the folder is refused
    first, with the fix; at burstcu.init on every rank (checked by hand on a tmpfs mounted noexec:
    the same message, from the file system's own flag). Here os.statvfs reports the flag."""
    real = os.statvfs

    class NoExec:
        def __init__(self, st):
            self.st = st

        def __getattr__(self, name):
            value = getattr(self.st, name)
            return value | os.ST_NOEXEC if name == "f_flag" else value

    monkeypatch.setattr(os, "statvfs", lambda path: NoExec(real(path)) if str(path).startswith(
        str(cache)) else real(path))
    said = (rf"the kernel cache folder {re.escape(str(cache / 'emu'))} is on a file system mounted noexec.*"
            r"Fix: set BURSTCU_CACHE_DIR")
    with pytest.raises(RuntimeError, match=said):
        emulate.build_module([tiny], ["tiny_a"])
    assert not list(cache.rglob("*.so")) and not list(cache.rglob("*.o"))
    with pytest.raises(ValueError, match="^burstcu.init: " + said):
        burstcu.init(backend="emulated")


# ------------------------------------------------------------------------------------------------
# the precompiled header


def pch_folder(cache: Path) -> Path:
    (found,) = (cache / "emu").glob("pch-*/")
    return found


def test_corrupt_gch_is_rebuilt_and_used(cache, tiny, monkeypatch, recwarn):
    monkeypatch.setenv("BURSTCU_EMU_PCH", "1")
    emulate.build_module([tiny], ["tiny_a"])
    gch = pch_folder(cache) / "emu_pch.h.gch"
    replace_bytes(gch, b"not a precompiled header")
    mod = emulate.build_module([tiny], ["tiny_b"])
    assert mod.kernel_names() == ["tiny_b"]
    messages = [str(w.message) for w in recwarn]
    assert [m for m in messages if "emu_pch.h.gch" in m and "rebuilt" in m], messages
    assert not [m for m in messages if "without the precompiled header" in m], messages
    assert compile.manifest_problem(gch.parent, "emu_pch", ["emu_pch.h", "emu_pch.h.gch"]) is None
    assert stat.S_IMODE(gch.parent.stat().st_mode) == 0o700


def test_a_precompiled_header_in_use_is_not_removed_by_another_versions_cleanup(cache, tiny,
                                                                                 monkeypatch):
    """Each use of a precompiled header counts as a use (its folder's time), as a runtime
    object's does: one made two days ago and used every day since was removed by the daily
    cleanup of a build of another emulator version (another checkout), which keeps only its own."""
    monkeypatch.setenv("BURSTCU_EMU_PCH", "1")
    emulate.build_module([tiny], ["tiny_a"])
    folder = pch_folder(cache)
    two_days_old = time.time() - 2 * 86400
    os.utime(folder, (two_days_old, two_days_old))
    emulate.build_module([tiny], ["tiny_b"])      # uses it
    emulate._remove_stale(keep=[])               # another version's build, keeping its own only
    assert folder.is_dir() and time.time() - folder.stat().st_mtime < 600


def test_group_writable_pch_folder_is_refused(cache, tiny, monkeypatch):
    monkeypatch.setenv("BURSTCU_EMU_PCH", "1")
    emulate.build_module([tiny], ["tiny_a"])
    os.chmod(pch_folder(cache), 0o770)
    with pytest.raises(RuntimeError, match="pch-.* writable by group"):
        emulate.build_module([tiny], ["tiny_b"])


def test_build_without_the_pch_warns_once(cache, tiny, monkeypatch, tmp_path, recwarn):
    """g++ rejects the header it is given (here: one that is gone); the retry without it warns,
    once in the process."""
    monkeypatch.setenv("BURSTCU_EMU_PCH", "1")
    monkeypatch.setattr(emulate, "_precompiled_header", lambda kdir: tmp_path / "gone" / "emu_pch.h")
    assert emulate.build_module([tiny], ["tiny_a"]).kernel_names() == ["tiny_a"]
    assert emulate.build_module([tiny], ["tiny_b"]).kernel_names() == ["tiny_b"]
    fallbacks = [w for w in recwarn if "without the precompiled header" in str(w.message)]
    assert len(fallbacks) == 1 and "gone" in str(fallbacks[0].message)


# ------------------------------------------------------------------------------------------------
# deadlines


@pytest.fixture
def held_lock():
    """held_lock(path): hold the file lock `path` from another thread (an fcntl lock, so it
    conflicts with this thread's too) for at most 10 s, released at the end of the test."""
    done, threads = threading.Event(), []

    def hold(path: Path) -> None:
        acquired = threading.Event()

        def run() -> None:
            with FileLock(str(path)):
                acquired.set()
                done.wait(10)

        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
        assert acquired.wait(10)

    yield hold
    done.set()
    for t in threads:
        t.join()


def nvrtc_entry(tmp_path: Path) -> Path:
    """The cache root path of the NVRTC test kernel's entry, without its suffix."""
    (tmp_path / "nvrtc.cu").write_text(NVRTC_CU)
    return compile.cache_dir() / compile.cache_key("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)


@pytest.mark.parametrize("builder", ["emulator", "nvrtc"])
def test_lock_held_elsewhere_times_out(cache, tiny, tmp_path, monkeypatch, held_lock, builder):
    if builder == "emulator":   # the runtime object that modules link comes before a module's lock
        emulate.build_module([tiny], ["tiny_b"])
    monkeypatch.setenv("BURSTCU_BUILD_TIMEOUT", "1")
    if builder == "nvrtc":
        needs_nvrtc()
        lock = nvrtc_entry(tmp_path).with_suffix(".lock")
        build = lambda: compile.cached_cubin("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)  # noqa: E731
    else:
        lock = predicted_so(tiny, "tiny_a").with_suffix(".lock")
        build = lambda: emulate.build_module([tiny], ["tiny_a"])  # noqa: E731
    held_lock(lock)
    start = time.monotonic()
    # a lock wait lasts twice the build timeout (its holder may run the compiler twice)
    with pytest.raises(RuntimeError, match=f"waited 2 s for the build lock {re.escape(str(lock))}: "
                       "another process holds it.*BURSTCU_BUILD_TIMEOUT") as err:
        build()
    assert time.monotonic() - start < 5
    assert isinstance(err.value, compile.BuildTimeoutError)


@pytest.mark.parametrize("stage", ["version", "pch", "runtime", "module"])
def test_hanging_compiler_times_out(cache, tiny, tmp_path, monkeypatch, stage):
    if stage == "module":   # the runtime object comes from the real compiler: only the module hangs
        runtime = emulate._runtime_object(emulate.kernel_dir().resolve(), [], None)
        monkeypatch.setattr(emulate, "_runtime_object", lambda kdir, flags, pch: runtime)
    cxx = tmp_path / "hanging-c++"
    cxx.write_text(HANGING_CXX)
    cxx.chmod(0o755)
    pid_file = tmp_path / "sleeper.pid"
    monkeypatch.setenv("SLEEPER_PID", str(pid_file))
    monkeypatch.setenv("HANG_ON_VERSION", "1" if stage == "version" else "0")
    monkeypatch.setenv("BURSTCU_EMU_PCH", "1" if stage == "pch" else "0")
    monkeypatch.setenv("BURSTCU_BUILD_TIMEOUT", "1")
    monkeypatch.setattr(emulate, "_CXX", str(cxx))
    emulate._compiler_version.cache_clear()
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"1 s for the compiler command `{re.escape(str(cxx))}"
                           ".*killed.*BURSTCU_BUILD_TIMEOUT") as err:
            emulate.build_module([tiny], ["tiny_a"])
        hung = {"version": "--version`", "pch": "emu_pch.h", "runtime": ".o`", "module": ".so -lrt`"}[stage]
        assert hung in str(err.value), (stage, str(err.value))
        assert time.monotonic() - start < 5
        assert isinstance(err.value, compile.BuildTimeoutError)
    finally:
        emulate._compiler_version.cache_clear()  # the next test asks the real compiler
    status = Path(f"/proc/{pid_file.read_text().strip()}/status")
    deadline = time.monotonic() + 5   # SIGKILL is sent to its group; the kernel ends it soon after
    while status.exists() and "zombie" not in _read_or_empty(status) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not status.exists() or "zombie" in _read_or_empty(status), "the compiler's child still runs"


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:   # it ended between the two looks
        return "zombie"


def test_hanging_nvrtc_times_out(cache, tmp_path, monkeypatch):
    needs_nvrtc()
    monkeypatch.setenv("BURSTCU_BUILD_TIMEOUT", "1")
    release = threading.Event()
    monkeypatch.setattr(compile, "nvrtc_compile", lambda *args: release.wait(10))
    nvrtc_entry(tmp_path)
    start = time.monotonic()
    try:
        said = re.escape(f"1 s for NVRTC to compile nvrtc.cu ({NVRTC_NAME}) for sm_80: it did not finish")
        with pytest.raises(RuntimeError, match=said) as err:
            compile.cached_cubin("nvrtc.cu", [NVRTC_NAME], "sm_80", kdir=tmp_path)
        assert time.monotonic() - start < 5
        assert isinstance(err.value, compile.BuildTimeoutError)
    finally:
        release.set()


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_bad_build_timeout_is_a_value_error(cache, tiny, monkeypatch, value):
    monkeypatch.setenv("BURSTCU_BUILD_TIMEOUT", value)
    said = re.escape(f"BURSTCU_BUILD_TIMEOUT={value!r}") + ".*positive number of seconds"
    with pytest.raises(ValueError, match=said):
        emulate.build_module([tiny], ["tiny_a"])


def test_build_timeout_reads_the_variable(monkeypatch):
    monkeypatch.setenv("BURSTCU_BUILD_TIMEOUT", " 2.5 ")
    assert compile.build_timeout() == 2.5
    monkeypatch.delenv("BURSTCU_BUILD_TIMEOUT")
    assert compile.build_timeout() == compile.DEFAULT_BUILD_TIMEOUT_S == 600


def test_a_build_timeout_past_what_a_wait_can_take_builds(cache, tiny, monkeypatch):
    """1e10 s passed the check, then every build (and a cached one: `g++ --version`) failed with
    an OverflowError inside subprocess; it waits MAX_BUILD_WAIT_S instead."""
    monkeypatch.setenv("BURSTCU_BUILD_TIMEOUT", "1e10")
    assert compile.build_timeout() == compile.MAX_BUILD_WAIT_S
    assert emulate.build_module([tiny], ["tiny_a"]).kernel_names() == ["tiny_a"]


# ------------------------------------------------------------------------------------------------
# warming the cache ahead of a GPU run (python -m burstcu.build warm)

def test_warm_fills_the_cache_a_gpu_run_reads(cache, monkeypatch, capsys):
    """`warm --device sm_90` compiles what a compute capability 9.0 GPU loads (its table, sm_90a,
    each kernel for sm_90 or its own sm_90a target), skips what is cached, and afterwards the run
    time's lookup (`cached_cubin` with the same arguments) compiles nothing."""
    needs_nvrtc()
    from burstcu.build import __main__ as cli
    from burstcu.build import all_variants

    jobs = cli.warm_jobs("sm_90")
    assert {name for _, name, _ in jobs} == {v.name for v in all_variants("sm_90a")}
    assert {arch for _, name, arch in jobs if "sm90" in name} == {"sm_90a"}
    assert {arch for _, name, arch in jobs if "sm90" not in name} == {"sm_90"}
    # --tables: another table's kernels too (a benchmark timing sm_80's tiles on a Hopper GPU),
    # each job once, each compiled for the device or its own target
    both = cli.warm_jobs("sm_90", tables=["sm_90a", "sm_80"])
    assert len(both) == len(set(both)) and set(jobs) < set(both)
    assert {name for _, name, _ in both} == {v.name for t in ("sm_90a", "sm_80") for v in all_variants(t)}
    assert {arch for _, name, arch in both if "sm90" not in name} == {"sm_90"}
    assert cli.main(["warm", "--device", "sm_90", "--family", "forward_finalize", "--jobs", "1"]) == 0
    assert "3 kernels compiled, 0 already cached, 0 failed" in capsys.readouterr().out
    assert cli.main(["warm", "--device", "sm_90", "--family", "forward_finalize", "--jobs", "1"]) == 0
    assert "0 kernels compiled, 3 already cached, 0 failed" in capsys.readouterr().out

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again")
    monkeypatch.setattr(compile, "nvrtc_compile", no_compile)
    for source, name, arch in cli.warm_jobs("sm_90", ["forward_finalize"]):
        path, lowered = compile.cached_cubin(source, [name], arch)
        assert path.exists() and name in lowered
    with pytest.raises(SystemExit):
        cli.main(["warm", "--device", "sm_75"])
    # a misspelled family or table is an error naming the choices, not a run that builds nothing
    with pytest.raises(SystemExit):
        cli.main(["warm", "--device", "sm_90", "--family", "forward_finalise"])
    assert "unknown family ['forward_finalise']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["warm", "--device", "sm_90", "--tables", "sm_90a,sm_75"])
    assert "unknown tile table ['sm_75']: choose from sm_80" in capsys.readouterr().err
    # a kernel that fails to build is named, the others still build, and the exit status says so
    # ... with the whole message: NVRTC's log comes after the first line
    monkeypatch.setattr(compile, "cubin_entry",
                        lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("nope:\nthe log line")))
    assert cli.main(["warm", "--device", "sm_90", "--family", "nonfinite_flag", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAILED") == 3 and "RuntimeError: nope:" in out and "3 failed" in out
    assert out.count("    the log line") == 3


def test_build_refuses_bad_options_before_compiling(cache, monkeypatch, capsys, tmp_path):
    """An arch NVRTC does not know, a device written with a leading zero, no compile process, a
    report path in a folder that does not exist, and a bad $BURSTCU_BUILD_TIMEOUT: each one
    message before any kernel compiles (not one a kernel, nor a traceback after the compiling)."""
    needs_nvrtc()
    from burstcu.build import __main__ as cli

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled")
    monkeypatch.setattr(compile, "cubin_entry", no_compile)
    monkeypatch.setattr(compile, "gate_variant", no_compile)
    for argv, says in ((["warm", "--device", "sm_999"], "this NVRTC compiles for sm_80"),
                       (["warm", "--device", "sm_0080"], "compute capability 8.0 or newer"),
                       (["warm", "--device", "sm_80", "--jobs", "0"], "at least 1 compile process"),
                       (["check", "--arch", "sm_80", "--json", str(tmp_path / "no" / "x.json")],
                        "is not a folder this user can write to"),
                       (["check", "--arch", "sm_80", "--md", str(tmp_path / "no" / "x.md")],
                        "is not a folder this user can write to"),
                       (["check", "--arch", "sm_80", "--json", str(tmp_path)], "a folder, not a file")):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err, argv
    monkeypatch.setenv("BURSTCU_BUILD_TIMEOUT", "abc")
    for argv in (["warm", "--device", "sm_80", "--family", "nonfinite_flag"],
                 ["check", "--arch", "sm_80", "--family", "nonfinite_flag"]):
        assert cli.main(argv) == 1
        out, err = capsys.readouterr()
        assert err.count("BURSTCU_BUILD_TIMEOUT='abc'") == 1 and "FAILED" not in out, argv


def test_warm_counts_what_it_built_and_refuses_an_untrusted_folder(cache, monkeypatch, capsys, tmp_path):
    """A cached CUBIN found truncated is rebuilt and counted as compiled (not as cached); a cache
    folder that fails the trust rule is one message and exit status 1, before any kernel."""
    needs_nvrtc()
    from burstcu.build import __main__ as cli

    warm = ["warm", "--device", "sm_90", "--family", "forward_finalize", "--jobs", "1"]
    assert cli.main(warm) == 0
    assert "3 kernels compiled, 0 already cached" in capsys.readouterr().out
    cubin = sorted(compile.cache_dir().glob("*.cubin"))[0]
    cubin.write_bytes(cubin.read_bytes()[:100])
    assert cli.main(warm) == 0   # (the worker process warns that it rebuilt the entry)
    assert "1 kernels compiled, 2 already cached" in capsys.readouterr().out
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o775)
    shared.chmod(0o775)
    monkeypatch.setenv("BURSTCU_CACHE_DIR", str(shared))
    assert cli.main(warm) == 1
    out, err = capsys.readouterr()
    assert "writable by group" in err and "FAILED" not in out and "Traceback" not in err


def test_check_refuses_a_family_the_arch_does_not_gate(capsys):
    """`check --arch sm_90a` gates the Hopper families only (the table's others are sm_90's):
    another family is an error naming those it gates, not a run of 0 variants."""
    from burstcu.build import __main__ as cli

    with pytest.raises(SystemExit):
        cli.main(["check", "--arch", "sm_90a", "--family", "forward"])
    err = capsys.readouterr().err
    assert "unknown family ['forward']" in err and "forward_sm90" in err


@pytest.mark.parametrize("given, said", [(["check", "--arch", ""], "unknown arch ''"),
                                         (["check", "--family", ""], "--family '' names none"),
                                         (["check", "--dtype", " , "], "--dtype ' , ' names none"),
                                         (["warm", "--device", "sm_80", "--family", ""],
                                          "--family '' names none"),
                                         (["warm", "--device", "sm_80", "--tables", ","],
                                          "--tables ',' names none")])
def test_check_refuses_options_that_name_nothing(capsys, given, said):
    """`check --arch ''` gated nothing and ended 2 with an empty table; `--family ''` gated every
    family (all 738 variants, minutes), and warmed every one; `warm --tables ,` warmed the
    default table: options given empty are usage errors, under the subcommand's usage line (it
    was the top-level one)."""
    from burstcu.build import __main__ as cli

    with pytest.raises(SystemExit) as ended:
        cli.main(given)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and said in err, err
    assert err.startswith(f"usage: python -m burstcu.build {given[0]} ") and \
        f"python -m burstcu.build {given[0]}: error: " in err, err


@pytest.mark.parametrize("name, bad, good", [
    ("BURSTCU_EMU_TIMEOUT_S", ["abc", "-1", "nan", "inf", "5s", "1_000"], ["0", "2.5", " 300 ", "1e3"]),
    ("BURSTCU_EMU_STACK_KB", ["abc", "0", "-64", "1.5", "\u00b2", "1_024"], ["128"]),
    ("BURSTCU_EMU_PCH", ["2", "maybe"], ["0", "off", "No", "1", "true"]),
])
def test_the_emulators_settings_are_checked_when_its_group_is_made(monkeypatch, name, bad, good):
    """The emulator's C runtime reads its settings with atof / atol, so junk read as 0 (the
    watchdog off, the default stack) and a PCH switch other than "0" left it on, without a word:
    a value it does not take is now a ValueError naming the variable when the group is made (on
    every rank: burstcu.init agrees on the local op); the values it takes make the group."""
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"^burstcu.init: the 'emulated' local op: {name}="):
            burstcu.init(backend="emulated")
    for value in good:
        monkeypatch.setenv(name, value)
        burstcu.init(backend="emulated").close()


def test_a_cache_folder_that_fails_its_trust_rule_is_refused_when_the_group_is_made(tmp_path,
                                                                                      monkeypatch):
    """A group-writable $BURSTCU_CACHE_DIR was refused inside the first call that built a kernel,
    which then aborted every rank; it is a ValueError from burstcu.init now, as other bad
    settings (on every rank: init agrees on them), and the NumPy backend, which builds nothing,
    does not look."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("BURSTCU_CACHE_DIR", str(shared))
    with pytest.raises(ValueError, match=r"^burstcu.init: the kernel cache folder .*shared is writable"):
        burstcu.init(backend="emulated")
    burstcu.init(backend="numpy").close()
    private = tmp_path / "private"            # a good folder whose emu/ is not: the emulator's
    (private / "emu").mkdir(parents=True)
    private.chmod(0o700)
    (private / "emu").chmod(0o777)
    monkeypatch.setenv("BURSTCU_CACHE_DIR", str(private))
    with pytest.raises(ValueError, match=r"^burstcu.init: the kernel cache folder .*emu is writable"):
        burstcu.init(backend="emulated")


def test_the_precompiled_header_switch_takes_its_words(cache, monkeypatch):
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("BURSTCU_EMU_PCH", off)
        assert emulate._precompiled_header(emulate.kernel_dir()) is None
