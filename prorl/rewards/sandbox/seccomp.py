"""A seccomp filter for sandboxed code: the kernel surface a judge never needs is denied.

Namespaces do not isolate everything: kernel keyrings are per uid (a key `add_key`ed into `@u` by
one run was read back by the next run of the same uid), and user namespaces let code become uid 0 of
a namespace of its own and mount file systems there (a much wider kernel surface). So, as
nsjail-style judges and Docker's default profile do, every sandboxed process runs under a filter
that denies:

- keyrings: `add_key`, `keyctl`, `request_key`;
- new namespaces: `unshare` and `clone` with CLONE_NEWUSER, `setns`; `clone3` answers ENOSYS (its
  flags live in memory a classic-BPF filter cannot read), so glibc falls back to `clone`;
- mounts (`mount`, `umount2`, `pivot_root`, the new mount API), `ptrace` and `process_vm_*`, `bpf`,
  `perf_event_open`, `userfaultfd`, io_uring, module and kexec loading, `reboot`, swap, `acct`,
  file handles (`open_by_handle_at`);
- sockets of any family but AF_UNIX (`socket`, `socketpair`: EAFNOSUPPORT): AF_VSOCK, for one,
  reaches a port space shared with the host from inside a network namespace;
- `fallocate` (EOPNOTSUPP, so glibc's `posix_fallocate` falls back to writing, which RLIMIT_FSIZE
  bounds): ext4 does not apply RLIMIT_FSIZE to FALLOC_FL_KEEP_SIZE, and 2 GiB of the host's disk
  went to the stdout file the host had opened.

Denied calls fail with EPERM (ENOSYS for `clone3`, and as said above). A call made through another
ABI (`int 0x80`'s i386 table on x86_64, whose numbers differ, or the x32 ABI) kills the process: the
filter checks the audit architecture first, as every hand-built filter must. The program is classic
BPF built here, with the syscall numbers of x86_64 and aarch64 written out (tests check them against
the kernel's headers); on another architecture `program()` is None and the sandbox runs without a
filter, with a warning.

Why not libseccomp: its Python bindings are Debian's `python3-seccomp` (importable only by Debian's
own interpreter, not a venv's or conda's) or the small `pyseccomp` ctypes wrapper, and it would need
libseccomp.so inside every sandbox; the ~45 instructions here need only `prctl`, called by the
interpreter inside the sandbox before it runs any sandboxed code (`INSTALL`).
"""

from __future__ import annotations

import os
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000  # x86_64: x32-ABI calls have this bit set in their number
CLONE_NEWUSER = 0x10000000
EPERM, ENOSYS = 1, 38

# name -> (x86_64 number, aarch64 number), from asm/unistd_64.h and asm-generic/unistd.h
SYSCALLS = {
    "add_key": (248, 217),
    "request_key": (249, 218),
    "keyctl": (250, 219),
    "setns": (308, 268),
    "unshare": (272, 97),
    "clone": (56, 220),
    "clone3": (435, 435),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "socket": (41, 198),
    "socketpair": (53, 199),
    "fallocate": (285, 47),
}
FLAG_CHECKED = ("unshare", "clone")  # denied only with CLONE_NEWUSER in their first argument
ENOSYS_CALLS = ("clone3",)
FAMILY_CHECKED = ("socket", "socketpair")  # allowed only for AF_UNIX (their first argument)
AF_UNIX, EAFNOSUPPORT, EOPNOTSUPP = 1, 97, 95
OTHER_ERRNO = {"fallocate": EOPNOTSUPP}
DENIED = tuple(
    n
    for n in SYSCALLS
    if n not in FLAG_CHECKED + ENOSYS_CALLS + FAMILY_CHECKED + tuple(OTHER_ERRNO)
)

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# offsets in struct seccomp_data: nr, arch, then (after the instruction pointer) the six arguments
_NR, _ARCH, _ARG0 = 0, 4, 16


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes | None:
    """The filter as a `struct sock_filter[]` (8 bytes an instruction), or None on an architecture
    whose syscall numbers are not written out here."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        return None
    col = 0 if machine == "x86_64" else 1
    nr = {name: nums[col] for name, nums in SYSCALLS.items()}
    # the low 32 bits of the first argument (CLONE_NEWUSER is among them)
    arg0_low = _ARG0 if struct.pack("=I", 1)[0] == 1 else _ARG0 + 4
    p = [
        _insn(_LD_ABS_W, _ARCH),
        _insn(_JEQ, AUDIT_ARCH[machine], 1, 0),
        _insn(_RET, RET_KILL_PROCESS),
    ]
    p.append(_insn(_LD_ABS_W, _NR))
    if machine == "x86_64":
        p += [_insn(_JGE, X32_SYSCALL_BIT, 0, 1), _insn(_RET, RET_KILL_PROCESS)]
    for name in DENIED:
        p += [_insn(_JEQ, nr[name], 0, 1), _insn(_RET, RET_ERRNO | EPERM)]
    for name in ENOSYS_CALLS:
        p += [_insn(_JEQ, nr[name], 0, 1), _insn(_RET, RET_ERRNO | ENOSYS)]
    for name, errno in OTHER_ERRNO.items():
        p += [_insn(_JEQ, nr[name], 0, 1), _insn(_RET, RET_ERRNO | errno)]
    for name in FAMILY_CHECKED:  # jump over the 4-instruction family check unless it is this call
        p += [_insn(_JEQ, nr[name], 0, 4), _insn(_LD_ABS_W, arg0_low)]
        p += [
            _insn(_JEQ, AF_UNIX, 1, 0),
            _insn(_RET, RET_ERRNO | EAFNOSUPPORT),
            _insn(_RET, RET_ALLOW),
        ]
    for name in FLAG_CHECKED:  # jump over the 4-instruction flag check unless it is this call
        p += [_insn(_JEQ, nr[name], 0, 4), _insn(_LD_ABS_W, arg0_low)]
        p += [
            _insn(_JSET, CLONE_NEWUSER, 0, 1),
            _insn(_RET, RET_ERRNO | EPERM),
            _insn(_RET, RET_ALLOW),
        ]
    p.append(_insn(_RET, RET_ALLOW))
    return b"".join(p)


def wanted() -> bool:
    """Whether sandboxes install the filter (PRORL_SANDBOX_SECCOMP=0 turns it off)."""
    return os.environ.get("PRORL_SANDBOX_SECCOMP", "").strip() != "0"


# Python source run inside the sandbox before any sandboxed code: `_seccomp(bytes.fromhex(hex))`
# installs the filter on the calling thread (the only one at that point) after no_new_privs, which
# an unprivileged process needs to install one. Raises OSError if the kernel refuses.
INSTALL = """
def _seccomp(prog):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = Prog(len(prog) // 8, ctypes.addressof(buf))
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with the filter
    for args in ((38, 1, 0, 0, 0), (22, 2, ctypes.byref(fprog), 0, 0)):
        if libc.prctl(*args) != 0:
            e = ctypes.get_errno()
            why = os.strerror(e) + " (PRORL_SANDBOX_SECCOMP=0 runs without it)"
            raise OSError(e, "cannot install the sandbox's seccomp filter: " + why)
"""
