#!/usr/bin/env python3
"""Calls functions of a process snapshot on an emulated CPU with AVX-512 (Bochs).

kiln's AVX-512 kernels are tested on hosts without AVX-512 this way: the test process
prepares its inputs, writes a copy of its readable memory (SNAPSHOT_DIR/mem.bin, its
regions in snapshot.json) and the calls to make, and this script runs each call on
bochscpu's CPU model (AVX-512F/BW/VL/DQ/CD, no VNNI) in 64-bit user mode: the snapshot's
pages are mapped at their addresses (loaded when first touched), each call gets a fresh
stack whose return address is a page of `ud2`, and it ends when it returns there. Any
other exception or a stray page is an error. The output range of each call is written to
SNAPSHOT_DIR/out-<i>.bin.

snapshot.json: {"regions": [{"start", "len", "offset", "exec"}], "fs_base",
                "calls": [{"entry", "arg", "out", "out_len"}], "cpu_model"?}

"cpu_model" picks Bochs's CPU model by name (MODELS below); absent, the wheel's default
(cannonlake: AVX-512F/BW/VL/DQ/CD, no VNNI). "sapphire_rapids" adds AVX-512 VNNI (and
AVX-VNNI, AVX512-BF16); it has no AMX, which the wheel was built without.

Pinned: bochscpu-python==0.4.0 (scripts/emulate/requirements.txt). Its wheel needs
glibc 2.38's __isoc23_strtoull / __isoc23_sscanf; on an older glibc preload the shim the
test builds (see crates/kiln-core/tests/avx512_emulated.rs).
"""

import ctypes
import json
import sys
from pathlib import Path

import bochscpu
import bochscpu.cpu
import bochscpu.memory

PAGE = 4096
CODE, DATA = 0, 1
PML4 = 0x10_0000
PA_BASE = 0x100_0000
STACK_TOP = 0x1000_0010_0000  # 1 MiB of stack below, a ud2 page at the top
STACK_PAGES = 256
RSP = STACK_TOP - 64 - 8
XCR0_AVX512 = 0xE7  # x87, SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
# The `cpu.model` parameter's values in the pinned wheel (bochscpu-python 0.4.0), by
# Bochs's model names; probed with CPUID once per model (brand string and feature bits).
MODELS = {"cannonlake": 27, "sapphire_rapids": 30}


def set_model(name: str) -> None:
    """Selects Bochs's CPU model `name` before the session builds the CPU. The binding has
    no call for it: the extension's own C++ parameter tree is reached through ctypes (the
    same shared object, already loaded), and the value read back must be the one set."""
    if name not in MODELS:
        raise SystemExit(f"cpu_model {name!r}: accepted are {', '.join(MODELS)}")
    so = ctypes.CDLL(bochscpu._bochscpu.__file__)
    so.sim_get_param_enum.restype = ctypes.c_void_p
    so.sim_get_param_enum.argtypes = [ctypes.c_char_p]
    param = so.sim_get_param_enum(b"cpu.model")
    if not param:
        raise SystemExit("the emulator has no cpu.model parameter: not the pinned bochscpu-python?")
    set_range = so._ZN14bx_param_num_c9set_rangeEmm  # bx_param_num_c::set_range(Bit64u, Bit64u)
    set_range.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    set_value = so._ZN15bx_param_enum_c3setEl  # bx_param_enum_c::set(Bit64s)
    set_value.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    get_value = so._ZN14bx_param_num_c3getEv  # bx_param_num_c::get()
    get_value.restype = ctypes.c_int64
    get_value.argtypes = [ctypes.c_void_p]
    set_range(param, 0, 63)
    set_value(param, MODELS[name])
    got = get_value(param)
    if got != MODELS[name]:
        raise SystemExit(f"cpu_model {name}: the emulator kept model {got}, not {MODELS[name]}")


def main(snap: Path) -> int:
    meta = json.loads((snap / "snapshot.json").read_text())
    mem = (snap / "mem.bin").open("rb")
    pages = {}  # va -> (file offset, executable)
    for r in meta["regions"]:
        for off in range(0, r["len"], PAGE):
            pages[r["start"] + off] = (r["offset"] + off, bool(r["exec"]))
    for va in range(STACK_TOP - STACK_PAGES * PAGE, STACK_TOP + PAGE, PAGE):
        assert va not in pages, f"the emulator's stack at {va:#x} overlaps the snapshot"

    pt = bochscpu.memory.PageMapLevel4Table()
    by_pa = {}
    pa = PA_BASE
    for va, (off, exe) in pages.items():
        pt.insert(va, pa, CODE if exe else DATA)
        by_pa[pa] = ("file", off)
        pa += PAGE
    for va in range(STACK_TOP - STACK_PAGES * PAGE, STACK_TOP, PAGE):
        pt.insert(va, pa, DATA)
        by_pa[pa] = ("zero", 0)
        pa += PAGE
    pt.insert(STACK_TOP, pa, CODE)
    by_pa[pa] = ("ud2", 0)
    pa += PAGE

    def load(gpa: int) -> None:
        base = gpa & ~(PAGE - 1)
        kind, off = by_pa.get(base, (None, 0))
        if kind is None:
            raise RuntimeError(f"the call touched physical page {gpa:#x}, outside the snapshot")
        if kind == "file":
            mem.seek(off)
            data = mem.read(PAGE)
        elif kind == "ud2":
            data = b"\x0f\x0b" * (PAGE // 2)
        else:
            data = bytes(PAGE)
        hva = bochscpu.memory.allocate_host_page()
        bochscpu.memory.page_insert(base, hva)
        bochscpu.memory.phy_write(base, list(data))

    for hva, gpa in pt.commit(PML4):
        bochscpu.memory.page_insert(gpa, hva)

    if "cpu_model" in meta:
        set_model(meta["cpu_model"])
    sess = bochscpu.Session()
    sess.missing_page_handler = load
    load(by_stack_top(by_pa))
    ret = STACK_TOP.to_bytes(8, "little")
    for i, call in enumerate(meta["calls"]):
        outcome = {}

        def exception(s, cpu_id, vector, error_code):
            outcome["vector"], outcome["rip"] = vector, s.cpu.rip
            s.stop()

        assert bochscpu.memory.virt_write(PML4, RSP, list(ret))
        hook = bochscpu.Hook()
        hook.exception = exception
        sess.cpu.state = state(meta["fs_base"], call)
        sess.run([hook])
        # The ud2 at the return address (#UD, vector 6; Bochs reports the rip past it).
        if outcome.get("rip") not in (STACK_TOP, STACK_TOP + 2) or outcome.get("vector") != 6:
            print(f"call {i}: stopped by exception {outcome.get('vector')} at {outcome.get('rip', 0):#x}, "
                  f"not by returning", file=sys.stderr)
            return 1
        out = bytes(bochscpu.memory.virt_read(PML4, call["out"], call["out_len"]))
        (snap / f"out-{i}.bin").write_bytes(out)
    return 0


def by_stack_top(by_pa: dict) -> int:
    """The physical page of the stack's top page (the one under the ud2 page)."""
    return [pa for pa, (kind, _) in by_pa.items() if kind == "ud2"][0] - PAGE


def state(fs_base: int, call: dict) -> "bochscpu.State":
    st = bochscpu.State()
    bochscpu.cpu.set_long_mode(st)
    cr0 = bochscpu.cpu.ControlRegister(st.cr0)
    cr4 = bochscpu.cpu.ControlRegister(st.cr4)
    cr0.MP, cr0.EM = True, False
    cr4.OSFXSR, cr4.OSXMMEXCPT, cr4.OSXSAVE = True, True, True
    st.cr0, st.cr4, st.xcr0 = int(cr0), int(cr4), XCR0_AVX512
    st.mxcsr = 0x1F80
    st.cr3 = PML4
    # The return address is the ud2 page; at entry rsp + 8 is 16-byte aligned.
    st.rsp = RSP
    st.rip = call["entry"]
    st.rdi = call["arg"]
    cs = bochscpu.Segment()
    cs.present, cs.selector, cs.base, cs.limit, cs.attr = True, 0x33, 0, 0xFFFF_FFFF, 0x22FB
    ds = bochscpu.Segment()
    ds.present, ds.selector, ds.base, ds.limit, ds.attr = True, 0x2B, 0, 0xFFFF_FFFF, 0xCF3
    fs = bochscpu.Segment()
    fs.present, fs.selector, fs.base, fs.limit, fs.attr = True, 0, fs_base, 0xFFFF_FFFF, 0xCF3
    st.cs, st.ds, st.ss, st.es, st.gs, st.fs = cs, ds, ds, ds, ds, fs
    return st


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
